"""The one plan by which trained weights reach the roles that serve them: after every update, and
when a checkpoint is restored."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable


@dataclass
class WeightSync:
    """The serving side gets the learner's weights: the rollout backend (a new version) and the
    critic the scorer reads. Composed once, from the placement, by ``setup.build.build_roles`` (its
    one owner: each sink and its source are named there and nowhere else); ``steps`` run in order.
    The controller calls it after every update (``control.stages.sync_weights``), and a restore
    calls it once the learner holds the checkpoint's weights (``Trainer.load_state_dict``)."""

    steps: list[Callable[[int], object]]  # (what a step returns is not used)

    def __call__(self, version: int) -> float:
        """Load the weights trained up to ``version``; returns the seconds it took."""
        t = time.perf_counter()
        for s in self.steps:
            s(version)
        return time.perf_counter() - t
