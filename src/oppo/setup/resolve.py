"""What a run is built from, decided from the checked config before any model loads: the models'
paths (the built-in task's where the config names none; a model object's saved copy where a role
loads it elsewhere), the algorithm, the devices and dtypes, and where every role runs (the
placement's ``decide``). It decides only: it checks, writes and builds nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import placements
from ..algo import build_algorithm
from ..algo.core import Algorithm
from ..api.placement import Placement, ResolvedPaths
from ..config import Config, CriticConfig, ReferenceConfig, RewardConfig
from ..marker import is_marker
from ..models import resolve_device, resolve_dtype
from ..rewards import function_spec, parse_terms
from ..weights.precision import master_dtype

if TYPE_CHECKING:
    from ..task.prepare import Prepared


@dataclass
class Resolved:
    """The run decided, nothing loaded: ``critic_source`` is the role whose model the critic starts
    from (critic, reward or policy); ``dtype`` the compute dtype, ``master`` the trained weights'."""

    paths: ResolvedPaths
    critic_source: str
    device: torch.device
    devices: dict[str, torch.device]
    """The other roles' devices: ``reference``, ``critic``, and ``reward`` where a reward model may score."""
    dtype: torch.dtype
    master: torch.dtype
    algorithm: Algorithm
    placement: Placement


def resolve(cfg: Config, task: Prepared | None, saved: dict[str, str]) -> Resolved:
    """Paths, devices, dtypes, the algorithm and the placement, decided in that order from checked
    settings (``setup.check``). ``task``: the built-in task's prepared files where the config names
    no policy; ``saved``: role -> the saved copy of a model object that a role loads elsewhere."""
    paths, critic_source = _paths(cfg, task, saved)
    algorithm = build_algorithm(cfg)
    if not algorithm.needs_critic:
        paths.critic = None  # critic-free: no critic is loaded, scored, trained or checkpointed
    dev = resolve_device(cfg.policy.device)
    # compute dtype (rollout, scoring, the training forward) and the trained weights' dtype:
    # fp32 masters under bf16 (weights/precision.py)
    dtype = resolve_dtype(cfg.policy.dtype, dev)
    master = master_dtype(dtype)
    devices = _role_devices(cfg.reference, cfg.critic, cfg.reward, paths, dev)
    placement = _placement(cfg, paths, dev, devices, computes_in_master=dtype == master)
    return Resolved(paths, critic_source, dev, devices, dtype, master, algorithm, placement)


def _paths(cfg: Config, task: Prepared | None, saved: dict[str, str]) -> tuple[ResolvedPaths, str]:
    """Every role's path (:func:`resolve_paths`), a model object's saved copy in place of its marker
    where a role loads it in another process; and the role the critic starts from (critic.path,
    else the reward model's, else the policy's)."""
    paths = resolve_paths(cfg, task)
    critic_source = "critic" if cfg.critic.path else "reward" if cfg.reward.path else "policy"
    for role in ("policy", "reward", "reference"):
        if role in saved:
            setattr(paths, role, saved[role])
    if paths.critic is not None and is_marker(paths.critic) and critic_source in saved:
        paths.critic = saved[critic_source]
    return paths, critic_source


def _role_devices(reference: ReferenceConfig, critic: CriticConfig, reward: RewardConfig, paths: ResolvedPaths,
                  dev: torch.device) -> dict[str, torch.device]:
    """The other roles' devices (the policy's, ``dev``, where they name none): the reference's, the
    critic's, and the reward model's where one may score (every reward model term's)."""
    devices = {"reference": resolve_device(reference.device, str(dev)),
               "critic": resolve_device(critic.device, str(dev))}
    if paths.reward is not None or reward.terms:
        devices["reward"] = resolve_device(reward.device, str(dev))
    return devices


def _placement(cfg: Config, paths: ResolvedPaths, dev: torch.device, devices: dict[str, torch.device],
               computes_in_master: bool) -> Placement:
    """Where every role runs: the placement's ``decide``, told which scorers there are and whether
    they all run on the CPU."""
    # the scorers: the reference (the policy's own base under LoRA without a reference model), the
    # critic, the reward model (reward.terms: paths.reward is its first reward model term)
    scorer_devices = [devices["reference"] if paths.reference or not cfg.lora.r else dev]
    if paths.critic is not None:
        scorer_devices.append(devices["critic"])
    if paths.reward is not None:
        scorer_devices.append(devices["reward"])
    facts = placements.Facts(needs_critic=paths.critic is not None,
                             scorers_on_cpu=all(d.type == "cpu" for d in scorer_devices),
                             computes_in_master=computes_in_master)
    return placements.of(cfg.placement).decide(cfg, placements.own(cfg.placement), facts)


DEFAULT_MAX_NEW_TOKENS = 256

def resolve_paths(cfg: Config, prepared: Prepared | None = None) -> ResolvedPaths:
    """Every role's path: the built-in task's models and prompts (``prepared``, its files) where the
    config names none. Checks nothing: ``setup.check`` has checked every path."""
    max_new = cfg.generation.max_new_tokens
    if cfg.uses_builtin_task:
        from ..task import get_task

        assert prepared is not None, "the built-in task is prepared before its paths are resolved (setup.build)"
        task = get_task(cfg.data.task)
        reward_fn = cfg.reward.function or task.reward_function
        reward_path = cfg.reward.path or (None if reward_fn else str(prepared.reward_path))
        if cfg.reward.terms:  # composite: the first reward model term is the reward role (critic init too)
            reward_fn, reward_path = None, _first_model_term(cfg.reward.terms)
        return ResolvedPaths(
            policy=str(prepared.policy_path), reward=reward_path,
            reward_function=function_spec(reward_fn) if reward_fn else None,
            critic=cfg.critic.path or reward_path or str(prepared.policy_path),
            reference=cfg.reference.path, prompts=cfg.data.prompts or str(prepared.prompts_path),
            judge=cfg.reward.judge or task.judge_function, max_new_tokens=max_new or task.max_new_tokens,
            accuracy=None if cfg.data.prompts else task.accuracy_function)  # it knows only the task's prompts
    # uses_builtin_task is exactly "no policy.path"; the preflight asks for data.prompts with it
    assert cfg.policy.path is not None and cfg.data.prompts is not None
    reward_path = _first_model_term(cfg.reward.terms) if cfg.reward.terms else cfg.reward.path
    return ResolvedPaths(
        policy=cfg.policy.path, reward=reward_path,
        reward_function=function_spec(cfg.reward.function) if cfg.reward.function else None,
        critic=cfg.critic.path or reward_path or cfg.policy.path, reference=cfg.reference.path,
        prompts=cfg.data.prompts, judge=cfg.reward.judge, max_new_tokens=max_new or DEFAULT_MAX_NEW_TOKENS)

def _first_model_term(terms: list) -> str | None:
    """The path of ``reward.terms``' first reward model (the ``reward`` scorer), None if it has none."""
    return next((t.path for t in parse_terms(terms) if t.path is not None), None)

