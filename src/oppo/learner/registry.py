"""Learner engines by name: ``placement.learner`` picks one entry of this registry.

An engine is one :class:`EngineSpec`, a part (:mod:`oppo.parts`): its name, help, own settings
(:class:`Ranks` for one on Ray ranks), checks, and ``build_local`` / ``build_remote`` for the
placements it can run under, each building a :class:`~oppo.api.protocols.LearnerEngine`. Built in:
``replicate`` and ``fsdp2``; others by :func:`register` or the ``oppo.learner_engines`` entry
points (:func:`group_builder` composes the built-in ranks with a strategy of one's own). Imports
no torch.

Design notes: docs/design.md, "Learner engines"."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

from ..parts import LEARNERS, Registry, setting

if TYPE_CHECKING:
    from ..api.protocols import LearnerEngine
    from ..config import Config
    from .group import LearnerSpec
    from .local import Learner

ENTRY_POINTS = LEARNERS.entry_points


@dataclass(frozen=True)
class LocalRequest:
    """What an in-process engine is built from: ``learner``, the local learner over the controller's
    trained models (built and holding its optimizers), and the run's ``cfg``."""

    learner: Learner
    cfg: Config


@dataclass(frozen=True)
class RemoteRequest:
    """What a Ray engine is built from: ``spec`` (what every rank loads), ``world`` ranks of
    ``num_cpus`` / ``num_gpus`` each running ``threads`` torch threads, the placement-group strategy
    ``placement``; ``critic_scorer``: the Ray scorer that scores with the critic trained here (or
    None); ``tracer``; ``home``: the controller's (policy, critic) modules that checkpoints save."""

    spec: LearnerSpec
    world: int
    num_cpus: float
    num_gpus: float
    threads: int
    placement: str
    critic_scorer: Any
    tracer: Any
    home: tuple


@runtime_checkable
class PushesCritic(Protocol):
    """A Ray engine that trains the critic a Ray scorer actor serves (``RemoteRequest.critic_scorer``):
    the weight sync sends it there after each update."""

    def push_critic(self, version: int) -> None:
        ...


@dataclass
class Ranks:
    """The Ray ranks of an engine that runs as a group of them (``learner.<engine>.*``); under a
    placement that runs the learner in this process, one learner and none of these."""

    ranks: int = setting(1, "Learner ranks under a remote placement (placement.name=ray): each holds actor, "
                            "critic and AdamW, or a shard of them (the engine's help says which).")
    cpus: float = setting(1.0, "CPUs per learner rank.")
    gpus: float = setting(0.0, "GPUs per learner rank.")
    spread: bool = setting(False, "Place the learner ranks on different nodes (STRICT_SPREAD) instead of as few as "
                                  "possible (PACK).")


def check_ranks(own: Ranks, name: str) -> list[str]:
    """Ranks that can start: at least one, no negative CPUs or GPUs (``learner.<name>.*``)."""
    out = []
    if own.ranks < 1:
        out.append(f"learner.{name}.ranks must be >= 1, got {own.ranks}.")
    if min(own.cpus, own.gpus) < 0:
        out.append(f"learner.{name}.cpus and learner.{name}.gpus must be >= 0.")
    return out


def ranks(learner: Mapping[str, Any], name: str) -> Ranks:
    """The ranks of the engine ``name`` (``placement.learner``): its own settings in ``learner`` (the
    config's ``learner`` section, ``{engine: its settings}``), where they are :class:`Ranks`; else
    one rank of the defaults."""
    own = learner.get(name)
    return own if isinstance(own, Ranks) else Ranks()


@dataclass(frozen=True)
class EngineSpec:
    """One learner engine (module docstring). ``settings``: the dataclass of its own settings
    (``learner.<name>.*``; :class:`Ranks` for one that runs on Ray ranks); ``checks(own, cfg)``: why
    the config cannot run on it, one line each with the fix."""

    name: str
    help: str
    build_local: Callable[[LocalRequest], LearnerEngine] | None = None
    build_remote: Callable[[RemoteRequest], LearnerEngine] | None = None
    checks: Callable[[Any, Config], list[str]] | None = None
    settings: type | None = None

    def __post_init__(self) -> None:
        if self.build_local is None and self.build_remote is None:
            raise ValueError(f"learner engine {self.name!r} has no builder (build_local or build_remote)")

    def where(self) -> str:
        """Where it runs, in words: in this process, on Ray ranks, or either."""
        places = [w for w, b in (("in this process", self.build_local), ("on Ray ranks", self.build_remote)) if b]
        return " or ".join(places)

    def runs_under(self, remote: bool) -> bool:
        """Whether it has the builder a placement asks for (``remote``: on Ray ranks; else here)."""
        return (self.build_remote if remote else self.build_local) is not None


REGISTRY: Registry[EngineSpec] = LEARNERS
register = REGISTRY.register
unregister = REGISTRY.unregister
names = REGISTRY.names
get = REGISTRY.get
help_lines = REGISTRY.help_lines
default_settings = REGISTRY.default_settings


def local(req: LocalRequest) -> LearnerEngine:
    """``build_local`` of an engine that is the local learner itself."""
    return req.learner


def group_builder(strategy_of: Callable[[], Any]) -> Callable[[RemoteRequest], LearnerEngine]:
    """``build_remote`` of an engine that is the built-in group of Ray ranks (``group.LearnerGroup``)
    running the update strategy ``strategy_of()`` makes."""
    def build(req: RemoteRequest) -> LearnerEngine:
        from .group import LearnerGroup

        return LearnerGroup(req.spec, req.world, strategy_of(), num_cpus=req.num_cpus, num_gpus=req.num_gpus,
                            threads=req.threads, placement=req.placement, critic_scorer=req.critic_scorer,
                            tracer=req.tracer, home=req.home)
    return build
