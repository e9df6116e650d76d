"""CUDA graphs captured once per shape key and replayed: the one capture recipe of the static
backend's decode steps (``rollout/static/backend.py``) and the streamed scorers' chunk forwards
(``scoring/slots.py``), with its bookkeeping (how many captures, how many seconds, which keys).

The recipe (``docs/static-backend.md``, "Capture while other threads work"): the owner's one side
stream, waiting for the current stream; two warm-up runs of the forward on it (the same inputs
and cache writes the replays make, so they are harmless, and lazy initialisations happen outside
the capture); then a thread-local capture on that stream into the owner's one memory pool, so the
actor, learner and scorer threads may run CUDA work meanwhile and every graph of an owner shares
one pool. Graphs share the pool: a graph's output may be overwritten by another key's replay, so
callers copy it out before the next replay.

The capture itself is a parameter (``capture``: a function of the forward returning a graph and
the forward's output): the default is the CUDA recipe above, and a stand-in (a graph whose replay
runs the forward again, or a traced forward) runs the same bookkeeping on a CPU, in CI.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Generic, Hashable, Protocol, TypeVar

import torch

K = TypeVar("K", bound=Hashable)


class Graph(Protocol):
    """What a captured graph offers: ``replay`` reruns the captured work on the static inputs."""

    def replay(self) -> None: ...


Capture = Callable[[Callable[[], torch.Tensor]], "tuple[Graph, torch.Tensor]"]
"""A capture: the forward (reading static inputs) -> (its graph, its output tensor)."""


class CapturedGraphs(Generic[K]):
    """Graphs of one owner by key (e.g. ``(Rb, Lb)``), each captured on its first use
    (:meth:`get`), with the counts a bench reports (:meth:`stats`).

    ``device``: the owner's CUDA device (its side stream and pool are made there on the first
    capture). ``capture``: the capture to use instead of :meth:`cuda_capture` (a stand-in on CPU).
    ``clock``: seconds, for the bookkeeping (``time.perf_counter``; injectable in tests)."""

    WARMUPS = 2

    def __init__(self, device: torch.device | None = None, capture: Capture | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.device = device
        self.capture = capture if capture is not None else self.cuda_capture
        self.clock = clock
        self.graphs: dict[K, tuple[Graph, torch.Tensor]] = {}
        self.captures = 0  # graphs captured so far, dropped ones (clear) included
        self.seconds = 0.0  # host seconds spent in captures (warm-ups included)
        self.keys: list[K] = []  # each capture's key, in order (a key dropped and captured again: twice)
        self._stream: Any = None
        self._pool: Any = None

    def __contains__(self, key: K) -> bool:
        return key in self.graphs

    def __len__(self) -> int:
        return len(self.graphs)

    def get(self, key: K, forward: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        """The graph of ``key`` and its output tensor: captured from ``forward`` now if this key
        has none. A capture that raises records nothing and leaves no graph."""
        held = self.graphs.get(key)
        if held is None:
            t0 = self.clock()
            held = self.capture(forward)
            self.seconds += self.clock() - t0
            self.captures += 1
            self.keys.append(key)
            self.graphs[key] = held
        return held

    def clear(self) -> None:
        """Drop every graph (they read memory the owner has replaced); the counts stay."""
        self.graphs.clear()

    def stats(self) -> dict[str, Any]:
        """``captures`` and ``seconds`` so far, and the ``keys`` captured (sorted, each once)."""
        return {"captures": self.captures, "seconds": self.seconds, "keys": sorted(set(self.keys))}

    def cuda_capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        """The CUDA recipe (module docstring): warm-ups on the owner's side stream, then a
        thread-local capture on it into the owner's pool."""
        if self._stream is None:  # taken once: every warm-up and capture of this owner runs on it
            self._stream = torch.cuda.Stream(self.device)
            self._pool = torch.cuda.graph_pool_handle()
        stream, here = self._stream, torch.cuda.current_stream(self.device)
        stream.wait_stream(here)  # the warm-ups read static inputs and caches written on this stream
        with torch.cuda.stream(stream):
            for _ in range(self.WARMUPS):
                forward()
        here.wait_stream(stream)  # replays (on this stream) come after the warm-ups' cache writes
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
            out = forward()
        return graph, out


class Rerun:
    """A stand-in graph for a CPU (CI): its capture runs the forward once, and each replay runs it
    again into that first output tensor, as a graph's replay refills its output. It keeps what a
    capture would not freeze (Python values read at replay time), so it checks bookkeeping, not
    capture safety (``tests/test_fastdecode.py`` traces the step with ``make_fx`` for that)."""

    def __init__(self, forward: Callable[[], torch.Tensor]):
        self.forward = forward
        self.out = forward()

    def replay(self) -> None:
        self.out.copy_(self.forward())


def rerun_capture(forward: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
    """A :data:`Capture` with the :class:`Rerun` stand-in."""
    g = Rerun(forward)
    return g, g.out
