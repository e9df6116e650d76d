"""Learner engines by name: ``placement.learner_sharding`` picks one entry of this registry.

An engine is one :class:`Engine`: its name, a line of help, the settings it reads (listed in the
help), its checks on the config (run by ``config.validate``, before any model loads), and a builder
for each place it can run: ``build_local`` in the controller's process (``placement.backend=local``)
and ``build_remote`` as a group of Ray ranks (``placement.backend=ray``). Whatever it builds is a
:class:`~oppo.api.protocols.LearnerEngine`.

Built in: ``replicate`` (the local learner in process; data-parallel replicas on Ray) and ``fsdp2``
(FSDP2 shards on Ray). Others register with :func:`register` (a plugin module the user imports, a
test) or through the ``oppo.learner_engines`` entry point group (the entry's value is its
:class:`Engine`). This module imports no torch, so the config can list the engines without loading
one.
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
PLACES = ("local", "ray")  # placement.backend's values


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

    def places(self) -> tuple[str, ...]:
        """The ``placement.backend`` values it runs under."""
        return tuple(p for p, b in zip(PLACES, (self.build_local, self.build_remote)) if b is not None)

    def describe(self) -> str:
        """One help line: its help, where it runs and its settings."""
        sets = "; ".join(f"{k}: {v}" for k, v in self.settings)
        return (f"{self.name}: {self.help} (placement.backend={' or '.join(self.places())}"
                f"{'; settings: ' + sets if sets else ''}).")


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
    engine = REGISTRY.find(name)
    if engine is None:
        raise KeyError(f"no learner engine {name!r}{REGISTRY.why_missing(name)}; known: {', '.join(names())}")
    return engine


def help_lines() -> list[str]:
    return [get(n).describe() for n in names()]


def problems(cfg: Config) -> list[str]:
    """Why ``cfg``'s learner engine cannot run it (where it runs, its own checks), one line each."""
    key = f"placement.learner_sharding={cfg.placement.learner_sharding}"
    engine = get(cfg.placement.learner_sharding)
    place = cfg.placement.backend
    if place not in engine.places():
        other = [n for n in names() if place in get(n).places()]
        return [f"{key} runs with placement.backend={' or '.join(engine.places())}, not {place}: set "
                f"placement.backend={engine.places()[0]}, or one of {', '.join(other)} for placement.learner_sharding."]
    return engine.problems(cfg) if engine.problems is not None else []


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
    p, pl = cfg.ppo, cfg.placement
    micro = p.minibatch_size // p.micro_batch_size
    if pl.learner_workers > micro:
        return [f"placement.learner_workers={pl.learner_workers} sharded ranks, but a minibatch has only {micro} "
                f"micro-batches (ppo.minibatch_size={p.minibatch_size} / ppo.micro_batch_size={p.micro_batch_size}): "
                f"some ranks would only pad. Use at most {micro} ranks, or a smaller ppo.micro_batch_size."]
    return []


_RANKS = (("placement.learner_workers", "Ray ranks"), ("placement.learner_cpus", "CPUs per rank"),
          ("placement.learner_gpus", "GPUs per rank"), ("placement.spread", "ranks on different nodes"))

register(Engine(
    "replicate", "each rank holds all of actor, critic and AdamW: one learner in this process, or data-parallel "
                 "replicas on Ray ranks (gradients summed once per minibatch: the same update as one learner)",
    build_local=_local, build_remote=_group(_replicated), settings=_RANKS))
register(Engine(
    "fsdp2", "each Ray rank holds 1/placement.learner_workers of the parameters, gradients and AdamW state (torch "
             "FSDP2, fully_shard); the same update. With LoRA the frozen base and the adapters are sharded alike; "
             "under bfloat16 the ranks compute in bf16 over fp32 masters (FSDP2 mixed precision, gradients reduced "
             "in fp32)", build_remote=_group(_sharded), problems=_fsdp2_problems,
    settings=_RANKS + (("ppo.micro_batch_size", "at most ppo.minibatch_size / ranks, so that no rank only pads"),)))
