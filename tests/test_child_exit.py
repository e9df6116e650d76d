"""A killed controller leaves no process behind: the scorer child exits when its parent dies, on
any signal (here SIGKILL, which runs no cleanup at all)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")


def _ppid_and_state(pid: int) -> tuple[int, str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    return int(fields[1]), fields[0]


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            info = _ppid_and_state(int(d.name))
            if info is not None and info[0] == pid and info[1] != "Z":
                out.append(int(d.name))
    return out


def alive(pid: int) -> bool:
    info = _ppid_and_state(pid)
    return info is not None and info[1] not in ("Z", "X")  # a zombie has exited (only its entry is left)


def wait_until(cond, limit: float = 120.0, what: str = "") -> None:
    """Poll ``cond`` (a generous limit: the machine may be loaded; not a timing assertion)."""
    end = time.monotonic() + limit
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.2)


def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


WORKER_SCRIPT = textwrap.dedent("""
    import sys, threading, time
    from transformers import AutoModelForSequenceClassification
    from oppo.scoring.streaming import StreamingScorer
    from oppo.trace import Tracer
    from oppo.scoring.worker import ScorerWorker

    def main():
        model = AutoModelForSequenceClassification.from_pretrained(sys.argv[1]).eval().requires_grad_(False)
        box = []
        start = lambda: box.append(ScorerWorker({"reward": StreamingScorer("reward", model, 0)}, 1, Tracer(),
                                                transport="process"))
        if sys.argv[2] == "thread":  # started from a thread that has ended: only the watchdog guards
            t = threading.Thread(target=start)
            t.start()
            t.join()
        else:
            start()
        box[0].barrier()  # the child is up and serving
        print(box[0].proc.pid, flush=True)
        time.sleep(600)

    if __name__ == "__main__":  # the spawned child imports this file too
        main()
""")


@pytest.mark.parametrize("started_from", ["main", "thread"])
def test_scorer_child_exits_when_parent_is_killed(tiny_models, tmp_path, started_from):
    script = tmp_path / "parent.py"
    script.write_text(WORKER_SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script), str(tiny_models["reward"]), started_from],
                              stdout=subprocess.PIPE, text=True, env=env())
    try:
        line = parent.stdout.readline()
        assert line.strip().isdigit(), "the parent script did not start its worker"
        child = int(line)
        assert alive(child) and _ppid_and_state(child)[0] == parent.pid
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        wait_until(lambda: not alive(child), what=f"scorer child {child} to exit after its parent was killed")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


@pytest.mark.slow
def test_kill_9_of_oppo_train_leaves_nothing_behind(tiny_models, tiny_prompts, tmp_path):
    """The issue's case: `kill -9` of `oppo train` in mode oppo (the scorer child process)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "oppo.cli", "train", f"policy.path={tiny_models['policy']}",
           f"reward.path={tiny_models['reward']}", f"data.prompts={tiny_prompts}", "overlap.mode=oppo",
           "run.steps=100000", "ppo.batch_size=4", "ppo.minibatch_size=2", "ppo.micro_batch_size=2",
           "generation.max_new_tokens=6", f"run.out_dir={out}", "log.progress=false", "run.samples=0"]
    train = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())
    try:
        # training is under way once a step's metrics are written: the scorer child serves by then
        wait_until(lambda: (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size > 0
                   or train.poll() is not None, limit=300, what="the first step")
        assert train.poll() is None, "oppo train ended early"
        kids = children(train.pid)
        cmdlines = [Path(f"/proc/{k}/cmdline").read_bytes() for k in kids]
        assert any(b"multiprocessing" in c for c in cmdlines), "no scorer child found: the test would prove nothing"
        train.send_signal(signal.SIGKILL)
        train.wait()
        wait_until(lambda: not any(alive(k) for k in kids), what=f"children {kids} to exit")
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()


@pytest.mark.slow
def test_sigterm_of_oppo_train_stops_cleanly(tiny_models, tiny_prompts, tmp_path):
    """`kill` (SIGTERM) ends a run like Ctrl-C: the step finishes, a checkpoint and the trace so far
    are saved, children exit, the message says how to resume (exit 143)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "oppo.cli", "train", f"policy.path={tiny_models['policy']}",
           f"reward.path={tiny_models['reward']}", f"data.prompts={tiny_prompts}", "overlap.mode=intra",
           "run.steps=100000", "ppo.batch_size=4", "ppo.minibatch_size=2", "ppo.micro_batch_size=2",
           "generation.max_new_tokens=6", f"run.out_dir={out}", "log.progress=false", "run.samples=0"]
    train = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env())
    try:
        wait_until(lambda: (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size > 0
                   or train.poll() is not None, limit=300, what="the first step")
        assert train.poll() is None, "oppo train ended early"
        kids = children(train.pid)
        train.send_signal(signal.SIGTERM)
        _, err = train.communicate(timeout=120)
        assert train.returncode == 143, err[-2000:]
        assert f"--resume {out}" in err and "Traceback" not in err
        assert (out / "checkpoints").is_dir()
        assert (out / "trace.json").is_file()
        wait_until(lambda: not any(alive(k) for k in kids), what=f"children {kids} to exit")
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
