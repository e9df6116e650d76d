"""Each role's own CUDA stream, and the events that order what crosses between roles (issue 50).
(Not ``control/streams.py``, the controller's chunk streams to the scorers.)

A :class:`Role` (the actor's decode, high priority; the learner; each scorer) owns a stream that
``with role:`` makes the thread's current one; weights, the caller's inputs, device outputs and
messages to the scorer worker's thread pass between roles by events. On the CPU :class:`Role` and
:class:`Event` are stand-ins that order nothing but log what they would order while
:func:`recording` is open. Design: ``docs/gpu-shapes.md``, "kernels/streams.py".
"""

from __future__ import annotations

import itertools
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

__all__ = ["Event", "Role", "caller_event", "current", "recording", "role"]

ACTOR_PRIORITY = -1
"""The actor's stream priority: CUDA's lower numbers run first (-1 is the high priority on every
device since Volta); the learner and scorers take the default, 0."""


@dataclass(frozen=True)
class Event:
    """A point in one role's (or the caller's) work. ``cuda``: the CUDA event; None on the CPU,
    where ``role`` and ``n`` name it in the log."""

    role: str
    n: int
    cuda: Any = None


_serial = itertools.count(1)
_local = threading.local()  # .stack: (role, its torch.cuda.stream context) entered on this thread, innermost last
_log: list[tuple[str, str, object]] | None = None  # (kind, role, detail) while recording
_log_lock = threading.Lock()


def _note(kind: str, who: str, detail: object) -> None:
    if _log is not None:
        with _log_lock:
            _log.append((kind, who, detail))


@contextmanager
def recording() -> Iterator[list[tuple[str, str, object]]]:
    """Log every role's enter, exit, record and wait (CPU and CUDA alike) while open: entries
    ``("enter" | "exit", role, None)``, ``("record" | "wait", role, Event)`` (a test's view)."""
    global _log
    old, _log = _log, []
    try:
        yield _log
    finally:
        _log = old


def _stack() -> list[tuple[Role, Any]]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def current() -> str:
    """The innermost role entered on this thread: its work's stream; ``"default"`` outside every role."""
    stack = _stack()
    return stack[-1][0].name if stack else "default"


def caller_event(device: torch.device) -> Event:
    """An event recorded now on this thread's current stream (a role's, or the default stream):
    what a message to the scorer worker carries so that its stream waits for what the sender queued."""
    who = current()
    ev = Event(who, next(_serial))
    if device.type == "cuda":
        cuda = torch.cuda.Event()
        cuda.record(torch.cuda.current_stream(device))
        ev = Event(who, ev.n, cuda)
    _note("record", who, ev)
    return ev


@dataclass
class _Mark:
    """What a role knows of an object's (a module's weights') last write and its readers."""

    write: Event | None = None
    writer: str | None = None
    readers: dict[str, tuple[Role, Event | None]] = field(default_factory=dict)  # None: all its work queued


_marks: weakref.WeakKeyDictionary[object, _Mark] = weakref.WeakKeyDictionary()
_marks_lock = threading.Lock()


def _mark(obj: object) -> _Mark:
    with _marks_lock:
        m = _marks.get(obj)
        if m is None:
            m = _marks[obj] = _Mark()
        return m


class Role:
    """One role's stream (CUDA) or its stand-in (CPU); see ``docs/gpu-shapes.md``, "kernels/streams.py"."""

    def __init__(self, name: str, device: torch.device | str, priority: int = 0, follow: bool = True):
        self.name, self.device, self.follow = name, torch.device(device), follow
        self.stream = torch.cuda.Stream(self.device, priority=priority) if self.device.type == "cuda" else None
        self._entered = False
        self._waited: set[int] = set()  # the serials of write events this role's stream already waits on

    def __repr__(self) -> str:
        return f"Role({self.name!r}, {self.device})"

    # ------------------------------------------------------------------ entering

    def __enter__(self) -> Role:
        stack = _stack()
        nested = bool(stack) and stack[-1][0] is self
        if not nested and (self.follow or not self._entered):
            self.wait(caller_event(self.device))  # the inputs the caller queued before this call
        self._entered = True
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else None
        if ctx is not None:
            ctx.__enter__()
        stack.append((self, ctx))
        if not nested:
            _note("enter", self.name, None)
        return self

    def __exit__(self, *exc) -> None:
        stack = _stack()
        _, ctx = stack.pop()
        if ctx is not None:
            ctx.__exit__(*exc)
        if not (stack and stack[-1][0] is self):
            _note("exit", self.name, None)

    # ------------------------------------------------------------------ events

    def record(self) -> Event:
        """An event at the end of the work queued on this role's stream so far."""
        ev = Event(self.name, next(_serial))
        if self.stream is not None:
            cuda = torch.cuda.Event()
            cuda.record(self.stream)
            ev = Event(self.name, ev.n, cuda)
        _note("record", self.name, ev)
        return ev

    def wait(self, ev: Event | None) -> None:
        """This role's later work waits for ``ev`` (on the device: the host does not wait)."""
        if ev is None or ev.role == self.name:
            return  # (a stream is ordered with itself)
        if self.stream is not None and ev.cuda is not None:
            self.stream.wait_event(ev.cuda)
        _note("wait", self.name, ev)

    def hand_back(self) -> None:
        """The caller's stream waits for this role's work so far (its device outputs are the caller's now)."""
        ev = self.record()
        _note("wait", "default", ev)
        if self.stream is not None:
            outer = next((r for r, _ in reversed(_stack()) if r is not self), None)
            (outer.stream if outer is not None and outer.stream is not None
             else torch.cuda.default_stream(self.device)).wait_event(ev.cuda)

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (made on another stream) is used on this one: the caching allocator must not hand its
        memory out again before this stream's work on it is done."""
        if self.stream is not None and t.is_cuda:
            t.record_stream(self.stream)
        return t

    def synchronize(self) -> None:
        """The host waits for this role's queued work (a barrier's one sync)."""
        if self.stream is not None:
            self.stream.synchronize()

    # ------------------------------------------------------------------ weights (objects) between roles

    def read(self, obj: object) -> None:
        """This role reads ``obj`` from now on: its stream waits for the last write by another role
        (once per write); a writer waits for all this role's work queued by then (:meth:`write`)."""
        m = _mark(obj)
        m.readers[self.name] = (self, None)
        if m.write is not None and m.writer != self.name and m.write.n not in self._waited:
            self._waited.add(m.write.n)
            self.wait(m.write)

    def read_done(self, obj: object) -> None:
        """This role's reads of ``obj`` end with its work so far: a writer waits for that only."""
        _mark(obj).readers[self.name] = (self, self.record())

    def write(self, obj: object) -> None:
        """This role writes ``obj`` next: its stream waits for every other role that has read it
        and for the last write by another role."""
        m = _mark(obj)
        for name, (reader, done) in list(m.readers.items()):
            if name != self.name:
                self.wait(done if done is not None else reader.record())
        if m.write is not None and m.writer != self.name:
            self.wait(m.write)

    def wrote(self, obj: object) -> None:
        """``obj``'s last write is this role's work so far (readers wait on it)."""
        m = _mark(obj)
        m.write, m.writer = self.record(), self.name
        m.readers = {}


def role(name: str, device: torch.device | str, priority: int = 0, follow: bool = True) -> Role:
    """A role's stream on ``device`` (a stand-in off CUDA); see :class:`Role`."""
    return Role(name, device, priority, follow)
