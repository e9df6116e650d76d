"""PPO (Schulman et al. 2017; InstructGPT's RLHF recipe): GAE against a learned critic.

Everything oppo knows about PPO is here, in :data:`SPEC`: the advantage estimator (:class:`GAE`),
the loss (the clipped token loss), the defaults (one response per prompt, the KL in the reward as
k1, beta 0.05) and the Config keys of its settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional, Tuple

from .core import AlgorithmSpec, ClippedTokenLoss, check_unit

if TYPE_CHECKING:
    from .core import Stats, Tensor


@dataclass(frozen=True)
class GAE:
    """PPO: GAE(gamma, lam) against the critic's values; optionally whitened over the batch."""

    gamma: float = 1.0
    lam: float = 0.95
    whiten: bool = True
    needs_critic: ClassVar[bool] = True
    min_group_size: ClassVar[int] = 1

    def __post_init__(self) -> None:
        check_unit("gamma", self.gamma)
        check_unit("lam", self.lam)

    def __call__(self, rewards: Tensor, mask: Tensor, values: Optional[Tensor], group_ids: Tensor
                 ) -> Tuple[Tensor, Optional[Tensor], Stats]:
        from .advantages import gae, masked_whiten

        if values is None:
            raise ValueError("GAE needs the critic's values; this algorithm needs a critic")
        a, returns = gae(rewards, values, mask, self.gamma, self.lam)  # [B, T], [B, T]
        return (masked_whiten(a, mask) if self.whiten else a), returns, {}


SPEC = AlgorithmSpec(
    name="ppo",
    help="clipped PPO with a critic and GAE",
    estimator=GAE,
    policy_loss=ClippedTokenLoss,
    group_size=1,
    kl_placement="reward",
    kl_coef=0.05,
    config_keys={"gamma": "ppo.gamma", "lam": "ppo.lam", "whiten": "ppo.whiten_advantages"},
)
