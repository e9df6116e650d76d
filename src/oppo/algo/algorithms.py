"""Algorithm objects: what differs between PPO, GRPO, RLOO and REINFORCE++, as small values.

An :class:`Algorithm` is composed of three parts, no base class and no hooks:

* ``estimator``: how per-token advantages come from the per-token rewards. One of
  :class:`GAE` (PPO; needs a critic), :class:`GroupNormalized` (GRPO / Dr. GRPO),
  :class:`LeaveOneOut` (RLOO), :class:`WhitenedReturnToGo` (REINFORCE++). Each is a frozen
  dataclass callable as ``estimator(rewards, mask, values, group_ids)``.
* ``kl``: a :class:`KLPenalty`: coefficient, estimator, and where it goes: subtracted from the
  per-token rewards (``placement="reward"``, PPO/RLOO/REINFORCE++) or added to the actor's loss
  (``placement="loss"``, GRPO). Any algorithm may use either placement.
* ``group_size``: G responses sampled per prompt; the scheduler admits and trains them together.

The runtime asks the algorithm questions instead of testing its name: ``needs_critic`` (no
critic is loaded, scored, trained or checkpointed when False), ``needs_reference`` (no
reference is scored when the KL coefficient is 0), ``group_size``, ``kl_in_reward``,
``kl_in_loss``. It calls ``advantages(...)`` for stages 4-5 and adds ``actor_loss_extra(...)``
to the clipped policy loss in stage 6. The policy loss itself (``ppo_math.policy_loss``,
clipped, importance-weighted for off-policy tokens) is the same for all four algorithms.

Sequence-level algorithms (GRPO, RLOO) turn the per-token rewards into one number per response,
``R_i = sum_t r_t = score_i - beta * sum_t KL_t`` (the score alone when the KL is in the loss),
compare it within the group, and give every response token the result.

Build one with ``get_algorithm(name, **settings)``; ``algorithm_settings(name)`` lists the
settings and their defaults.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, Optional, Tuple, Union

import torch

from .. import ppo_math as pm
from . import advantages as adv

Tensor = torch.Tensor
Stats = Dict[str, Tensor]
Number = Union[int, float]

__all__ = [
    "ALGORITHMS",
    "KL_PLACEMENTS",
    "AdvantageResult",
    "Algorithm",
    "GAE",
    "GroupNormalized",
    "KLPenalty",
    "LeaveOneOut",
    "WhitenedReturnToGo",
    "algorithm_settings",
    "consecutive_group_ids",
    "get_algorithm",
]

KL_PLACEMENTS = ("reward", "loss")


def _check_unit(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")


def consecutive_group_ids(batch_size: int, group_size: int, device=None) -> Tensor:
    """Group ids [B] for a batch whose groups are consecutive rows: ``0,0,..,1,1,..`` (G each)."""
    if batch_size % group_size:
        raise ValueError(
            f"a batch of {batch_size} sequences is not a whole number of groups of {group_size}; "
            "the scheduler hands out whole groups, so check how the batch was assembled"
        )
    return torch.arange(batch_size, device=device) // group_size  # [B]


# ---------------------------------------------------------------------------
# parts
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class KLPenalty:
    """KL(pi || ref) regularisation: ``coef`` (beta), per-token ``estimator`` (k1/k2/k3/abs),
    ``placement`` "reward" (``r_t -= coef * KL_t``) or "loss" (``loss += coef * kl_loss``), and
    ``max_value`` (loss placement only: clamp of the per-token estimate, None = no clamp)."""

    coef: float = 0.0
    estimator: str = "k1"
    placement: str = "reward"
    max_value: Optional[float] = None

    def __post_init__(self) -> None:
        if isinstance(self.coef, bool) or not isinstance(self.coef, (int, float)) or not (
            math.isfinite(self.coef) and self.coef >= 0
        ):
            raise ValueError(f"kl_coef must be a finite number >= 0, got {self.coef!r}; use 0 for no KL term")
        if self.estimator not in pm.KL_KINDS:
            raise ValueError(f"unknown kl_estimator {self.estimator!r}; valid: {', '.join(pm.KL_KINDS)}")
        if self.placement not in KL_PLACEMENTS:
            raise ValueError(f"unknown kl_placement {self.placement!r}; valid: {', '.join(KL_PLACEMENTS)}")
        if self.max_value is not None:
            if self.placement != "loss":
                raise ValueError("kl_max clamps the KL loss term; it needs kl_placement='loss'")
            if not self.max_value > 0:
                raise ValueError(f"kl_max must be > 0 or None, got {self.max_value!r}")

    @property
    def in_reward(self) -> bool:
        return self.placement == "reward" and self.coef > 0

    @property
    def in_loss(self) -> bool:
        return self.placement == "loss" and self.coef > 0

    @property
    def reward_coef(self) -> float:
        """The beta to use in the reward: ``coef`` if the KL goes there, else 0."""
        return float(self.coef) if self.placement == "reward" else 0.0


@dataclass(frozen=True)
class GAE:
    """PPO: GAE(gamma, lam) against the critic's values; optionally whitened over the batch."""

    gamma: float = 1.0
    lam: float = 0.95
    whiten: bool = True
    needs_critic: ClassVar[bool] = True
    min_group_size: ClassVar[int] = 1

    def __post_init__(self) -> None:
        _check_unit("gamma", self.gamma)
        _check_unit("lam", self.lam)

    def __call__(self, rewards: Tensor, mask: Tensor, values: Optional[Tensor], group_ids: Tensor
                 ) -> Tuple[Tensor, Optional[Tensor], Stats]:
        if values is None:
            raise ValueError("GAE needs the critic's values; this algorithm needs a critic")
        a, returns = pm.gae(rewards, values, mask, self.gamma, self.lam)  # [B, T], [B, T]
        return (pm.masked_whiten(a, mask) if self.whiten else a), returns, {}


@dataclass(frozen=True)
class GroupNormalized:
    """GRPO: sequence reward against its group's mean, divided by the group's std
    (``std_normalize``; off = Dr. GRPO). See ``advantages.grpo_advantages``."""

    std_normalize: bool = True
    eps: float = 1e-6
    needs_critic: ClassVar[bool] = False
    min_group_size: ClassVar[int] = 2  # with G = 1 every advantage is 0: nothing to learn

    def __post_init__(self) -> None:
        if not (isinstance(self.eps, (int, float)) and self.eps >= 0):
            raise ValueError(f"eps must be >= 0, got {self.eps!r}")

    def __call__(self, rewards: Tensor, mask: Tensor, values: Optional[Tensor], group_ids: Tensor
                 ) -> Tuple[Tensor, Optional[Tensor], Stats]:
        seq = pm.masked_sum(rewards, mask, dim=1)  # [B]
        a, stats = adv.grpo_advantages(seq, group_ids, self.std_normalize, self.eps)  # [B]
        return adv.broadcast_to_tokens(a, mask), None, stats


@dataclass(frozen=True)
class LeaveOneOut:
    """RLOO: sequence reward against the mean of the other G-1 in its group
    (``advantages.rloo_advantages``)."""

    needs_critic: ClassVar[bool] = False
    min_group_size: ClassVar[int] = 2  # a leave-one-out baseline needs another sample

    def __call__(self, rewards: Tensor, mask: Tensor, values: Optional[Tensor], group_ids: Tensor
                 ) -> Tuple[Tensor, Optional[Tensor], Stats]:
        seq = pm.masked_sum(rewards, mask, dim=1)  # [B]
        a, stats = adv.rloo_advantages(seq, group_ids)  # [B]
        return adv.broadcast_to_tokens(a, mask), None, stats


@dataclass(frozen=True)
class WhitenedReturnToGo:
    """REINFORCE++: discounted return-to-go of the per-token rewards, whitened over the batch
    (``advantages.reinforce_pp_advantages``)."""

    gamma: float = 1.0
    needs_critic: ClassVar[bool] = False
    min_group_size: ClassVar[int] = 1

    def __post_init__(self) -> None:
        _check_unit("gamma", self.gamma)

    def __call__(self, rewards: Tensor, mask: Tensor, values: Optional[Tensor], group_ids: Tensor
                 ) -> Tuple[Tensor, Optional[Tensor], Stats]:
        a, _, stats = adv.reinforce_pp_advantages(rewards, mask, self.gamma)
        return a, None, stats  # the returns are no critic's target


Estimator = Union[GAE, GroupNormalized, LeaveOneOut, WhitenedReturnToGo]


# ---------------------------------------------------------------------------
# the algorithm
# ---------------------------------------------------------------------------


@dataclass
class AdvantageResult:
    """Stages 4-5 output. advantages, rewards: [B, T]. returns: [B, T] critic targets (None
    without a critic). kl: [B, T] per-token estimate (None without reference log-probs).
    stats: detached 0-d tensors."""

    advantages: Tensor
    returns: Optional[Tensor]
    rewards: Tensor
    kl: Optional[Tensor]
    stats: Stats = field(default_factory=dict)


@dataclass(frozen=True)
class Algorithm:
    """An RL algorithm as data: ``name``, an advantage ``estimator``, a ``kl`` penalty, and the
    ``group_size`` G of responses sampled per prompt (see the module docstring)."""

    name: str
    estimator: Estimator
    kl: KLPenalty = KLPenalty()
    group_size: int = 1

    def __post_init__(self) -> None:
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"group_size must be an int >= 1, got {g!r}")
        need = self.estimator.min_group_size
        if g < need:
            raise ValueError(
                f"{self.name} compares the responses to one prompt and needs group_size >= {need}, "
                f"got {g}; set group_size (for example 4)"
            )

    @property
    def needs_critic(self) -> bool:
        return self.estimator.needs_critic

    @property
    def needs_reference(self) -> bool:
        return self.kl.coef > 0

    @property
    def kl_in_reward(self) -> bool:
        return self.kl.in_reward

    @property
    def kl_in_loss(self) -> bool:
        return self.kl.in_loss

    def advantages(
        self,
        scores: Tensor,
        mask: Tensor,
        logprobs: Optional[Tensor] = None,
        ref_logprobs: Optional[Tensor] = None,
        values: Optional[Tensor] = None,
        group_ids: Optional[Tensor] = None,
    ) -> AdvantageResult:
        """Stages 4-5: per-token rewards (KL-shaped if the KL goes in the reward), advantages.

        scores [B] (any missing-EOS penalty already applied); mask [B, T]; logprobs [B, T] of
        the policy that sampled/owns the batch (pi_k); ref_logprobs [B, T] (needed when
        ``needs_reference``); values [B, T] (needed when ``needs_critic``); group_ids [B]
        (default: consecutive groups of ``group_size`` rows). Call under ``torch.no_grad()``.
        """
        B = mask.shape[0]
        if group_ids is None:
            group_ids = consecutive_group_ids(B, self.group_size, mask.device)  # [B]
        if ref_logprobs is None or logprobs is None:
            if self.kl.in_reward:
                raise ValueError(f"{self.name} puts the KL in the reward: pass logprobs and ref_logprobs")
            dtype = scores.dtype if scores.is_floating_point() else torch.get_default_dtype()
            zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)  # [B, T]
            rewards, _ = pm.kl_shaped_rewards(scores, zeros, zeros, mask, 0.0)  # [B, T]
            kl = None
        else:
            rewards, kl = pm.kl_shaped_rewards(
                scores, logprobs, ref_logprobs, mask, self.kl.reward_coef, self.kl.estimator
            )  # [B, T], [B, T]
        a, returns, stats = self.estimator(rewards, mask, values, group_ids)
        return AdvantageResult(advantages=a, returns=returns, rewards=rewards, kl=kl, stats=stats)

    def actor_loss_extra(
        self,
        logprobs: Tensor,
        ref_logprobs: Optional[Tensor],
        mask: Tensor,
        is_weights: Optional[Tensor] = None,
        loss_agg: str = "token_mean",
        num_tokens: Optional[Union[Number, Tensor]] = None,
        num_seqs: Optional[Union[Number, Tensor]] = None,
    ) -> Tuple[Tensor, Stats]:
        """What this algorithm adds to the clipped policy loss of one micro-batch: the KL term
        ``coef * kl_loss`` when ``kl_in_loss``, else a 0-d zero (no graph). Same denominators as
        the policy loss (``loss_agg``, ``num_tokens``, ``num_seqs``)."""
        if not self.kl.in_loss:
            return logprobs.new_zeros(()), {}
        if ref_logprobs is None:
            raise ValueError(f"{self.name} puts the KL in the loss: pass ref_logprobs")
        loss, stats = adv.kl_loss(
            logprobs, ref_logprobs, mask, self.kl.estimator, self.kl.max_value, is_weights,
            loss_agg, num_tokens, num_seqs,
        )
        return self.kl.coef * loss, stats


# ---------------------------------------------------------------------------
# construction by name
# ---------------------------------------------------------------------------


def _kl(coef: float, estimator: str, placement: str, max_value: Optional[float]) -> KLPenalty:
    return KLPenalty(coef=coef, estimator=estimator, placement=placement, max_value=max_value)


def _ppo(*, group_size: int = 1, kl_coef: float = 0.05, kl_estimator: str = "k1", kl_placement: str = "reward",
         kl_max: Optional[float] = None, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True) -> Algorithm:
    return Algorithm("ppo", GAE(gamma, lam, whiten), _kl(kl_coef, kl_estimator, kl_placement, kl_max), group_size)


def _grpo(*, group_size: int = 4, kl_coef: float = 0.04, kl_estimator: str = "k3", kl_placement: str = "loss",
          kl_max: Optional[float] = None, std_normalize: bool = True, eps: float = 1e-6) -> Algorithm:
    # beta = 0.04 and k3 in the loss as DeepSeekMath; std_normalize=False is Dr. GRPO
    return Algorithm("grpo", GroupNormalized(std_normalize, eps), _kl(kl_coef, kl_estimator, kl_placement, kl_max),
                     group_size)


def _rloo(*, group_size: int = 4, kl_coef: float = 0.05, kl_estimator: str = "k1", kl_placement: str = "reward",
          kl_max: Optional[float] = None) -> Algorithm:
    # the KL in the sequence reward, as Ahmadian et al. 2024
    return Algorithm("rloo", LeaveOneOut(), _kl(kl_coef, kl_estimator, kl_placement, kl_max), group_size)


def _reinforce_pp(*, group_size: int = 1, kl_coef: float = 0.05, kl_estimator: str = "k1",
                  kl_placement: str = "reward", kl_max: Optional[float] = None, gamma: float = 1.0) -> Algorithm:
    return Algorithm("reinforce_pp", WhitenedReturnToGo(gamma), _kl(kl_coef, kl_estimator, kl_placement, kl_max),
                     group_size)


_BUILDERS: Dict[str, Callable[..., Algorithm]] = {
    "ppo": _ppo,
    "grpo": _grpo,
    "rloo": _rloo,
    "reinforce_pp": _reinforce_pp,
}
ALGORITHMS = tuple(_BUILDERS)


def _builder(name: str) -> Callable[..., Algorithm]:
    try:
        return _BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(ALGORITHMS)}") from None


def algorithm_settings(name: str) -> Dict[str, Any]:
    """The settings ``get_algorithm(name, ...)`` accepts, with their defaults."""
    params = inspect.signature(_builder(name)).parameters
    return {k: p.default for k, p in params.items()}


def get_algorithm(name: str, **settings: Any) -> Algorithm:
    """Build an algorithm by name ("ppo", "grpo", "rloo", "reinforce_pp").

    Unknown names and settings the algorithm does not use raise ``ValueError`` naming the valid
    ones (a setting is never silently ignored); invalid values raise from the parts.
    """
    build = _builder(name)
    valid = algorithm_settings(name)
    unknown = sorted(set(settings) - set(valid))
    if unknown:
        raise ValueError(
            f"algorithm {name!r} has no setting(s) {', '.join(unknown)}; its settings are: "
            f"{', '.join(valid)}"
        )
    return build(**settings)
