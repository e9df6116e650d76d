"""What a run is built from, decided from the config before any model loads: the models' paths
(the built-in task's where the config names none), the placement of every role, and the rollout
engine's settings (``generation.engine=auto`` resolved)."""

from __future__ import annotations

import dataclasses

import torch

from ..api.placement import Placement, ResolvedPaths, ThreadBudget
from ..config import Config
from ..models import check_model_path
from ..rewards import function_spec, parse_terms
from ..rollout import registry
from ..rollout.registry import EngineSettings, resolve_engine


DEFAULT_MAX_NEW_TOKENS = 256

def resolve_paths(cfg: Config, progress: bool = True) -> ResolvedPaths:
    """Fill in the built-in task's models and prompts where the config names none.

    Checks user paths before anything expensive; prepares the built-in task if needed.
    """
    max_new = cfg.generation.max_new_tokens
    if cfg.uses_builtin_task:
        from ..task import get_task, prepare

        task = get_task(cfg.data.task)
        prepared = prepare(task=cfg.data.task, progress=progress)
        reward_fn = cfg.reward.function or task.reward_function
        reward_path = cfg.reward.path or (None if reward_fn else str(prepared.reward_path))
        if cfg.reward.terms:  # composite: the first reward model term is the reward role (critic init too)
            reward_fn, reward_path = None, _first_model_term(cfg)
        return ResolvedPaths(
            policy=str(prepared.policy_path), reward=reward_path,
            reward_function=function_spec(reward_fn) if reward_fn else None,
            critic=cfg.critic.path or reward_path or str(prepared.policy_path),
            reference=cfg.reference.path, prompts=cfg.data.prompts or str(prepared.prompts_path),
            judge=cfg.reward.judge or task.judge_function, max_new_tokens=max_new or task.max_new_tokens,
            accuracy=None if cfg.data.prompts else task.accuracy_function)  # it knows only the task's prompts
    assert cfg.policy.path is not None  # uses_builtin_task is exactly "no policy.path"
    if cfg.data.prompts is None:
        raise ValueError("policy.path is set but data.prompts is not: give a prompt set (data.prompts=path.jsonl).")
    reward_path = _first_model_term(cfg) if cfg.reward.terms else cfg.reward.path
    term_paths = [t.path for t in parse_terms(cfg.reward.terms) if t.path] if cfg.reward.terms else []
    for role, path in (("policy", cfg.policy.path), ("reward", cfg.reward.path), ("critic", cfg.critic.path),
                       ("reference", cfg.reference.path), *(("reward", p) for p in term_paths)):
        if path:
            check_model_path(path, role)
    return ResolvedPaths(
        policy=cfg.policy.path, reward=reward_path,
        reward_function=function_spec(cfg.reward.function) if cfg.reward.function else None,
        critic=cfg.critic.path or reward_path or cfg.policy.path, reference=cfg.reference.path,
        prompts=cfg.data.prompts, judge=cfg.reward.judge, max_new_tokens=max_new or DEFAULT_MAX_NEW_TOKENS)

def _first_model_term(cfg: Config) -> str | None:
    """The path of ``reward.terms``' first reward model (the ``reward`` scorer), None if it has none."""
    return next((t.path for t in parse_terms(cfg.reward.terms) if t.path is not None), None)

def decide_placement(cfg: Config, needs_critic: bool, devices_on_cpu: bool, critic_is_master: bool) -> Placement:
    """``devices_on_cpu``: every scorer's model is on the CPU (a child process shares them);
    ``critic_is_master``: the critic the scorer reads is the trained one (fp32)."""
    pl = cfg.placement
    ray = pl.backend == "ray"
    critic_on_scorer = bool(cfg.streams and pl.critic_on_worker and needs_critic and not ray)
    if ray:
        scorer = "ray"
    elif not cfg.streams:
        scorer = "inline"
    else:
        # the child process shares the scorers' weights in place; when the critic trains in the
        # child, it trains the copy it scores with, so that must be the fp32 master: a bf16 run
        # then uses the thread worker
        process = pl.scorer_process and devices_on_cpu and (critic_is_master or not critic_on_scorer)
        scorer = "process" if process else "thread"
    full = pl.threads or torch.get_num_threads()
    decode = pl.actor_threads if cfg.streams or ray else full
    return Placement(scorer=scorer,
                     critic_trains_on="none" if not needs_critic else "scorer" if critic_on_scorer else "learner",
                     learner="ray" if ray else "local", rollout="ray" if ray and pl.rollout_workers else "local",
                     rollout_streams_itself=bool(ray and pl.rollout_workers and cfg.overlap.mode != "sequential"),
                     threads=ThreadBudget(full, decode, pl.actor_threads))

def engine_settings(cfg: Config, stop_ids, pad_id: int, max_new_tokens: int, device: torch.device,
                    model: torch.nn.Module | None = None) -> EngineSettings:
    """The rollout engine's settings from the config (``generation.*``, and the backend's own
    ``rollout.<kind>.*`` resolved for ``device``), for an engine on ``device``;
    ``generation.engine=auto`` resolved there (``rollout.registry.resolve_engine``: the fast engine on
    CUDA when ``model``, the policy it will decode, suits it; else eager). Ray rollout workers get
    settings for ``cpu``, so ``auto`` runs the eager engine in them."""
    g, B = cfg.generation, cfg.ppo.batch_size
    max_len = cfg.data.max_prompt_tokens + max_new_tokens

    def unfit() -> str | None:
        check = registry.get(registry.FAST).unfit
        if model is None:
            return "the policy was not given to check"
        return check(model, max_len) if check else None
    kind, reason = resolve_engine(g.engine, device, unfit)
    spec, own = registry.get(kind), cfg.rollout.get(kind)
    if own is not None:  # a copy: the engine's settings do not change with the config object
        own = spec.for_device(own, device.type) if spec.for_device else dataclasses.replace(own)
    return EngineSettings(tuple(stop_ids), pad_id, max_new_tokens, g.temperature, g.top_k, g.top_p,
                          g.kv_budget_mb or None, cfg.run.seed, kind,
                          max_rows=2 * B if cfg.carries else B,  # B + Delta, refill: <= 2B
                          max_len=max_len, reason=reason, backend=own)
