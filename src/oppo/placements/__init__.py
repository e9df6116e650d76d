"""Placements by name: ``placement.name`` picks one entry of this registry.

A placement is one :class:`PlacementSpec`, a part (:mod:`oppo.parts`) that owns its whole vertical: its settings (a dataclass,
the config's ``placement.<name>.*`` section), its checks (asked by config validation), ``decide``
(where each role runs and the thread budgets, from the config alone, before any model loads) and
``build`` (the learner, the rollout backend and the scorer from the loaded models, with the weight
sync steps that connect them). Built in: ``local`` (every role in this process, the scorer inline,
on a thread or in a child process) and ``ray`` (scorers and learner ranks as Ray actors, rollout
replicas optional), named in ``parts.BUILT_IN``. Others register with :func:`register` or through
the ``oppo.placements`` entry point group. This module imports no torch, so the config can list the placements without loading one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..parts import PLACEMENTS, Registry

if TYPE_CHECKING:
    import torch

    from ..api.placement import Placement
    from ..api.protocols import LearnerEngine, RolloutBackend, Scorer
    from ..api.roles import Models
    from ..config import Config, PlacementConfig
    from ..rollout.registry import BackendSettings

ENTRY_POINTS = PLACEMENTS.entry_points
BUILT_IN = PLACEMENTS.built_in


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
    update (each ``step(version)``), the closers in the order they run, and the rollout backend's
    line for the log."""

    learner: LearnerEngine
    rollout: RolloutBackend
    scorer: Scorer
    sync: list[Callable[[int], object]] = field(default_factory=list)
    closers: list[Callable[[], None]] = field(default_factory=list)
    backend: str = ""  # which rollout backend runs, and why (for the run's log)


@dataclass(frozen=True)
class PlacementSpec:
    """One placement.

    - ``remote``: its roles run in other processes that load their models from directories (a
      model given as an object is saved for them first; the learner engine's ``build_remote``
      builds the learner); ``where`` says where, for messages.
    - ``settings``: the dataclass of its own settings (fields made with ``parts.setting``), the
      config's ``placement.<name>.*``; None: it has none.
    - ``checks(own, cfg)``: why the config cannot run under it, one line each with the fix.
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
    checks: Callable[[Any, Config], list[str]] | None = None


REGISTRY: Registry[PlacementSpec] = PLACEMENTS
register = REGISTRY.register
unregister = REGISTRY.unregister
names = REGISTRY.names
get = REGISTRY.get
default_settings = REGISTRY.default_settings
help_lines = REGISTRY.help_lines


def own(placement: PlacementConfig) -> Any:
    """The chosen placement's own settings (``placement.<name>.*``; ``placement``: the config's
    section), or None."""
    return placement.by_name.get(placement.name)


def of(placement: PlacementConfig) -> PlacementSpec:
    """The chosen placement's spec (``placement.name``; ``placement``: the config's section)."""
    return get(placement.name)


def rollout_settings(models: Models, device: torch.device, model: torch.nn.Module | None = None) -> BackendSettings:
    """The rollout backend's settings (``rollout.registry.backend_settings``) for a backend on
    ``device`` decoding ``model`` (None: not given to check), read from the run's config once here:
    ``generation.*``, the backends' own ``rollout.*``, ``run.seed`` and the rows in flight."""
    from ..rollout import registry

    m, cfg = models, models.cfg
    B = cfg.ppo.batch_size
    return registry.backend_settings(cfg.generation, cfg.rollout, m.stop_ids, m.pad_id, m.max_new_tokens, device,
                                     seed=cfg.run.seed, max_rows=2 * B if cfg.carries else B,  # B + Delta, refill: <= 2B
                                     prompt_width=m.prompt_set.width, model=model)


def local_rollout(models: Models) -> tuple[RolloutBackend, str]:
    """The rollout backend in this process (``generation.backend``), sampling with (or, for a
    backend that loads the policy itself, starting from) the serving policy's weights; and which
    backend runs and why, for the log."""
    from ..rollout import registry

    m = models
    settings = rollout_settings(m, m.device, model=m.rollout_policy)
    backend = registry.build(registry.BuildRequest(settings, m.rollout_policy, m.paths.policy, m.compute_dtype,
                                                   m.device.type))
    return backend, settings.reason


__all__ = ["BUILT_IN", "Facts", "PlacementSpec", "Placed", "default_settings", "get", "help_lines", "local_rollout",
           "names", "of", "own", "register", "rollout_settings", "unregister"]
