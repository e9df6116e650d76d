"""The cost-aware overlap controller (``overlap.delta_rule=cost``, the default): Delta and the
streaming chunk chosen by what they save, measured on the run's own steps (a planner, where attached,
predicts first so that only candidates worth a trial are measured). Pure: no torch, threads or clocks.
Its rules (moves, noise, confirmation, holds, prediction, short runs): ``docs/overlap.md``, "The
cost-aware controller: design notes".
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..checkpoint.formats import FormatError, upgraded
from .records import StepTiming

__all__ = ["OverlapTuner", "Prediction", "Setting", "TunedDelta", "delta_ladder"]

_NAME, _VERSION = "oppo.overlap_tuner", 2
_FORMAT = f"{_NAME}/{_VERSION}"  # a change of state_dict's shape bumps it and adds an upgrade (_UPGRADES)
_Z = 1.5  # standard errors that count as decided (a trial) ...
_Z_DRIFT = 3.0  # ... and as a drift (a hold: checked every step, so a false alarm must be rare)
_DRIFT_WINDOW = 4  # the hold's last steps whose median is checked for drift
_MEDIAN_SE = 1.2533  # the standard error of a median is this times that of a mean (normal noise)
_DIFFS = 64  # consecutive-step differences kept for the spread
_BACKOFF = 4  # a hold lengthens up to this many times retune_every while rounds change nothing


@dataclass(frozen=True)
class Setting:
    """What a step runs with: ``delta`` extra sequences (groups) in flight; ``chunk`` tokens per
    streamed chunk, 0 for no streaming (the scorers score the closed batch one-shot)."""

    delta: int
    chunk: int

    def describe(self) -> str:
        return f"Delta {self.delta}, " + (f"chunk {self.chunk}" if self.chunk else "one-shot scoring")


@dataclass(frozen=True)
class Prediction:
    """A planner's figures for one setting: seconds per trained token and the share of trained
    tokens sampled by an older policy.

    ``fitted``: the cost model behind ``cost`` is fitted from the run's own measures; False where
    part of it is still assumed (the online planner's split of a decode step's cost before two row
    counts have run). Then ``extremes`` holds the costs under the other models the measures allow,
    the same ones, in the same order, for every setting (so that two predictions compare model by
    model), and a cost veto must hold under each (:meth:`OverlapTuner._ruled_out`). ``basis``: the
    model in words, for the decision's line."""

    cost: float
    stale: float = 0.0
    fitted: bool = True
    extremes: tuple[float, ...] = ()
    basis: str = ""


def delta_ladder(low: int, high: int) -> tuple[int, ...]:
    """The Delta levels the controller moves between: ``low``, a quarter and a half of ``high``,
    and ``high`` (those above ``low``): steps large enough to be measured over a step's noise."""
    return tuple(sorted({low, high} | {d for d in (high // 4, high // 2) if low < d < high}))


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


class OverlapTuner:
    """Cost-aware choice of Delta and the chunk size (module docstring).

    Args:
        deltas: the Delta levels, ascending (:func:`delta_ladder`); one level: Delta is fixed.
        chunks: the chunk sizes in the order they are tried, the first the start; 0 is one-shot
            scoring; one size: fixed.
        trial_steps: the fewest measured steps per trial (after its warm-up); a close call runs up
            to three times as many.
        retune_every: steps the incumbent holds between rounds (None: one round only).
        margin: the relative cost difference that counts as a difference.
        max_stale_share: the most that Delta may add to the share of tokens trained off-policy.
        in_flight: the pipeline mode (the next step begins under the setting of the previous one:
            a Delta change takes one more warm-up step).
        steps: the run's length in steps (None: unknown); trials that the steps left cannot repay
            are not run.
    """

    def __init__(self, deltas: Sequence[int], chunks: Sequence[int], *, trial_steps: int = 2,
                 retune_every: int | None = 50, margin: float = 0.05, max_stale_share: float = 0.5,
                 in_flight: bool = False, steps: int | None = None) -> None:
        self.deltas, self.chunks = tuple(deltas), tuple(chunks)
        if not self.deltas or list(self.deltas) != sorted(set(self.deltas)) or self.deltas[0] < 0:
            raise ValueError(f"deltas must be distinct levels >= 0 in ascending order, got {self.deltas}")
        if not self.chunks or len(set(self.chunks)) != len(self.chunks) or min(self.chunks) < 0:
            raise ValueError(f"chunks must be distinct sizes >= 0 (0: one-shot), got {self.chunks}")
        if trial_steps < 1 or (retune_every is not None and retune_every < 1):
            raise ValueError(f"trial_steps and retune_every must be >= 1, got {trial_steps}, {retune_every}")
        if not (0 <= margin < 1 and 0 <= max_stale_share <= 1):
            raise ValueError(f"margin must be in [0, 1) and max_stale_share in [0, 1], got {margin}, "
                             f"{max_stale_share}")
        if steps is not None and steps < 0:
            raise ValueError(f"steps (the run's length) must be >= 0 or None, got {steps}")
        self.trial_steps, self.retune_every, self.margin = trial_steps, retune_every, margin
        self.max_stale_share, self.in_flight, self.steps = max_stale_share, in_flight, steps
        self.predictor: Callable[[Setting], Prediction | None] | None = None  # not checkpointed: refit on resume
        self.learner: Callable[[Setting, StepTiming], None] | None = None  # what the predictor learns from (observe)
        self.incumbent = Setting(self.deltas[0], self.chunks[0])
        self.cost: float | None = None  # the incumbent's measured cost (s per token)
        self.base_stale: float | None = None  # the off-policy share at the lowest Delta
        self.phase = "measure"  # measure | chunk | up | down | confirm | hold
        self.trial: Setting | None = None  # the challenger being measured
        self._kind = ""  # the kind of move being tried or confirmed (chunk | up | down)
        self._challenger: Setting | None = None  # a move that passed its trial, being confirmed
        self._plan: list[tuple[str, Setting]] = []  # the round's moves still to try
        self._warm = 1  # steps still to discard (the run's first step pays one-off costs)
        self._costs: list[float] = []  # the trial (or measure, or confirm) in progress
        self._stale: list[float] = []
        self._trial_costs: list[float] = []  # a passed challenger's measures, kept while it is confirmed
        self._trial_stale = 0.0
        self._before: list[float] = []  # the incumbent's latest measures before a trial
        self._held: list[float] = []
        self._diffs: list[float] = []  # relative differences of consecutive measures of one setting
        self._last: tuple[Setting, float] | None = None  # the last measure, for the next difference
        self._hold_len = retune_every
        self._pred: tuple[float, float] | None = None  # the trial's predicted cost (s per token) and gain
        self._pred_basis = ""  # the cost model it was predicted with (Prediction.basis), for the log
        self.last_decision: dict[str, float] = {}  # the last judged move: predicted and measured gain
        self.short_said = False  # a run too short to repay a trial says so once
        self._changed = False  # the round in progress moved the incumbent (a drift counts as a change)
        self._keep_last = False  # the warm-up is a resume's, not a switch's: the chain of measures goes on
        self.rounds = 0
        self.trial_steps_run = 0  # steps run under a challenger (the price of exploring)
        self.decisions: list[str] = []  # lines not yet taken by the caller (take_decisions)
        self._ran = self.incumbent  # the setting of the last step recorded
        self.step = 0

    @property
    def tunes(self) -> bool:
        return len(self.deltas) > 1 or len(self.chunks) > 1

    def current(self) -> Setting:
        """The setting for the next step."""
        return self.trial or self.incumbent

    @property
    def sigma(self) -> float | None:
        """The measured step-to-step spread (relative standard deviation), None before four pairs."""
        if len(self._diffs) < 4:
            return None
        # |a - b| of two draws of spread s has median 0.954 s (normal): median |d| / 0.954 estimates s
        return _median([abs(d) for d in self._diffs]) / 0.954

    def _spread(self) -> float:
        # before the spread is measured, assume half the margin (what the margin was chosen to clear)
        s = self.sigma
        return s if s is not None else self.margin / 2

    def record(self, seconds: float, tokens: float, stale_share: float = 0.0) -> None:
        """One step ran with :meth:`current`: its wall-clock ``seconds``, the response ``tokens`` it
        trained and the share of them sampled by an older policy version."""
        if not (math.isfinite(seconds) and seconds >= 0 and math.isfinite(tokens) and math.isfinite(stale_share)):
            raise ValueError(f"record needs finite figures, got {seconds}, {tokens}, {stale_share}")
        self.step += 1
        ran = self._ran = self.current()
        if not self.tunes:
            return
        if self.trial is not None:
            self.trial_steps_run += 1
        if self._warm:
            self._warm -= 1
            if not self._keep_last:  # a switch: the next measure pairs with none before it
                self._last = None
            self._keep_last = False
            return
        cost = seconds / max(tokens, 1.0)
        if self._last is not None and self._last[0] == ran and self._last[1] > 0 and cost > 0:
            self._diffs = (self._diffs + [2 * (cost - self._last[1]) / (cost + self._last[1])])[-_DIFFS:]
        self._last = (ran, cost)
        if self.phase == "hold":
            self._hold(cost)
            return
        self._costs.append(cost)
        self._stale.append(stale_share)
        self._step_trial()

    def take_decisions(self) -> list[str]:
        out, self.decisions = self.decisions, []
        return out

    # ---------------------------------------------------------------- as the run's controller

    def chunk_size(self) -> int:
        """Tokens per streamed chunk for the next step (0: one-shot scoring)."""
        return self.current().chunk

    def observe(self, ran: StepTiming) -> None:
        """A step ran with :meth:`current`: the predictor's model learns from it (:attr:`learner`),
        then it is recorded (:meth:`record`)."""
        if self.learner is not None:
            self.learner(self.current(), ran)
        self.record(ran.seconds, ran.tokens, ran.stale_share)

    def step_metrics(self) -> dict[str, float]:
        """:meth:`metrics` where the controller tunes; a fixed setting adds none."""
        return self.metrics() if self.tunes else {}

    def metrics(self) -> dict[str, float]:
        """The controller's state for the step's metrics; a figure with no value yet is absent."""
        out = {"overlap/tuner_exploring": float(self.phase != "hold"),
               "overlap/tuner_trial": float(self.trial is not None),
               "overlap/tuner_trial_steps": float(self.trial_steps_run), "overlap/tuner_rounds": float(self.rounds)}
        if self.cost is not None:  # a metric with no value yet is absent, not NaN (a NaN reads as a failure)
            out["overlap/tuner_cost_ms_per_token"] = 1e3 * self.cost
        if self.sigma is not None:
            out["overlap/tuner_noise"] = self.sigma
        if self._pred is not None and self.trial is not None:
            out["overlap/tuner_predicted_ms_per_token"] = 1e3 * self._pred[0]
        out.update({f"overlap/tuner_{k}": v for k, v in self.last_decision.items()})
        return out

    # ---------------------------------------------------------------- trials

    def _se(self, n_a: int, n_b: int) -> float:
        """The standard error of the relative difference of two medians of ``n_a`` and ``n_b`` steps."""
        return _MEDIAN_SE * self._spread() * math.sqrt(1 / max(n_a, 1) + 1 / max(n_b, 1))

    def _threshold(self, kind: str) -> float:
        return -self.margin if kind == "down" else self.margin

    def _step_trial(self) -> None:
        n = len(self._costs)
        if n < self.trial_steps:
            return
        if self.phase == "measure":
            self._measured()
            return
        if self.phase == "confirm":
            assert self._challenger is not None
            ref = (_median(self._before) + _median(self._costs)) / 2
            gain = 1 - _median(self._trial_costs) / ref
            se = self._se(len(self._trial_costs), len(self._before) + n)
        else:
            assert self.cost is not None
            gain = 1 - _median(self._costs) / self.cost
            se = self._se(n, len(self._before))
        if abs(gain - self._threshold(self._kind)) < _Z * se and n < 3 * self.trial_steps:
            return  # a close call: measure another step
        if self.phase == "confirm":
            self._confirmed(gain)
        else:
            self._judge(gain)

    def _measured(self) -> None:
        cost, stale = _median(self._costs), _median(self._stale)
        self.cost, self._before = cost, list(self._costs)
        if self.incumbent.delta == self.deltas[0]:
            self.base_stale = stale
        self._costs, self._stale = [], []
        self._say(f"measured {self.incumbent.describe()}: {1e3 * cost:.3f} ms per token")
        self._plan = self._first_round()
        self._next()

    def _why(self, cost: float, ref: float, gain: float) -> str:
        out = f"{1e3 * cost:.3f} against {1e3 * ref:.3f} ms per token ({-gain:+.1%})"
        if self._pred is not None:
            out += f"; predicted {1e3 * self._pred[0]:.3f} ({-self._pred[1]:+.1%}{self._basis()})"
        return out

    def _basis(self) -> str:
        """The cost model behind the trial's prediction when it was made, and the planner's model now
        where it has changed (a trial fits a model that was not fitted), for the decision's line."""
        p = self.predictor(self.trial or self._challenger or self.incumbent) if self.predictor else None
        out = f", {self._pred_basis}" if self._pred_basis else ""
        if p is not None and p.basis and p.basis != self._pred_basis:
            out += f"; the planner now: {p.basis}"
        return out

    def _judge(self, gain: float) -> None:
        """A trial is decided: a passing move goes to confirmation, a failing one is dropped."""
        assert self.trial is not None and self.cost is not None
        kind, new, old = self._kind, self.trial, self.incumbent
        cost, stale = _median(self._costs), _median(self._stale)
        if new.delta == self.deltas[0] and self.base_stale is None:
            self.base_stale = stale
        added = stale - (self.base_stale if self.base_stale is not None else 0.0)
        passed = gain >= self._threshold(kind) and (kind != "up" or added <= self.max_stale_share)
        self._decided(gain)
        if passed:  # measure the incumbent again before taking the move
            self._challenger, self._trial_costs, self._trial_stale = new, list(self._costs), stale
            self._costs, self._stale = [], []
            self.phase, self.trial = "confirm", None
            self._warm = self._warmup(self._ran, old)
            return
        why = self._why(cost, self.cost, gain)
        if kind == "up":
            why += f", off-policy tokens {stale:.0%} ({added:+.0%} over Delta {self.deltas[0]})"
        limit = {"down": f"costs more than {self.margin:.0%} more",
                 "up": (f"adds more than {self.max_stale_share:.0%} off-policy tokens"
                        if gain >= self.margin else f"saves less than {self.margin:.0%}"),
                 "chunk": f"saves less than {self.margin:.0%}"}[kind]
        self._say(f"kept {old.describe()}: {new.describe()} {limit} ({why})")
        self._costs, self._stale = [], []
        self._next()

    def _confirmed(self, gain: float) -> None:
        """The incumbent measured again after a move passed its trial: keep the move only if it still
        passes against the mean of the incumbent's measures before and after."""
        assert self._challenger is not None
        new, old, kind = self._challenger, self.incumbent, self._kind
        cost, before, again = _median(self._trial_costs), _median(self._before), _median(self._costs)
        why = (f"{1e3 * cost:.3f} ms per token against {1e3 * before:.3f} before and {1e3 * again:.3f} after "
               f"({-gain:+.1%})")
        if self._pred is not None:
            why += f"; predicted {1e3 * self._pred[0]:.3f} ({-self._pred[1]:+.1%}{self._basis()})"
        if kind != "chunk":
            why += f", off-policy tokens {self._trial_stale:.0%}"
        self._challenger = None
        if gain >= self._threshold(kind):
            self.incumbent, self.cost, self._before = new, cost, list(self._trial_costs)
            self._changed = True
            self._say(f"{old.describe()} -> {new.describe()}: {why}")
            if kind == "up":
                self._plan[:0] = [("up", s) for s in self._neighbour(new, +1)]
            elif kind == "down":
                self._plan = [("down", s) for s in self._neighbour(new, -1)] + [
                    m for m in self._plan if m[0] != "up"]
        else:
            self.cost, self._before = again, list(self._costs)
            self._say(f"kept {old.describe()}: {new.describe()} "
                      + ("costs more than" if kind == "down" else "saves less than")
                      + f" {self.margin:.0%} once the incumbent is measured again ({why})")
        self._costs, self._stale = [], []
        self._next()

    def _decided(self, gain: float) -> None:
        self.last_decision = {"measured_gain": gain}
        if self._pred is not None:
            self.last_decision["predicted_gain"] = self._pred[1]

    # ---------------------------------------------------------------- rounds

    def _first_round(self) -> list[tuple[str, Setting]]:
        inc = self.incumbent
        return ([("chunk", Setting(inc.delta, c)) for c in self.chunks if c != inc.chunk]
                + [("up", s) for s in self._neighbour(inc, +1)])

    def _round(self) -> list[tuple[str, Setting]]:
        """A later round: Delta's neighbours (down first) in odd rounds, the other chunks in even
        ones (half the trials of trying both each time), or whichever of the two is tuned."""
        inc = self.incumbent
        deltas = [("down", s) for s in self._neighbour(inc, -1)] + [("up", s) for s in self._neighbour(inc, +1)]
        chunks = [("chunk", Setting(inc.delta, c)) for c in self.chunks if c != inc.chunk]
        if not deltas or not chunks:
            return deltas or chunks
        return deltas if self.rounds % 2 else chunks

    def _neighbour(self, s: Setting, way: int) -> list[Setting]:
        i = self.deltas.index(s.delta) + way
        return [Setting(self.deltas[i], s.chunk)] if 0 <= i < len(self.deltas) else []

    def _predict(self, kind: str, s: Setting) -> tuple[float, float] | None:
        """(predicted cost, predicted gain) of ``s`` against the incumbent, scaled to the incumbent's
        measure; None with no planner, or where it cannot tell. Raises nothing: a planner that fails
        is a planner that cannot tell."""
        if self.predictor is None or self.cost is None:
            return None
        p, q = self.predictor(s), self.predictor(self.incumbent)
        if p is None or q is None or q.cost <= 0 or not math.isfinite(p.cost):
            return None
        cost = self.cost * p.cost / q.cost
        return cost, 1 - cost / self.cost

    def _ruled_out(self, kind: str, s: Setting) -> str | None:
        """Why the prediction rules out a trial of ``s``, or None."""
        if self.predictor is None:
            return None
        if kind == "down":
            return self._down_ruled_out(s)
        pred = self._predict(kind, s)
        if pred is None:
            return None
        p = self.predictor(s)
        added = (p.stale if p else 0.0) - (self.base_stale or 0.0)
        if kind == "up" and added > self.max_stale_share:
            return f"predicted to add {added:.0%} off-policy tokens, over {self.max_stale_share:.0%}"
        if pred[1] >= self.margin:
            return None
        q = self.predictor(self.incumbent)
        assert p is not None and q is not None  # (_predict returned a figure)
        if p.fitted and q.fitted:
            basis = f"; {p.basis}" if p.basis else ""
            return (f"predicted {1e3 * pred[0]:.3f} ms per token ({-pred[1]:+.1%}), saves less than "
                    f"{self.margin:.0%}{basis}")
        if len(p.extremes) != len(q.extremes) or not p.extremes:
            return None  # an assumed model with nothing to bound it: measure instead
        best = max(1 - a / b for a, b in zip(p.extremes, q.extremes) if b > 0) if any(
            b > 0 for b in q.extremes) else math.inf
        if best >= self.margin:
            return None  # a model the measures allow makes it save the margin: try it
        return (f"predicted {1e3 * pred[0]:.3f} ms per token ({-pred[1]:+.1%}), and at most {-best:+.1%} under "
                f"any split the measures allow; saves less than {self.margin:.0%} ({p.basis or 'model not fitted'})")

    def _down_ruled_out(self, s: Setting) -> str | None:
        """A move down is ruled out only by a fitted model (both predictions ``fitted``) that predicts
        it to cost more than ``margin`` more: the measure it would need to be kept (issue 51: at 10%
        noise, a down trial of a Delta that truly saves 8% passed by chance in one run in five)."""
        pred = self._predict("down", s)
        p, q = self.predictor(s) if self.predictor else None, self.predictor(self.incumbent) if self.predictor else None
        if pred is None or p is None or q is None or not (p.fitted and q.fitted) or -pred[1] <= self.margin:
            return None
        basis = f"; {p.basis}" if p.basis else ""
        return (f"predicted {1e3 * pred[0]:.3f} ms per token ({-pred[1]:+.1%}), costs more than {self.margin:.0%} "
                f"more{basis}")

    def _trial_length(self, s: Setting) -> int:
        """Steps a trial of ``s`` takes, its confirmation included: warm-ups and the fewest measures."""
        return (self._warmup(self.incumbent, s) + self._warmup(s, self.incumbent) + 2 * self.trial_steps)

    def _repays(self, s: Setting, gain: float | None) -> bool:
        if self.steps is None:
            return True
        length = self._trial_length(s)
        left = self.steps - self.step - length
        return max(gain if gain is not None else self.margin, self.margin) * left >= 2 * self.margin * length

    def _next(self) -> None:
        """Start the next move of the round (with the incumbent's current chunk and Delta), or hold."""
        prev = self._ran
        plan = [(k, Setting(s.delta, self.incumbent.chunk) if k in ("up", "down") else Setting(self.incumbent.delta,
                                                                                             s.chunk))
                for k, s in self._plan]
        plan = [(k, s) for k, s in plan if s != self.incumbent]
        if self.predictor is not None:
            # most promising first: a move back down first (it only removes stale tokens), then those
            # predicted to save most, then those the planner cannot tell (in their order)
            def rank(m: tuple[str, Setting]) -> tuple[int, float]:
                pred = None if m[0] == "down" else self._predict(m[0], m[1])
                return (-1, 0.0) if m[0] == "down" else (0, -pred[1]) if pred else (1, 0.0)

            plan.sort(key=rank)
        while plan:
            kind, s = plan.pop(0)
            why = self._ruled_out(kind, s)
            if why is not None:
                self._say(f"not trying {s.describe()}: {why}")
                continue
            pred = self._predict(kind, s)
            if not self._repays(s, pred[1] if pred else None):  # a shorter trial (no warm-ups) may still repay
                if not self.short_said:
                    self._say(f"too few steps left ({(self.steps or 0) - self.step}) to repay a trial of {s.describe()} "
                              f"({self._trial_length(s)} steps): not trying it, nor any trial that cannot repay")
                    self.short_said = True
                continue
            self._plan = plan
            self.phase, self.trial, self._kind, self._pred = kind, s, kind, pred
            made = self.predictor(s) if pred is not None and self.predictor is not None else None
            self._pred_basis = made.basis if made is not None else ""
            self._costs, self._stale = [], []
            self._warm = self._warmup(prev, s)
            return
        self._plan = []
        changed = getattr(self, "_changed", False)
        if self.retune_every is not None:
            self._hold_len = self.retune_every if changed or self._hold_len is None else min(
                self._hold_len * 2 if self.rounds else self._hold_len, _BACKOFF * self.retune_every)
        self._changed = False
        self.phase, self.trial, self._held, self._pred = "hold", None, [], None
        self._warm = self._warmup(prev, self.incumbent)
        self.rounds += 1
        self._say(f"holding {self.incumbent.describe()} at {1e3 * (self.cost or 0):.3f} ms per token")

    def _warmup(self, prev: Setting, new: Setting) -> int:
        """Steps to discard after a switch: the change reaches over the step boundary where rows are
        carried (Delta > 0 before or after) or the next step begins early (pipeline)."""
        if prev == new:
            return 0
        carried = prev.delta > 0 or new.delta > 0
        return int(carried or self.in_flight) + int(self.in_flight and prev.delta != new.delta)

    def _hold(self, cost: float) -> None:
        self._held.append(cost)
        assert self.cost is not None
        held = self._held
        if len(held) >= _DRIFT_WINDOW:  # the hold measures itself: its own median, not a trial's
            base = _median(held)
            recent = held[-_DRIFT_WINDOW:]
            rise = _median(recent) / base - 1
            limit = max(2 * self.margin, _Z_DRIFT * self._se(_DRIFT_WINDOW, len(held)))
            drift = len(held) > _DRIFT_WINDOW and rise > limit
        else:
            drift = False
        due = self._hold_len is not None and len(held) >= self._hold_len
        if drift or due:
            self.cost = _median(recent) if drift else _median(held)
            self._before = list(recent if drift else held[-max(_DRIFT_WINDOW, 2 * self.trial_steps):])
            if drift:
                self._hold_len, self._changed = self.retune_every, True
                self._say(f"the cost of {self.incumbent.describe()} rose to {1e3 * self.cost:.3f} ms per token "
                          f"({rise:+.0%}, over the {limit:.0%} its spread explains): trying the neighbours again")
            self._plan = self._round()
            self._next()
        elif self._hold_len is None and len(held) > 3 * _DIFFS:  # an endless hold keeps a long window
            self.cost, self._held = _median(held), held[-2 * _DIFFS:]

    def _say(self, text: str) -> None:
        self.decisions.append(f"overlap controller, after step {self.step - 1}: {text}")

    # ---------------------------------------------------------------- checkpoints

    def _config(self) -> dict[str, Any]:
        return {"deltas": list(self.deltas), "chunks": list(self.chunks), "trial_steps": self.trial_steps,
                "retune_every": self.retune_every, "margin": self.margin, "max_stale_share": self.max_stale_share,
                "in_flight": self.in_flight}

    def state_dict(self) -> dict[str, Any]:
        def s(x: Setting | None):
            return None if x is None else [x.delta, x.chunk]

        return {"format": _FORMAT, "config": self._config(), "incumbent": s(self.incumbent), "cost": self.cost,
                "base_stale": self.base_stale, "phase": self.phase, "kind": self._kind, "trial": s(self.trial),
                "challenger": s(self._challenger), "plan": [[k, *s(x)] for k, x in self._plan], "warm": self._warm,
                "costs": list(self._costs), "stale": list(self._stale), "trial_costs": list(self._trial_costs),
                "trial_stale": self._trial_stale, "before": list(self._before), "held": list(self._held),
                "diffs": list(self._diffs), "last": None if self._last is None else [*s(self._last[0]), self._last[1]],
                "hold_len": self._hold_len, "pred": None if self._pred is None else list(self._pred),
                "last_decision": dict(self.last_decision), "short_said": self.short_said, "changed": self._changed,
                "rounds": self.rounds, "trial_steps_run": self.trial_steps_run, "step": self.step,
                "ran": s(self._ran)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`, of this format or an older one (upgraded on load:
        :data:`_UPGRADES`). The next step is a warm-up (not measured): a resumed run's first step
        pays one-off costs (the carried rows' prefill, cold caches) that are not the setting's."""
        d = upgraded("the checkpoint's overlap controller state (overlap.delta_rule=cost)", d, _version(d), _VERSION,
                     _UPGRADES)
        if d["config"] != self._config():
            raise ValueError(f"the checkpoint's overlap controller was built with {d['config']} but this run's is "
                             f"{self._config()}; resume with the same overlap settings")

        def s(x) -> Setting | None:
            return None if x is None else Setting(*x)

        self.incumbent = Setting(*d["incumbent"])
        self.trial, self._challenger = s(d["trial"]), s(d["challenger"])
        self.cost, self.base_stale, self.phase, self._kind = d["cost"], d["base_stale"], d["phase"], d["kind"]
        self._plan = [(k, Setting(a, b)) for k, a, b in d["plan"]]
        self._costs, self._stale = list(d["costs"]), list(d["stale"])
        self._trial_costs, self._trial_stale, self._before = list(d["trial_costs"]), d["trial_stale"], list(d["before"])
        self._held, self._diffs, self._hold_len = list(d["held"]), list(d["diffs"]), d["hold_len"]
        self._last = None if d["last"] is None else (Setting(d["last"][0], d["last"][1]), d["last"][2])
        self._pred = None if d["pred"] is None else (d["pred"][0], d["pred"][1])
        self.last_decision, self.short_said, self._changed = dict(d["last_decision"]), d["short_said"], d["changed"]
        self.rounds, self.trial_steps_run, self.step = d["rounds"], d["trial_steps_run"], d["step"]
        self._ran = Setting(*d["ran"]) if d["ran"] is not None else self.incumbent
        if self.tunes:
            self._keep_last = d["warm"] == 0
            self._warm = max(d["warm"], 1)


def check_format(d: dict[str, Any]) -> None:
    """Raise :class:`~oppo.checkpoint.formats.FormatError` unless :meth:`OverlapTuner.load_state_dict` reads
    ``d``'s format (this one, or an older one it upgrades): a resume checks it before any model loads."""
    upgraded("the checkpoint's overlap controller state", {}, _version(d), _VERSION, {v: dict for v in _UPGRADES})


def _version(d: dict[str, Any]) -> int:
    """The format version of a saved :meth:`OverlapTuner.state_dict` (``oppo.overlap_tuner/N``)."""
    name, _, version = str(d.get("format")).rpartition("/")
    if name != _NAME or not version.isdigit():
        # (the settings check before any model loads refuses another delta_rule: this is a damaged file, or state
        # handed to load_state_dict by hand)
        raise FormatError(f"the checkpoint's overlap controller state is not the cost rule's (format "
                          f"{d.get('format')!r}, expected {_FORMAT}); the checkpoint was written with another "
                          f"overlap.delta_rule or is damaged")
    return int(version)


def _from_v1(d: dict[str, Any]) -> dict[str, Any]:
    """Format 1 (oppo before 9924323, the confirmed trials) -> 2. The setting in force (the
    incumbent), its cost, the off-policy share at the lowest Delta, a hold's measures, the step and
    round counts carry over. A trial or confirmation in progress has no counterpart (format 2
    judges a trial against other figures and confirms every kept move), so it is dropped: the
    incumbent is measured again and the round starts afresh, as after a retune. What format 2 added
    starts empty (the measured spread is measured again)."""
    holds = d["phase"] == "hold"
    measuring = d["phase"] == "measure"
    return {**d, "format": f"{_NAME}/2", "phase": d["phase"] if holds or measuring else "measure",
            "kind": "", "trial": None, "challenger": None, "plan": [],
            "costs": list(d["costs"]) if measuring else [], "stale": list(d["stale"]) if measuring else [],
            "trial_costs": [], "trial_stale": 0.0, "before": [], "held": list(d["held"]) if holds else [],
            "diffs": [], "last": None, "hold_len": d["config"]["retune_every"], "pred": None, "last_decision": {},
            "short_said": False, "changed": False}


_UPGRADES = {1: _from_v1}
"""Upgrades of :meth:`OverlapTuner.state_dict` by the format they read (v -> v + 1): ``formats.upgraded``."""


class TunedDelta:
    """The scheduler's view of an :class:`OverlapTuner`'s Delta (a ``scheduler.DeltaRule``): it
    reads the tuner's Delta and never changes it; the tuner's state is checkpointed with the tuner."""

    def __init__(self, tuner: OverlapTuner) -> None:
        self._tuner = tuner
        self.delta_max = tuner.deltas[-1]

    @property
    def delta(self) -> int:
        return self._tuner.current().delta

    def after_step(self, mean_reward: float) -> int:
        return self.delta

    def state_dict(self) -> dict[str, Any]:
        return {"rule": "cost"}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("rule") != "cost":
            raise ValueError("the checkpoint's Delta was set by the reward-slope rule; resume with "
                             "overlap.delta_rule=reward_slope")
