"""What every algorithm shares: :class:`Algorithm`, :class:`KLPenalty`, :class:`AdvantageResult`,
and :class:`AlgorithmSpec`, the record each algorithm's own file fills in.

An :class:`Algorithm` is composed of three parts, no base class and no hooks:

* ``estimator``: how per-token advantages come from the per-token rewards, a frozen dataclass
  callable as ``estimator(rewards, mask, values, group_ids)``, defined in the algorithm's file
  (``ppo.GAE``, ``grpo.GroupNormalized``, ``rloo.LeaveOneOut``,
  ``reinforce_pp.WhitenedReturnToGo``). Its class says ``needs_critic`` and
  ``min_group_size``; its fields are the algorithm's own settings.
* ``kl``: a :class:`KLPenalty`: coefficient, estimator, and where it goes: subtracted from the
  per-token rewards (``placement="reward"``, PPO/RLOO/REINFORCE++) or added to the actor's loss
  (``placement="loss"``, GRPO). Any algorithm may use either placement.
* ``group_size``: G responses sampled per prompt; the scheduler admits and trains them together.

The runtime asks the algorithm questions instead of testing its name: ``needs_critic`` (no
critic is loaded, scored, trained or checkpointed when False), ``needs_reference`` (no
reference is scored when the KL coefficient is 0), ``group_size``, ``kl_in_reward``,
``kl_in_loss``. It calls ``advantages(...)`` for stages 4-5 and adds ``actor_loss_extra(...)``
to the clipped policy loss in stage 6. The policy loss itself (``ppo_math.policy_loss``,
clipped, importance-weighted for off-policy tokens) is the same for all algorithms.

Sequence-level algorithms (GRPO, RLOO) turn the per-token rewards into one number per response,
``R_i = sum_t r_t = score_i - beta * sum_t KL_t`` (the score alone when the KL is in the loss),
compare it within the group, and give every response token the result.

Importing this package does not import torch (the config reads the specs, and ``oppo train
--help`` or a config error should not wait for torch): the tensor math (``ppo_math``,
``advantages``) is imported inside the functions that run it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, Optional, Protocol, Tuple, Union

if TYPE_CHECKING:
    import torch

    Tensor = torch.Tensor
    Stats = Dict[str, Tensor]
    Number = Union[int, float]

__all__ = [
    "KL_PLACEMENTS",
    "AdvantageEstimator",
    "AdvantageResult",
    "Algorithm",
    "AlgorithmSpec",
    "KLPenalty",
    "check_unit",
    "consecutive_group_ids",
]

KL_PLACEMENTS = ("reward", "loss")


def check_unit(name: str, value: float) -> None:
    """Raise unless ``value`` is a number in [0, 1] (a discount or a GAE lambda)."""
    if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")


def consecutive_group_ids(batch_size: int, group_size: int, device=None) -> Tensor:
    """Group ids [B] for a batch whose groups are consecutive rows: ``0,0,..,1,1,..`` (G each)."""
    import torch

    if batch_size % group_size:
        raise ValueError(
            f"a batch of {batch_size} sequences is not a whole number of groups of {group_size}; "
            "the scheduler hands out whole groups, so check how the batch was assembled"
        )
    return torch.arange(batch_size, device=device) // group_size  # [B]


# ---------------------------------------------------------------------------
# parts
# ---------------------------------------------------------------------------


class AdvantageEstimator(Protocol):
    """What an algorithm's ``estimator`` is (module docstring): a frozen dataclass, its fields the
    algorithm's own settings, its class saying ``needs_critic`` and ``min_group_size``."""

    needs_critic: ClassVar[bool]
    min_group_size: ClassVar[int]
    __dataclass_fields__: ClassVar[Dict[str, Any]]  # (a dataclass: ``AlgorithmSpec.settings`` reads its fields)

    def __call__(self, rewards: Tensor, mask: Tensor, values: Optional[Tensor], group_ids: Tensor
                 ) -> Tuple[Tensor, Optional[Tensor], Stats]:
        """(advantages [B, T], returns [B, T] or None without a critic, stats)."""
        ...


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
        from ..ppo_math import KL_KINDS

        if isinstance(self.coef, bool) or not isinstance(self.coef, (int, float)) or not (
            math.isfinite(self.coef) and self.coef >= 0
        ):
            raise ValueError(f"kl_coef must be a finite number >= 0, got {self.coef!r}; use 0 for no KL term")
        if self.estimator not in KL_KINDS:
            raise ValueError(f"unknown kl_estimator {self.estimator!r}; valid: {', '.join(KL_KINDS)}")
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


# ---------------------------------------------------------------------------
# the algorithm
# ---------------------------------------------------------------------------


@dataclass
class AdvantageResult:
    """Stages 4-5 output. advantages, rewards: [B, T]. returns: [B, T] critic targets (None
    without a critic). kl: [B, T] per-token estimate (None without reference log-probs).
    stats: detached 0-d tensors: the estimator's, and ``kl/coef`` (beta, whatever the placement)."""

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
    estimator: AdvantageEstimator
    kl: KLPenalty = field(default_factory=KLPenalty)
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
        import torch

        from .. import ppo_math as pm

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
        # beta in effect, reported every step: a Config's empty ppo.kl_coef is the spec's default
        stats = {**stats, "kl/coef": torch.tensor(float(self.kl.coef), dtype=torch.float64)}
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
        from .advantages import kl_loss

        loss, stats = kl_loss(
            logprobs, ref_logprobs, mask, self.kl.estimator, self.kl.max_value, is_weights,
            loss_agg, num_tokens, num_seqs,
        )
        return self.kl.coef * loss, stats


# ---------------------------------------------------------------------------
# the spec: everything oppo knows about one algorithm, in that algorithm's file
# ---------------------------------------------------------------------------

SHARED_SETTINGS = ("group_size", "kl_coef", "kl_estimator", "kl_placement", "kl_max")
"""Settings every algorithm takes; the estimator's fields are its own settings."""


def _no_settings(cfg: Any) -> Dict[str, Any]:
    return {}


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm: its estimator, its defaults, and how a Config sets it. Each algorithm's file
    (``ppo.py``, ``grpo.py``, ...) defines one as ``SPEC``; ``algorithms.SPECS`` lists them.

    The config asks the spec instead of testing names: ``algo.group_size=0`` means
    ``group_size``, ``algo.kl_placement=auto`` means ``kl_placement``, ``ppo.kl_estimator=auto``
    means ``kl_estimator_for(placement)``, and ``algo.group_size`` must be at least
    ``min_group_size``. ``needs_critic`` and ``min_group_size`` are the estimator class's.

    ``kl_coef`` is beta when ``get_algorithm`` is given none and when a Config leaves
    ``ppo.kl_coef`` empty (``Config.kl_coef``).
    """

    name: str
    summary: str
    """A few words for ``algo.name``'s help, e.g. "leave-one-out baseline"."""
    estimator: type[AdvantageEstimator]
    """The advantage estimator class (module docstring); its fields and their defaults are the
    algorithm's own settings."""
    group_size: int
    """G when ``algo.group_size=0``."""
    kl_placement: str
    """Where the KL goes when ``algo.kl_placement=auto``: "reward" or "loss"."""
    kl_coef: float
    """beta when ``get_algorithm`` is not given one, and under an empty ``ppo.kl_coef``."""
    reward_kl_estimator: str = "k1"
    """The KL estimator in the reward when none is named: k1, whose expectation is the KL."""
    loss_kl_estimator: str = "k3"
    """The KL estimator in the loss when none is named: k3 (GRPO's); k1's gradient is 0 in
    expectation there (``advantages`` module docstring)."""
    from_config: Callable[[Any], Dict[str, Any]] = _no_settings
    """The estimator's settings read from a Config (the shared ones the Config derives itself)."""

    @property
    def needs_critic(self) -> bool:
        return self.estimator.needs_critic

    @property
    def min_group_size(self) -> int:
        """Smallest G: 2 for algorithms that compare the responses to one prompt."""
        return self.estimator.min_group_size

    @property
    def kl_estimator(self) -> str:
        """The KL estimator in the algorithm's own placement."""
        return self.kl_estimator_for(self.kl_placement)

    def kl_estimator_for(self, placement: str) -> str:
        return self.loss_kl_estimator if placement == "loss" else self.reward_kl_estimator

    def settings(self) -> Dict[str, Any]:
        """The settings ``build`` takes, with their defaults (the shared ones first)."""
        shared = dict(group_size=self.group_size, kl_coef=self.kl_coef, kl_estimator=self.kl_estimator,
                      kl_placement=self.kl_placement, kl_max=None)
        own = {f.name: f.default for f in dataclasses.fields(self.estimator)}
        return {**shared, **own}

    def build(self, **settings: Any) -> Algorithm:
        """The Algorithm with these settings over the defaults. A KL estimator not named follows
        the KL placement (``kl_estimator_for``). Unknown settings raise ``ValueError``."""
        valid = self.settings()
        unknown = sorted(set(settings) - set(valid))
        if unknown:
            raise ValueError(
                f"algorithm {self.name!r} has no setting(s) {', '.join(unknown)}; its settings are: "
                f"{', '.join(valid)}"
            )
        s = {**valid, **settings}
        if "kl_estimator" not in settings:
            s["kl_estimator"] = self.kl_estimator_for(s["kl_placement"])
        kl = KLPenalty(coef=s["kl_coef"], estimator=s["kl_estimator"], placement=s["kl_placement"],
                       max_value=s["kl_max"])
        estimator = self.estimator(**{k: s[k] for k in valid if k not in SHARED_SETTINGS})
        return Algorithm(self.name, estimator, kl, s["group_size"])
