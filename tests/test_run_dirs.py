"""Run directories and resume, through `oppo train` in a process of its own as a user runs it (forked
from a server that has imported torch: ``clirun``): a new run
never mixes with an old one, and a resume that cannot continue the run says why and touches
nothing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import clirun

from oppo.metrics import read_metrics

TINY = ["placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=2", "ppo.micro_batch_size=2",
        "generation.max_new_tokens=6", "overlap.mode=sequential", "run.samples=0"]


def oppo_train(tiny_models, tiny_prompts, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "oppo.cli", "train", *TINY, f"policy.path={tiny_models['policy']}",
           f"reward.path={tiny_models['reward']}", f"data.prompts={tiny_prompts}", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return clirun.run(cmd, timeout=600, cwd=cwd, env=env)


def digest(d: Path) -> dict[str, str]:
    """Every file under ``d`` with its content hash: equal digests mean nothing was touched."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def steps_of(run: Path) -> list[int]:
    return [m["step"] for m in read_metrics(run)]


@pytest.mark.slow
def test_explicit_directory_refused_then_resumed(tiny_models, tiny_prompts, tmp_path):
    out = tmp_path / "exp"
    first = oppo_train(tiny_models, tiny_prompts, tmp_path, f"run.out_dir={out}", "run.steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "oppo report" in first.stdout and str(out) in first.stdout  # the closing summary
    settings = yaml.safe_load((out / "config.yaml").read_text())
    assert settings["policy"]["path"] == str(tiny_models["policy"])
    assert "task" not in settings["data"]  # own models: no built-in task was used
    before = digest(out)

    again = oppo_train(tiny_models, tiny_prompts, tmp_path, f"run.out_dir={out}", "run.steps=2")
    assert again.returncode == 2
    assert "already holds a run" in again.stderr and "--resume auto" in again.stderr
    assert "a fresh directory" in again.stderr and "run.out_dir=" in again.stderr
    assert "Traceback" not in again.stderr
    assert digest(out) == before

    # another mode and no steps left: both named in user terms, in one message; nothing touched
    wrong = oppo_train(tiny_models, tiny_prompts, tmp_path, "--resume", "auto", f"run.out_dir={out}",
                       "overlap.mode=oppo", "run.steps=2")
    assert wrong.returncode == 2
    assert "2 problems" in wrong.stderr
    assert "overlap.mode is sequential in the checkpoint, oppo now" in wrong.stderr
    assert "nothing left to train" in wrong.stderr and "run.steps above 2" in wrong.stderr
    assert "Traceback" not in wrong.stderr and "Scheduler" not in wrong.stderr
    assert digest(out) == before

    more = oppo_train(tiny_models, tiny_prompts, tmp_path, "--resume", "auto", f"run.out_dir={out}", "run.steps=3")
    assert more.returncode == 0, more.stderr[-3000:]
    assert "resumed from" in more.stderr
    assert steps_of(out) == [0, 1, 2]
    assert "done: 3 steps (0-2)" in more.stdout


@pytest.mark.slow
def test_default_runs_get_their_own_directories(tiny_models, tiny_prompts, tmp_path):
    """With the default run.out_dir (runs/latest), each run has its own directory and runs/latest
    points to the newest; --resume auto continues the newest, in its directory."""
    a = oppo_train(tiny_models, tiny_prompts, tmp_path, "run.steps=2")
    assert a.returncode == 0, a.stderr[-3000:]
    latest = tmp_path / "runs" / "latest"
    assert latest.is_symlink()
    run_a = latest.resolve()
    assert run_a.parent == (tmp_path / "runs").resolve() and run_a.name.endswith("-sequential")
    assert "runs/latest points to it" in a.stdout
    before_a = digest(run_a)

    b = oppo_train(tiny_models, tiny_prompts, tmp_path, "run.steps=2")
    assert b.returncode == 0, b.stderr[-3000:]
    run_b = latest.resolve()
    assert run_b != run_a and steps_of(run_b) == [0, 1]
    assert digest(run_a) == before_a  # the first run is whole: metrics, trace and checkpoints

    c = oppo_train(tiny_models, tiny_prompts, tmp_path, "--resume", "auto", "run.steps=3")
    assert c.returncode == 0, c.stderr[-3000:]
    assert latest.resolve() == run_b and steps_of(run_b) == [0, 1, 2]
    assert digest(run_a) == before_a
    trace_steps = {e["args"]["step"] for e in json.loads((run_b / "trace.json").read_text())["traceEvents"]
                   if e.get("ph") == "X"}
    assert trace_steps == {0, 1, 2}  # the resumed trace keeps the steps before the checkpoint
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(["latest", run_a.name, run_b.name])


@pytest.mark.slow
def test_run_that_fails_before_its_first_step_leaves_nothing(tiny_models, tiny_prompts, tmp_path):
    """A new run whose first step fails removes what it wrote: its own directory (no empty
    metrics.jsonl left behind), or, in a directory that was there before, only its own files."""
    (tmp_path / "failing.py").write_text("def score(prompts, responses):\n    raise RuntimeError('scorer down')\n")
    bad = ["reward.function=failing:score", "reward.path="]
    a = oppo_train(tiny_models, tiny_prompts, tmp_path, *bad)
    assert a.returncode != 0 and "scorer down" in a.stderr
    runs = tmp_path / "runs"
    assert not (runs / "latest").exists() and not any(runs.iterdir()), list(runs.iterdir())

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's own file")
    b = oppo_train(tiny_models, tiny_prompts, tmp_path, *bad, f"run.out_dir={mine}")
    assert b.returncode != 0 and "scorer down" in b.stderr
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
