"""A learner as a group of Ray ranks: what every rank builds (:class:`LearnerSpec`), the rank actor
(:class:`LearnerRank`) and the controller's handle (:class:`LearnerGroup`, a
:class:`~oppo.api.protocols.LearnerEngine`).

How the ranks split an update is an :class:`UpdateStrategy`, composed in: :class:`~.dp.Replicated`
or :class:`~.fsdp.Sharded`. Every rank runs the single learner's code on its models, in one
``torch.distributed`` group; a rank that raises or dies stops the whole group.

Design notes (the process group, checkpoints, weights out, faults): docs/distributed.md, "Learner
ranks"."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from ..api.protocols import Wait
from ..api.specs import ModelSpec
from ..cluster import ActorGroup
from ..weights.sync import (Manifest, Packed, RemoteWeights, SyncGroup, WeightSender, WeightSyncError, full_tensors,
                            pack_state, trained_parameters)
from .batch import Experience, OldLogprobSettings, old_logprob_targets, set_old_logprobs
from .local import Draw, Learner, draw_rows

if TYPE_CHECKING:  # (the config lists the learner engines: no import back at run time)
    from ..config import LoraConfig, PolicyConfig, PPOConfig


@dataclass(frozen=True)
class LearnerSpec:
    """What every rank builds its ``Learner`` from, as the trainer builds its own.

    ``actor``/``critic``: the trained models' specs, in their master dtype (fp32 under bf16
    compute, ``weights.py``; with LoRA the actor's frozen base in the compute dtype). ``critic``
    None: a critic-free algorithm. ``algorithm``: the ``algo.Algorithm`` (None: plain PPO).
    ``lora``: ``(r, alpha, dropout, target_modules)`` to wrap the actor with, or None.
    """

    actor: ModelSpec
    critic: ModelSpec | None
    ppo: PPOConfig
    temperature: float
    seed: int
    compute_dtype: torch.dtype = torch.float32
    recompute_old: bool = False
    algorithm: object = None
    lora: tuple | None = None
    gradient_checkpointing: bool = False

    def build(self, prepare: Callable[[torch.nn.Module], None] | None = None) -> Learner:
        """Load the models and build the Learner. ``prepare(model)``, if given, runs on the actor and
        the critic before their optimizers are built (the FSDP2 ranks shard them there)."""
        from ..models import apply_lora, enable_gradient_checkpointing

        torch.manual_seed(self.seed)
        actor = self.actor.load()
        if self.lora is not None:
            actor = apply_lora(actor, *self.lora)
        critic = self.critic.load() if self.critic is not None else None
        if self.gradient_checkpointing:
            for m in (actor, critic):
                if m is not None:
                    enable_gradient_checkpointing(m)
        actor.eval()
        if prepare is not None:
            for m in (actor, critic):
                if m is not None:
                    prepare(m)
        return Learner(actor, critic, self.ppo, self.temperature, self.seed, compute_dtype=self.compute_dtype,
                       recompute_old=self.recompute_old, algorithm=self.algorithm)


def learner_spec(policy: PolicyConfig, lora: LoraConfig, ppo: PPOConfig, temperature: float, seed: int, paths,
                 pad_id: int, compute_dtype: torch.dtype, algorithm, recompute_old: bool, critic: bool = True,
                 device: str = "auto") -> LearnerSpec:
    """The learner the trainer builds (``setup.build.build_roles``), as a spec for the ranks: the policy in
    its master dtype (the compute dtype under LoRA: only the fp32 adapters train), the critic in
    its master dtype (``critic`` False: none here, e.g. it trains on its scorer actor, or a
    critic-free algorithm), LoRA and gradient checkpointing as configured (the ``policy``, ``lora``
    and ``ppo`` sections; ``temperature``: ``generation.temperature``, ``seed``: ``run.seed``)."""
    from ..weights.precision import master_dtype

    master = master_dtype(compute_dtype)
    return LearnerSpec(
        actor=ModelSpec("policy", paths.policy, compute_dtype if lora.r else master, device,
                        trust_remote_code=policy.trust_remote_code),
        critic=ModelSpec("critic", paths.critic, master, device, pad_id) if critic and paths.critic else None,
        ppo=ppo, temperature=temperature, seed=seed, compute_dtype=compute_dtype,
        recompute_old=recompute_old, algorithm=algorithm,
        lora=(lora.r, lora.alpha, lora.dropout, list(lora.target_modules)) if lora.r else None,
        gradient_checkpointing=policy.gradient_checkpointing)


def portable(exp: Experience) -> Experience:
    """The Experience as it travels to the ranks: CPU tensors, no Rollout records (the update
    needs only the tensors)."""
    moved: dict[str, Any] = {f.name: (v.cpu() if torch.is_tensor(v) else v) for f in dataclasses.fields(exp)
                             for v in [getattr(exp, f.name)]}
    moved["rollouts"] = []
    return Experience(**moved)


def _to(exp: Experience, device: torch.device) -> Experience:
    return dataclasses.replace(exp, **{f.name: getattr(exp, f.name).to(device) for f in dataclasses.fields(exp)
                                       if torch.is_tensor(getattr(exp, f.name))})


def learner_state(learner: Learner) -> dict:
    """A learner's trained state as checkpoints save it: ``{"actor", "critic"}`` model state dicts
    (CPU tensors) and ``{"actor_opt", "critic_opt"}`` AdamW state dicts."""
    state = {"actor": cpu_state(learner.actor), "actor_opt": cpu_state(learner.actor_opt)}
    if learner.critic is not None:  # critic-free algorithms have none
        state.update(critic=cpu_state(learner.critic), critic_opt=cpu_state(learner.critic_opt))
    return state


def load_learner_state(learner: Learner, state: dict) -> None:
    """Inverse of :func:`learner_state` (for a single learner, or a rank of a group of any size)."""
    if (learner.critic is None) != ("critic" not in state):
        raise ValueError("a learner state with a critic loads only into a learner with one (and without into without)")
    learner.actor.load_state_dict(state["actor"])
    learner.actor_opt.load_state_dict(state["actor_opt"])
    if learner.critic is not None:
        assert learner.critic_opt is not None  # (built with the critic)
        learner.critic.load_state_dict(state["critic"])
        learner.critic_opt.load_state_dict(state["critic_opt"])


def cpu_state(module_or_opt) -> dict:
    """A snapshot of a module's or optimizer's state dict: CPU copies, never views of live tensors."""
    return _cpu_copy(module_or_opt.state_dict())


def _cpu_copy(x):
    if torch.is_tensor(x):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: _cpu_copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_cpu_copy(v) for v in x]
    return x


# ====================================================================== how ranks split an update

class UpdateStrategy(Protocol):
    """How the ranks of a :class:`LearnerGroup` hold the trained state and split an update.
    Implementations: ``dp.Replicated``, ``fsdp.Sharded``."""

    name: str
    sharded: bool
    """Each rank holds a shard: reads of the weights are collectives (every rank is called, rank 0
    keeps the result), checkpoints are written shard by shard, and old log-probs are split by rows."""

    def build(self, spec: LearnerSpec, world: int, mesh_device: str) -> Learner:
        """This rank's Learner, inside the process group (rank 0's weights broadcast)."""

    def update(self, learner: Learner, exp: Experience, step: int, rank: int, world: int, critic: bool
               ) -> dict[str, float]:
        """``learner.update(exp, step, critic)`` as rank ``rank`` of ``world``: every rank returns the
        same stats."""

    def old_logprobs(self, learner: Learner, exp: Experience, version: int, rank: int, world: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, their log-probs under the current weights) of this rank's share of the rows to
        recompute (``batch.old_logprob_targets``)."""

    def model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state dict (CPU) on rank 0 (may be a collective)."""

    def optim_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
        """The whole optimizer state in the single learner's format, on rank 0 (may be a collective)."""

    def load_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer, weights: dict, optim: dict) -> None:
        """Every rank loads a whole model state dict and a single learner's optimizer state."""


# ====================================================================== the rank (a Ray actor)

class LearnerRank:
    """One rank: a Learner (a replica or a shard, as ``strategy`` builds it) in a process group.
    Plain class; the group spawns it with Ray. Its Learner is built in :meth:`join`, inside the
    process group (sharding and the start-up broadcast need it)."""

    def __init__(self, spec: LearnerSpec, rank: int, world: int, threads: int, strategy: UpdateStrategy):
        torch.set_num_threads(threads)
        self.spec, self.rank, self.world, self.strategy = spec, rank, world, strategy
        self.learner: Learner  # (built in join)
        self.weight_sender: WeightSender | None = None

    def address(self) -> tuple[str, int]:
        """(this node's IP, a free port) for the process group's rendezvous (rank 0)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def join(self, host: str, port: int, backend: str, timeout_s: float) -> None:
        import torch.distributed as dist

        want = self.spec.actor.device
        dev = torch.device(want if want != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=timeout_s))
        self.learner = self.strategy.build(self.spec, self.world, dev.type)

    def update(self, exp: Experience, step: int, critic: bool) -> dict[str, float]:
        """The strategy's update stats, with ``_t0`` / ``_t1``: when this rank trained
        (``time.perf_counter``, CLOCK_MONOTONIC: the controller's clock on the same node) for the trace."""
        t0 = time.perf_counter()
        stats = self.strategy.update(self.learner, _to(exp, self.learner.device), step, self.rank, self.world, critic)
        return {**stats, "_t0": t0, "_t1": time.perf_counter()}

    def old_logprobs(self, exp: Experience, version: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows, new = self.strategy.old_logprobs(self.learner, _to(exp, self.learner.device), version, self.rank,
                                               self.world)
        return rows.cpu(), new.cpu()

    def actor_state(self) -> dict[str, torch.Tensor]:
        return self.strategy.model_state(self.learner.actor)

    def critic_state(self) -> dict[str, torch.Tensor]:
        assert self.learner.critic is not None  # (asked only of a group with a critic)
        return self.strategy.model_state(self.learner.critic)

    def actor_weights(self) -> Packed | None:
        """What an update changed of the actor, for a weight sync (``weights.sync.pack``'s format: no
        tensor pickling; the trained parameters only: with LoRA, the adapters), on rank 0; None
        elsewhere."""
        actor = self.learner.actor
        names = {n for n, p in actor.named_parameters() if p.requires_grad}
        state = self.strategy.model_state(actor)
        return pack_state({k: v for k, v in state.items() if k in names}) if self.rank == 0 else None

    def critic_weights(self) -> Packed | None:
        assert self.learner.critic is not None  # (asked only of a group with a critic: critic_scorer)
        state = self.strategy.model_state(self.learner.critic)
        return pack_state(state) if self.rank == 0 else None

    def open_weight_sync(self, host: str, port: int, world: int, bucket_bytes: int, wire_dtype, timeout_s: float
                         ) -> str:
        """Join the collective weight sync (``weights.sync.SyncGroup`` at the store ``host:port``) as
        its sender (rank 0; ``wire_dtype``: the serving side's dtype, one or per name); a sharded
        group's other ranks only take part in the gathers of each sync. Returns "" or why the group
        could not form (the caller may fall back to the object store); a refused manifest raises."""
        self.weight_sender, self._wire_dtype = None, wire_dtype
        if self.rank != 0:
            return ""
        try:
            group = SyncGroup(host, port, 0, world, self.learner.device, timeout_s=timeout_s)
            manifest = Manifest.of(trained_parameters(self.learner.actor), wire_dtype)
            self.weight_sender = WeightSender.connect(group, manifest, bucket_bytes)
        except WeightSyncError:
            raise
        except Exception as e:  # noqa: BLE001 (any reason the group cannot form: reported, not raised)
            return f"{type(e).__name__}: {e}"
        return ""

    @torch.no_grad()
    def send_weights(self, version: int) -> None:
        """One collective sync of the trained actor parameters as ``version`` (``open_weight_sync``
        first): rank 0 streams them in buckets; a sharded learner's ranks all-gather one parameter at
        a time (``weights.sync.full_tensors``), so no rank holds the whole model."""
        import torch.distributed as dist

        named = trained_parameters(self.learner.actor)
        refused = None
        if self.weight_sender is not None:
            try:
                self.weight_sender.header(version, Manifest.of(named, self._wire_dtype))
            except WeightSyncError as e:
                refused = e
        if self.strategy.sharded and self.world > 1:  # no rank may wait in a gather rank 0 skips
            flag = torch.tensor([float(refused is not None)], device=self.learner.device)
            dist.broadcast(flag, src=0)
            if flag.item() and refused is None:
                raise WeightSyncError("learner rank 0's weight sync was refused (its error names why)")
        if refused is not None:
            raise refused
        tensors = full_tensors(named)
        if self.weight_sender is None:
            for gathered in tensors:  # the gathers rank 0 needs
                del gathered  # (not held while the next one is gathered)
            return
        self.weight_sender.stream(tensors)

    def state_dict(self) -> dict:
        """Rank 0: the single learner's format (:func:`learner_state`); {} elsewhere (may be a collective)."""
        lr, st = self.learner, self.strategy
        state = {"actor": st.model_state(lr.actor), "actor_opt": st.optim_state(lr.actor, lr.actor_opt)}
        if lr.critic is not None:
            assert lr.critic_opt is not None  # (built with the critic)
            state.update(critic=st.model_state(lr.critic), critic_opt=st.optim_state(lr.critic, lr.critic_opt))
        return state if self.rank == 0 else {}

    def load_state_dict(self, state: dict) -> None:
        lr = self.learner
        if (lr.critic is None) != ("critic" not in state):
            raise ValueError("a learner state with a critic loads only into a learner with one (and without into "
                             "without)")
        self.strategy.load_state(lr.actor, lr.actor_opt, state["actor"], state["actor_opt"])
        if lr.critic is not None:
            assert lr.critic_opt is not None  # (built with the critic)
            self.strategy.load_state(lr.critic, lr.critic_opt, state["critic"], state["critic_opt"])

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds of the trained state (local shards)."""
        return local_bytes(self.learner)

    def _models(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        lr = self.learner
        out: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {"actor": (lr.actor, lr.actor_opt)}
        if lr.critic is not None:
            assert lr.critic_opt is not None  # (built with the critic)
            out["critic"] = (lr.critic, lr.critic_opt)
        return out

    def save_sharded(self, path: str) -> None:
        """Write this rank's shards (``sharded.save_sharded``; a collective)."""
        from .sharded import save_sharded

        save_sharded(path, self._models())

    def load_sharded(self, path: str) -> None:
        """Load this rank's shards of a sharded checkpoint written by any number of ranks."""
        from .sharded import load_sharded

        load_sharded(path, self._models())

    def close(self) -> None:
        """Release the weight-sync group this rank opened, then the learners' default group, in that
        order (not left to the interpreter's exit)."""
        import torch.distributed as dist

        if self.weight_sender is not None:
            self.weight_sender.group.close()
            self.weight_sender = None
        if dist.is_initialized():
            dist.destroy_process_group()


def local_bytes(learner: Learner) -> dict[str, int]:
    """Bytes this rank holds of the trained state: parameters, gradients, optimizer state (local
    shards of DTensors)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    out = {"params": 0, "grads": 0, "optim": 0}
    for model, opt in ((learner.actor, learner.actor_opt), (learner.critic, learner.critic_opt)):
        if model is None:
            continue
        assert opt is not None  # (built with its model)
        for p in model.parameters():
            out["params"] += local(p).numel() * p.element_size()
            if p.grad is not None:
                out["grads"] += local(p.grad).numel() * p.grad.element_size()
        for st in opt.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    out["optim"] += local(v).numel() * v.element_size()
    return out


# ====================================================================== the controller's handle

class LearnerGroup:
    """M learner ranks on Ray behind the :class:`~oppo.api.protocols.LearnerEngine` Protocol:
    ``update`` = ``Learner.update`` on the same batch, split by ``strategy`` (module docstring).

    ``tracer``: where each rank's training span goes (trace row ``learner<rank>``; on another node its
    clock differs). ``critic_scorer``: a ``scoring.ray.RayScorerWorker`` scoring with the critic
    trained here: rank 0's critic weights go to it once at start and at each :meth:`push_critic`.
    ``home``: the controller's (policy, critic) modules, which checkpoints save and restore. Each rank
    gets ``num_cpus`` CPUs and ``num_gpus`` GPUs; ``placement``: Ray placement-group strategy (PACK:
    as few nodes as possible; SPREAD / STRICT_SPREAD: across nodes). Call :func:`.cluster.init_ray`
    first.
    """

    def __init__(self, spec: LearnerSpec, world_size: int, strategy: UpdateStrategy, *, num_cpus: float = 1,
                 num_gpus: float = 0, threads: int = 1, backend: str | None = None, placement: str = "PACK",
                 critic_scorer=None, timeout_s: float = 600.0, tracer=None,
                 home: tuple[torch.nn.Module, torch.nn.Module | None] | None = None):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if critic_scorer is not None and spec.critic is None:
            raise ValueError("critic_scorer given but the learner has no critic (a critic-free algorithm)")
        self.world, self.strategy, self.critic_scorer, self.tracer, self.home = (world_size, strategy, critic_scorer,
                                                                                 tracer, home)
        self._draw = _Draw(Draw.of(spec.ppo, spec.seed), OldLogprobSettings.of(spec.ppo), spec.recompute_old)
        self.group = ActorGroup(LearnerRank, world_size, lambda r: (spec, r, world_size, threads, strategy),
                                role="learner actor", num_cpus=num_cpus, num_gpus=num_gpus, placement=placement,
                                timeout_s=timeout_s, stop_on_failure=True)
        host, port = self.group.call("address", ranks=[0])[0]
        self.group.call("join", host, port, backend or ("nccl" if num_gpus else "gloo"), timeout_s)
        if critic_scorer is not None:
            critic_scorer.set_critic_weights(self._read("critic_weights"))

    @property
    def ranks(self) -> list[Any]:
        """The ranks' Ray actor handles."""
        return self.group.actors

    def update(self, exp: Experience, step: int, critic: bool = True) -> dict[str, float]:
        """Stage 6 on the group; returns the learner's stats (the weight sync is the trainer's:
        ``weights.steps.WeightSync``)."""
        import ray

        ref = ray.put(portable(exp))  # once, read by every rank
        per_rank = self.group.call("update", ref, step, critic)
        for r, st in enumerate(per_rank):  # each rank's busy span joins the trace as row learner<r>
            t0, t1 = st.pop("_t0"), st.pop("_t1")
            if self.tracer is not None:
                self.tracer.add(f"learner{r}", "train", step, t0, t1)
        return per_rank[0]

    def push_critic(self, version: int) -> None:
        """Rank 0's critic to the scorer actor that scores with it (applied before any later call to
        it), from rank to scorer through the object store; nothing without one."""
        if self.critic_scorer is not None:
            self.critic_scorer.set_critic_weights(self._read("critic_weights"), version)

    def minibatches(self, B: int, step: int, lengths: torch.Tensor | list[int] | None = None) -> list[list[int]]:
        """The rows of each minibatch, as every rank draws them (``Learner.minibatches``: seeded by
        the step only); for a critic trained elsewhere on the same minibatches."""
        return draw_rows(self._draw.minibatches, B, step, lengths)

    def weights_out(self) -> RemoteWeights:
        """A ref to rank 0's trained actor parameters (``weights.sync.pack``'s arrays) in Ray's object
        store, for the rollout side to load directly."""
        return RemoteWeights(self._read("actor_weights"))

    def open_weight_link(self, host: str, port: int, world: int, bucket_bytes: int, wire_dtype,
                         timeout_s: float) -> Wait:
        """Join the collective weight sync as its sender (``api.protocols.WeightLinkSender``): rank 0
        sends; a sharded group's every rank gathers."""
        ranks = self._link_ranks()
        refs = self.group.submit("open_weight_sync", host, port, world, bucket_bytes, wire_dtype, timeout_s,
                                 ranks=ranks)
        return lambda: [f"learner rank {r}: {w}" if w else "" for r, w in zip(ranks, self.group.gather(refs, ranks))]

    def send_weights(self, version: int) -> Wait:
        ranks = self._link_ranks()
        refs = self.group.submit("send_weights", version, ranks=ranks)
        return lambda: self.group.gather(refs, ranks)

    def _link_ranks(self) -> list[int]:
        return list(range(self.world)) if self.strategy.sharded else [0]

    def old_logprobs(self, exp: Experience, version: int) -> Experience:
        """``Learner.old_logprobs``: rank 0 recomputes the rows (replicas), or each rank its share
        (shards); merged here."""
        import ray

        ranks = list(range(self.world)) if self.strategy.sharded else [0]
        ref = ray.put(portable(exp))
        shares = self.group.call("old_logprobs", ref, version, ranks=ranks)
        rows = torch.cat([s[0] for s in shares]).to(exp.mask.device)
        new = torch.cat([s[1] for s in shares]).to(exp.mask.device)
        redo, off = old_logprob_targets(exp, version, self._draw.recompute_old)
        return set_old_logprobs(exp, rows, new, redo, off, self._draw.old)

    def nodes(self) -> list[str]:
        """The Ray node id each rank runs on."""
        return self.group.call("node_id")

    def actor_state(self) -> dict[str, torch.Tensor]:
        return self._get("actor_state")

    def critic_state(self) -> dict[str, torch.Tensor]:
        return self._get("critic_state")

    def state_dict(self) -> dict:
        """Rank 0's ``{"actor", "critic", "actor_opt", "critic_opt"}``: the single learner's format."""
        return self._get("state_dict")

    def memory(self) -> list[dict[str, int]]:
        """Each rank's bytes of parameters, gradients and optimizer state."""
        return self.group.call("memory")

    def checkpoint_state(self):
        """Replicas: the optimizer states (``Learner.checkpoint_state``'s format), rank 0's trained
        weights brought into the ``home`` modules, which the checkpoint saves. Shards: a writer of
        every rank's shards (``sharded.ShardedLearnerState``), the whole weights gathered into the
        ``home`` modules for the Hugging Face export."""
        assert self.home is not None, "a learner group without home modules cannot checkpoint (home=...)"
        policy, critic = self.home
        if self.strategy.sharded:
            from .sharded import ShardedLearnerState

            policy.load_state_dict(self.actor_state())
            if critic is not None:
                critic.load_state_dict(self.critic_state())
            return ShardedLearnerState(lambda path: self.group.call("save_sharded", path))
        st = self.state_dict()
        policy.load_state_dict(st["actor"])
        out = {"actor": st["actor_opt"]}
        if critic is not None:
            critic.load_state_dict(st["critic"])
            out["critic"] = st["critic_opt"]
        return out

    def load_checkpoint_state(self, optim: dict) -> None:
        """A sharded checkpoint (``{"sharded": path}``, from any number of ranks) into shards: each rank
        reads its own. Anything else: every rank loads the ``home`` modules' weights (a checkpoint's,
        loaded there first) and ``optim`` (a sharded one read whole first: ``sharded.dense_optim_state``)."""
        if self.strategy.sharded and "sharded" in optim:
            self.group.call("load_sharded", optim["sharded"])
            self.push_critic(-1)
            return
        from .sharded import dense_optim_state

        assert self.home is not None, "a learner group without home modules cannot checkpoint (home=...)"
        policy, critic = self.home
        optim = dense_optim_state(optim, policy, critic)
        st = {"actor": policy.state_dict(), "actor_opt": optim["actor"]}
        if critic is not None:
            st.update(critic=critic.state_dict(), critic_opt=optim["critic"])
        self.load_state_dict(st)

    def load_state_dict(self, state: dict) -> None:
        """Every rank loads ``state`` (from this group, a group of another size, or a single learner)."""
        import ray

        self.group.call("load_state_dict", ray.put(state))
        self.push_critic(-1)

    def close(self) -> None:
        self.group.shutdown("close", timeout_s=10)

    # ------------------------------------------------------------------ plumbing

    def _read(self, method: str):
        """A Ray ref to rank 0's answer to ``method()``; a sharded group's other ranks take part in
        the gathers (waited for here)."""
        refs = self.group.submit(method, ranks=list(range(self.world)) if self.strategy.sharded else [0])
        if len(refs) > 1:
            self.group.gather(refs[1:], list(range(1, len(refs))))
        return refs[0]

    def _get(self, method: str):
        """Rank 0's answer to ``method()``, waited for (failures name the rank)."""
        return self.group.gather([self._read(method)], [0])[0]


@dataclass(frozen=True)
class _Draw:
    """What the controller needs of the ranks' settings: ``Learner.minibatches``'s
    (``local.draw_minibatches``), what ``set_old_logprobs`` reads, and whether on-policy old
    log-probs are recomputed."""

    minibatches: Draw
    old: OldLogprobSettings
    recompute_old: bool
