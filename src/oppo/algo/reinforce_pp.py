"""REINFORCE++ (Hu 2025): the discounted return-to-go of the KL-shaped per-token rewards, whitened
over every response token of the batch; no critic and no group.

Everything oppo knows about REINFORCE++ is here: the advantage estimator
(:class:`WhitenedReturnToGo`, over ``advantages.reinforce_pp_advantages``), the defaults (one
response per prompt, the KL in the reward as k1, beta 0.05) and the setting a Config gives it
(``ppo.gamma``), in :data:`SPEC`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Dict, Optional, Tuple

from .core import AlgorithmSpec, check_unit

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


def _from_config(cfg: Any) -> Dict[str, Any]:
    return dict(gamma=cfg.ppo.gamma)


SPEC = AlgorithmSpec(
    name="reinforce_pp",
    summary="REINFORCE++: batch-whitened return-to-go",
    estimator=WhitenedReturnToGo,
    group_size=1,
    kl_placement="reward",
    kl_coef=0.05,
    from_config=_from_config,
)
