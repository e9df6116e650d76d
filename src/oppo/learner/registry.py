"""Learner engines by name: ``placement.learner`` picks one entry of this registry.

An engine is one :class:`Engine`: its name, a line of help, the settings it reads (listed in the
help), its checks on the config (run by ``config.validate``, before any model loads), and a builder
for each kind of placement it can run under: ``build_local`` in the controller's process (a
placement whose roles run here: ``local``) and ``build_remote`` as a group of Ray ranks (a remote
placement: ``ray``). Whatever it builds is a :class:`~oppo.api.protocols.LearnerEngine`.

Built in: ``replicate`` (the local learner in process; data-parallel replicas on Ray) and ``fsdp2``
(FSDP2 shards on Ray). Others register with :func:`register` (a plugin module the user imports, a
test) or through the ``oppo.learner_engines`` entry point group (the entry's value is its
:class:`Engine`). A ``build_remote`` may compose the built-in group of ranks
(``group.LearnerGroup``) with an update strategy of its own; the ranks receive that strategy, its
code by value where they cannot import its module (``cluster.ship_plugins``). This module imports
no torch, so the config can list the engines without loading one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

from ..plugins import Registry

if TYPE_CHECKING:
    from ..api.protocols import LearnerEngine
    from ..config import Config
    from .group import LearnerSpec
    from .local import Learner

ENTRY_POINTS = "oppo.learner_engines"


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


@dataclass(frozen=True)
class Engine:
    """One learner engine (module docstring). ``settings``: the config keys it reads, each with what
    it means for this engine (shown in the help). ``problems(cfg)``: why the config cannot run on it,
    one line each with the fix."""

    name: str
    help: str
    build_local: Callable[[LocalRequest], LearnerEngine] | None = None
    build_remote: Callable[[RemoteRequest], LearnerEngine] | None = None
    problems: Callable[[Config], list[str]] | None = None
    settings: tuple[tuple[str, str], ...] = ()

    def where(self) -> str:
        """Where it runs, in words: in this process, on Ray ranks, or either."""
        places = [w for w, b in (("in this process", self.build_local), ("on Ray ranks", self.build_remote)) if b]
        return " or ".join(places)

    def describe(self) -> str:
        """One help line: its help, where it runs and its settings."""
        sets = "; ".join(f"{k}: {v}" for k, v in self.settings)
        return f"{self.name}: {self.help} (runs {self.where()}{'; settings: ' + sets if sets else ''})."


def _check(engine: Engine) -> None:
    if engine.build_local is None and engine.build_remote is None:
        raise ValueError(f"learner engine {engine.name!r} has no builder (build_local or build_remote)")


REGISTRY: Registry[Engine] = Registry("a learner engine", ENTRY_POINTS, check=_check)
register = REGISTRY.register
unregister = REGISTRY.unregister


def names() -> tuple[str, ...]:
    """The registered engines' names, built-in first."""
    return REGISTRY.names()


def get(name: str) -> Engine:
    """The engine called ``name``; an unknown name raises naming the known ones."""
    return REGISTRY.get(name)


def help_lines() -> list[str]:
    return [get(n).describe() for n in names()]


# ---------------------------------------------------------------- the built-in engines


def _local(req: LocalRequest) -> LearnerEngine:
    return req.learner


def _group(strategy_of: Callable[[], Any]) -> Callable[[RemoteRequest], LearnerEngine]:
    def build(req: RemoteRequest) -> LearnerEngine:
        from .group import LearnerGroup

        return LearnerGroup(req.spec, req.world, strategy_of(), num_cpus=req.num_cpus, num_gpus=req.num_gpus,
                            threads=req.threads, placement=req.placement, critic_scorer=req.critic_scorer,
                            tracer=req.tracer, home=req.home)
    return build


def _replicated():
    from .dp import Replicated

    return Replicated()


def _sharded():
    from .fsdp import Sharded

    return Sharded()


def _fsdp2_problems(cfg: Config) -> list[str]:
    p, ranks = cfg.ppo, cfg.placement.ray.learner_workers
    micro = p.minibatch_size // p.micro_batch_size
    if ranks > micro:
        return [f"placement.ray.learner_workers={ranks} sharded ranks, but a minibatch has only {micro} "
                f"micro-batches (ppo.minibatch_size={p.minibatch_size} / ppo.micro_batch_size={p.micro_batch_size}): "
                f"some ranks would only pad. Use at most {micro} ranks, or a smaller ppo.micro_batch_size."]
    return []


_RANKS = (("placement.ray.learner_workers", "Ray ranks"), ("placement.ray.learner_cpus", "CPUs per rank"),
          ("placement.ray.learner_gpus", "GPUs per rank"), ("placement.ray.spread", "ranks on different nodes"))

register(Engine(
    "replicate", "each rank holds all of actor, critic and AdamW: one learner in this process, or data-parallel "
                 "replicas on Ray ranks (gradients summed once per minibatch: the same update as one learner)",
    build_local=_local, build_remote=_group(_replicated), settings=_RANKS))
register(Engine(
    "fsdp2", "each Ray rank holds 1/placement.ray.learner_workers of the parameters, gradients and AdamW state (torch "
             "FSDP2, fully_shard); the same update. With LoRA the frozen base and the adapters are sharded alike; "
             "under bfloat16 the ranks compute in bf16 over fp32 masters (FSDP2 mixed precision, gradients reduced "
             "in fp32)", build_remote=_group(_sharded), problems=_fsdp2_problems,
    settings=_RANKS + (("ppo.micro_batch_size", "at most ppo.minibatch_size / ranks, so that no rank only pads"),)))
