"""PPO (Schulman et al. 2017; InstructGPT's RLHF recipe): GAE against a learned critic.

Everything oppo knows about PPO is here: the advantage estimator (:class:`GAE`), the defaults
(one response per prompt, the KL in the reward as k1, beta 0.05) and the settings a Config
gives it (``ppo.gamma``, ``ppo.lam``, ``ppo.whiten_advantages``), in :data:`SPEC`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Dict, Optional, Tuple

from .core import AlgorithmSpec, check_unit

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
        from .. import ppo_math as pm

        if values is None:
            raise ValueError("GAE needs the critic's values; this algorithm needs a critic")
        a, returns = pm.gae(rewards, values, mask, self.gamma, self.lam)  # [B, T], [B, T]
        return (pm.masked_whiten(a, mask) if self.whiten else a), returns, {}


def _from_config(cfg: Any) -> Dict[str, Any]:
    return dict(gamma=cfg.ppo.gamma, lam=cfg.ppo.lam, whiten=cfg.ppo.whiten_advantages)


SPEC = AlgorithmSpec(
    name="ppo",
    summary="clipped PPO with a critic and GAE",
    estimator=GAE,
    group_size=1,
    kl_placement="reward",
    kl_coef=0.05,
    from_config=_from_config,
)
