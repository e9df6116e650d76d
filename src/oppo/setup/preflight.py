"""The checks that need no model, composed: each concern's rule lives with its owner (the prompt
set's in ``data``, a model directory's and the devices' in ``models.checks``, the hub's in
``models.hub``, a reward function's in ``scoring.reward_fn``, the objects' in ``setup.inputs``, a
rollout backend's in its spec) and :func:`problems` asks each of them, once per run, from the
one hand-off (``setup.check``). Every problem is reported in one message, so a user fixes them
all at once instead of one per attempt, each attempt costing a model load."""

from __future__ import annotations

from typing import Any

from ..config import Config, DataConfig, RewardConfig
from ..errors import ModelLoadError
from ..marker import is_marker
from ..models.checks import device_problems, dir_problems
from ..models.hub import hub_problems
from ..rewards import function_spec, parse_terms
from ..rollout.registry import backend_problems
from ..scoring.reward_fn import function_problems
from .inputs import Inputs, object_problems

ROLES = ("policy", "reward", "critic", "reference")


class PreflightError(ModelLoadError):
    """One or more problems found before anything expensive ran; the message lists them all. A
    :class:`~oppo.models.ModelLoadError` (so a ``ValueError``): what loading the run's inputs would
    have raised, found before anything loads, whichever way the run started."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        if len(self.problems) == 1:
            msg = self.problems[0]
        else:
            msg = (f"{len(self.problems)} problems, found before loading anything:\n"
                   + "\n".join(f"  - {p}" for p in self.problems))
        super().__init__(msg)


def problems(cfg: Config, inputs: Inputs) -> list[str]:
    """What the roles are built from, checked without loading it: the objects, the task or the
    prompt set, each model path, the reward's functions and models, the devices, the rollout
    backend, the hub names (offline mode switched on when the hub cannot be reached and every hub
    model is cached). The one place a run's inputs are checked."""
    columns, found, hub_dataset = _prompt_set(cfg.data, cfg.uses_builtin_task, inputs.prompts)
    found += object_problems(cfg, inputs, columns)
    hub_names: list[tuple[str, str]] = []  # (setting, hub name) of each model that is not a local path
    found += _model_paths(cfg, inputs, hub_names)
    found += _reward(cfg.reward, columns, hub_names)
    found += device_problems({f"{role}.device": getattr(cfg, role).device for role in ROLES})
    found += backend_problems(cfg.generation.backend, None if is_marker(cfg.policy.path) else cfg.policy.path,
                              cfg.policy.device)  # (a policy object: checked once saved, setup.build)
    found += hub_problems(hub_names, hub_dataset)
    return found


def _prompt_set(d: DataConfig, builtin_task: bool, prompts: Any) -> tuple[list[str] | None, list[str], str | None]:
    """The prompt set checked without reading it (``data``'s rules): its columns where they are
    known (the ``prompts`` object's, the file's first line, or the built-in task's prompt field),
    ``data.prompts``' problems, and the hub dataset it names (None: a local file, or none)."""
    from ..data import known_columns, source_problems

    if prompts is None and d.prompts is None:
        columns = [d.field] if builtin_task else None
    else:
        columns = known_columns(None if prompts is not None else d.prompts, prompts, d.field, d.split)
    found, hub_dataset = source_problems(None if is_marker(d.prompts) else d.prompts, d.field)
    return columns, found, hub_dataset


def _model_paths(cfg: Config, inputs: Inputs, hub_names: list[tuple[str, str]]) -> list[str]:
    """The task or prompt set a run needs, and each role's model directory (hub names collected)."""
    found = []
    if cfg.uses_builtin_task:
        from ..task import TASKS

        if cfg.data.task not in TASKS:
            found.append(f"data.task={cfg.data.task!r} is not a built-in task; known: {', '.join(sorted(TASKS))}.")
    elif cfg.data.prompts is None:
        found.append("policy.path is set but data.prompts is not: give a prompt set (data.prompts=path.jsonl).")
    for role in ROLES:
        path = getattr(cfg, role).path
        if path and not is_marker(path):
            own = dir_problems(role, f"{role}.path", path, hub_names, new_head=role == "reward" and cfg.reward.new_head)
            if role == "policy" and inputs.tokenizer is not None:  # (the tokenizer given as an object is used)
                own = [p for p in own if "holds no tokenizer" not in p]
            found += own
    return found


def _reward(reward: RewardConfig, columns: list[str] | None, hub_names: list[tuple[str, str]]) -> list[str]:
    """``reward.function``, ``reward.judge`` and each ``reward.terms`` term named by path or spec
    (objects: ``setup.inputs.object_problems``); ``columns``: the prompt set's, where known."""
    found = []
    for key, spec in (("reward.function", reward.function), ("reward.judge", reward.judge)):
        if spec and not is_marker(spec):
            found += function_problems(key, function_spec(spec) if key == "reward.function" else spec, None, columns)
    for i, term in enumerate(parse_terms(reward.terms) if reward.terms else []):  # (validated before)
        if term.path:
            found += dir_problems("reward", f"reward.terms[{i}].path", term.path, hub_names)
        elif term.function and not is_marker(term.function):  # (a callable: object_problems)
            found += function_problems(f"reward.terms[{i}].function", term.function, None, columns,
                                       bound=term.kwargs)
    return found


__all__ = ["PreflightError", "problems"]
