"""What setup built (``Models``, ``Roles``: every model and role of a run, built once) and what the
controller is handed of it (``RoleHandles``: the roles and what a step reads, no model)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from .placement import Placement, ResolvedPaths
from .protocols import LearnerEngine, RolloutBackend, Scorer

if TYPE_CHECKING:
    from ..weights.steps import WeightSync  # (the weights import the Protocols: only a type here)
    from ..algo.core import Algorithm
    from ..config import Config, OverlapConfig, PPOConfig
    from ..data import PromptSet
    from ..rewards.terms import CompositeReward
    from ..trace import Tracer


@dataclass
class Models:
    """What setup loaded before any role is built (``setup.load.load_models``): the run's inputs
    resolved, the models in their dtypes and devices, the functions that score."""

    cfg: Config
    paths: ResolvedPaths
    tokenizer: Any  # a Hugging Face tokenizer
    prompt_set: PromptSet
    algorithm: Algorithm
    device: torch.device
    compute_dtype: torch.dtype
    max_new_tokens: int
    pad_id: int
    stop_ids: tuple[int, ...]  # the ids that end a response (models.stop_token_ids)
    policy: torch.nn.Module  # the trained weights (what checkpoints save)
    critic: torch.nn.Module | None
    reference: torch.nn.Module
    rollout_policy: torch.nn.Module  # what a local rollout backend samples with (the policy, or its bf16 copy)
    scoring_critic: torch.nn.Module | None
    reward: CompositeReward  # the trained reward: reward.terms, or reward.path / reward.function as one term
    reward_model: torch.nn.Module | None  # the ``reward`` scorer's model (a model term's; None: functions only)
    judge_fn: Callable | None
    accuracy_fn: Callable | None
    extra_reward_models: dict[str, torch.nn.Module]  # reward.terms: the reward models after the first, by scorer role
    recompute_old: bool  # the learner recomputes the old log-probs (ppo.old_logprobs resolved)
    tracer: Tracer


@dataclass
class Roles(Models):
    """Everything a run needs, built once (``setup.build.build_roles``): the models, and the three
    roles behind their Protocols (the controller calls nothing else of theirs), where the placement
    put them."""

    placement: Placement
    rollout: RolloutBackend
    scorer: Scorer
    learner: LearnerEngine
    sync: WeightSync
    closers: list = field(default_factory=list)
    backend: str = ""  # which rollout backend runs, and why (generation.backend=auto resolved), for the run's log

    def close(self) -> None:
        for c in self.closers:
            c()


@dataclass(frozen=True)
class StepSettings:
    """What a step reads of the settings, read once when the roles are handed to the controller."""

    overlap: OverlapConfig
    ppo: PPOConfig
    steps: int  # run.steps
    group_size: int  # the algorithm's group (GRPO/RLOO), 1 for PPO
    carries: bool  # the mode carries unfinished rows into the next step

    @classmethod
    def of(cls, cfg: Config) -> "StepSettings":
        return cls(cfg.overlap, cfg.ppo, cfg.run.steps, cfg.group_size, cfg.carries)


@dataclass
class RoleHandles:
    """What the controller (``control.stages.Loop``) is handed: the three roles behind their
    Protocols, the weight sync, where they run, and what a step reads; no model and no config.
    ``actor_flops`` / ``critic_flops``: a forward's FLOPs over sequences of given lengths (the MFU
    figures; None where there is no such model)."""

    rollout: RolloutBackend
    scorer: Scorer
    learner: LearnerEngine
    sync: WeightSync
    placement: Placement
    tracer: Tracer
    tokenizer: Any
    prompt_set: PromptSet
    pad_id: int
    device: torch.device
    compute_dtype: torch.dtype
    reward: CompositeReward
    judge_fn: Callable | None
    accuracy_fn: Callable | None
    algorithm: Algorithm
    recompute_old: bool
    has_critic: bool
    settings: StepSettings
    actor_flops: Callable[[list[int]], float] | None = None
    critic_flops: Callable[[list[int]], float] | None = None

    @classmethod
    def of(cls, roles: Roles) -> "RoleHandles":
        import functools

        from ..perf import forward_flops

        return cls(roles.rollout, roles.scorer, roles.learner, roles.sync, roles.placement, roles.tracer,
                   roles.tokenizer, roles.prompt_set, roles.pad_id, roles.device, roles.compute_dtype, roles.reward,
                   roles.judge_fn, roles.accuracy_fn, roles.algorithm, roles.recompute_old,
                   has_critic=roles.critic is not None, settings=StepSettings.of(roles.cfg),
                   actor_flops=functools.partial(forward_flops, roles.policy) if roles.policy is not None else None,
                   critic_flops=functools.partial(forward_flops, roles.critic) if roles.critic is not None else None)
