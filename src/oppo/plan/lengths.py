"""Response-length models for the planner.

``LogNormalLengths`` draws one response length per prompt index, deterministically: the length
of prompt ``i`` is ``round(median * exp(sigma * z_i))`` clipped to ``[1, cap]``, with ``z_i`` a
standard normal from ``random.Random(seed * 1_000_003 + i)``. That is exactly the synthetic
sampler of ``oppo bench --tail`` (``oppo.bench._length_sampler``), so with ``seed=0``,
``median = max_new_tokens // 12`` and ``cap = max_new_tokens`` the planner replays the very
lengths a measured tail-sweep run generated (a test keeps the two equal). ``sigma`` is the tail
heaviness: 0 gives equal lengths; at 1.5 about 5% of the responses hit a cap of 12x the median
(0.6% at 1.0).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["LogNormalLengths", "FixedLengths"]


@dataclass(frozen=True)
class LogNormalLengths:
    """Log-normal response lengths (tokens, EOS included), capped at ``cap`` (max_new_tokens)."""

    median: float
    sigma: float
    cap: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.median <= 0 or self.sigma < 0 or self.cap < 1:
            raise ValueError(f"LogNormalLengths needs median > 0, sigma >= 0 and cap >= 1; got {self}")

    def __call__(self, index: int) -> int:
        rng = random.Random(self.seed * 1_000_003 + index)
        return max(1, min(self.cap, int(round(self.median * math.exp(rng.gauss(0.0, self.sigma))))))

    def sample(self, n: int, start: int = 0) -> list[int]:
        return [self(i) for i in range(start, start + n)]

    def describe(self) -> str:
        return f"log-normal lengths, median {self.median:g}, sigma {self.sigma:g}, cap {self.cap}"


@dataclass(frozen=True)
class FixedLengths:
    """Every response has the same length (no tail at all)."""

    length: int

    def __call__(self, index: int) -> int:
        return self.length

    def sample(self, n: int, start: int = 0) -> list[int]:
        return [self.length] * n

    def describe(self) -> str:
        return f"every response {self.length} tokens"
