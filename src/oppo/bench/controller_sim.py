"""The overlap controller (``oppo.scheduler.tuner``) driven by a synthetic cost: how often it explores, how much
its exploration and its mistakes cost, and how often it ends on the best setting, under step-to-step
noise. Pure Python (no torch, no models): the controller's statistics, not the machine's.

    PYTHONPATH=src python -m oppo.bench.controller_sim --noise 0.02,0.05,0.1,0.2 --seeds 200 --steps 400
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from ..scheduler.tuner import OverlapTuner, Setting, delta_ladder

__all__ = ["LONG_TAIL", "SEPARATED", "NO_TAIL", "SimOutcome", "simulate", "summarize"]

CHUNKS = (16, 0, 8, 32)  # overlap.chunk_candidates's default


def LONG_TAIL(s: Setting) -> float:
    """Carrying pays up to Delta 8 (the tail hidden), a little worse at 16 (more rows per decode
    step); streaming in chunks of 8-16 beats one-shot by 20%. (Chunk 8 is 2% behind chunk 16: a
    difference below the controller's margin, which it is not asked to see.)"""
    by_delta = {0: 1.0, 4: 0.75, 8: 0.62, 16: 0.66}[s.delta]
    by_chunk = {0: 1.2, 8: 1.0, 16: 0.98, 32: 1.05}[s.chunk]
    return by_delta * by_chunk


def SEPARATED(s: Setting) -> float:
    """:data:`LONG_TAIL` with every other setting at least 10% (twice the default margin) dearer than
    the best (Delta 8, chunk 16): a difference the controller is asked to find under noise. (A
    setting just over the margin is a coin toss at 10% noise, as any test of that many steps is.)"""
    by_delta = {0: 1.0, 4: 0.75, 8: 0.62, 16: 0.69}[s.delta]
    by_chunk = {0: 1.2, 8: 1.08, 16: 0.98, 32: 1.08}[s.chunk]
    return by_delta * by_chunk


def NO_TAIL(s: Setting) -> float:
    """Equal lengths at the cap: every extra row makes each decode step dearer; chunks alike."""
    return 1 + 0.03 * s.delta


def stale_of(s: Setting) -> float:
    return 0.4 * min(1.0, s.delta / 4) if s.delta else 0.0


@dataclass
class SimOutcome:
    trial_share: float  # steps run under a challenger / steps
    overhead: float  # the run's cost over the best fixed setting's, same steps (0.05: 5% slower)
    final_best: bool  # the incumbent at the end is the best setting
    final_within_margin: bool  # ... or costs within the margin of it
    changes: int  # moves kept


def simulate(cost: Callable[[Setting], float], noise: float, seed: int, steps: int, *,
             deltas=delta_ladder(0, 16), chunks=CHUNKS, margin: float = 0.05, run_steps: int | None = None,
             predictor=None, **kw) -> SimOutcome:
    """One run: each step costs ``cost(setting) * (1 + N(0, noise))`` seconds per token (100 tokens)."""
    rng = random.Random(seed)
    t = OverlapTuner(deltas, chunks, margin=margin, steps=run_steps, **kw)
    t.predictor = predictor
    total = 0.0
    for _ in range(steps):
        s = t.current()
        c = cost(s)
        total += c
        t.record(100 * c * max(0.05, 1 + rng.gauss(0.0, noise)), 100, stale_of(s))
    grid = [Setting(d, c) for d in deltas for c in chunks]
    best = min(grid, key=cost)
    fin = cost(t.incumbent)
    return SimOutcome(t.trial_steps_run / steps, total / (steps * cost(best)) - 1, t.incumbent == best,
                      fin <= cost(best) * (1 + margin), sum(" -> " in d for d in t.take_decisions()))


def summarize(outs: list[SimOutcome]) -> dict[str, float]:
    return {"trial_share": statistics.mean(o.trial_share for o in outs),
            "trial_share_max": max(o.trial_share for o in outs),
            "overhead": statistics.mean(o.overhead for o in outs),
            "final_best": sum(o.final_best for o in outs) / len(outs),
            "final_within_margin": sum(o.final_within_margin for o in outs) / len(outs)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--noise", default="0.02,0.05,0.1,0.2")
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--curve", default="long_tail", choices=("long_tail", "separated", "no_tail"))
    a = p.parse_args(argv)
    curve = {"long_tail": LONG_TAIL, "separated": SEPARATED, "no_tail": NO_TAIL}[a.curve]
    print(f"curve {a.curve}, {a.seeds} seeds x {a.steps} steps, Gaussian noise per step")
    print("| noise | steps under a trial setting (mean, max) | cost over the best fixed setting | final = best | "
          "final within the margin of the best |")
    print("|---|---|---|---|---|")
    for noise in (float(x) for x in a.noise.split(",")):
        s = summarize([simulate(curve, noise, seed, a.steps) for seed in range(a.seeds)])
        print(f"| {noise:.0%} | {s['trial_share']:.1%}, {s['trial_share_max']:.1%} | {s['overhead']:+.1%} | "
              f"{s['final_best']:.0%} | {s['final_within_margin']:.0%} |")


if __name__ == "__main__":
    main()
