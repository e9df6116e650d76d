"""The one order in which trained weights reach the roles that serve them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable


@dataclass
class WeightSync:
    """After an update, the serving side gets the trained weights: the rollout backend (a new
    version) and the critic the scorer reads. Composed once by :func:`build_roles` from the
    placement: ``steps`` run in order."""

    steps: list[Callable[[int], None]]

    def __call__(self, version: int) -> float:
        """Load the weights trained up to ``version``; returns the seconds it took."""
        t = time.perf_counter()
        for s in self.steps:
            s(version)
        return time.perf_counter() - t
