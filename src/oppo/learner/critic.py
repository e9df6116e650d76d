"""Critic training where the critic is scored: :class:`CriticTrainer` (its AdamW and its update, run
by a scorer worker, process or Ray actor between two scoring messages) and
:class:`CriticBesideScorer` (the learner when it does: ``placement.local.critic_on_worker``). The scorers
only host it; the update itself is the learner's (``local.critic_update``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from ..api.placement import ThreadBudget
from ..trace import Tracer
from ..weights.precision import copy_weights, master_dtype, serving_copy
from .batch import CriticBatch, row_lengths
from .local import CriticSettings, Learner, critic_update, load_optimizer_state_in_place

if TYPE_CHECKING:
    from ..api.protocols import LearnerEngine
    from ..api.specs import ModelSpec
    from ..config import PPOConfig


class CriticHost(Protocol):
    """What hosts the critic's update (a scorer worker, ``scoring.worker.ScorerWorker`` or its Ray
    group): the scorers import the learner to run :class:`CriticTrainer`, so the learner names
    only the three calls it makes here, not the scorers."""

    def train_critic(self, batch: CriticBatch, minibatches: "list[list[int]] | list[torch.Tensor]", step: int
                     ) -> None:
        """Start the critic's update on ``minibatches`` of ``batch``."""

    def barrier(self) -> None:
        """Wait until every message sent so far (the update among them) has run."""

    def take_train_stats(self) -> dict[str, float]:
        """The finished update's statistics (once)."""


@dataclass
class CriticTrainer:
    """The critic's PPO update where it is scored: its AdamW, its update's settings
    (:class:`~.local.CriticSettings`), and its fp32 master weights when they are not the scored module
    (bf16, weights.py; None: the scorer's critic is the trained one)."""

    opt: torch.optim.Optimizer
    settings: CriticSettings
    master: torch.nn.Module | None = None
    compute_dtype: torch.dtype = torch.float32

    @classmethod
    def load(cls, spec: ModelSpec, ppo: PPOConfig) -> tuple["CriticTrainer", torch.nn.Module]:
        """Load the critic of ``spec`` as fp32 masters with their AdamW (``ppo``: the section its
        settings are read from, once); returns the trainer and the serving copy the scorer reads
        (``spec``'s dtype: the masters themselves in fp32)."""
        settings = CriticSettings.of(ppo)
        master = spec.with_dtype(master_dtype(spec.dtype)).load()
        opt = torch.optim.AdamW(master.parameters(), lr=settings.update.lr, weight_decay=settings.update.weight_decay)
        return cls(opt, settings, master, spec.dtype), serving_copy(master, spec.dtype)

    def train(self, scored: torch.nn.Module, batch: CriticBatch, minibatches, step: int,
              adapt: Callable[[], None]) -> dict[str, float]:
        """One update on ``batch``'s ``minibatches``; then the scored copy takes the new weights."""
        master = self.master if self.master is not None else scored
        stats = critic_update(master, self.opt, batch, list(minibatches), self.settings, adapt, self.compute_dtype, step)
        copy_weights(master, scored)  # the bf16 copy it scores with (no-op in fp32)
        return stats

    def state(self, scored: torch.nn.Module) -> dict[str, Any]:
        """``{"model": the trained critic's state dict (CPU), "optim": its AdamW's}``, for checkpoints."""
        master = self.master if self.master is not None else scored
        return {"model": {k: v.detach().cpu() for k, v in master.state_dict().items()},
                "optim": self.opt.state_dict()}

    def load_state(self, scored: torch.nn.Module, model: dict[str, torch.Tensor], optim: dict | None = None) -> None:
        """Inverse of :meth:`state` (``optim`` None: the weights only)."""
        master = self.master if self.master is not None else scored
        master.load_state_dict(model)
        copy_weights(master, scored)
        if optim is not None:
            load_optimizer_state_in_place(self.opt, optim)


class CriticBesideScorer:
    """The learner when the critic trains on the scorer worker (``placement.local.critic_on_worker``): the
    critic's update goes to the worker (its own core or stream) while the actor trains here, on
    the same minibatches; the two updates share nothing else, so the weights are those of one
    learner doing both (``Learner.update``)."""

    def __init__(self, learner: Learner, scorer: CriticHost, tracer: Tracer, threads: ThreadBudget,
                 in_flight: bool, engine: LearnerEngine | None = None):
        """``engine``: what trains the actor (the registered learner engine built over ``learner``;
        default ``learner`` itself)."""
        self.inner: LearnerEngine = engine if engine is not None else learner
        self.scorer, self.tracer, self.threads, self.in_flight = scorer, tracer, threads, in_flight
        # the trained state, as the local learner's (the scorer process shares the critic's AdamW state)
        self.actor, self.critic, self.actor_opt, self.critic_opt = (learner.actor, learner.critic, learner.actor_opt,
                                                                    learner.critic_opt)
        self.recompute_old = learner.recompute_old

    def old_logprobs(self, exp, version: int):
        return self.inner.old_logprobs(exp, version)

    def minibatches(self, B: int, step: int, lengths=None):
        return self.inner.minibatches(B, step, lengths)

    def update(self, exp, step: int, critic: bool = True) -> dict[str, float]:
        """``Learner.update``: the actor here while the critic trains on the scorer worker (``critic``
        False: the actor only, as ``Learner.update(critic=False)``)."""
        if not critic:
            with self.tracer.span("learner", "train", step):
                return self.inner.update(exp, step, critic=False)
        self.scorer.train_critic(CriticBatch.of(exp), self.inner.minibatches(exp.mask.shape[0], step, row_lengths(exp)), step)
        if not self.in_flight:  # (in-flight, the decoding owns the process's thread count)
            self.threads.use(self.threads.beside_critic)
        with self.tracer.span("learner", "train", step):
            stats = self.inner.update(exp, step, critic=False)
        if not self.in_flight:
            self.threads.use(self.threads.full)
        with self.tracer.span("controller", "wait_critic", step):
            self.scorer.barrier()
        stats.update(self.scorer.take_train_stats())
        return stats

    def weights_out(self):
        return self.inner.weights_out()

    def checkpoint_state(self) -> dict:
        return self.inner.checkpoint_state()

    def load_checkpoint_state(self, optim: dict) -> None:
        self.inner.load_checkpoint_state(optim)

    def close(self) -> None:
        self.inner.close()
