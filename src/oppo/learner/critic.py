"""The learner when the critic trains beside its scoring (``placement.critic_on_worker``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..api.plan import ThreadBudget
from ..trace import Tracer
from .batch import CriticBatch
from .local import Learner

if TYPE_CHECKING:
    from ..scoring.worker import ScorerWorker  # (the scorer trains the critic: scoring imports the learner)


class CriticBesideScorer:
    """The learner when the critic trains on the scorer worker (``placement.critic_on_worker``): the
    critic's update goes to the worker (its own core or stream) while the actor trains here, on
    the same minibatches; the two updates share nothing else, so the weights are those of one
    learner doing both (``Learner.update``)."""

    def __init__(self, learner: Learner, scorer: ScorerWorker, tracer: Tracer, threads: ThreadBudget,
                 in_flight: bool):
        self.inner, self.scorer, self.tracer, self.threads, self.in_flight = learner, scorer, tracer, threads, in_flight
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
        self.scorer.train_critic(CriticBatch.of(exp), self.inner.minibatches(exp.mask.shape[0], step, exp.valid.sum(1)), step)
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

    def actor_weights(self):
        return self.inner.actor_weights()

    def checkpoint_state(self) -> dict:
        return self.inner.checkpoint_state()

    def load_checkpoint_state(self, optim: dict) -> None:
        self.inner.load_checkpoint_state(optim)

    def close(self) -> None:
        self.inner.close()
