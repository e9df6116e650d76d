"""``python -m oppo.cli ...`` (or ``python -c CODE ...``) as a process of its own, without paying
the interpreter's start and the imports of torch and transformers each time.

A command a test runs "as a user runs it" spends most of its CPU before it reads its first argument:
about 6 CPU-seconds on the project's 2-core box to import torch and transformers, against 1-6 s
for a tiny run after that. The suite runs about twenty such commands. Here each one is forked from
multiprocessing's fork server, which has imported them once for the test process (the same server
``oppo.scoring.worker.start_method`` forks the scorer children from), so a command's own process
still starts from a clean ``oppo``: its module ``__main__`` run afresh (``runpy``, as ``-m`` does),
its own working directory, environment, file descriptors 1 and 2, exit status, signals and process
group (``start_new_session``), and its own children. What differs from a fresh interpreter: the
modules the server imported were imported under the test process's environment (so a test whose
command needs another environment at import time, e.g. ``HF_HUB_OFFLINE``, runs a real
subprocess), and the command's interpreter shuts down by ``os._exit`` after running its exit
handlers and waiting for its threads, as Python's own shutdown does.

``run`` stands in for ``subprocess.run(cmd, capture_output=True, text=True, ...)`` and ``Popen`` for
``subprocess.Popen(cmd, stdout=DEVNULL or PIPE, stderr=PIPE, text=True, ...)``; any other command
(not this interpreter with ``-m`` or ``-c``) goes to subprocess itself.
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

_PRELOAD = ["oppo.scoring.worker", "transformers", "oppo.cli"]


def _ours(cmd) -> bool:
    return len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] in ("-m", "-c")


def _child(cmd: list[str], cwd: str | None, env: dict | None, out: str, err: str, new_session: bool) -> None:
    """The command's process: set up as the interpreter would have been, run, shut down, exit."""
    if new_session:
        os.setsid()
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    if cwd is not None:
        os.chdir(cwd)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    code: object = 0
    try:
        if cmd[1] == "-m":
            sys.argv = [cmd[2], *cmd[3:]]
            runpy.run_module(cmd[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *cmd[3:]]
            exec(compile(cmd[2], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        code = e.code
    except BaseException:  # as the interpreter does for an uncaught exception
        traceback.print_exc()
        code = 1
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()  # non-daemon threads finish first, as at an interpreter's exit
    atexit._run_exitfuncs()
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code or 0)


def _context():
    from oppo.scoring.worker import start_method

    ctx = start_method()
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # (read only if the server is not running yet)
    return ctx


class Popen:
    """The part of ``subprocess.Popen`` the tests use: ``pid``, ``poll``, ``wait``, ``kill``,
    ``send_signal``, ``communicate``, ``returncode`` and ``stderr.read()`` (text)."""

    def __init__(self, cmd, *, cwd=None, env=None, start_new_session: bool = False, **_ignored):
        assert _ours(cmd), f"not a command of this interpreter: {cmd[:3]}"
        self._dir = tempfile.TemporaryDirectory(prefix="clirun")
        self._out, self._err = Path(self._dir.name, "out"), Path(self._dir.name, "err")
        self._proc = _context().Process(target=_child, args=(list(map(str, cmd)), None if cwd is None else str(cwd),
                                                             env, str(self._out), str(self._err), start_new_session))
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode: int | None = None
        self.stderr = self  # (proc.stderr.read(): what it wrote so far)

    def read(self) -> str:
        return self._err.read_text(errors="replace") if self._err.is_file() else ""

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self._proc.join()
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired("clirun child", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self._out.read_text(errors="replace"), self.read()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run(cmd, *, cwd=None, env=None, timeout: float | None = None, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, cwd=..., env=..., timeout=...)``."""
    if not _ours(cmd):
        return subprocess.run(cmd, cwd=cwd, env=env, timeout=timeout, capture_output=True, text=True)
    p = Popen(cmd, cwd=cwd, env=env)
    t = time.monotonic()
    try:
        out, err = p.communicate(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise subprocess.TimeoutExpired(cmd, time.monotonic() - t)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)
