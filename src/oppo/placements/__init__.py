"""Placements by name: ``placement.backend`` picks one entry of this registry.

A placement is one :class:`PlacementSpec` that owns its whole vertical: its settings (a dataclass,
the config's ``placement.<name>.*`` section), its checks (asked by config validation), ``decide``
(where each role runs and the thread budgets, from the config alone, before any model loads) and
``build`` (the learner, the rollout backend and the scorer from the loaded models, with the weight
sync steps that connect them). Built in: ``local`` (every role in this process, the scorer inline,
on a thread or in a child process) and ``ray`` (scorers and learner ranks as Ray actors, rollout
workers optional). Others register with :func:`register` or through the ``oppo.placements`` entry
point group. This module imports no torch, so the config can list the placements without loading one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..plugins import Registry, check_section, from_refs

if TYPE_CHECKING:
    from ..api.placement import Placement
    from ..api.protocols import LearnerEngine, RolloutBackend, Scorer
    from ..api.roles import Models
    from ..config import Config

ENTRY_POINTS = "oppo.placements"
BUILT_IN = ("oppo.placements.local:SPEC", "oppo.placements.ray:SPEC")


@dataclass(frozen=True)
class Facts:
    """What ``decide`` needs beyond the config, known before any model loads: the run has a
    critic; every scorer's model is on the CPU (a child process can share them); the compute dtype
    is the trained weights' (fp32), so the critic the scorer reads can be the trained one."""

    needs_critic: bool
    scorers_on_cpu: bool
    computes_in_master: bool


@dataclass
class Placed:
    """What a placement built: the three roles, the weight sync steps run in order after each
    update (each ``step(version)``), the closers in the order they run, and the rollout engine's
    line for the log."""

    learner: LearnerEngine
    rollout: RolloutBackend
    scorer: Scorer
    sync: list[Callable[[int], object]] = field(default_factory=list)
    closers: list[Callable[[], None]] = field(default_factory=list)
    engine: str = ""


@dataclass(frozen=True)
class PlacementSpec:
    """One placement.

    - ``remote``: its roles run in other processes that load their models from directories (a
      model given as an object is saved for them first; the learner engine's ``build_remote``
      builds the learner); ``where`` says where, for messages.
    - ``settings``: the dataclass of its own settings (fields made with ``plugins.setting``), the
      config's ``placement.<name>.*``; None: it has none.
    - ``problems(cfg, own)``: why the config cannot run under it, one line each with the fix.
    - ``decide(cfg, own, facts)``: the :class:`~oppo.api.placement.Placement`.
    - ``build(models, placement, own)``: the roles, as :class:`Placed`.
    """

    name: str
    help: str
    decide: Callable[[Config, Any, Facts], Placement]
    build: Callable[[Models, Placement, Any], Placed]
    remote: bool = False
    where: str = ""
    settings: type | None = None
    problems: Callable[[Config, Any], list[str]] | None = None


def _check(spec: PlacementSpec) -> None:
    check_section(f"placement {spec.name!r}", spec.settings)


REGISTRY: Registry[PlacementSpec] = Registry("a placement", ENTRY_POINTS,
                                             built_in=from_refs(BUILT_IN), check=_check)
register = REGISTRY.register
unregister = REGISTRY.unregister


def names() -> tuple[str, ...]:
    """The registered placements' names, built-in first."""
    return REGISTRY.names()


def get(name: str) -> PlacementSpec:
    """The placement called ``name``; an unknown name raises naming the known ones."""
    return REGISTRY.get(name)


def default_settings() -> dict[str, Any]:
    """``{name: its settings at their defaults}`` for every placement with settings of its own
    (the ``placement.<name>`` sections)."""
    return {n: s.settings() for n in names() if (s := get(n)).settings is not None}


def own(cfg: Config) -> Any:
    """The chosen placement's own settings (``placement.<backend>.*``), or None."""
    return cfg.placement.by_name.get(cfg.placement.backend)


def of(cfg: Config) -> PlacementSpec:
    return get(cfg.placement.backend)


def help_lines() -> list[str]:
    return [f"{n}: {get(n).help}." + (f" Its settings: placement.{n}.* (read under placement.backend={n} only)."
                                      if get(n).settings else "") for n in names()]


def runs_under(engine: Any, spec: PlacementSpec) -> bool:
    """Whether the learner ``engine`` has the builder ``spec`` asks for (remote or in-process)."""
    return (engine.build_remote if spec.remote else engine.build_local) is not None


def problems(cfg: Config) -> list[str]:
    """Why ``cfg`` cannot run under its placement, and why its learner engine cannot run there."""
    from ..learner import registry as learners

    spec = of(cfg)
    out = spec.problems(cfg, own(cfg)) if spec.problems is not None else []
    engine = learners.get(cfg.placement.learner)
    if not runs_under(engine, spec):
        fits = [n for n in names() if runs_under(engine, get(n))]
        others = [n for n in learners.names() if runs_under(learners.get(n), spec)]
        out.append(f"placement.learner={engine.name} runs {engine.where()}, not under placement.backend={spec.name}: "
                   f"set placement.backend={' or '.join(fits) or '(none registered)'}, or placement.learner="
                   f"{' or '.join(others)}.")
    elif engine.problems is not None:
        out += engine.problems(cfg)
    return out


def local_rollout(models: Models) -> tuple[RolloutBackend, str]:
    """The rollout backend in this process (``generation.engine``), sampling with (or, for a
    backend that loads the policy itself, starting from) the serving policy's weights; and which
    engine runs and why, for the log."""
    from ..rollout import registry

    m = models
    settings = registry.engine_settings(m.cfg, m.stop_ids, m.pad_id, m.max_new_tokens, m.device,
                                        model=m.rollout_policy)
    backend = registry.build(registry.BuildRequest(settings, m.rollout_policy, m.paths.policy, m.compute_dtype,
                                                   m.device.type))
    return backend, settings.reason


__all__ = ["BUILT_IN", "Facts", "PlacementSpec", "Placed", "default_settings", "get", "help_lines", "local_rollout", "names", "of",
           "own", "problems", "register", "unregister"]
