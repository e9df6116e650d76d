"""A line while a long step runs: the progress bar counts finished steps only, so a step of many
minutes (a 1B model on CPU, TRL's TL;DR command line at micro-batch 1 and 4 epochs: 13 minutes)
showed nothing until it ended. Every :data:`HEARTBEAT_S` seconds of one step, one line: the step,
the time so far, and the stages that finished in it (from the run's trace, when ``log.trace`` is
on), e.g. ``[oppo] step 0 running for 2m00s; done in it: generate 41s, score_reward 9.8s``."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

from ..procs import periodic
from ..trace import Tracer

HEARTBEAT_S = 60.0
"""Seconds between two lines of one step (none for a step that ends sooner)."""


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    m, s = divmod(s, 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def status_line(step: int, seconds: float, tracer: Tracer | None) -> str:
    """What a long step has done so far: its stages that finished (their total time each, in the
    order they first started), from ``tracer``'s spans of ``step``."""
    line = f"[oppo] step {step} running for {_duration(seconds)}"
    done: dict[str, list[float]] = {}  # stage -> [first start, total seconds]
    for span in tracer.spans if tracer is not None and tracer.enabled else ():
        if span.step == step:
            first, total = done.get(span.stage, [span.start, 0.0])
            done[span.stage] = [min(first, span.start), total + span.duration]
    if done:
        stages = sorted(done.items(), key=lambda kv: kv[1][0])
        line += "; done in it: " + ", ".join(f"{stage} {_duration(total)}" for stage, (_, total) in stages)
    return line


@contextlib.contextmanager
def step_heartbeat(step: int, note: Callable[[str], None], tracer: Tracer | None = None,
                   every: float | None = None) -> Iterator[None]:
    """Around one step: ``note(status_line(...))`` every ``every`` seconds (default
    :data:`HEARTBEAT_S`) until the step ends, from a daemon thread."""
    every = HEARTBEAT_S if every is None else every
    t0 = time.monotonic()
    with periodic(every, lambda: note(status_line(step, time.monotonic() - t0, tracer)), "step-heartbeat"):
        yield
