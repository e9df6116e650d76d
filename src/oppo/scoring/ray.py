"""The streaming scorers in Ray actors, behind a drop-in for :class:`oppo.scoring.worker.ScorerWorker`.

Each actor (:class:`ScorerHost`) loads its roles' models itself and runs the local worker's very
message loop on a thread; its methods only enqueue, so chunks that queue up are scored in one
batched forward, as locally. The controller's handle, :class:`RayScorerWorker`, waits on its refs
only at ``barrier`` (one more call, ordered after the others by Ray), where results arrive and
errors surface named by role and rank. The critic trains in the actor that serves it
(``critic_trainer``) or receives its weights from the learner group. Design:
``docs/distributed.md``, "Scorer actors".
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..learner.batch import CriticBatch
from ..api.records import Chunk
from ..api.records import ScoredOutputs
from .streaming import Kind, StreamingScorer, score_full
from ..trace import Tracer
from ..weights.precision import copy_weights
from ..learner.critic import CriticTrainer
from .worker import BarrierReply, ScorerWorker
from ..cluster import ActorGroup
from ..api.specs import ModelSpec
from ..weights.sync import is_packed, pack, unpack_into

if TYPE_CHECKING:
    from ..config import PPOConfig

SCORER_ROLES: tuple[Kind, ...] = ("reward", "reference", "critic")


class ScorerHost:
    """The actor: a :class:`ScorerWorker` over models it loads itself (see the module docstring).

    Plain class; :class:`RayScorerWorker` wraps it with ``ray.remote``. Usable without Ray too
    (the tests compare it with the local worker that way as well).
    """

    def __init__(self, specs: dict[str, ModelSpec], temperature: float, threads: int, name: str,
                 critic_trainer: PPOConfig | None = None, seed: int = 0):
        torch.set_num_threads(threads)
        torch.manual_seed(seed)  # a fresh critic head is then at least reproducible (specs.py)
        scorers: dict[str, StreamingScorer] = {}
        trainer: CriticTrainer | None = None
        for role, spec in specs.items():
            if role not in SCORER_ROLES:
                raise ValueError(f"a scorer hosts {SCORER_ROLES}, not {role!r}")
            if spec.pad_id is None:
                raise ValueError(f"the {role} scorer's ModelSpec needs pad_id (it pads chunks with it)")
            if role == "critic" and critic_trainer is not None:
                # trained here: fp32 masters and AdamW; the scorer reads a serving copy (weights.py)
                trainer, model = CriticTrainer.load(spec, critic_trainer)
            else:
                model = spec.load()
            scorers[role] = StreamingScorer(role, model, spec.pad_id,
                                            temperature if role == "reference" else 1.0)
        self.scorers, self.temperature = scorers, temperature
        self.tracer = Tracer(enabled=True)
        self.trainer = trainer
        self.worker = ScorerWorker(scorers, threads, self.tracer, name, trainer=trainer)

    # calls from the controller: the first four only enqueue (ScorerWorker's message loop)
    def admit(self, uids: list[int], prompts: list[list[int]], step: int) -> None:
        self.worker.admit(uids, prompts, step)

    def feed(self, chunks: list[Chunk], step: int) -> None:
        self.worker.feed(chunks, step)

    def forget(self, uids: set[int]) -> None:
        self.worker.forget(uids)

    def train_critic(self, batch: CriticBatch, minibatches: "list[list[int]] | list[torch.Tensor]", step: int) -> None:
        self.worker.train_critic(batch, minibatches, step)

    def barrier(self) -> BarrierReply:
        self.worker.barrier()  # the loop is idle from here until this method returns
        results = {role: dict(res) for role, res in self.worker.results.items()}
        for res in self.worker.results.values():
            res.clear()
        spans = self.tracer.spans
        self.tracer.clear()
        return BarrierReply(0, results, spans, dict(self.worker.peak_cache_bytes), self.worker.take_train_stats())

    def set_critic_weights(self, weights: dict, step: int = -1) -> None:
        """Load trained critic weights (from a learner: a state dict, or ``weight_sync.pack``'s
        arrays) into the critic this actor scores with."""
        self.worker.barrier()  # nothing may be reading the critic while it changes
        t = time.perf_counter()
        trainer, scored = self.trainer, self.scorers["critic"].model
        target = trainer.master if trainer is not None and trainer.master is not None else scored
        if is_packed(weights):
            unpack_into(target, weights)
        else:
            target.load_state_dict(weights)
        copy_weights(target, scored)
        self.tracer.add(self.worker.name, "load_critic", step, t, time.perf_counter())

    def critic_state(self) -> dict[str, Any]:
        """The trained critic's weights and AdamW state (``CriticTrainer.state``), for checkpoints."""
        self.worker.barrier()
        return self._trainer().state(self.scorers["critic"].model)

    def load_critic_state(self, model: dict[str, torch.Tensor], optim: dict | None = None) -> None:
        self.worker.barrier()
        self._trainer().load_state(self.scorers["critic"].model, model, optim)

    def _trainer(self) -> CriticTrainer:
        if self.trainer is None:
            raise RuntimeError("this scorer actor does not train the critic (built without critic_trainer)")
        return self.trainer

    def score_full(self, role: str, prompts: list[list[int]], responses: list[list[int]]) -> list[ScoredOutputs]:
        """One-shot scores of whole sequences with this actor's model of ``role`` (after the queued work)."""
        self.worker.barrier()
        s = self.scorers[role]
        return score_full(s.kind, s.model, prompts, responses, s.pad_id, s.temperature)  # (its kind: its role)

    def close(self) -> None:
        self.worker.close()


class RayScorerWorker:
    """Drop-in for :class:`oppo.scoring.worker.ScorerWorker` with the scorers in Ray actors.

    ``specs``: role -> ModelSpec for the roles to score (any of reward, reference, critic).
    ``groups``: which roles share an actor; None: all in one. Each actor gets ``num_cpus`` CPUs and
    ``num_gpus`` GPUs from Ray and runs ``threads`` torch threads. ``critic_trainer``: the PPO
    settings if the critic trains on its actor (``train_critic``). Call :func:`.cluster.init_ray`
    first.
    """

    def __init__(self, specs: dict[str, ModelSpec], tracer: Tracer, *, temperature: float = 1.0, threads: int = 1,
                 num_cpus: float = 1, num_gpus: float = 0, groups: Sequence[Sequence[str]] | None = None,
                 critic_trainer: PPOConfig | None = None, name: str = "scorer", seed: int = 0):
        roles = [r for r in SCORER_ROLES if r in specs]
        groups = [tuple(roles)] if groups is None else [tuple(g) for g in groups]
        if sorted(r for g in groups for r in g) != sorted(specs):
            raise ValueError(f"scorer groups {groups} must place each of {sorted(specs)} exactly once")
        self.tracer, self.name = tracer, name
        self.roles: tuple[str, ...] = tuple(roles)
        self.peak_cache_bytes: dict[str, int] = {r: 0 for r in roles}  # refreshed at barriers
        self.results: dict[str, dict[int, ScoredOutputs]] = {r: {} for r in roles}
        self.train_stats: dict[str, float] = {}
        self.critic_trains_here = critic_trainer is not None
        self.labels: list[str] = ["+".join(g) for g in groups]  # each actor's roles, "+"-joined
        self._pending: list[list[Any]] = [[] for _ in groups]  # per actor: the refs of the calls not waited on yet
        self.feeders: list = []  # others that feed the actors (rollout replicas): flushed before a barrier

        def args(i: int) -> tuple:
            g = groups[i]
            worker_name = name if len(groups) == 1 else f"{name}/{self.labels[i]}"
            return ({r: specs[r] for r in g}, temperature, threads, worker_name,
                    critic_trainer if "critic" in g else None, seed)

        # one actor per group of roles, each its group's rank 0 (one replica per group)
        self.group = ActorGroup(ScorerHost, len(groups), args, role="scorer actor", num_cpus=num_cpus,
                                num_gpus=num_gpus, labels=self.labels, numbers=[0] * len(groups))
        self.actors: list[Any] = self.group.actors  # Ray actor handles of ScorerHost
        self._critic = next((i for i, g in enumerate(groups) if "critic" in g), None)

    # ------------------------------------------------------------------ the ScorerWorker methods

    def admit(self, uids: list[int], prompts: list[list[int]], step: int) -> None:
        self._broadcast(lambda a, *args: a.admit.remote(*args), list(uids), [list(p) for p in prompts], step)

    def feed(self, chunks: list[Chunk], step: int) -> None:
        if chunks:
            self._broadcast(lambda a, *args: a.feed.remote(*args), list(chunks), step)

    def admit_finished(self, uids, prompts, responses, step: int) -> None:
        self.admit(uids, prompts, step)
        self.feed([Chunk(u, tuple(r), True) for u, r in zip(uids, responses)], step)

    def forget(self, uids: set[int]) -> None:
        self._broadcast(lambda a, *args: a.forget.remote(*args), set(uids))

    def train_critic(self, batch: CriticBatch, minibatches: "list[list[int]] | list[torch.Tensor]", step: int) -> None:
        """Start the critic's PPO update on its actor; stats from ``take_train_stats`` after the
        next barrier. The batch goes as CPU tensors (the actor moves it to its device)."""
        if not self.critic_trains_here:
            raise RuntimeError("internal error: this scorer worker was built without critic_trainer")
        self._call(self._critic_actor(),
                   lambda a: a.train_critic.remote(batch.to("cpu"), [mb if isinstance(mb, list) else mb.cpu() for mb in minibatches], step))

    def take_train_stats(self) -> dict[str, float]:
        stats, self.train_stats = self.train_stats, {}
        return stats

    def barrier(self) -> None:
        """Wait until every call sent so far has run; collect results, spans and peaks. Raise if an
        actor failed or died, naming each one that did by role and rank."""
        for f in self.feeders:  # their chunks first: Ray orders one caller's calls, not two callers'
            f.flush()
        for i, actor in enumerate(self.actors):
            self._pending[i].append(actor.barrier.remote())
        replies, errors = [], []
        for i in range(len(self.actors)):  # every actor's outcome, so that each failure is named
            try:
                replies.append(self._wait(i)[-1])
            except RuntimeError as e:
                errors.append(e)
        if errors:
            raise RuntimeError("; ".join(str(e) for e in errors)) from errors[0].__cause__
        for reply in replies:
            for role, res in reply.results.items():
                self.results[role].update(res)
            for sp in reply.spans:
                self.tracer.add(sp.lane, sp.stage, sp.step, sp.start, sp.end, **sp.args)
            self.peak_cache_bytes.update(reply.peaks)
            self.train_stats.update(reply.train_stats)

    def take(self, uids: list[int]) -> dict[str, list[ScoredOutputs]]:
        """Outputs for ``uids`` (all must be complete: call barrier() first)."""
        return {role: [res.pop(u) for u in uids] for role, res in self.results.items()}

    def close(self) -> None:
        """Stop the actors (a clean stop if they answer within 10 s, then killed either way)."""
        self.group.shutdown("close", timeout_s=10)
        self.actors = []

    # ------------------------------------------------------------------ the critic's weights

    def set_critic_weights(self, state_dict, step: int = -1) -> None:
        """Send trained critic weights (a state dict, a module, ``weight_sync.pack``'s arrays, or a
        Ray ref to either) to the actor scoring with the critic; they apply before any call sent
        after this one."""
        import ray

        if isinstance(state_dict, torch.nn.Module):
            state_dict = pack(state_dict)
        if not isinstance(state_dict, ray.ObjectRef):
            state_dict = ray.put(state_dict)
        self._call(self._critic_actor(), lambda a: a.set_critic_weights.remote(state_dict, step))

    def critic_state(self) -> dict[str, Any]:
        """``{"model": critic state_dict, "optim": AdamW state_dict}`` from the actor that trains it."""
        i = self._critic_actor()
        self._call(i, lambda a: a.critic_state.remote())
        return self._wait(i)[-1]

    def load_critic_state(self, model: dict[str, torch.Tensor], optim: dict | None = None) -> None:
        i = self._critic_actor()
        self._call(i, lambda a: a.load_critic_state.remote(model, optim))
        self._wait(i)

    def score_full(self, role: str, prompts: list[list[int]], responses: list[list[int]]) -> list[ScoredOutputs]:
        """One-shot scoring on the actor holding ``role`` (e.g. the values of carried prefixes with
        the critic it trained, or the sequential mode's stage 3)."""
        i = next(i for i, label in enumerate(self.labels) if role in label.split("+"))
        self._call(i, lambda a: a.score_full.remote(role, [list(p) for p in prompts], [list(r) for r in responses]))
        return self._wait(i)[-1]

    # ------------------------------------------------------------------ plumbing

    def _broadcast(self, send, *args) -> None:
        """``send(actor, *args)`` to every actor (the arguments serialised once, not once per actor)."""
        if len(self.actors) > 1:
            import ray

            args = tuple(ray.put(a) for a in args)
        for i in range(len(self.actors)):
            self._call(i, lambda a: send(a, *args))

    def _critic_actor(self) -> int:
        """The index of the actor holding the critic."""
        if self._critic is None:
            raise RuntimeError("internal error: no scorer actor holds the critic")
        return self._critic

    def _call(self, i: int, send) -> None:
        """``send(actor i)``: one remote call, its ref kept for the next wait."""
        self._pending[i].append(send(self.actors[i]))

    def _wait(self, i: int) -> list:
        """Results of actor ``i``'s pending calls, in order; the first failure raised by role and rank."""
        refs, self._pending[i] = self._pending[i], []
        return self.group.gather(refs, [i] * len(refs))


class FedByRollout:
    """The scorer as the controller sees it when the Ray rollout replicas admit and feed the scorer
    actors themselves: the controller sends nothing, and a barrier first flushes the rollout replicas."""

    def __init__(self, scorer):
        self.inner = scorer
        self.roles = scorer.roles

    @property
    def peak_cache_bytes(self) -> dict[str, int]:
        return self.inner.peak_cache_bytes

    def admit(self, uids, prompts, step: int) -> None:
        pass  # (sent by the rollout replicas, before their first chunk)

    def feed(self, chunks, step: int) -> None:
        if chunks:
            raise RuntimeError("internal error: rollout replicas that stream themselves reported chunks")

    def admit_finished(self, uids, prompts, responses, step: int) -> None:
        self.inner.admit_finished(uids, prompts, responses, step)  # (no rollout replica holds these)

    def forget(self, uids) -> None:
        self.inner.forget(uids)

    def barrier(self) -> None:
        self.inner.barrier()  # (flushes the rollout replicas first: they are its feeders)

    def take(self, uids):
        return self.inner.take(uids)

    def score_full(self, role, prompts, responses):
        return self.inner.score_full(role, prompts, responses)

    def close(self) -> None:
        self.inner.close()
