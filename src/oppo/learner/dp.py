"""The learner as a data-parallel group of Ray actors, and the weight sync to the rollout side.

Each of the M ranks (:class:`LearnerRank`, one Ray actor each, gang-scheduled in a placement
group) holds a replica of actor and critic with their AdamW: a plain :class:`oppo.learner.local.Learner`
built from the same :class:`~.specs.ModelSpec` paths. They join one ``torch.distributed`` process
group (gloo on CPU, NCCL on GPU) at the address of rank 0, and rank 0's weights are broadcast at
start, so the replicas are identical even where loading is not (a freshly initialised head).

The update (:func:`dp_update`) is the single learner's, split by rows:

- every rank draws the same minibatches (``Learner.minibatches`` is seeded by the step only);
- the learner's own loop (``learner._train``) runs on every rank over every minibatch, with the
  minibatch's *global* token and sequence counts as the loss denominators; each rank computes
  only its share of the minibatch's micro-batches (micro-batch j goes to rank ``batch.rank_of(j, M)``: j mod M, reversed every other round) and passes
  over the others;
- after a minibatch's last micro-batch the gradients are summed over the ranks (one all-reduce
  of one flat buffer). Each micro-batch's loss is already divided by the global counts, so the
  sum is the single learner's gradient (up to summation order); clipping (on that gradient) and
  the AdamW step are then the same on every rank, and the replicas stay identical;
- the statistics are summed over ranks the same way (losses and per-token means are already
  weighted by the global counts); the gradient norm is every rank's (the same).

A rank gets work only if a minibatch has at least M micro-batches: choose
``ppo.micro_batch_size <= ppo.minibatch_size / M`` (as DeepSpeed's global batch = micro x
accumulation x ranks); otherwise the update is still exact, but ranks idle.

We sum gradients by hand rather than wrap the models in DDP: the learner runs the backbone and
the head separately (``models.backbone_and_head``), which bypasses a DDP wrapper's forward, and
the SUM over ranks of globally normalised losses is exactly what the single learner computes
(DDP averages, which would need the loss rescaled by M).

Checkpoints: :meth:`DPLearnerGroup.state_dict` is rank 0's state in the single learner's format
(``{"actor", "critic"}`` model state dicts, ``{"actor_opt", "critic_opt"}`` AdamW state dicts, as
``checkpoint.py`` saves from ``Learner``), so a checkpoint resumes on any number of ranks.

Weight sync: after each update, rank 0's actor weights go to the rollout model (timed:
``time/weight_sync``): through the object store (:meth:`DPLearnerGroup.sync_actor`,
``actor_weights``), or streamed in buckets over a process group of its own
(:meth:`LearnerRank.send_weights`, ``weight_sync.CollectiveSync``: ``placement.weight_sync``). If the
critic trains here, its weights go to the Ray scorer actor that scores with it, rank 0 to scorer
through the object store, without passing through the controller.

Faults: a rank that raises or dies is named (``learner actor (role=learner, rank=1) died: ...``)
and the whole group is stopped: the other ranks would otherwise wait in a collective.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch

from ..config import PPOConfig
from .batch import CriticBatch, Experience, padding_stats, rank_of
from .local import Learner, _train, critic_micro_step, draw_minibatches
from .offpolicy import MismatchProbe
from ..cluster import one_line
from ..api.specs import ModelSpec
from ..weights.sync import Manifest, Packed, SyncGroup, WeightSender, WeightSyncError, full_tensors, pack, \
    trained_parameters, unpack_into


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


def learner_spec(cfg, paths, pad_id: int, compute_dtype: torch.dtype, algorithm, recompute_old: bool,
                 critic: bool = True, device: str = "auto") -> LearnerSpec:
    """The learner the trainer builds (``setup.roles.build_roles``), as a spec for the ranks: the policy in
    its master dtype (the compute dtype under LoRA: only the fp32 adapters train), the critic in
    its master dtype (``critic`` False: none here, e.g. it trains on its scorer actor, or a
    critic-free algorithm), LoRA and gradient checkpointing as configured. ``cfg``: the Config."""
    from ..weights.precision import master_dtype

    master = master_dtype(compute_dtype)
    lora = cfg.lora
    return LearnerSpec(
        actor=ModelSpec("policy", paths.policy, compute_dtype if lora.r else master, device,
                        trust_remote_code=cfg.policy.trust_remote_code),
        critic=ModelSpec("critic", paths.critic, master, device, pad_id) if critic and paths.critic else None,
        ppo=cfg.ppo, temperature=cfg.generation.temperature, seed=cfg.run.seed, compute_dtype=compute_dtype,
        recompute_old=recompute_old, algorithm=algorithm,
        lora=(lora.r, lora.alpha, lora.dropout, list(lora.target_modules)) if lora.r else None,
        gradient_checkpointing=cfg.policy.gradient_checkpointing)


# ====================================================================== the math on one rank

def dp_update(learner: Learner, exp: Experience, step: int, rank: int, world: int, critic: bool = True
              ) -> dict[str, float]:
    """``learner.update(exp, step, critic)`` as rank ``rank`` of ``world`` in the default process
    group (module docstring). Every rank gets the whole batch and returns the same stats."""
    cfg = learner.cfg
    mbs = [mb.to(exp.mask.device) for mb in learner.minibatches(exp.mask.shape[0], step, exp.valid.sum(1))]
    probe = MismatchProbe(learner.actor_opt, step)  # each rank sees its share of the first minibatch
    actor_steps = _Shard(mbs, rank, world, learner.actor,
                         lambda rows, nt, ns: learner._actor_micro_step(exp, rows, nt, ns, probe))
    agree = any_rank(world, learner.device)
    stats = _train(learner.actor, learner.actor_opt, exp, mbs, cfg, "actor", actor_steps, step, agree,
                   compute_dtype=learner.compute_dtype)
    actor_steps.check_done()
    if critic and learner.critic is not None:
        batch = CriticBatch.of(exp)
        critic_steps = _Shard(mbs, rank, world, learner.critic,
                              lambda rows, nt, ns: critic_micro_step(learner.critic, batch, rows, nt, ns, cfg,
                                                                      learner.compute_dtype))
        stats.update(_train(learner.critic, learner.critic_opt, batch, mbs, cfg, "critic", critic_steps, step,
                            agree, compute_dtype=learner.compute_dtype))
        critic_steps.check_done()
    return {**merge_rank_stats(stats, world, probe), **padding_stats(exp, mbs, cfg, learner.row_plan())}


def merge_rank_stats(stats: dict[str, float], world: int, probe: MismatchProbe) -> dict[str, float]:
    """One rank's share of the update's stats -> the update's (every rank gets the same): losses and
    per-token means are already weighted by the global counts, so they add up over the ranks; the
    gradient norm is computed on the summed gradient, the same on every rank; the mismatch probes'
    partial sums are merged; the guard's counts (``guard/*``) are every rank's (the same). A collective."""
    import torch.distributed as dist

    if world == 1:
        return {**stats, **MismatchProbe.stats(probe.partial())}
    gathered: list[tuple[dict[str, float], list[float]]] = [({}, []) for _ in range(world)]
    dist.all_gather_object(gathered, (stats, probe.partial()))
    out = {}
    for k in sorted(set().union(*(g for g, _ in gathered))):
        same = k.startswith(("grad_norm/", "guard/"))
        out[k] = gathered[0][0][k] if same else sum(g.get(k, 0.0) for g, _ in gathered)
    out.update(MismatchProbe.stats(MismatchProbe.merge([p for _, p in gathered])))
    return out


class _Shard:
    """The micro-step ``learner._train`` calls, for one rank: computes its share of each minibatch's
    micro-batches, passes over the others, and all-reduces the gradients after each minibatch's
    last micro-batch (before ``_train`` clips and steps)."""

    def __init__(self, minibatches: list[torch.Tensor], rank: int, world: int, model: torch.nn.Module,
                 micro_step: Callable):
        self.mbs, self.rank, self.world, self.model, self.micro_step = minibatches, rank, world, model, micro_step
        self.i = self.pos = self.j = 0  # minibatch, rows of it seen, micro-batches of it seen

    def __call__(self, rows: torch.Tensor, num_tokens: torch.Tensor, num_seqs: int) -> dict[str, float]:
        mb = self.mbs[self.i]
        if not torch.equal(rows, mb[self.pos: self.pos + len(rows)]):
            raise RuntimeError("internal error: the learner's loop no longer visits each minibatch's rows in order; "
                               "dp_update must follow it")
        stats = self.micro_step(rows, num_tokens, num_seqs) if rank_of(self.j, self.world) == self.rank else {"_frac": 0.0}
        self.pos += len(rows)
        self.j += 1
        if self.pos == len(mb):
            if self.world > 1:
                all_reduce_grads(self.model)
            self.i, self.pos, self.j = self.i + 1, 0, 0
        return stats

    def check_done(self) -> None:
        if self.i != len(self.mbs):
            raise RuntimeError("internal error: the learner's loop skipped minibatches; dp_update must follow it")


def any_rank(world: int, device: torch.device) -> Callable[[bool], bool] | None:
    """The guard's ``agree`` for ``learner._train`` on ``world`` ranks (None for one): a flag true on
    any rank (one all-reduce of one number per optimizer step, a collective), so a loss that is not
    finite on one rank stops or skips the step on every rank and the replicas/shards stay alike."""
    if world == 1:
        return None
    import torch.distributed as dist

    def agree(flag: bool) -> bool:
        t = torch.tensor([float(flag)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())  # CPU-GPU sync point (beside the gradient norm's, once per optimizer step)

    return agree


def all_reduce_grads(model: torch.nn.Module) -> None:
    """Sum the gradients of ``model`` over the ranks, in one flat buffer. A parameter without a
    gradient on every rank keeps none (so AdamW skips it, as the single learner's would)."""
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    ref = next((p.grad for p in params if p.grad is not None), params[0])
    has = torch.tensor([float(p.grad is not None) for p in params], dtype=ref.dtype, device=ref.device)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p, dtype=ref.dtype)).reshape(-1)
                      for p in params] + [has])
    dist.all_reduce(flat)  # SUM
    off = 0
    for p, n in zip(params, flat[-len(params):].tolist()):
        k = p.numel()
        p.grad = flat[off: off + k].view_as(p) if n > 0 else None
        off += k


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
    state = {"actor": _cpu_state(learner.actor), "actor_opt": _cpu_state(learner.actor_opt)}
    if learner.critic is not None:  # critic-free algorithms have none
        state.update(critic=_cpu_state(learner.critic), critic_opt=_cpu_state(learner.critic_opt))
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


def _cpu_state(module_or_opt) -> dict:
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


# ====================================================================== the rank (a Ray actor)

class LearnerRank:
    """One rank: a Learner replica in a process group. Plain class; the group wraps it with
    ``ray.remote``."""

    def __init__(self, spec: LearnerSpec, rank: int, world: int, threads: int = 1):
        torch.set_num_threads(threads)
        self.rank, self.world = rank, world
        self.learner = spec.build()

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

        dev = self.learner.device
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=timeout_s))
        with torch.no_grad():  # identical replicas, whatever loading gave (a fresh head, LoRA adapters)
            for model in (self.learner.actor, self.learner.critic):
                if model is None:
                    continue
                for t in list(model.parameters()) + list(model.buffers()):
                    dist.broadcast(t.data, src=0)

    def update(self, exp: Experience, step: int, critic: bool) -> dict[str, float]:
        """``dp_update``'s stats, with ``_t0`` / ``_t1``: when this rank trained (``time.perf_counter``,
        CLOCK_MONOTONIC: the controller's clock on the same node) for the merged trace."""
        t0 = time.perf_counter()
        stats = dp_update(self.learner, _to(exp, self.learner.device), step, self.rank, self.world, critic)
        return {**stats, "_t0": t0, "_t1": time.perf_counter()}

    def old_logprobs(self, exp: Experience, version: int):
        exp = self.learner.old_logprobs(_to(exp, self.learner.device), version)
        return exp.old_logprobs.cpu(), exp.is_weights.cpu(), exp.stats

    def actor_state(self) -> dict[str, torch.Tensor]:
        return _cpu_state(self.learner.actor)

    def critic_state(self) -> dict[str, torch.Tensor]:
        return _cpu_state(self.learner.critic)

    def actor_weights(self) -> Packed | None:
        """What an update changed of the actor, for a weight sync (``weight_sync.pack``: no tensor
        pickling; the trained parameters only: with LoRA, the adapters). (None: a sharded rank but
        rank 0, ``fsdp.FSDPLearnerRank``.)"""
        return pack(self.learner.actor, trainable_only=True)

    def critic_weights(self) -> Packed | None:
        assert self.learner.critic is not None  # (asked only of a group with a critic: critic_scorer)
        return pack(self.learner.critic)

    def open_weight_sync(self, host: str, port: int, world: int, bucket_bytes: int, wire_dtype, timeout_s: float,
                         every_rank_gathers: bool) -> str:
        """Join the collective weight sync (``weight_sync.SyncGroup`` at the store ``host:port``) as
        its sender (rank 0; ``wire_dtype``: the serving side's dtype, one or per name). With
        ``every_rank_gathers`` (a sharded learner) every rank is called, and the others only take
        part in the gathers of each sync. Returns "" or why the group could not form (the caller may
        fall back to the object store); a refused manifest raises."""
        self.weight_sender, self._wire_dtype, self._every_rank_gathers = None, wire_dtype, every_rank_gathers
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
        a time (``weight_sync.full_tensors``), so no rank holds the whole model."""
        import torch.distributed as dist

        named = trained_parameters(self.learner.actor)
        refused = None
        if self.weight_sender is not None:
            try:
                self.weight_sender.header(version, Manifest.of(named, self._wire_dtype))
            except WeightSyncError as e:
                refused = e
        if self._every_rank_gathers and self.world > 1:  # no rank may wait in a gather rank 0 skips
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
        return learner_state(self.learner)

    def load_state_dict(self, state: dict) -> None:
        load_learner_state(self.learner, state)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# ====================================================================== the controller's handle

class DPLearnerGroup:
    """M learner ranks on Ray; ``update`` = ``Learner.update`` on the same batch (module docstring).

    ``rank_class``: what each rank runs (:class:`LearnerRank`: a replica; ``fsdp.FSDPLearnerRank``:
    a shard, whose reads of the weights are collectives: :meth:`_rank0_ref` calls every rank).

    ``tracer``: where each rank's training span goes (worker ``learner<rank>``; on another node
    its clock differs). ``rollout``: the model the rollout engine samples with (a local module): rank 0's actor
    weights are copied into it after each update (``time/weight_sync``). ``critic_scorer``: a
    :class:`~.ray_scorer.RayScorerWorker` scoring with the critic trained here: rank 0's critic
    weights are sent to it after each update (and once at start). Each rank gets ``num_cpus``
    CPUs and ``num_gpus`` GPUs; ``strategy``: Ray placement-group strategy (PACK: as few nodes as
    possible; SPREAD / STRICT_SPREAD: across nodes). Call :func:`.cluster.init_ray` first.
    """

    rank_class = LearnerRank

    def __init__(self, spec: LearnerSpec, world_size: int, *, num_cpus: float = 1, num_gpus: float = 0,
                 threads: int = 1, backend: str | None = None, strategy: str = "PACK",
                 rollout: torch.nn.Module | None = None, critic_scorer=None, timeout_s: float = 600.0,
                 tracer=None, home: tuple[torch.nn.Module, torch.nn.Module | None] | None = None,
                 defer_sync: bool = False):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if critic_scorer is not None and spec.critic is None:
            raise ValueError("critic_scorer given but the learner has no critic (a critic-free algorithm)")
        self.world, self.rollout, self.critic_scorer, self.tracer = world_size, rollout, critic_scorer, tracer
        self.home, self.defer_sync = home, defer_sync  # (checkpoints; the caller syncs: see update)
        self._draw = _Draw(spec.ppo, spec.seed)
        bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
        self.pg = placement_group([bundle] * world_size, strategy=strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            raise RuntimeError(f"the Ray cluster cannot place {world_size} learner ranks of {bundle} "
                               f"({strategy}) within {timeout_s:.0f} s; it has {ray.cluster_resources()}")
        cls = ray.remote(self.rank_class)
        # Ray actor handles; Any: Ray types an actor's methods as plain functions (no ``.remote``) unless
        # each is decorated with ray.method
        self.ranks: list[Any] = [cls.options(num_cpus=num_cpus, num_gpus=num_gpus, scheduling_strategy=
                                             PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r)
                                             ).remote(spec, r, world_size, threads) for r in range(world_size)]
        host, port = self._gather([self.ranks[0].address.remote()], ranks=[0])[0]
        backend = backend or ("nccl" if num_gpus else "gloo")
        self._gather([r.join.remote(host, port, backend, timeout_s) for r in self.ranks])
        if critic_scorer is not None:
            critic_scorer.set_critic_weights(self._rank0_ref(lambda r: r.critic_weights.remote()))

    def update(self, exp: Experience, step: int, critic: bool = True, sync: bool | None = None) -> dict[str, float]:
        """Stage 6 on the group, then (``sync``; default: unless built with ``defer_sync``) the
        weight sync; returns the learner's stats plus ``time/weight_sync`` (seconds: rank 0's actor
        weights into ``rollout``). The trainer defers it: its weight sync (``weights.plan.WeightSync``)
        calls :meth:`sync` after the update, between two decode steps with in-flight updates."""
        import ray

        sync = not self.defer_sync if sync is None else sync

        ref = ray.put(portable(exp))  # once, read by every rank
        per_rank = self._gather([r.update.remote(ref, step, critic) for r in self.ranks])
        for r, st in enumerate(per_rank):  # each rank's busy span joins the trace as worker learner<r>
            t0, t1 = st.pop("_t0"), st.pop("_t1")
            if self.tracer is not None:
                self.tracer.add(f"learner{r}", "train", step, t0, t1)
        stats = per_rank[0]
        if sync:
            stats.update(self.sync(step, critic))
        return stats

    def sync(self, step: int, critic: bool = True) -> dict[str, float]:
        """The weight sync after an update: rank 0's critic to the scorer actor (applied before any
        later call to it), its actor into ``rollout``; returns ``time/weight_sync``."""
        if self.critic_scorer is not None and critic:
            self.critic_scorer.set_critic_weights(self._rank0_ref(lambda r: r.critic_weights.remote()), step)  # rank 0 -> scorer
        if self.rollout is None:
            return {}
        return {"time/weight_sync": self.sync_actor(self.rollout)}

    def minibatches(self, B: int, step: int, lengths: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The rows of each minibatch, as every rank draws them (``Learner.minibatches``: seeded by
        the step only); for a critic trained elsewhere on the same minibatches."""
        return draw_minibatches(self._draw.cfg, self._draw.seed, B, step, lengths)  # the learner's own draw

    def actor_weights(self):
        """A Ray ref to rank 0's actor weights (``weight_sync.pack``), for workers to load directly."""
        return self._rank0_ref(lambda r: r.actor_weights.remote())

    def weight_sync_ranks(self) -> list[int]:
        """The ranks a collective weight sync calls (``weight_sync.CollectiveSync``): rank 0 alone,
        the replicas' sender."""
        return [0]

    def sync_actor(self, target: torch.nn.Module) -> float:
        """Copy rank 0's actor weights into ``target`` (cast to its dtype); returns the seconds taken."""
        t = time.perf_counter()
        unpack_into(target, self._rank0(lambda r: r.actor_weights.remote()), partial=True)
        return time.perf_counter() - t

    def old_logprobs(self, exp: Experience, version: int) -> Experience:
        """``Learner.old_logprobs`` on rank 0 (its weights are pi_k): a new record with
        ``old_logprobs``, ``is_weights`` and ``stats``."""
        old, w, stats = self._gather([self.ranks[0].old_logprobs.remote(portable(exp), version)], ranks=[0])[0]
        return dataclasses.replace(exp, old_logprobs=old.to(exp.mask.device), is_weights=w.to(exp.mask.device),
                                   stats=stats)

    def nodes(self) -> list[str]:
        """The Ray node id each rank runs on."""
        return self._gather([r.node_id.remote() for r in self.ranks])

    def actor_state(self) -> dict[str, torch.Tensor]:
        return self._rank0(lambda r: r.actor_state.remote())

    def critic_state(self) -> dict[str, torch.Tensor]:
        return self._rank0(lambda r: r.critic_state.remote())

    def state_dict(self) -> dict:
        """Rank 0's ``{"actor", "critic", "actor_opt", "critic_opt"}``: the single learner's format."""
        return self._rank0(lambda r: r.state_dict.remote())

    def checkpoint_state(self) -> dict:
        """The optimizer states a checkpoint saves (``Learner.checkpoint_state``'s format); rank 0's
        trained weights are brought into the ``home`` modules, which the checkpoint saves."""
        st = self.state_dict()
        assert self.home is not None, "a learner group without home modules cannot checkpoint (home=...)"
        policy, critic = self.home
        policy.load_state_dict(st["actor"])
        out = {"actor": st["actor_opt"]}
        if critic is not None:
            critic.load_state_dict(st["critic"])
            out["critic"] = st["critic_opt"]
        return out

    def load_checkpoint_state(self, optim: dict) -> None:
        """Every rank loads the ``home`` modules' weights (a checkpoint's, loaded there first) and
        ``optim``. A checkpoint of any placement loads into any other (a sharded learner's is read
        whole here first: ``sharded_checkpoint.dense_optim_state``)."""
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

        ref = ray.put(state)
        self._gather([r.load_state_dict.remote(ref) for r in self.ranks])
        if self.critic_scorer is not None:
            self.critic_scorer.set_critic_weights(self._rank0_ref(lambda r: r.critic_weights.remote()))

    def close(self) -> None:
        import ray

        refs = [r.close.remote() for r in self.ranks]
        ray.wait(refs, num_returns=len(refs), timeout=10)
        self._kill()

    # ------------------------------------------------------------------ plumbing

    def _rank0_ref(self, call: Callable):
        """A Ray ref to rank 0's answer to ``call(rank_handle)`` (replicas: only rank 0 is asked)."""
        return call(self.ranks[0])

    def _rank0(self, call: Callable):
        """Rank 0's answer to ``call(rank_handle)``, waited for (failures name the rank)."""
        return self._gather([self._rank0_ref(call)], ranks=[0])[0]

    def _gather(self, refs: list, ranks: list[int] | None = None, grace_s: float = 5.0) -> list:
        """Results of one call per rank. On a failure or death, stop the whole group (the other
        ranks may be waiting in a collective) and raise naming each rank that failed or died; the
        dead ones first, as a rank whose peer died fails in its next collective as a consequence."""
        import ray

        ranks = list(range(len(refs))) if ranks is None else ranks
        which = {ref: r for ref, r in zip(refs, ranks)}
        out, left, dead, failed = {}, list(refs), [], []
        while left:
            done, left = ray.wait(left, num_returns=1)
            try:
                out[done[0]] = ray.get(done[0])
                continue
            except ray.exceptions.RayActorError as e:
                dead.append((which[done[0]], e))
            except ray.exceptions.RayTaskError as e:
                failed.append((which[done[0]], e))
            more, left = ray.wait(left, num_returns=len(left), timeout=grace_s) if left else ([], [])
            for ref in more:  # the others' outcomes, briefly: name every rank that failed
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    dead.append((which[ref], e))
                except ray.exceptions.RayTaskError as e:
                    failed.append((which[ref], e))
            self._kill()
            msgs = [f"learner actor (role=learner, rank={r}) died: {one_line(e)}" for r, e in sorted(dead, key=_rank)]
            msgs += [f"learner actor (role=learner, rank={r}) failed: {getattr(e, 'cause', None) or e!r}"
                     for r, e in sorted(failed, key=_rank)]
            first = (dead or failed)[0][1]
            raise RuntimeError("; ".join(msgs) + "; the learner group was stopped") from first
        return [out[r] for r in refs]

    def _kill(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r)
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)
            self.pg = None


def _rank(item: tuple[int, BaseException]) -> int:
    return item[0]


@dataclass(frozen=True)
class _Draw:
    """What ``Learner.minibatches`` reads of a learner (its settings, ``local.draw_minibatches``), for
    the controller's copy."""

    cfg: PPOConfig
    seed: int
