"""GRPO (DeepSeekMath, Shao et al. 2024) and Dr. GRPO (Liu et al. 2025): each response's
sequence reward against its group's mean, divided by the group's std (GRPO) or not (Dr. GRPO).

Everything oppo knows about GRPO is here, in :data:`SPEC`: the advantage estimator
(:class:`GroupNormalized`), the loss (the clipped token loss), the defaults (G = 4 responses per
prompt, the KL in the loss as k3 with beta 0.04, as DeepSeekMath); its own settings are the
config's ``algo.grpo.*`` (``std_normalize``, ``eps``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Optional, Tuple

from .core import AlgorithmSpec, ClippedTokenLoss

if TYPE_CHECKING:
    from .core import Stats, Tensor


@dataclass(frozen=True)
class GroupNormalized:
    """GRPO: sequence reward against its group's mean, divided by the group's std
    (``std_normalize``; off = Dr. GRPO). See ``advantages.grpo_advantages``."""

    std_normalize: bool = field(default=True, metadata={"help": "divide by the group's reward std (false: Dr. GRPO)."})
    eps: float = field(default=1e-6, metadata={"help": "added to the group's std before dividing."})
    needs_critic: ClassVar[bool] = False
    min_group_size: ClassVar[int] = 2  # with G = 1 every advantage is 0: nothing to learn

    def __post_init__(self) -> None:
        if not (isinstance(self.eps, (int, float)) and self.eps >= 0):
            raise ValueError(f"eps must be >= 0, got {self.eps!r}")

    def __call__(self, rewards: Tensor, mask: Tensor, values: Optional[Tensor], group_ids: Tensor
                 ) -> Tuple[Tensor, Optional[Tensor], Stats]:
        from .advantages import broadcast_to_tokens, grpo_advantages
        from .masks import masked_sum

        seq = masked_sum(rewards, mask, dim=1)  # [B]
        a, stats = grpo_advantages(seq, group_ids, self.std_normalize, self.eps)  # [B]
        return broadcast_to_tokens(a, mask), None, stats


SPEC = AlgorithmSpec(
    name="grpo",
    help="group-normalised outcome advantages",
    estimator=GroupNormalized,
    policy_loss=ClippedTokenLoss,
    group_size=4,
    kl_placement="loss",
    kl_coef=0.04,  # DeepSeekMath's beta; a Config's when ppo.kl_coef is empty (its default)
)
