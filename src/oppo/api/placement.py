"""The frozen plan of a run: where every role runs (:class:`Placement`) and the torch thread
counts by phase (:class:`ThreadBudget`), decided once by the placement's spec (``oppo.placements``,
asked by ``setup.resolve``) and read by the controller."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ThreadBudget:
    """torch thread counts of this process, by phase (decided once; torch's count is per process).

    ``decode``: while the actor decodes (its own core(s) when a scorer worker runs beside it);
    ``full``: every core this process may use (scoring one-shot, training alone);
    ``beside_critic``: training the actor while the scorer worker trains the critic.
    """

    full: int
    decode: int
    beside_critic: int

    def use(self, n: int) -> None:
        torch.set_num_threads(n)

@dataclass(frozen=True)
class Placement:
    """Where every role runs, decided once from the config (module docstring)."""

    scorer: str  # "inline": in the controller's thread; "thread"; "process"; "ray"
    critic_trains_on: str  # "learner", "scorer" (placement.local.critic_on_worker) or "none" (critic-free)
    learner: str  # "local" or "ray" (data-parallel ranks)
    rollout: str  # "local" or "ray" (rollout replicas)
    rollout_streams_itself: bool  # Ray rollout replicas feed the scorer actors directly
    threads: ThreadBudget


@dataclass
class ResolvedPaths:
    policy: str
    reward: str | None
    reward_function: str | None
    critic: str | None
    reference: str | None
    prompts: str
    judge: str | None
    max_new_tokens: int
    accuracy: str | None = None
    """The built-in task's right-answer function (``task/accuracy``), if it has one."""
