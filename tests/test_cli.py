"""Subprocess smoke test of `oppo train` with a toy budget, on tiny local models."""

import json
import os
import sys

import pytest

import clirun


@pytest.mark.slow
def test_oppo_train_two_steps(tiny_models, tiny_prompts, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "oppo.cli", "train", f"policy.path={tiny_models['policy']}",
           f"reward.path={tiny_models['reward']}", f"data.prompts={tiny_prompts}", "run.steps=2",
           "ppo.batch_size=4", "ppo.minibatch_size=2", "ppo.micro_batch_size=2", "generation.max_new_tokens=8",
           f"run.out_dir={out}", "log.tensorboard=true", "overlap.delta_max=2"]
    proc = clirun.run(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [0, 1]
    for key in ("reward/mean", "reward/std", "kl/mean", "loss/policy", "loss/value", "ppo/clipfrac",
                "ppo/approx_kl", "ppo/entropy", "value/explained_var", "response_length/mean",
                "response_length/max", "time/step", "time/generate", "time/score", "time/train",
                "perf/tokens_per_s"):
        assert key in lines[-1], key
    # sampler vs trainer (issue 22 item 6): under the thresholds peers gate CI on. Measured on the
    # first minibatch's tokens sampled by the trained weights: always some at step 0; a later step's
    # first minibatch can hold only carried rows (nothing to measure then)
    from oppo.learner.offpolicy import MISMATCH_THRESHOLDS

    assert "mismatch/logprob_abs_diff" in lines[0]
    for line in lines:
        if "mismatch/tokens" in line:
            assert line["mismatch/tokens"] > 0 and 0 < line["mismatch/ess"] <= 1 + 1e-9
            for key, bound in MISMATCH_THRESHOLDS.items():
                assert 0 <= line[key] <= bound, (line["step"], key, line[key], bound)
    assert (out / "checkpoints" / "step_000002" / "state.json").is_file()
    assert list(out.glob("events.out.tfevents*")) or list(out.rglob("events.out.tfevents*"))
    assert proc.stderr.count("samples at step 0:") == 1 and proc.stderr.count("samples at step 1:") == 1


def test_a_one_step_run_prints_its_samples_once(builtin_task, tmp_path, capsys):
    """The first step's samples are printed when it finishes; a run whose last step is its first does
    not print them again at the end."""
    from oppo.config import load_config
    from oppo.run import train

    cfg = load_config(None, ["run.steps=1", "run.save_final=none", "log.trace=false", "placement.threads=1",
                             f"run.out_dir={tmp_path / 'run'}", "ppo.batch_size=4", "ppo.minibatch_size=4",
                             "ppo.micro_batch_size=4", "generation.max_new_tokens=4", "overlap.mode=sequential"])
    train(cfg, progress=True)
    assert capsys.readouterr().err.count("samples at step 0:") == 1


def test_cli_rejects_bad_setting_before_loading(tmp_path):
    proc = clirun.run([sys.executable, "-m", "oppo.cli", "train", "ppo.minibatch_size=5"], timeout=120)
    assert proc.returncode == 2
    assert "ppo.minibatch_size" in proc.stderr


def test_help_lists_every_command_with_a_line(capsys):
    from oppo import cli

    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        line = next((l for l in out.splitlines() if l.strip().startswith(name + " ")), None)
        assert line is not None and len(line.split()) > 3, (name, out)
    assert cli.main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err


def test_progress_line_shows_the_judge():
    import io

    from oppo.metrics import ProgressBar

    out = io.StringIO()
    bar = ProgressBar(total_steps=2, file=out)
    bar.update(0, {"reward/mean": 0.5, "judge/mean": -0.25, "kl/mean": 0.01, "time/step": 1.0})
    bar.update(1, {"reward/mean": 0.5, "kl/mean": 0.01, "time/step": 1.0})  # no judge configured
    first, second = out.getvalue().splitlines()
    assert "reward 0.500 | judge -0.250 | kl" in first and "judge" not in second


def test_run_summary(tmp_path):
    from oppo.metrics import MetricsLogger
    from oppo.run import run_summary

    with MetricsLogger(tmp_path / "r") as log:
        for step in range(12):
            log.log(step, {"reward/mean": float(step), "judge/mean": step / 10, "kl/mean": 0.5,
                           "time/wallclock": 10.0 * (step + 1)})
    text = run_summary(tmp_path / "r", wall_seconds=150)
    assert "done: 12 steps (0-11) in 2m30s, 2m00s of it training" in text
    assert "reward 2.000 -> 9.000, judge 0.200 -> 0.900" in text and "first and last 5 steps" in text
    assert f"oppo report {tmp_path / 'r'}" in text
    assert run_summary(tmp_path / "nothing").strip() == f"run directory: {tmp_path / 'nothing'}"
    # resumed at step 8: this command trained steps 8-11, 40 s of its 92 (time/wallclock counts from step 0)
    text = run_summary(tmp_path / "r", wall_seconds=92, first_step=8)
    assert "done: 12 steps (0-11), steps 8-11 by this command in 1m32s, 40s of it training" in text


@pytest.mark.slow
def test_prepare_without_a_terminal_prints_a_line_per_phase(tmp_path, capsys):
    import importlib

    prep = importlib.import_module("oppo.task.prepare")
    import dataclasses

    sizes = dataclasses.replace(prep.PrepareSizes.tiny(), n_prompts=8, n_eval_prompts=4, sft_steps=2, rm_prompts=4,
                                rm_eval_prompts=4, rm_steps=1, eval_samples=4)  # the phases, not the models
    prep.prepare("positive", home=tmp_path, progress=True, sizes=sizes)
    err = capsys.readouterr().err  # captured: not a terminal
    phases = [line for line in err.splitlines() if "] phase " in line and "still running" not in line]
    assert [line.split("] ")[1].split(":")[0] for line in phases] == [f"phase {i}/4" for i in range(1, 5)]
    assert "\r" not in err and "Writing model shards" not in err  # no progress bars in a log
    assert err.splitlines()[-1].split("] ")[1].startswith("done in")


def test_prepare_heartbeat_in_long_phases(capsys):
    import importlib
    import threading

    prep = importlib.import_module("oppo.task.prepare")
    log = prep._Log(True)
    log.phases = 2
    beat = threading.Event()
    real = log.__call__

    class Spy(type(log)):
        def __call__(self, msg):
            real(msg)
            if "still running" in msg:
                beat.set()

    log.__class__ = Spy
    with log.heartbeat(every=0.05):
        log.phase("a long one")
        assert beat.wait(30), "no heartbeat line"
    assert "phase 1/2 still running" in capsys.readouterr().err


def test_loading_line_names_every_model_before_the_load():
    from oppo.config import Config
    from oppo.run import loading_line

    cfg = Config()
    cfg.policy.path, cfg.reward.path, cfg.data.prompts = "/m/policy", "/m/rm", "p.jsonl"
    line = loading_line(cfg)
    assert line.startswith("loading models: policy /m/policy, reward /m/rm, reference a frozen copy")
    assert "critic from /m/rm" in line  # ppo: the critic starts from the reward model
    cfg.reward.path, cfg.reward.function, cfg.algo.name = None, "mod:fn", "grpo"
    line = loading_line(cfg)
    assert "reward function mod:fn" in line and "critic" not in line  # grpo is critic-free


def test_threads_lines_warn_only_on_an_oversubscribed_machine():
    from oppo.config import Config
    from oppo.run import threads_lines

    cfg = Config()
    cfg.overlap.mode = "sequential"
    calm = threads_lines(cfg.placement, cfg.streams, torch_threads=8, cores=16, usable=8, load=3.0)
    assert calm == ["threads: torch 8 (placement.threads=0: torch's default); 8 usable of 16 cores; "
                    "load average 3.0"]
    busy = threads_lines(cfg.placement, cfg.streams, torch_threads=8, cores=16, usable=8, load=12.5)
    assert len(busy) == 2 and "oversubscribed (load average 12.5 over 8 usable cores" in busy[1]
    assert "placement.threads=1" in busy[1]
    cfg.placement.threads = 1
    one = threads_lines(cfg.placement, cfg.streams, torch_threads=8, cores=8, usable=None, load=12.5)
    assert one[0].startswith("threads: torch 1 (placement.threads=1); 8 cores")
    assert "already uses one thread" in one[1]
    assert len(threads_lines(cfg.placement, cfg.streams, torch_threads=8, cores=8, usable=None, load=None)) == 1  # no load average
    # the load: the 1-minute average, but no more than what runs now besides this process (it lags a
    # minute: after `make demo`'s pip install it warned on an idle 2-core machine, issue 53)
    from oppo.run.lines import machine_threads, others_runnable

    assert others_runnable("2.61 1.90 0.80 1/153 318") == 0 and others_runnable("8.1 9.7 11.0 9/153 318") == 8
    assert others_runnable("") is None
    load = machine_threads()[3]
    assert load is not None and load <= os.getloadavg()[0]


def test_a_broken_torchaudio_at_import_is_named_with_its_fix(monkeypatch, capsys):
    """An OSError raised inside torchaudio (a wheel built for another torch, which transformers
    imports when it is installed): one line naming the package and the fix, not a traceback."""
    import torch

    from oppo import cli

    code = compile("raise OSError('libtorchaudio.so: undefined symbol: _ZN3c10')",
                   "/venv/lib/python3.11/site-packages/torchaudio/_extension/utils.py", "exec")

    def broken(argv):
        exec(code, {})

    monkeypatch.setitem(cli.COMMANDS, "train", broken)
    assert cli.main(["train"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("oppo: error: importing torchaudio failed (OSError: libtorchaudio.so")
    assert f"torch {torch.__version__}" in err[0] and "pip uninstall -y torchvision torchaudio" in err[0]
    assert "--index-url https://download.pytorch.org/whl/" in err[0]

    def other(argv):
        raise OSError("disk on fire")

    monkeypatch.setitem(cli.COMMANDS, "train", other)
    with pytest.raises(OSError, match="disk on fire"):  # (anything else is not dressed up)
        cli.main(["train"])


def test_print_config_marks_the_builtin_tasks_presets(tiny_models, tmp_path, capsys):
    """``oppo train --print-config > f.yaml`` with no model named writes the built-in task's presets
    (learning rates for its tiny models) as comments, not as the user's own values: the file with
    one's own model gives the defaults (issue 53: it kept ppo.actor_lr=1e-4, ten times the default),
    and without one the presets again; a value the user set stays theirs."""
    import yaml

    from oppo.cli import main
    from oppo.config import TASK_PRESETS, Config

    default = Config()
    f = tmp_path / "f.yaml"
    assert main(["train", "--print-config"]) == 0
    out = capsys.readouterr()
    f.write_text(out.out)
    assert "presets" in out.err and "policy.path" in out.err
    assert "# actor_lr: 0.0001" in out.out and "'positive''s preset" in out.out
    assert "actor_lr" not in yaml.safe_load(out.out)["ppo"]
    assert main(["train", "--config", str(f), f"policy.path={tiny_models['policy']}",
                 f"reward.path={tiny_models['reward']}", "data.prompts=p.jsonl", "--print-config"]) == 0
    mine = yaml.safe_load(capsys.readouterr().out)
    assert mine["ppo"]["actor_lr"] == default.ppo.actor_lr == 1e-5
    assert mine["ppo"]["critic_lr"] == default.ppo.critic_lr and mine["run"]["steps"] == default.run.steps
    assert main(["train", "--config", str(f), "--print-config"]) == 0  # the built-in task: its presets again
    again = capsys.readouterr().out
    assert again == out.out
    assert main(["train", "ppo.actor_lr=1e-4", "--print-config"]) == 0  # the user's own value: plain
    d = yaml.safe_load(capsys.readouterr().out)
    assert d["ppo"]["actor_lr"] == 1e-4 and TASK_PRESETS["positive"]["ppo.actor_lr"] == 1e-4


def test_recipes_imports_neither_torch_nor_transformers():
    """``oppo recipes`` prints four lines: it imports no torch (issue 53: 22 s on a busy machine,
    nearly all of it importing torch for the checkpoint error class and transformers' progress bars)."""
    import subprocess

    code = ("import sys; sys.argv = ['oppo', 'recipes']; from oppo.cli import main; rc = main(); "
            "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "gsm8k_ppo" in out.stdout and out.stdout.splitlines()[-1] == "0 False False", out.stderr
