"""The planner inside a run: from the run's own first steps, predict each overlap setting's cost
per trained token and stale share, so that the controller (``oppo.scheduler.tuner``) measures only
the candidates worth a trial.

Pure Python (no torch, no numpy). :meth:`OnlinePlanner.observe` takes each step's trained lengths,
decode seconds and decode steps, and the rest of the step per token; :meth:`OnlinePlanner.predict`
replays the scheduler's carrying over lengths redrawn from those. Until two Deltas have run, the
split of a decode step's cost between the step and its rows is not fitted, and the prediction
says so and carries both extreme splits (issue 51). Unseen chunk settings and groups are not
predicted.

Design notes: docs/planner.md, "The planner inside a run"."""

from __future__ import annotations

import random
import statistics
from collections import deque

from ..scheduler.tuner import Prediction, Setting

__all__ = ["OnlinePlanner", "replay_carry"]


def replay_carry(lengths: list[int], batch: int, delta: int, max_lag: int = 1, steps: int = 24,
                 warmup: int = 4, seed: int = 0) -> tuple[float, float, float, float]:
    """Replay ``steps`` steps of oppo's scheduler (``oppo.scheduler.admission``, groups of one) with
    each admitted row's length drawn from ``lengths``: admit until ``batch + delta`` rows are
    untrained; decode in lock step until ``batch`` rows are finished (those that finished in an
    earlier step and wait count) and no row carried ``max_lag`` times is still running; train the
    ``batch`` oldest finished. Returns, per step after ``warmup``: decode steps, row-steps (rows
    decoding, summed over the decode steps), trained tokens; and the stale share of trained tokens
    (sampled before the step that trains them)."""
    rng = random.Random(seed)
    rows: list[list[int]] = []  # [remaining (0: finished, waiting), start step, length, finish order]
    d_sum = rs_sum = tok_sum = stale_sum = 0.0
    order = 0
    for k in range(steps):
        while len(rows) < batch + delta:
            n = max(1, rng.choice(lengths))
            rows.append([n, k, n, 0])
        done = sum(1 for r in rows if r[0] == 0)
        rem = sorted(r[0] for r in rows if r[0] > 0)
        need = batch - done
        close = rem[min(need, len(rem)) - 1] if need > 0 and rem else 0
        due = [r[0] for r in rows if r[0] > 0 and k - r[1] >= max_lag]
        close = max([close, *due])
        rs = 0
        before = {id(r): r[2] - r[0] for r in rows}  # tokens each row had sampled before this step
        for r in sorted((r for r in rows if r[0] > 0), key=lambda r: r[0]):
            step_tokens = min(r[0], close)
            rs += step_tokens
            if r[0] <= close:
                order += 1
                r[0], r[3] = 0, order
            else:
                r[0] -= close
        finished = sorted((r for r in rows if r[0] == 0), key=lambda r: (r[1], r[3]))[:batch]
        if k >= warmup:
            d_sum, rs_sum = d_sum + close, rs_sum + rs
            tok_sum += sum(r[2] for r in finished)
            stale_sum += sum(before[id(r)] for r in finished)
        picked = {id(r) for r in finished}
        rows = [r for r in rows if id(r) not in picked]
    n = steps - warmup
    return d_sum / n, rs_sum / n, tok_sum / n, (stale_sum / tok_sum if tok_sum else 0.0)


class OnlinePlanner:
    """Predicts a setting's cost per trained token and stale share from the run's own steps
    (module docstring). ``batch``: sequences trained per step (B); ``max_lag``: overlap.max_lag."""

    def __init__(self, batch: int, max_lag: int = 1, window: int = 8) -> None:
        if batch < 1 or max_lag < 0 or window < 1:
            raise ValueError(f"batch and window must be >= 1 and max_lag >= 0, got {batch}, {max_lag}, {window}")
        self.batch, self.max_lag = batch, max_lag
        self.lengths: deque[list[int]] = deque(maxlen=window)  # the last steps' trained lengths
        self.window = window
        self.decode: dict[int, deque[float]] = {}  # Delta -> its last steps' seconds per decode step
        self.rest: dict[int, deque[float]] = {}  # chunk -> seconds per trained token outside decoding
        self._cache: dict[Setting, Prediction | None] = {}
        self._replays: dict[int, tuple[float, float, float, float]] = {}

    def observe(self, setting: Setting, seconds: float, lengths: list[int], decode_steps: float,
                generate_s: float) -> None:
        """One step ran with ``setting``: its seconds, trained response lengths, lock-step decode steps
        and seconds in the decode loop."""
        if not lengths or decode_steps <= 0 or generate_s <= 0 or seconds < generate_s:
            return  # nothing to learn from (a step with no decoding: everything was carried in)
        self.lengths.append([int(n) for n in lengths])
        self.decode.setdefault(setting.delta, deque(maxlen=self.window)).append(generate_s / decode_steps)
        self.rest.setdefault(setting.chunk, deque(maxlen=self.lengths.maxlen)).append(
            (seconds - generate_s) / sum(lengths))
        self._cache.clear()
        self._replays.clear()

    def _replay(self, delta: int) -> tuple[float, float, float, float]:
        if delta not in self._replays:  # (cleared with the predictions: the lengths changed)
            self._replays[delta] = replay_carry([n for step in self.lengths for n in step], self.batch, delta,
                                                self.max_lag)
        return self._replays[delta]

    def _rows(self, delta: int) -> float:
        """Rows decoding in a mean decode step at ``delta`` (fewer than B + Delta: rows finish)."""
        d, rs, _, _ = self._replay(delta)
        return rs / d if d else float(self.batch + delta)

    @property
    def fitted(self) -> bool:
        """The decode model is fitted from the run's own measures: two distinct row counts have run."""
        return len({round(self._rows(d), 6) for d in self.decode}) >= 2

    def _decode_models(self) -> list[tuple[float, float]]:
        """The decode models the measures allow, each (a, b): seconds per decode step = a + b * rows.
        Fitted (two row counts): the one least-squares fit. Not fitted: half per row (the prior),
        then the two extremes, all per step and all per row (module docstring)."""
        xs = [self._rows(d) for d, cs in self.decode.items() for _ in cs]
        ys = [c for cs in self.decode.values() for c in cs]
        if len(set(round(x, 6) for x in xs)) >= 2:
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            b = max(b, 0.0)
            return [(max(my - b * mx, 0.0), b)]
        c = statistics.median(ys)
        return [(c / 2, c / 2 / xs[0]), (c, 0.0), (0.0, c / xs[0])]

    def decode_model(self) -> str:
        """The decode model in words, for the controller's log."""
        models = self._decode_models()
        if not self.decode:
            return "no decode step measured"
        a, b = models[0]
        if self.fitted:
            rows = ", ".join(f"{self._rows(d):.1f} (Delta {d}, {len(cs)} steps)" for d, cs in sorted(self.decode.items()))
            return f"decode step {1e3 * a:.3g} ms + {1e3 * b:.3g} ms per row, fitted at rows {rows}"
        (d, cs), = self.decode.items()
        return (f"decode model not fitted (one row count measured: {self._rows(d):.1f} rows at Delta {d}, "
                f"{len(cs)} steps); half per row assumed")

    def predict(self, s: Setting) -> Prediction | None:
        if s in self._cache:
            return self._cache[s]
        out = None
        if self.decode and s.chunk in self.rest:
            d, rs, tok, stale = self._replay(s.delta)
            rest = statistics.median(self.rest[s.chunk])
            costs = [(a * d + b * rs) / tok + rest for a, b in self._decode_models()]
            out = Prediction(costs[0], stale, fitted=len(costs) == 1, extremes=tuple(costs[1:]),
                             basis=self.decode_model())
        self._cache[s] = out
        return out
