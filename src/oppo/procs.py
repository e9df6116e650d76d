"""Process helpers shared by the parts that clean up after a killed process, and :func:`periodic`,
the heartbeat thread of long work (a step, the built-in task's build)."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Iterator


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running(pid: int) -> bool:
    """Whether process ``pid`` runs: alive, and not a zombie where ``/proc`` tells (a process that
    has exited and waits for its parent to collect its status still answers a signal 0)."""
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return pid_alive(pid)
    return stat[stat.rindex(")") + 2] != "Z"


def kill_with_parent() -> bool:
    """Have the kernel SIGKILL this process when the thread that started it exits
    (``prctl(PR_SET_PDEATHSIG)``; the signal follows the starting *thread*, so callers set it only
    for a child started from a main thread). False where it cannot: not Linux, or no prctl."""
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def periodic(every: float, call: Callable[[], None], name: str = "heartbeat") -> Iterator[None]:
    """Within: ``call()`` every ``every`` seconds from a daemon thread, stopped and joined on exit."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every):
            call()

    thread = threading.Thread(target=beat, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
