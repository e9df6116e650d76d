"""The overlap controller (``overlap.delta_rule=cost``, the default): Delta and the streaming chunk
chosen by what they save, measured on the run's own steps.

Pure: no torch, no threads, no clocks. Before a step the caller reads :meth:`OverlapTuner.current`
(a :class:`Setting`), runs the step with it, then reports :meth:`OverlapTuner.record` (its seconds,
the response tokens it trained, the share of those tokens sampled by an older policy).

The cost of a setting is seconds per trained response token (the inverse of the bench's tokens/s:
a step of longer responses is not mistaken for a slower setting). A *trial* runs a setting for
``trial_steps`` measured steps, after a warm-up step where the change reaches across the step
boundary (carried rows, or the pipeline's next step begun under the old setting), and takes the
median. Moves, each against the *incumbent* (the setting in force):

- **chunk** (another chunk size, or 0: no streaming, one-shot scoring after the step closes): kept
  if it costs at least ``margin`` less;
- **Delta up** (the next level of the ladder): kept if it costs at least ``margin`` less, and the
  share of tokens it trains off-policy exceeds that of the lowest Delta by at most
  ``max_stale_share``. A carried token must buy time, so a Delta that passes is confirmed: the
  incumbent is measured again, and the Delta kept only if it still costs ``margin`` less than the
  mean of the incumbent's two measures (a machine that slowed down or sped up during the trials,
  as a shared one does, cancels out). Then the next level up is tried;
- **Delta down**: kept if it costs at most ``margin`` more (fewer stale tokens for the same time),
  so Delta falls back to its floor where carrying stops paying.

The first round measures the starting setting (Delta at its floor: no staleness; the first chunk
candidate), tries every other chunk, then climbs Delta. Then the incumbent holds for
``retune_every`` steps, its steps measuring it for free; a new round tries Delta down and up, or
(every other round) the other chunks. A hold ends early when the median of its last ``trial_steps`` + 1 steps costs
more than ``2 * margin`` above the incumbent's measure (the workload moved). Noise within
``margin`` never changes the setting, and a move needs a whole trial's median, not one step.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["OverlapTuner", "Setting", "TunedDelta", "delta_ladder"]

_FORMAT = "oppo.overlap_tuner/1"


@dataclass(frozen=True)
class Setting:
    """What a step runs with: ``delta`` extra sequences (groups) in flight; ``chunk`` tokens per
    streamed chunk, 0 for no streaming (the scorers score the closed batch one-shot)."""

    delta: int
    chunk: int

    def describe(self) -> str:
        return f"Delta {self.delta}, " + (f"chunk {self.chunk}" if self.chunk else "one-shot scoring")


def delta_ladder(low: int, high: int) -> tuple[int, ...]:
    """The Delta levels the controller moves between: ``low``, a quarter and a half of ``high``,
    and ``high`` (those above ``low``): steps large enough to be measured over a step's noise."""
    return tuple(sorted({low, high} | {d for d in (high // 4, high // 2) if low < d < high}))


class OverlapTuner:
    """Cost-aware choice of Delta and the chunk size (module docstring).

    Args:
        deltas: the Delta levels, ascending (:func:`delta_ladder`); one level: Delta is fixed.
        chunks: the chunk sizes in the order they are tried, the first the start; 0 is one-shot
            scoring; one size: fixed.
        trial_steps: measured steps per trial (after its warm-up).
        retune_every: steps the incumbent holds between rounds (None: one round only).
        margin: the relative cost difference that counts as a difference (step-to-step noise).
        max_stale_share: the most that Delta may add to the share of tokens trained off-policy.
        in_flight: the pipeline mode (the next step begins under the setting of the previous one:
            a Delta change takes one more warm-up step).
    """

    def __init__(self, deltas: Sequence[int], chunks: Sequence[int], *, trial_steps: int = 2,
                 retune_every: int | None = 50, margin: float = 0.05, max_stale_share: float = 0.5,
                 in_flight: bool = False) -> None:
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
        self.trial_steps, self.retune_every, self.margin = trial_steps, retune_every, margin
        self.max_stale_share, self.in_flight = max_stale_share, in_flight
        self.incumbent = Setting(self.deltas[0], self.chunks[0])
        self.cost: float | None = None  # the incumbent's measured cost (s per token)
        self.base_stale: float | None = None  # the off-policy share at the lowest Delta
        self.phase = "measure"  # measure | chunk | up | confirm | down | hold
        self._challenger: tuple[Setting, float, float] | None = None  # an up move that passed, to confirm
        self.trial: Setting | None = None  # the challenger being measured
        self._plan: list[tuple[str, Setting]] = []  # the round's moves still to try
        self._warm = 1  # steps still to discard (the run's first step pays one-off costs)
        self._costs: list[float] = []
        self._stale: list[float] = []
        self._held: list[float] = []
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

    def record(self, seconds: float, tokens: float, stale_share: float = 0.0) -> None:
        """One step ran with :meth:`current`: its wall-clock ``seconds``, the response ``tokens`` it
        trained and the share of them sampled by an older policy version."""
        if not (math.isfinite(seconds) and seconds >= 0 and math.isfinite(tokens) and math.isfinite(stale_share)):
            raise ValueError(f"record needs finite figures, got {seconds}, {tokens}, {stale_share}")
        self.step += 1
        self._ran = self.current()
        if not self.tunes:
            return
        if self.trial is not None:
            self.trial_steps_run += 1
        if self._warm:
            self._warm -= 1
            return
        cost = seconds / max(tokens, 1.0)
        if self.phase == "hold":
            self._hold(cost)
            return
        self._costs.append(cost)
        self._stale.append(stale_share)
        if len(self._costs) >= self.trial_steps:
            self._judge(statistics.median(self._costs), statistics.median(self._stale))

    def take_decisions(self) -> list[str]:
        out, self.decisions = self.decisions, []
        return out

    def metrics(self) -> dict[str, float]:
        """The controller's state for the step's metrics."""
        out = {"overlap/tuner_exploring": float(self.phase != "hold"),
               "overlap/tuner_trial": float(self.trial is not None),
               "overlap/tuner_trial_steps": float(self.trial_steps_run), "overlap/tuner_rounds": float(self.rounds)}
        if self.cost is not None:  # a metric with no value yet is absent, not NaN (a NaN reads as a failure)
            out["overlap/tuner_cost_ms_per_token"] = 1e3 * self.cost
        return out

    # ---------------------------------------------------------------- the rounds

    def _judge(self, cost: float, stale: float) -> None:
        self._costs, self._stale = [], []
        if self.phase == "measure":
            self.cost = cost
            if self.incumbent.delta == self.deltas[0]:
                self.base_stale = stale
            self._say(f"measured {self.incumbent.describe()}: {1e3 * cost:.3f} ms per token")
            self._plan = self._first_round()
            self._next()
            return
        assert self.cost is not None
        if self.phase == "confirm":
            self._confirm(cost)
            return
        assert self.trial is not None
        kind, new, old = self.phase, self.trial, self.incumbent
        gain = 1 - cost / self.cost  # > 0: the challenger is cheaper
        added = stale - (self.base_stale if self.base_stale is not None else 0.0)
        if kind == "down":
            keep = gain >= -self.margin
        elif kind == "up":
            keep = gain >= self.margin and added <= self.max_stale_share
        else:
            keep = gain >= self.margin
        if new.delta == self.deltas[0] and self.base_stale is None:
            self.base_stale = stale
        why = f"{1e3 * cost:.3f} against {1e3 * self.cost:.3f} ms per token ({-gain:+.0%})"
        if kind == "up":
            why += f", off-policy tokens {stale:.0%} ({added:+.0%} over Delta {self.deltas[0]})"
        if keep and kind == "up":  # measure the incumbent again before taking the stale tokens
            self._challenger = (new, cost, stale)
            self.phase, self.trial = "confirm", None
            self._warm = self._warmup(self._ran, old)
            return
        if keep:
            self.incumbent, self.cost = new, cost
            self._say(f"{old.describe()} -> {new.describe()}: {why}")
            if kind == "up":
                self._plan[:0] = [("up", s) for s in self._neighbour(new, +1)]
            elif kind == "down":
                self._plan = [("down", s) for s in self._neighbour(new, -1)] + [
                    m for m in self._plan if m[0] != "up"]
        else:
            limit = {"down": f"costs more than {self.margin:.0%} more",
                     "up": (f"adds more than {self.max_stale_share:.0%} off-policy tokens"
                            if gain >= self.margin else f"saves less than {self.margin:.0%}"),
                     "chunk": f"saves less than {self.margin:.0%}"}[kind]
            self._say(f"kept {old.describe()}: {new.describe()} {limit} ({why})")
        self._next()

    def _confirm(self, again: float) -> None:
        """The incumbent measured again after an up move passed its trial: keep the move only if it
        beats the mean of the incumbent's two measures by ``margin``."""
        assert self._challenger is not None and self.cost is not None
        new, cost, stale = self._challenger
        old, before = self.incumbent, self.cost
        self._challenger = None
        ref = (before + again) / 2
        gain = 1 - cost / ref
        why = (f"{1e3 * cost:.3f} ms per token against {1e3 * before:.3f} before and {1e3 * again:.3f} after "
               f"({-gain:+.0%}), off-policy tokens {stale:.0%}")
        if gain >= self.margin:
            self.incumbent, self.cost = new, cost
            self._say(f"{old.describe()} -> {new.describe()}: {why}")
            self._plan[:0] = [("up", s) for s in self._neighbour(new, +1)]
        else:
            self.cost = again
            self._say(f"kept {old.describe()}: {new.describe()} saves less than {self.margin:.0%} once the "
                      f"incumbent is measured again ({why})")
        self._next()

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

    def _next(self) -> None:
        """Start the next move of the round (with the incumbent's current chunk and Delta), or hold."""
        prev = self._ran
        while self._plan:
            kind, s = self._plan.pop(0)
            s = Setting(s.delta, self.incumbent.chunk) if kind in ("up", "down") else Setting(self.incumbent.delta,
                                                                                               s.chunk)
            if s != self.incumbent:
                self.phase, self.trial = kind, s
                self._warm = self._warmup(prev, s)
                return
        self.phase, self.trial, self._held = "hold", None, []
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
        recent = self._held[-(self.trial_steps + 1):]
        drift = len(recent) == self.trial_steps + 1 and statistics.median(recent) > self.cost * (1 + 2 * self.margin)
        if drift or (self.retune_every is not None and len(self._held) >= self.retune_every):
            self.cost = statistics.median(recent if drift else self._held)
            if drift:
                self._say(f"the cost of {self.incumbent.describe()} rose to {1e3 * self.cost:.3f} ms per token: "
                          "trying the neighbours again")
            self._plan = self._round()
            self._next()
        elif self.retune_every is None:
            self._held = self._held[-(self.trial_steps + 1):]

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
                "base_stale": self.base_stale, "phase": self.phase, "trial": s(self.trial),
                "plan": [[k, *s(x)] for k, x in self._plan], "warm": self._warm, "costs": list(self._costs),
                "stale": list(self._stale), "held": list(self._held), "rounds": self.rounds,
                "challenger": None if self._challenger is None else [*s(self._challenger[0]), *self._challenger[1:]],
                "trial_steps_run": self.trial_steps_run, "step": self.step, "ran": s(self._ran)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("format") != _FORMAT:
            raise ValueError("the checkpoint's overlap state was written by the reward-slope rule or an older "
                             "oppo; resume with the settings it was written with (overlap.delta_rule=reward_slope)")
        if d["config"] != self._config():
            raise ValueError(f"the checkpoint's overlap controller was built with {d['config']} but this run's is "
                             f"{self._config()}; resume with the same overlap settings")
        self.incumbent = Setting(*d["incumbent"])
        self.trial = None if d["trial"] is None else Setting(*d["trial"])
        self.cost, self.base_stale, self.phase = d["cost"], d["base_stale"], d["phase"]
        self._plan = [(k, Setting(a, b)) for k, a, b in d["plan"]]
        self._warm, self._costs, self._stale = d["warm"], list(d["costs"]), list(d["stale"])
        self._held, self.rounds = list(d["held"]), d["rounds"]
        c = d["challenger"]
        self._challenger = None if c is None else (Setting(c[0], c[1]), c[2], c[3])
        self.trial_steps_run, self.step = d["trial_steps_run"], d["step"]
        self._ran = Setting(*d["ran"])


class TunedDelta:
    """The scheduler's view of an :class:`OverlapTuner`'s Delta (a ``scheduler.DeltaRule``): it
    reads the tuner's Delta and never changes it; the tuner's state is checkpointed with the tuner."""

    def __init__(self, tuner: OverlapTuner) -> None:
        self._tuner = tuner
        self.delta_max = tuner.deltas[-1]

    @property
    def delta(self) -> int:
        return self._tuner.current().delta

    def update(self, mean_reward: float) -> int:
        return self.delta

    def state_dict(self) -> dict[str, Any]:
        return {"rule": "cost"}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("rule") != "cost":
            raise ValueError("the checkpoint's Delta was set by the reward-slope rule; resume with "
                             "overlap.delta_rule=reward_slope")
