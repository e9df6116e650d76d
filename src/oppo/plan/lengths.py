"""Response-length models for the planner.

``LogNormalLengths`` draws one response length per prompt index, deterministically: the length
of prompt ``i`` is ``round(median * exp(sigma * z_i))`` clipped to ``[1, cap]``, with ``z_i`` a
standard normal from ``random.Random(seed * 1_000_003 + i)``. That is exactly the synthetic
sampler of ``oppo bench --tail`` (``oppo.bench.length_sampler``), so with ``seed=0``,
``median = max_new_tokens // 12`` and ``cap = max_new_tokens`` the planner replays the very
lengths a measured tail-sweep run generated (a test keeps the two equal). ``sigma`` is the tail
heaviness: 0 gives equal lengths; at 1.5 about 5% of the responses hit a cap of 12x the median
(0.6% at 1.0).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["LogNormalLengths", "FixedLengths", "TableLengths", "EmpiricalLengths"]


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

    def __call__(self, index: int, member: int = 0) -> int:
        # member: a sequence's place in its group (GRPO/RLOO), keyed as the bench's sampler keys it
        rng = random.Random(self.seed * 1_000_003 + index if member == 0 else f"{self.seed}/{index}/{member}")
        return max(1, min(self.cap, int(round(self.median * math.exp(rng.gauss(0.0, self.sigma))))))

    def sample(self, n: int, start: int = 0) -> list[int]:
        return [self(i) for i in range(start, start + n)]

    def describe(self) -> str:
        return f"log-normal lengths, median {self.median:g}, sigma {self.sigma:g}, cap {self.cap}"


@dataclass(frozen=True)
class FixedLengths:
    """Every response has the same length (no tail at all)."""

    length: int

    def __call__(self, index: int, member: int = 0) -> int:
        return self.length

    def sample(self, n: int, start: int = 0) -> list[int]:
        return [self.length] * n

    def describe(self) -> str:
        return f"every response {self.length} tokens"


@dataclass(frozen=True)
class TableLengths:
    """Measured lengths: ``table[(prompt_index, member)]``, ``default`` for a sequence the run
    never trained (in flight at its end: any length past what it reached gives the same schedule)."""

    table: dict
    default: int

    def __call__(self, index: int, member: int = 0) -> int:
        return int(self.table.get((index, member), self.default))

    def describe(self) -> str:
        return f"{len(self.table)} measured lengths (others {self.default})"


@dataclass(frozen=True)
class EmpiricalLengths:
    """Lengths drawn from a measured sample (e.g. the fit runs' natural lengths): prompt ``i``'s
    member ``m`` gets ``sample[u]`` for a ``u`` drawn from ``Random((seed, i, m))``, so the same
    sequence always gets the same length. A prediction of a run whose lengths are not forced."""

    sample: tuple[int, ...]
    seed: int = 0

    def __call__(self, index: int, member: int = 0) -> int:
        rng = random.Random(f"empirical/{self.seed}/{index}/{member}")
        return int(self.sample[rng.randrange(len(self.sample))])

    def describe(self) -> str:
        s = sorted(self.sample)
        return (f"the fit runs' {len(s)} measured lengths, resampled (median {s[len(s) // 2]}, "
                f"p99 {s[min(len(s) - 1, int(0.99 * len(s)))]}, max {s[-1]})")
