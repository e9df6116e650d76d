"""RLOO (Kool et al. 2019; Ahmadian et al. 2024): each response's sequence reward against the mean
of the other G-1 responses to its prompt.

Everything oppo knows about RLOO is here, in :data:`SPEC`: the advantage estimator
(:class:`LeaveOneOut`), the loss (the clipped token loss) and the defaults (G = 4 responses per
prompt, the KL in the sequence reward as k1 with beta 0.05, as Ahmadian et al.). It has no
settings of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional, Tuple

from .core import AlgorithmSpec, ClippedTokenLoss

if TYPE_CHECKING:
    from .core import Stats, Tensor


@dataclass(frozen=True)
class LeaveOneOut:
    """RLOO: sequence reward against the mean of the other G-1 in its group
    (``advantages.rloo_advantages``)."""

    needs_critic: ClassVar[bool] = False
    min_group_size: ClassVar[int] = 2  # a leave-one-out baseline needs another sample

    def __call__(self, rewards: Tensor, mask: Tensor, values: Optional[Tensor], group_ids: Tensor
                 ) -> Tuple[Tensor, Optional[Tensor], Stats]:
        from .advantages import broadcast_to_tokens, rloo_advantages
        from .masks import masked_sum

        seq = masked_sum(rewards, mask, dim=1)  # [B]
        a, stats = rloo_advantages(seq, group_ids)  # [B]
        return broadcast_to_tokens(a, mask), None, stats


SPEC = AlgorithmSpec(
    name="rloo",
    help="leave-one-out baseline",
    estimator=LeaveOneOut,
    policy_loss=ClippedTokenLoss,
    group_size=4,
    kl_placement="reward",
    kl_coef=0.05,
)
