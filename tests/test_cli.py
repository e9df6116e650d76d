"""Subprocess smoke test of `oppo train` with a toy budget, on tiny local models."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_oppo_train_two_steps(tiny_models, tiny_prompts, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "oppo.cli", "train", f"policy.path={tiny_models['policy']}",
           f"reward.path={tiny_models['reward']}", f"data.prompts={tiny_prompts}", "run.steps=2",
           "ppo.batch_size=4", "ppo.minibatch_size=2", "ppo.micro_batch_size=2", "generation.max_new_tokens=8",
           f"run.out_dir={out}", "log.tensorboard=true", "overlap.delta_max=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [0, 1]
    for key in ("reward/mean", "reward/std", "kl/mean", "loss/policy", "loss/value", "ppo/clipfrac",
                "ppo/approx_kl", "ppo/entropy", "value/explained_var", "response_length/mean",
                "response_length/max", "time/step", "time/generate", "time/score", "time/train",
                "perf/tokens_per_s"):
        assert key in lines[-1], key
    assert (out / "checkpoints" / "step_000002" / "state.json").is_file()
    assert list(out.glob("events.out.tfevents*")) or list(out.rglob("events.out.tfevents*"))
    assert "samples at step 0" in proc.stderr


def test_cli_rejects_bad_setting_before_loading(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "oppo.cli", "train", "ppo.minibatch_size=5"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "ppo.minibatch_size" in proc.stderr
