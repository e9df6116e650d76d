"""A killed controller leaves no process behind: the scorer child exits when its parent dies, on
any signal (here SIGKILL, which runs no cleanup at all). ``oppo train`` itself, killed:
``test_kill_resume`` (kill -9), ``test_preempt`` (SIGTERM)."""

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


def descendants(pid: int) -> list[int]:
    """``pid``'s children, theirs, and so on (a scorer child forked by the fork server its parent
    started is a grandchild)."""
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
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
        t = threading.Thread(target=start)
        t.start()
        t.join()
        box[0].barrier()  # the child is up and serving
        print(box[0].proc.pid, flush=True)
        sys.stdin.readline()
        box[0].barrier()  # and still serves (after the test's SIGTERM to its fork server)
        print("served", flush=True)
        time.sleep(600)

    if __name__ == "__main__":  # the spawned child imports this file too
        main()
""")


def test_scorer_child_of_a_thread_that_ended_exits_when_parent_is_killed(tiny_models, tmp_path):
    """The worker started from a thread that has ended: only the watchdog guards (one started from
    the main thread, as ``oppo train`` starts its own: ``test_kill_resume``'s kill -9). A child of
    the fork server outlives a SIGTERM to the server (as a scheduler's SIGTERM to the process
    group, which the controller answers with a checkpoint that needs the child:
    ``test_preempt``), and still exits with its controller."""
    script = tmp_path / "parent.py"
    script.write_text(WORKER_SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script), str(tiny_models["reward"])],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env())
    try:
        line = parent.stdout.readline()
        assert line.strip().isdigit(), "the parent script did not start its worker"
        child = int(line)
        assert alive(child) and child in descendants(parent.pid)  # (spawned, or forked by its fork server)
        left = descendants(parent.pid)
        server = _ppid_and_state(child)[0]
        if server != parent.pid:
            os.kill(server, signal.SIGTERM)
            wait_until(lambda: not alive(server), what=f"fork server {server} to exit on SIGTERM")
            time.sleep(2.5)  # (the child's watchdog looks each second)
        parent.stdin.write("go\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "served" and alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        wait_until(lambda: not alive(child), what=f"scorer child {child} to exit after its parent was killed")
        wait_until(lambda: not any(alive(k) for k in left), what=f"processes {left} to exit")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_a_killed_scorer_child_is_named_with_its_pid_and_signal(monkeypatch, capsys):
    """The controller waiting on a scorer child that was killed: one error naming the process, its
    roles, pid and signal; the CLI prints it on one line (the run's resume line comes from
    run.train), not a traceback ending in 'scorer process died'."""
    import multiprocessing as mp

    import oppo.run
    from oppo import cli
    from oppo.scoring import worker

    ctx = mp.get_context("fork")
    proc = ctx.Process(target=time.sleep, args=(60,), daemon=True)
    proc.start()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(5)
    transport = worker._ProcessTransport.__new__(worker._ProcessTransport)  # (its child: the process just killed)
    transport.proc, transport.out, transport.boost = proc, ctx.Queue(), ctx.Value("b", 0, lock=False)
    transport.forked, transport.name, transport.start_method = False, "scorer", "forkserver"
    transport.roles = ("reward", "reference", "critic")
    with pytest.raises(worker.ScorerDied) as info:
        transport.wait_reply()
    msg = str(info.value)
    assert f"pid {proc.pid}" in msg and "killed by SIGKILL" in msg
    assert "the scorer process" in msg and "reward, reference and critic scorers" in msg

    def failing_train(cfg, resume=None):
        raise info.value

    monkeypatch.setattr(oppo.run, "train", failing_train)
    assert cli.main(["train", "run.steps=1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"oppo: error: {msg}"]
    # a child that exited with an error (e.g. a script re-run at its top level) is named so, with the fix
    said = worker.death_message("scorer", ("reward",), 7, 1, "forkserver")
    assert "exited with status 1" in said and "if __name__ == '__main__':" in said and "the reward scorer)" in said


def _echo(q, out):
    while (msg := q.get()) is not None:
        out.put(("reply", msg))


def test_the_scorer_queues_leave_no_semaphore_behind(tmp_path):
    """Once the child has answered, the queues' named semaphores (/dev/shm/sem.mp-*) are unlinked:
    a kill -9 of the process group (the resource tracker with it) leaves none; the queues still work."""
    from oppo.scoring import worker

    ctx = worker.start_method()
    q, out = ctx.Queue(), ctx.Queue()
    names = [lk._semlock.name for qu in (q, out) for lk in (qu._rlock, qu._wlock, qu._sem) if lk is not None]
    shm = Path("/dev/shm")
    if not shm.is_dir() or not any((shm / f"sem.{n.lstrip('/')}").exists() for n in names):
        pytest.skip("this platform keeps no named semaphores in /dev/shm")
    proc = ctx.Process(target=_echo, args=(q, out), daemon=True)
    proc.start()
    transport = worker._ProcessTransport.__new__(worker._ProcessTransport)  # (its child: the echo process)
    transport.proc, transport.q, transport.out = proc, q, out
    transport.boost, transport.forked = ctx.Value("b", 0, lock=False), False
    try:
        q.put(1)
        assert transport.wait_reply() == 1
        assert not [n for n in names if (shm / f"sem.{n.lstrip('/')}").exists()]
        q.put(2)
        assert transport.wait_reply() == 2  # the queues work on
    finally:
        q.put(None)
        proc.join(10)
