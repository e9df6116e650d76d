"""What every algorithm shares: :class:`Algorithm`, its parts (an advantage estimator, a
:class:`KLPenalty`, a policy loss), and :class:`AlgorithmSpec`, the record each algorithm's own
file fills in and registers (``algorithms.register``).

An :class:`Algorithm` is composed, no base class and no hooks: ``estimator``, ``kl``,
``policy_loss`` (:class:`ClippedTokenLoss` unless the spec names another) and ``group_size``. The
runtime asks it (``needs_critic``, ``needs_reference``, ``kl_in_reward``, ...) instead of testing
its name. Importing this module does not import torch (the config reads the specs).

Design notes (each part, where the runtime calls it): docs/implementation-details.md, "What every
algorithm shares"."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, List, Mapping, Optional, Protocol, Tuple, Union

from .choices import KL_KINDS, KL_PLACEMENTS

if TYPE_CHECKING:
    import torch

    Tensor = torch.Tensor
    Stats = Dict[str, Tensor]
    Number = Union[int, float]

__all__ = [
    "KL_PLACEMENTS",
    "AdvantageEstimator",
    "ClippedTokenLoss",
    "PolicyLoss",
    "AdvantageResult",
    "Algorithm",
    "AlgorithmSpec",
    "KLPenalty",
    "check_unit",
    "consecutive_group_ids",
]



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


class PolicyLoss(Protocol):
    """What an algorithm's ``policy_loss`` is: a frozen dataclass (its fields the algorithm's own
    settings) called on one micro-batch. The run-wide PPO settings (``ppo.clip_eps``,
    ``clip_eps_high``, ``dual_clip``, ``loss_agg``) come as arguments: a loss may use them or
    clip by its own fields. ``is_weights`` [B, T] weigh off-policy tokens (detached);
    ``num_tokens`` / ``num_seqs`` are the minibatch's denominators (``losses.aggregate``).
    Returns ``(loss, stats)``, stats detached 0-d with at least "clipfrac", "approx_kl" and
    "ratio_mean" (tests/algo_conformance.py checks what every loss must do)."""

    __dataclass_fields__: ClassVar[Dict[str, Any]]

    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                 is_weights: Optional[Tensor], clip_eps: float, clip_eps_high: Optional[float],
                 dual_clip: Optional[float], loss_agg: str, num_tokens: Optional[Union[Number, Tensor]],
                 num_seqs: Optional[Union[Number, Tensor]]) -> Tuple[Tensor, Stats]:
        ...


@dataclass(frozen=True)
class ClippedTokenLoss:
    """PPO's clipped surrogate per token, clipped at ppo.clip_eps (and clip_eps_high, dual_clip).

    ``losses.policy_loss``: off-policy tokens importance-weighted."""

    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                 is_weights: Optional[Tensor] = None, clip_eps: float = 0.2, clip_eps_high: Optional[float] = None,
                 dual_clip: Optional[float] = None, loss_agg: str = "token_mean",
                 num_tokens: Optional[Union[Number, Tensor]] = None,
                 num_seqs: Optional[Union[Number, Tensor]] = None) -> Tuple[Tensor, Stats]:
        from .losses import policy_loss

        return policy_loss(logprobs, old_logprobs, advantages, mask, clip_eps=clip_eps, clip_eps_high=clip_eps_high,
                           dual_clip=dual_clip, is_weights=is_weights, loss_agg=loss_agg, num_tokens=num_tokens,
                           num_seqs=num_seqs)


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
    """An RL algorithm as data: ``name``, an advantage ``estimator``, a ``kl`` penalty, the
    ``group_size`` G of responses sampled per prompt, and the ``policy_loss`` (module docstring)."""

    name: str
    estimator: AdvantageEstimator
    kl: KLPenalty = field(default_factory=KLPenalty)
    group_size: int = 1
    policy_loss: PolicyLoss = field(default_factory=ClippedTokenLoss)

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

        from .advantages import kl_shaped_rewards

        B = mask.shape[0]
        if group_ids is None:
            group_ids = consecutive_group_ids(B, self.group_size, mask.device)  # [B]
        if ref_logprobs is None or logprobs is None:
            if self.kl.in_reward:
                raise ValueError(f"{self.name} puts the KL in the reward: pass logprobs and ref_logprobs")
            dtype = scores.dtype if scores.is_floating_point() else torch.get_default_dtype()
            zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)  # [B, T]
            rewards, _ = kl_shaped_rewards(scores, zeros, zeros, mask, 0.0)  # [B, T]
            kl = None
        else:
            rewards, kl = kl_shaped_rewards(
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
        from .losses import kl_loss

        loss, stats = kl_loss(
            logprobs, ref_logprobs, mask, self.kl.estimator, self.kl.max_value, is_weights,
            loss_agg, num_tokens, num_seqs,
        )
        return self.kl.coef * loss, stats


# ---------------------------------------------------------------------------
# the spec: everything oppo knows about one algorithm, in that algorithm's file
# ---------------------------------------------------------------------------

SHARED_SETTINGS = ("group_size", "kl_coef", "kl_estimator", "kl_placement", "kl_max")
"""Settings every algorithm takes; the estimator's and the loss's fields are its own settings."""


def _no_checks(own: Any, cfg: Any) -> List[str]:
    return []


def _first_line(obj: Any) -> str:
    return (obj.__doc__ or "").strip().split("\n")[0].rstrip(".")


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm: its parts, its defaults, and how a Config sets it. Each algorithm's file
    (``ppo.py``, ``grpo.py``, ...) defines one as ``SPEC``; ``algorithms.register`` adds it.

    The config asks the spec instead of testing names: ``algo.group_size=0`` means
    ``group_size``, ``algo.kl_placement=auto`` means ``kl_placement``, ``ppo.kl_estimator=auto``
    means ``kl_estimator_for(placement)``; ``problems(cfg)`` are its checks before models load.
    ``kl_coef`` is beta when ``get_algorithm`` is given none and under an empty ``ppo.kl_coef``.
    """

    name: str
    help: str
    """A few words for ``algo.name``'s help, e.g. "leave-one-out baseline" (a part's ``help``:
    :mod:`oppo.parts`)."""
    estimator: type[AdvantageEstimator]
    """The advantage estimator class; its fields (with defaults) are own settings."""
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
    expectation there (docs/implementation-details.md)."""
    from_config: Callable[[Any], Dict[str, Any]] = None  # type: ignore[assignment]
    """Own settings read from a Config's fields (the shared ones the Config derives itself).
    None: those named in ``config_keys``."""
    policy_loss: type[PolicyLoss] = ClippedTokenLoss
    """The actor's loss class; its fields (with defaults) are own settings."""
    config_keys: Mapping[str, str] = field(default_factory=dict)
    """Own settings a Config gives by another key (``{"gamma": "ppo.gamma"}``); the others are its
    section ``algo.<name>.*`` (:attr:`settings`)."""
    checks: Callable[[Any, Any], List[str]] = _no_checks
    """``checks(own, cfg)``: problems of a Config for this algorithm beyond its settings' own
    checks (``own``: its section ``algo.<name>``, or None), each a line with its fix (run before any model loads)."""
    modes: Optional[Tuple[str, ...]] = None
    """The overlap modes it may run in; None: every mode."""

    def __post_init__(self) -> None:
        if self.from_config is None:
            object.__setattr__(self, "from_config", self._from_config_keys)
        clash = {f.name for f in dataclasses.fields(self.estimator)} & {f.name for f in dataclasses.fields(self.policy_loss)}
        clash |= ({f.name for f in dataclasses.fields(self.estimator)}
                  | {f.name for f in dataclasses.fields(self.policy_loss)}) & set(SHARED_SETTINGS)
        if clash:
            raise ValueError(f"algorithm {self.name!r}: setting(s) {', '.join(sorted(clash))} named twice (estimator, "
                             "loss or shared settings); rename one")

    def _from_config_keys(self, cfg: Any) -> Dict[str, Any]:
        out = {}
        for setting, key in self.config_keys.items():
            section, name = key.split(".")
            out[setting] = getattr(getattr(cfg, section), name)
        return out

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

    def defaults(self) -> Dict[str, Any]:
        """The settings ``build`` takes, with their defaults: the shared ones, the estimator's, the loss's."""
        shared = dict(group_size=self.group_size, kl_coef=self.kl_coef, kl_estimator=self.kl_estimator,
                      kl_placement=self.kl_placement, kl_max=None)
        own = {f.name: f.default for part in (self.estimator, self.policy_loss) for f in dataclasses.fields(part)}
        return {**shared, **own}

    def build(self, **settings: Any) -> Algorithm:
        """The Algorithm with these settings over the defaults. A KL estimator not named follows
        the KL placement (``kl_estimator_for``). Unknown settings raise ``ValueError``."""
        valid = self.defaults()
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
        estimator = self.estimator(**{f.name: s[f.name] for f in dataclasses.fields(self.estimator)})
        loss = self.policy_loss(**{f.name: s[f.name] for f in dataclasses.fields(self.policy_loss)})
        return Algorithm(self.name, estimator, kl, s["group_size"], loss)

    @property
    def settings(self) -> type | None:
        """The dataclass of its own settings, the config's section ``algo.<name>.*`` (a part's
        ``settings``: :mod:`oppo.parts`): the estimator's and the loss's fields with their defaults and
        types, but those a Config gives by another key (``config_keys``); None when none is left."""
        return _own_settings_class(self)

    def config_settings(self, cfg: Any) -> Dict[str, Any]:
        """Own settings from a Config: ``from_config``'s, then its section ``algo.<name>.*``. A
        section value that ``from_config`` reads from another key (a spec's own ``from_config``
        function: its keys are known only from a Config), set away from its default, raises
        ``ValueError`` naming the fix."""
        fixed = self.from_config(cfg)
        own = cfg.algo.by_name.get(self.name) if hasattr(cfg.algo, "by_name") else None
        fields = dataclasses.fields(own) if own is not None else ()
        given = {f.name: getattr(own, f.name) for f in fields}
        taken = sorted(f.name for f in fields if f.name in fixed and getattr(own, f.name) != f.default)
        if taken:
            where = self.config_keys.get(taken[0], "another setting")
            raise ValueError(f"algo.{self.name}.{taken[0]}: algo.name={self.name} reads it from {where}; set that "
                             f"instead")
        return {**{k: v for k, v in given.items() if k not in fixed}, **fixed}

    def from_cfg(self, cfg: Any) -> Algorithm:
        """The Algorithm a Config asks for (``cfg``: an ``oppo.config.Config``): the shared settings
        the Config derives once from the spec, and :meth:`config_settings`."""
        return self.build(group_size=cfg.group_size, kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
                          kl_placement=cfg.kl_placement, **self.config_settings(cfg))

    def problems(self, cfg: Any) -> List[str]:
        """Why a Config cannot run this algorithm (a line each, with its fix); [] when it can."""
        out = []
        if self.modes is not None and cfg.overlap.mode not in self.modes:
            out.append(f"algo.name={self.name} runs in overlap.mode {', '.join(self.modes)}, not "
                       f"{cfg.overlap.mode}; pick one of those.")
        try:
            self.config_settings(cfg)
        except ValueError as e:
            return out + [str(e)]
        try:
            self.from_cfg(cfg)
        except ValueError as e:  # a value the algorithm's parts refuse
            out.append(f"algo.name={self.name}: {e}")
        return out + list(self.checks(cfg.algo.by_name.get(self.name), cfg))

    def help_lines(self, cfg: Any) -> List[str]:
        """``algo.name``'s help for this algorithm: what it is, needs and sets by default, and
        its own settings with where a Config sets each (``cfg``: a default Config)."""
        kl = f"KL in the {self.kl_placement} ({self.kl_estimator}, beta {self.kl_coef})"
        lines = [f"{self.name}: {self.help}. {'Needs a critic' if self.needs_critic else 'No critic'}; G = "
                 f"{self.group_size}; {kl}; advantages: {_first_line(self.estimator)}; loss: "
                 f"{_first_line(self.policy_loss)}."]
        fixed = self.from_config(cfg)
        own = [(k, v) for k, v in self.defaults().items() if k not in SHARED_SETTINGS]
        if own:
            def where(k: str, v: Any) -> str:
                if k in fixed:
                    return f"{k} (from {self.config_keys.get(k, 'its config field')})"
                return f"algo.{self.name}.{k}={v!r}"

            lines.append(f"  its settings: {', '.join(where(k, v) for k, v in own)}")
        if self.modes is not None:
            lines.append(f"  overlap modes: {', '.join(self.modes)}")
        return lines


_OWN_CLASSES: Dict[str, type | None] = {}


def _own_settings_class(spec: AlgorithmSpec) -> type | None:
    """``spec.settings``, made once per spec: a dataclass of the estimator's and the loss's own fields
    (types read from their annotations, so the config coerces ``algo.<name>.<field>`` as it does
    any setting; help from a field's ``help`` metadata, else its owner's first docstring line)."""
    key = f"{spec.name}:{id(spec)}"
    if key not in _OWN_CLASSES:
        import typing

        fields = []
        for part in (spec.estimator, spec.policy_loss):
            hints = typing.get_type_hints(part)
            for f in dataclasses.fields(part):
                if f.name in spec.config_keys or not f.init:
                    continue
                help_ = f.metadata.get("help") or f"{part.__name__}'s {f.name} ({_first_line(part)})"
                fields.append((f.name, hints[f.name], dataclasses.field(default=f.default, metadata={"help": help_})))
        name = "".join(w.capitalize() for w in spec.name.split("_")) + "Settings"
        _OWN_CLASSES[key] = dataclasses.make_dataclass(name, fields) if fields else None
    return _OWN_CLASSES[key]
