"""What the controller is handed: every model and role of a run, built once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from .placement import Placement, ResolvedPaths
from .protocols import LearnerEngine, RolloutBackend, Scorer

if TYPE_CHECKING:
    from ..weights.steps import WeightSync  # (the weights import the Protocols: only a type here)
    from ..algo.core import Algorithm
    from ..config import Config
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
    rollout_policy: torch.nn.Module  # what a local engine samples with (the policy, or its bf16 copy)
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
