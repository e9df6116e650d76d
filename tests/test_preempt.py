"""No lost work: a stopped run saves, a failed save cleans up, a damaged checkpoint is skipped.

- SIGTERM: ``oppo train`` finishes its step, writes a checkpoint (with the sequences in flight)
  and the trace so far, ends its scorer child and exits 143 with the resume command;
  ``--resume auto`` continues, no step logged twice;
- a save that fails (a full disk, simulated) removes its temporary directory and says which
  disk and how much space is left, in one paragraph;
- a truncated newest checkpoint (caught by its manifest) is skipped for the previous one, with a
  warning naming both; a load error names the checkpoint; one without a manifest still loads.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time

import pytest

import clirun

from oppo.checkpoint import MANIFEST_FILE, CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from oppo.config import load_config
from oppo.setup.preflight import PreflightError
from oppo.run import start_run
from oppo.trainer import Trainer

from test_child_exit import alive, descendants, wait_until
from test_kill_resume import _env, _lines, _settings


def test_sigterm_saves_a_checkpoint_and_exits_143_then_resumes(tiny_models, tiny_prompts, tmp_path):
    out = tmp_path / "run"
    base = [sys.executable, "-m", "oppo.cli", "train",
            *[s for s in _settings(tiny_models, tiny_prompts, out) if not s.startswith("run.steps=")]]
    # the scorers in a child process, and the signal to the whole process group (as Ctrl-C in a
    # terminal, or a scheduler, sends it): the child must not die before the controller's checkpoint
    proc = clirun.Popen([*base, "run.steps=100000", "placement.local.scorer_process=true"], env=_env(),
                        start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _lines(out / "lengths.jsonl") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, f"oppo train ended early: {proc.stderr.read()[-2000:]}"
        kids = descendants(proc.pid)
        assert kids, "no scorer child process: the test would not cover one"
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        print(f"SIGTERM to exit: {time.monotonic() - t0:.2f} s")
        wait_until(lambda: not any(alive(k) for k in kids), what=f"children {kids} to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err
    ckpt = latest_checkpoint(out)
    assert ckpt is not None, "no checkpoint written on SIGTERM"
    assert (out / "trace.json").is_file(), "the trace so far is saved"
    state = json.loads((ckpt / "state.json").read_text())
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"oppo: stopped by SIGTERM after {state['step']} of 100000 steps: checkpoint {ckpt} "
                           f"holds them")
    assert f"oppo train --resume {out}" in last
    assert state["in_flight"]["how"] == "saved"
    assert [r["step"] for r in _lines(out / "lengths.jsonl")] == list(range(state["step"]))

    steps = state["step"] + 1
    done = clirun.run([*base, f"run.steps={steps}", "--resume", "auto"],
                          env=_env(), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _lines(out / "lengths.jsonl")
    assert [r["step"] for r in rows] == list(range(steps)), "every step logged once"
    trained = [p for r in rows for p in r["prompt_index"]]
    assert len(trained) == len(set(trained)), "no prompt trained twice"


@pytest.fixture(scope="module")
def two_checkpoints(tiny_models, tiny_prompts, tmp_path_factory):
    """A run directory with checkpoints at steps 0 and 1 (the state of step 0 saved twice: enough
    for what is checked here), and its config."""
    out = tmp_path_factory.mktemp("ckpts") / "run"
    cfg = load_config(None, _settings(tiny_models, tiny_prompts, out, steps=4))
    trainer = Trainer.from_config(cfg, progress=False)
    try:
        save_checkpoint(trainer, out)
        trainer.step = 1
        save_checkpoint(trainer, out)
    finally:
        trainer.close()
    return cfg, out


def test_failed_save_removes_its_temporary_directory_and_names_the_disk(tiny_models, tiny_prompts, tmp_path,
                                                                       monkeypatch, capsys):
    import oppo.checkpoint.store
    from oppo.cli import main

    def full(obj, f, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(oppo.checkpoint.store.torch, "save", full)
    out = tmp_path / "run"
    settings = [s for s in _settings(tiny_models, tiny_prompts, out, mode="sequential") if "run.steps" not in s]
    assert main(["train", *settings, "run.steps=1"]) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"oppo: checkpoint error: could not write checkpoint {out / 'checkpoints' / 'step_000001'}: "
                           f"No space left on device (the disk of {out / 'checkpoints'}: ")
    assert " free of " in last and "The partial checkpoint was removed" in last
    assert "Traceback" not in err
    assert not list((out / "checkpoints").glob(".tmp-step_*")), "the temporary directory stays"


def test_truncated_newest_checkpoint_falls_back_to_the_previous(two_checkpoints, tmp_path, capsys):
    import shutil

    cfg, src = two_checkpoints
    out = tmp_path / "run"
    shutil.copytree(src, out)
    cfg.run.out_dir = str(out)
    newest, previous = out / "checkpoints" / "step_000001", out / "checkpoints" / "step_000000"
    weights = newest / "policy" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])

    plan = start_run(cfg, "auto")
    assert plan.checkpoint == previous
    err = capsys.readouterr().err
    assert f"the newest checkpoint {newest} is damaged (policy/model.safetensors is {len(data) // 2} bytes" in err
    assert f"resuming from the previous one, {previous}" in err

    with pytest.raises(PreflightError, match="step_000001 is damaged"):  # that checkpoint, named: no fallback
        start_run(cfg, str(newest))

    trainer = Trainer.from_config(cfg, progress=False)
    try:
        with pytest.raises(CheckpointError, match=f"could not load checkpoint {newest}"):
            load_checkpoint(trainer, newest)
        (previous / MANIFEST_FILE).unlink()  # a checkpoint from before manifests: loads unchecked
        shutil.rmtree(newest)
        assert start_run(cfg, "auto").checkpoint == previous
        load_checkpoint(trainer, previous)
        assert trainer.step == 0
    finally:
        trainer.close()


def test_save_every_minutes_checkpoints_by_time(tiny_models, tiny_prompts, tmp_path):
    """The default cadence is by time (run.save_every_minutes=30: never due in a test's seconds);
    a tiny one saves after every step."""
    from oppo.config import Config
    from oppo.run import train

    assert Config().run.save_every_minutes == 30 and Config().run.save_every == 0
    out = tmp_path / "run"
    settings = [s for s in _settings(tiny_models, tiny_prompts, out, mode="sequential", steps=3)]
    train(load_config(None, settings + ["run.save_every_minutes=1e-6", "run.keep_checkpoints=10"]), progress=False)
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [f"step_00000{i}" for i in (1, 2, 3)]


@pytest.mark.parametrize("when", ["save", "after_last_step"])
def test_sigterm_during_the_final_save_waits_for_it(tiny_models, tiny_prompts, tmp_path, monkeypatch, capsys, when):
    """A signal after the last step (as the final checkpoint starts, with the default
    run.save_final=full and no periodic saves; or just after the last step, as its lengths are
    written) lets that checkpoint finish: every step is kept, and the line says so (issue 53: it
    said "finishing this step" after the last one)."""
    import oppo.run.loop
    from oppo.cli import _terminate_like_ctrl_c, main

    name = {"save": "save_checkpoint", "after_last_step": "_write_lengths"}[when]
    real = getattr(oppo.run.loop, name)

    def signalled(*a, **k):
        if name == "save_checkpoint" or a[1] == 1:  # (_write_lengths(lengths, step, exp): the last step, 1)
            os.kill(os.getpid(), signal.SIGTERM)  # handled here, in the main thread
        return real(*a, **k)

    monkeypatch.setattr(oppo.run.loop, name, signalled)
    out = tmp_path / "run"
    settings = [s for s in _settings(tiny_models, tiny_prompts, out, mode="sequential") if "run.steps" not in s]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    _terminate_like_ctrl_c()  # the `oppo` command's handlers (main(argv) from Python leaves signals alone)
    try:
        rc = main(["train", *settings, "run.steps=2"])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    err = capsys.readouterr().err
    assert rc == 0, err[-3000:]
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and ckpt.name == "step_000002", "the final checkpoint was lost to the signal"
    assert json.loads((ckpt / "state.json").read_text())["step"] == 2
    assert (ckpt / "optim.pt").is_file(), "a full, resumable checkpoint"
    assert "SIGTERM: writing the final checkpoint (all steps are done)" in err
    assert f"all 2 steps are trained and the final checkpoint {ckpt} holds them" in err
