"""``build_roles(cfg)``, the last step from a config to the roles (after the one validation and the
one preflight): resolve the run (paths, devices, where each role runs), load the models, build the
roles where the placement puts them (its spec's ``build``: ``oppo.placements``), and compose the
weight sync from the steps it names. The controller (``oppo.control``) receives the roles behind
their Protocols (``api/protocols.py``) and never asks where one runs."""

from __future__ import annotations

import dataclasses

from .. import placements
from ..api.roles import Models, Roles
from ..config import Config
from ..inputs import Inputs
from ..weights.plan import WeightSync
from .load import load_models
from .resolve import resolve


def build_roles(cfg: Config, progress: bool = True, inputs: Inputs | None = None) -> Roles:
    """Every model loaded and every role built, once, for settings and objects that the preflight
    has passed. ``inputs``: the objects given from Python in place of paths (their settings hold
    markers: ``inputs.split_inputs``)."""
    inputs = inputs or Inputs()
    run = resolve(cfg, inputs, progress)  # decided, nothing loaded yet
    models = load_models(cfg, inputs, run)
    run.placement.threads.use(run.placement.threads.full)
    placed = placements.of(cfg.placement).build(models, run.placement, placements.own(cfg.placement))
    loaded = {f.name: getattr(models, f.name) for f in dataclasses.fields(Models)}
    return Roles(**loaded, placement=run.placement, rollout=placed.rollout, scorer=placed.scorer,
                 learner=placed.learner, sync=WeightSync(placed.sync), closers=placed.closers, backend=placed.backend)


__all__ = ["Roles", "build_roles"]
