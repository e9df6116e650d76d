"""Who was busy when: span recording, Chrome trace-event files, and busy/bubble arithmetic.

A trace has one row per lane: ``actor``, ``scorer`` (the scorer worker's), ``learner``,
``learner0``, ``rollout0``, ``controller``, ... Work is wrapped in ``tracer.span(lane, stage, step)``;
the spans are saved as Chrome trace-event JSON (``trace.json``, which Perfetto and
``chrome://tracing`` open, a lane's name as its thread's name). From them: a lane's busy
fraction (:func:`busy_stats`), a step's ideal bound (the busiest lane's busy time), the bubble
ratio (:func:`bubble_ratio`) and two lanes' overlap seconds (:func:`overlap_seconds`).

Design notes (the format, each measure): docs/bench.md, "Who was busy when"."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

__all__ = [
    "Span",
    "Tracer",
    "load_trace",
    "busy_seconds",
    "busy_stats",
    "step_windows",
    "bubble_ratio",
    "overlap_seconds",
]

Interval = tuple[float, float]


@dataclass(frozen=True)
class Span:
    """One busy interval of one lane (a row of the trace). Times are seconds on one clock.

    In a live :class:`Tracer` the clock is ``time.perf_counter()``; spans read back by
    :func:`load_trace` are relative to the tracer's start.
    """

    lane: str
    stage: str
    step: int
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def worker(self) -> str:  # the name before the rename; "worker" is the scorer worker's word alone
        raise AttributeError('Span.worker is now Span.lane (docs/python-api.md, "Moved and renamed")')


class _SpanContext:
    """Records a span on exit. ``__enter__`` returns the args dict, to add results found late."""

    __slots__ = ("_tracer", "_lane", "_stage", "_step", "_args", "_start")

    def __init__(self, tracer: Tracer, lane: str, stage: str, step: int, args: dict) -> None:
        self._tracer = tracer
        self._lane = lane
        self._stage = stage
        self._step = step
        self._args = args

    def __enter__(self) -> dict[str, Any]:
        self._start = time.perf_counter()
        return self._args

    def __exit__(self, *exc) -> None:
        end = time.perf_counter()
        self._tracer._append(
            Span(self._lane, self._stage, self._step, self._start, end, self._args)
        )


class _NullSpanContext:
    __slots__ = ()

    def __enter__(self) -> dict[str, Any]:
        return {}  # callers may write into it; the dict is simply dropped

    def __exit__(self, *exc) -> None:
        return None


_NULL_SPAN = _NullSpanContext()


class Tracer:
    """Thread-safe recorder of busy spans.

    >>> tracer = Tracer()
    >>> with tracer.span("policy", "generate", step=3) as args:
    ...     args["tokens"] = 128   # optional: extra args known only at the end
    >>> tracer.save("trace.json")

    A disabled tracer records nothing and its ``span`` costs one method call.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.t0 = time.perf_counter()  # origin of ts in the saved file
        self._lock = threading.Lock()
        self._spans: list[Span] = []

    def span(self, lane: str, stage: str, step: int, **args: Any):
        """Context manager timing its body as one span of ``lane`` doing ``stage``."""
        if not self.enabled:
            return _NULL_SPAN
        return _SpanContext(self, lane, stage, step, args)

    def add(self, lane: str, stage: str, step: int, start: float, end: float, **args: Any) -> None:
        """Record a span timed elsewhere (``start``/``end`` from ``time.perf_counter()``)."""
        if not self.enabled:
            return
        if end < start:
            raise ValueError(f"span {lane}/{stage} ends before it starts ({start} > {end})")
        self._append(Span(lane, stage, int(step), float(start), float(end), args))

    def _append(self, span: Span) -> None:
        with self._lock:  # list.append is atomic in CPython, but save() must see a consistent list
            self._spans.append(span)

    @property
    def spans(self) -> list[Span]:
        """A snapshot (copy) of the spans recorded so far, in recording order."""
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def to_chrome(self) -> dict[str, Any]:
        """The trace as a Chrome trace-event dict (see the module docstring)."""
        return spans_to_chrome(self.spans, t0=self.t0)

    def save(self, path: str | Path, previous: Iterable[Span] = ()) -> Path:
        """Write the Chrome trace JSON atomically (temp file + rename); returns the path.

        ``previous``: spans of an earlier process of the same run (a resumed run passes the
        steps before its checkpoint, read back with :func:`load_trace`). They are written first,
        on their own clock, and this tracer's spans follow them after a one-second gap that marks
        the restart, so resuming never loses the trace of the steps already run.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        previous = list(previous)
        if previous:
            shift = max(s.end for s in previous) + 1.0 - self.t0
            spans = previous + [Span(s.lane, s.stage, s.step, s.start + shift, s.end + shift, s.args)
                                for s in self.spans]
            data = spans_to_chrome(spans, t0=0.0)
        else:
            data = self.to_chrome()
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".trace.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, default=str)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path


def spans_to_chrome(spans: Iterable[Span], t0: float = 0.0, pid: int = 0) -> dict[str, Any]:
    """Chrome trace-event dict for ``spans``; ``ts`` = microseconds since ``t0``.

    Thread ids are assigned per lane in sorted name order (1, 2, ...), so the same lanes get
    the same rows in every mode's trace; a lane's name is its thread's ``thread_name``.
    """
    spans = list(spans)
    lanes = sorted({s.lane for s in spans})
    tids = {lane: i + 1 for i, lane in enumerate(lanes)}
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "oppo"}}
    ]
    for lane, tid in tids.items():
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}})
        events.append(
            {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
        )
    for s in sorted(spans, key=lambda s: s.start):
        events.append(
            {
                "ph": "X",
                "name": s.stage,
                "cat": s.stage,
                "pid": pid,
                "tid": tids[s.lane],
                "ts": (s.start - t0) * 1e6,
                "dur": (s.end - s.start) * 1e6,
                "args": {**s.args, "step": s.step},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def load_trace(path: str | Path) -> list[Span]:
    """Read a trace written by :meth:`Tracer.save` back into spans (seconds since its start).

    Complete events without a step in their args get step -1; events of threads without a
    ``thread_name`` are given the lane name ``"tid<N>"``.
    """
    path = Path(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    events = data["traceEvents"] if isinstance(data, dict) else data
    names: dict[tuple[Any, Any], str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e.get("pid"), e.get("tid"))] = str(e["args"]["name"])
    spans = []
    for e in events:
        if e.get("ph") != "X":
            continue
        key = (e.get("pid"), e.get("tid"))
        args = dict(e.get("args") or {})
        step = int(args.pop("step", -1))
        start = float(e["ts"]) / 1e6
        spans.append(
            Span(
                lane=names.get(key, f"tid{e.get('tid')}"),
                stage=str(e.get("name", "")),
                step=step,
                start=start,
                end=start + float(e.get("dur", 0.0)) / 1e6,
                args=args,
            )
        )
    spans.sort(key=lambda s: s.start)
    return spans


# ---------------------------------------------------------------------------------------------
# Interval arithmetic
# ---------------------------------------------------------------------------------------------


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge intervals into disjoint sorted ones (touching intervals merge)."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _clip(intervals: Iterable[Interval], t0: float, t1: float) -> list[Interval]:
    return [(max(a, t0), min(b, t1)) for a, b in intervals if b > t0 and a < t1]


def _lane_union(spans: Iterable[Span], lane: str, t0: float, t1: float) -> list[Interval]:
    return _union(_clip(((s.start, s.end) for s in spans if s.lane == lane), t0, t1))


def _window(spans: list[Span], t0: float | None, t1: float | None) -> Interval:
    if t0 is None:
        t0 = min((s.start for s in spans), default=0.0)
    if t1 is None:
        t1 = max((s.end for s in spans), default=t0)
    return t0, t1


def busy_seconds(spans: Iterable[Span], t0: float | None = None, t1: float | None = None) -> dict[str, float]:
    """Seconds each lane was busy inside [t0, t1] (default: the whole trace)."""
    spans = list(spans)
    t0, t1 = _window(spans, t0, t1)
    return {
        lane: sum(b - a for a, b in _lane_union(spans, lane, t0, t1))
        for lane in sorted({s.lane for s in spans})
    }


def busy_stats(spans: Iterable[Span], t0: float | None = None, t1: float | None = None) -> dict[str, float]:
    """Busy fraction per lane over [t0, t1] (default: first start to last end of all spans).

    A lane's spans are merged before measuring, so overlapping spans of one lane (e.g. two
    streams) are not counted twice. An empty window gives 0.0 for every lane.
    """
    spans = list(spans)
    t0, t1 = _window(spans, t0, t1)
    length = t1 - t0
    return {lane: (b / length if length > 0 else 0.0) for lane, b in busy_seconds(spans, t0, t1).items()}


def step_windows(spans: Iterable[Span]) -> dict[int, Interval]:
    """Per step: (first start, last end) over the spans tagged with that step, sorted by step."""
    windows: dict[int, list[float]] = {}
    for s in spans:
        w = windows.get(s.step)
        if w is None:
            windows[s.step] = [s.start, s.end]
        else:
            w[0] = min(w[0], s.start)
            w[1] = max(w[1], s.end)
    return {k: (windows[k][0], windows[k][1]) for k in sorted(windows)}


def bubble_ratio(spans: Iterable[Span], window: Interval | None = None) -> float:
    """``1 - busiest lane's busy time / window length`` over ``window`` (default: all spans).

    The ideal bound of a step is its busiest lane's busy time: however well the stages
    overlap, the step cannot end before that lane's work is done. The ratio is the fraction
    of the window by which the step exceeds that bound (0 = ideal). Spans are clipped to the
    window by time, whatever step they are tagged with: with inter-step overlap, work of step
    k+1 running during step k fills step k's bubbles, and should count.
    """
    spans = list(spans)
    t0, t1 = _window(spans, *(window if window is not None else (None, None)))
    length = t1 - t0
    if length <= 0:
        return 0.0
    busiest = max(busy_seconds(spans, t0, t1).values(), default=0.0)
    return 1.0 - busiest / length


def overlap_seconds(
    spans: Iterable[Span],
    lane_a: str,
    lane_b: str,
    t0: float | None = None,
    t1: float | None = None,
) -> float:
    """Seconds during which ``lane_a`` and ``lane_b`` were both busy (within [t0, t1])."""
    spans = list(spans)
    t0, t1 = _window(spans, t0, t1)
    a = _lane_union(spans, lane_a, t0, t1)
    b = _lane_union(spans, lane_b, t0, t1)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):  # two-pointer sweep over the sorted disjoint intervals
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
