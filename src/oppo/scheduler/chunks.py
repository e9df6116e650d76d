"""The streaming chunk size for intra-step overlap, chosen online by timing real steps."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from .records import StepTiming, check_int, state_mismatch


class ChunkSizeTuner:
    """Online choice of the streaming chunk size (tokens per chunk) for intra-step overlap.

    Cycle: a *tuning round* runs each candidate, in the given order, for ``trial_steps`` real
    steps, then keeps the candidate with the lowest median step time (ties: the earlier
    candidate); that ``best`` is used for ``retune_every`` steps, then a new round starts (the
    OPPO paper re-tries candidates about every 50 steps, since response lengths drift). One
    cycle is therefore ``len(candidates) * trial_steps + retune_every`` steps.
    ``retune_every=None`` tunes once. ``fixed=N`` always returns N and never tunes.

    Warm-up: when ``trial_steps >= 2`` the first step of each trial is recorded in ``history``
    but left out of the median, because it still carries work shaped by the previous chunk
    size (sequences carried across the step boundary were partly scored in the old chunking)
    and pays one-off costs of new shapes (allocator growth, kernel selection). With
    ``trial_steps == 1`` the single step is used as is.

    Use: ``size = tuner.current()`` before a step, ``tuner.record(seconds)`` after it. As the
    controller of the reward-slope rule (``control.controller.OverlapController``): ``chunk_size``,
    ``observe``; it decides nothing the run's log reports and adds no metric.
    """

    def __init__(
        self,
        candidates: Sequence[int] = (8, 16, 32, 64),
        trial_steps: int = 2,
        retune_every: int | None = 50,
        fixed: int | None = None,
    ) -> None:
        cands = tuple(candidates)
        if not cands:
            raise ValueError("candidates is empty; give at least one chunk size (or fixed=N)")
        for c in cands:
            check_int("chunk size candidate", c, 1, "chunk sizes are positive token counts")
        if len(set(cands)) != len(cands):
            raise ValueError(f"candidates {cands} contain duplicates; list each size once")
        check_int("trial_steps", trial_steps, 1, "each candidate needs at least one step")
        if retune_every is not None:
            check_int("retune_every", retune_every, 1, "or None to tune only once")
        if fixed is not None:
            check_int("fixed", fixed, 1, "or None to tune online")
        self.candidates = cands
        self.trial_steps = trial_steps
        self.retune_every = retune_every
        self.fixed = fixed
        self.history: list[tuple[int, float]] = []  # (chunk size used, step time) per step
        self._best: int | None = fixed
        self._tuning = fixed is None
        self._trial = 0  # index into candidates during a round
        self._round: list[list[float]] = [[] for _ in cands]  # times of the current round
        self._medians: dict[int, float] = {}  # of the last completed round
        self._since_tuned = 0
        self._rounds = 0

    @property
    def best(self) -> int | None:
        """The chunk size chosen by the last completed round (``fixed`` if set; None before)."""
        return self._best

    @property
    def tuning(self) -> bool:
        return self._tuning

    @property
    def rounds(self) -> int:
        """Completed tuning rounds."""
        return self._rounds

    @property
    def medians(self) -> dict[int, float]:
        """Median step time per candidate in the last completed round (for logging)."""
        return dict(self._medians)

    def current(self) -> int:
        """Chunk size to use for the next step."""
        if self.fixed is not None:
            return self.fixed
        if self._tuning:
            return self.candidates[self._trial]
        assert self._best is not None
        return self._best

    def record(self, step_time_s: float) -> None:
        """Report the wall-clock time of the step that used ``current()``."""
        if (
            isinstance(step_time_s, bool)
            or not isinstance(step_time_s, (int, float))
            or not math.isfinite(step_time_s)
            or step_time_s < 0
        ):
            raise ValueError(f"step_time_s must be a finite number >= 0, got {step_time_s!r}")
        t = float(step_time_s)
        self.history.append((self.current(), t))
        if self.fixed is not None:
            return
        if not self._tuning:
            self._since_tuned += 1
            if self.retune_every is not None and self._since_tuned >= self.retune_every:
                self._tuning, self._trial = True, 0
                self._round = [[] for _ in self.candidates]
            return
        times = self._round[self._trial]
        times.append(t)
        if len(times) < self.trial_steps:
            return
        self._trial += 1
        if self._trial < len(self.candidates):
            return
        warm = 1 if self.trial_steps >= 2 else 0
        self._medians = {
            c: statistics.median(ts[warm:]) for c, ts in zip(self.candidates, self._round)
        }
        self._best = min(self.candidates, key=lambda c: self._medians[c])  # first on ties
        self._tuning, self._trial, self._since_tuned = False, 0, 0
        self._rounds += 1

    def chunk_size(self) -> int:
        return self.current()

    def observe(self, ran: StepTiming) -> None:
        self.record(ran.seconds)

    def take_decisions(self) -> list[str]:
        return []

    def step_metrics(self) -> dict[str, float]:
        return {}

    def _config(self) -> dict[str, Any]:
        return {
            "candidates": list(self.candidates),
            "trial_steps": self.trial_steps,
            "retune_every": self.retune_every,
            "fixed": self.fixed,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "config": self._config(),
            "history": [[c, t] for c, t in self.history],
            "best": self._best,
            "tuning": self._tuning,
            "trial": self._trial,
            "round": [list(ts) for ts in self._round],
            "medians": [[c, m] for c, m in self._medians.items()],
            "since_tuned": self._since_tuned,
            "rounds": self._rounds,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d["config"] != self._config():
            raise state_mismatch("ChunkSizeTuner config", d["config"], self._config())
        self.history = [(int(c), float(t)) for c, t in d["history"]]
        self._best = None if d["best"] is None else int(d["best"])
        self._tuning = bool(d["tuning"])
        self._trial = int(d["trial"])
        self._round = [[float(t) for t in ts] for ts in d["round"]]
        self._medians = {int(c): float(m) for c, m in d["medians"]}
        self._since_tuned = int(d["since_tuned"])
        self._rounds = int(d["rounds"])

