"""``build_roles(cfg)``, the last step from a config to the roles (after the one check,
``setup.check``), in steps the log names: prepare the built-in task where the config names no
policy, save the model objects a role loads elsewhere, resolve the run (paths, devices, where each
role runs), load the models, build the roles where the placement puts them (its spec's ``build``:
``oppo.placements``), and compose the weight sync from the steps it names. The controller
(``oppo.control``) receives the roles behind their Protocols (``api/protocols.py``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .. import placements
from ..api.roles import Models, Roles
from ..config import Config
from ..marker import is_marker
from ..rollout.registry import check_backend
from ..weights.steps import WeightSync
from .inputs import Inputs, save_for_elsewhere
from .load import load_models
from .resolve import resolve

if TYPE_CHECKING:
    from ..task.prepare import Prepared


def build_roles(cfg: Config, progress: bool = True, inputs: Inputs | None = None) -> Roles:
    """Every model loaded and every role built, once, for checked settings and objects
    (``setup.check``). ``inputs``: the objects given from Python in place of paths (their settings
    hold markers: ``setup.inputs.split_inputs``)."""
    inputs = inputs or Inputs()
    task = prepared_task(cfg, progress)
    saved = save_for_elsewhere(cfg, inputs, log=progress)  # objects a role loads in another process
    if is_marker(cfg.policy.path):  # a policy object: the check had no directory to read; its saved copy has one
        check_backend(cfg.generation.backend, saved.get("policy", cfg.policy.path), cfg.policy.device)
    run = resolve(cfg, task, saved)  # decided, nothing loaded yet
    models = load_models(cfg, inputs, run)
    run.placement.threads.use(run.placement.threads.full)
    placed = placements.of(cfg.placement).build(models, run.placement, placements.own(cfg.placement))
    loaded = {f.name: getattr(models, f.name) for f in dataclasses.fields(Models)}
    return Roles(**loaded, placement=run.placement, rollout=placed.rollout, scorer=placed.scorer,
                 learner=placed.learner, sync=WeightSync(placed.sync), closers=placed.closers, backend=placed.backend)


def prepared_task(cfg: Config, progress: bool = True) -> Prepared | None:
    """The built-in task's models and prompts where the config names no policy (``data.task``):
    installed from the package, or built, on first use (``task.prepare``, whose log line names the
    step: reusing, installing or building); None where the config names the models."""
    if not cfg.uses_builtin_task:
        return None
    from ..task import prepare

    return prepare(task=cfg.data.task, progress=progress)  # (it says what it reuses, installs or builds)


__all__ = ["Roles", "build_roles", "prepared_task"]
