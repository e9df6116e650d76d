"""The trainer from Python, without the CLI, as the README shows it."""

from __future__ import annotations

import subprocess
import sys

import pytest

import oppo

TINY = ["placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=2", "ppo.micro_batch_size=2",
        "generation.max_new_tokens=6", "overlap.mode=sequential", "log.progress=false", "run.samples=0"]


def test_import_is_light():
    code = "import sys, oppo; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_exports():
    for name in oppo.__all__:
        assert getattr(oppo, name) is not None, name
    with pytest.raises(AttributeError):
        oppo.no_such_name  # noqa: B018


def test_build_step_read_metrics(tiny_models, tiny_prompts, tmp_path):
    cfg = oppo.load_config(overrides=[*TINY, f"policy.path={tiny_models['policy']}",
                                      f"reward.path={tiny_models['reward']}", f"data.prompts={tiny_prompts}",
                                      "run.steps=2", f"run.out_dir={tmp_path / 'run'}"])
    trainer = oppo.Trainer(cfg)
    try:
        for _ in range(2):
            metrics = trainer.run_step()
        assert trainer.step == 2
        assert {"reward/mean", "kl/mean", "loss/policy", "time/step"} <= set(metrics)
    finally:
        trainer.close()

    run_dir = oppo.train(cfg, progress=False)
    assert [m["step"] for m in oppo.read_metrics(run_dir)] == [0, 1]
    assert oppo.latest_checkpoint(run_dir).name == "step_000002"
    assert "run directory" in oppo.run_summary(run_dir)
    with pytest.raises(oppo.PreflightError, match="already holds a run"):
        oppo.train(cfg)  # the same directory again: refused, before loading anything
