"""REINFORCE++ (Hu 2025): the discounted return-to-go of the KL-shaped per-token rewards, whitened
over every response token of the batch; no critic and no group.

Everything oppo knows about REINFORCE++ is here, in :data:`SPEC`: the advantage estimator
(:class:`WhitenedReturnToGo`), the loss (the clipped token loss), the defaults (one response per
prompt, the KL in the reward as k1, beta 0.05) and the Config key of its setting (``ppo.gamma``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional, Tuple

from .core import AlgorithmSpec, ClippedTokenLoss, check_unit

if TYPE_CHECKING:
    from .core import Stats, Tensor


@dataclass(frozen=True)
class WhitenedReturnToGo:
    """REINFORCE++: discounted return-to-go of the per-token rewards, whitened over the batch
    (``advantages.reinforce_pp_advantages``)."""

    gamma: float = 1.0
    needs_critic: ClassVar[bool] = False
    min_group_size: ClassVar[int] = 1

    def __post_init__(self) -> None:
        check_unit("gamma", self.gamma)

    def __call__(self, rewards: Tensor, mask: Tensor, values: Optional[Tensor], group_ids: Tensor
                 ) -> Tuple[Tensor, Optional[Tensor], Stats]:
        from .advantages import reinforce_pp_advantages

        a, _, stats = reinforce_pp_advantages(rewards, mask, self.gamma)
        return a, None, stats  # the returns are no critic's target


SPEC = AlgorithmSpec(
    name="reinforce_pp",
    help="REINFORCE++: batch-whitened return-to-go",
    estimator=WhitenedReturnToGo,
    policy_loss=ClippedTokenLoss,
    group_size=1,
    kl_placement="reward",
    kl_coef=0.05,
    config_keys={"gamma": "ppo.gamma"},
)
