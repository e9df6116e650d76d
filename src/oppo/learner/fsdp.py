"""The learner sharded with FSDP2 (``fully_shard``): M Ray ranks, each holding 1/M of the actor's and
the critic's parameters, gradients and AdamW state.

Each rank runs :class:`oppo.learner.local.Learner`'s own code on modules wrapped by
:func:`shard_model`, so the loss, the minibatch loop, clipping and AdamW are the single learner's.
:func:`fsdp_update` splits micro-batches as the replicas do (``dp.py``), divides every loss by the
minibatch's global counts and SUMS gradients in the reduce-scatter, so the update equals one
learner's; since forward and backward are collectives, a rank with a short share runs zero-weight
micro-steps. LoRA, gradient checkpointing and bf16 mixed precision (:func:`mixed_precision`) are
covered in ``docs/distributed.md``, "The sharded learner (FSDP2)".
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch

from .batch import CriticBatch, Experience, old_logprob_targets, padding_stats, rank_of, row_lengths
from .local import Learner, train_minibatches, critic_micro_step
from .offpolicy import MismatchProbe
from .dp import any_rank, merge_rank_stats, resolve_token_budget
from .group import LearnerSpec

_ZERO_WEIGHT = float("inf")  # a micro-step's loss denominators for weight 0: every gradient is exactly 0


# ====================================================================== sharding a model

def mixed_precision(compute_dtype: torch.dtype):
    """FSDP2's mixed precision for a learner computing in ``compute_dtype``: bf16 all-gathers and
    compute over the fp32 shards (the masters, and AdamW's state), gradients reduce-scattered in
    fp32 (``docs/distributed.md``); None in fp32 (nothing to cast)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from ..weights.precision import LOW_PRECISION

    if compute_dtype not in LOW_PRECISION:
        return None
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def shard_model(model: torch.nn.Module, mesh=None, mp_policy=None) -> None:
    """Wrap ``model`` in place with FSDP2: each transformer layer (the model's ``_no_split_modules``),
    the output head (with the embedding it is tied to, if any), then the backbone (embedding and
    final norm). Gradients are SUMMED over the ranks (module docstring). A LoRA (peft) model is
    sharded whole, frozen base and adapters alike, each layer's in one group. ``mp_policy``:
    :func:`mixed_precision`'s, or None."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from ..models import backbone_and_head

    backbone, head = backbone_and_head(model)
    head = getattr(head, "lm_head", head)  # models.LogitsHead wraps the output projection
    get_base_model = getattr(model, "get_base_model", None)  # peft
    base = get_base_model() if get_base_model is not None else model
    layer_types = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in backbone.modules() if type(m).__name__ in layer_types]
    if not layers:
        raise ValueError(f"{type(base).__name__} names no transformer layer class (_no_split_modules); "
                         f"placement.learner=fsdp2 cannot shard it")
    mp = mp_policy or MixedPrecisionPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    shared = {id(p) for p in head.parameters()}
    tied = [m for m in backbone.modules() if any(id(p) in shared for p in m.parameters(recurse=False))]
    fully_shard([head, *tied] if tied else head, mesh=mesh, mp_policy=mp)
    fully_shard(backbone, mesh=mesh, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def _reshard(model: torch.nn.Module | None) -> None:
    """Free the all-gathered parameters a no-grad forward left unsharded (FSDP2 keeps a root's)."""
    from torch.distributed.fsdp import FSDPModule

    if model is None:
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def build_sharded(spec: LearnerSpec, mesh=None) -> Learner:
    """Rank r's Learner: the spec's models, rank 0's weights (broadcast: a freshly initialised head
    or adapter differs per process), sharded before the optimizers are built. Call inside the
    process group."""
    import torch.distributed as dist

    def prepare(model: torch.nn.Module) -> None:
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=0)
        shard_model(model, mesh, mixed_precision(spec.compute_dtype))

    return spec.build(prepare=prepare)


# ====================================================================== the math on one rank

def fsdp_update(learner: Learner, exp: Experience, step: int, rank: int, world: int, critic: bool = True
                ) -> dict[str, float]:
    """``learner.update(exp, step, critic)`` on rank ``rank`` of ``world`` sharded ranks (module
    docstring). Every rank gets the whole batch and returns the same stats."""
    mbs = learner.minibatches(exp.mask.shape[0], step, row_lengths(exp))  # (host rows)
    probe = MismatchProbe(learner.actor_opt, step)  # each rank sees its share of the first minibatch
    actor_steps = _Rounds(mbs, rank, world, lambda rows, nt, ns: learner._actor_micro_step(exp, rows, nt, ns, probe),
                          pad=lambda rows, nt, ns: learner._actor_micro_step(exp, rows, nt, ns))
    agree = any_rank(world, learner.device)
    stats = train_minibatches(learner.actor, learner.actor_opt, exp, mbs, learner.actor_update, "actor", actor_steps,
                              step, agree)
    actor_steps.check_done()
    if critic and learner.critic is not None:
        batch = CriticBatch.of(exp)
        critic_steps = _Rounds(mbs, rank, world, lambda rows, nt, ns: critic_micro_step(
            learner.critic, batch, rows, nt, ns, learner.critic_settings, learner.compute_dtype))
        stats.update(train_minibatches(learner.critic, learner.critic_opt, batch, mbs, learner.critic_settings.update,
                                       "critic", critic_steps, step, agree))
        critic_steps.check_done()
    return {**merge_rank_stats(stats, world, probe), **padding_stats(exp, mbs, learner.micro, learner.layout_rule())}


class _Rounds:
    """The micro-step ``learner.train_minibatches`` calls, for one sharded rank: computes micro-batches j with
    ``rank_of(j, M)`` == rank, passes over the others, and after a minibatch's last micro-batch runs
    zero-weight micro-steps until it has run ceil(micro-batches / M), as every rank has: the
    forwards and backwards are collectives, so no rank may run fewer. The reduce-scatters sum the
    shards' gradients as they go; ``train_minibatches`` then clips and steps (both collective-safe)."""

    def __init__(self, minibatches: "list[list[int]] | list[torch.Tensor]", rank: int, world: int, micro_step, pad=None):
        """``pad``: the micro-step for zero-weight steps, if it must differ (no statistics probe)."""
        self.mbs: list[list[int]] = [m if isinstance(m, list) else m.tolist() for m in minibatches]  # host rows, compared with the loop's
        self.rank, self.world, self.micro_step = rank, world, micro_step
        self.pad = pad or micro_step
        self.i = self.pos = self.j = self.ran = 0  # minibatch; its rows seen, micro-batches seen, run here
        self.first: list[int] | None = None  # the minibatch's first micro-batch (padding runs on it)

    def __call__(self, rows: list[int], num_tokens: torch.Tensor, num_seqs: int) -> dict:
        mb = self.mbs[self.i]
        if list(rows) != mb[self.pos: self.pos + len(rows)]:
            raise RuntimeError("internal error: the learner's loop no longer visits each minibatch's rows in order; "
                               "fsdp_update must follow it")
        if self.first is None:
            self.first = rows
        stats = {"_frac": 0.0}
        if rank_of(self.j, self.world) == self.rank:
            stats = self.micro_step(rows, num_tokens, num_seqs)
            self.ran += 1
        self.pos += len(rows)
        self.j += 1
        if self.pos == len(mb):
            for _ in range(math.ceil(self.j / self.world) - self.ran):
                self.pad(self.first, torch.tensor(_ZERO_WEIGHT), _ZERO_WEIGHT)  # stats: zeros, dropped
            self.i, self.pos, self.j, self.ran, self.first = self.i + 1, 0, 0, 0, None
        return stats

    def check_done(self) -> None:
        if self.i != len(self.mbs):
            raise RuntimeError("internal error: the learner's loop skipped minibatches; fsdp_update must follow it")


@torch.no_grad()
def fsdp_old_logprobs(learner: Learner, exp: Experience, version: int, rank: int, world: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of ``Learner.old_logprobs``: (rows, their recomputed log-probs [rows, T]),
    rows i of the ones to recompute with i mod M == rank; padded with discarded forwards to as many
    forwards as the largest share needs (every forward is a collective)."""
    redo, _ = old_logprob_targets(exp, version, learner.recompute_old)
    rows = redo.any(1).nonzero().squeeze(1)  # [n], the same on every rank
    mine = rows[rank::world]
    per = learner.micro.micro_batch_size
    new = learner.recompute_logprobs(exp, mine, budget=False)  # (a count every rank can predict)
    for _ in range(math.ceil(math.ceil(len(rows) / world) / per) - math.ceil(len(mine) / per)):
        learner.recompute_logprobs(exp, rows[:1], budget=False)
    _reshard(learner.actor)
    return mine, new


# ====================================================================== weights in and out

def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0 (CPU), {} elsewhere. A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast("dict[str, torch.Tensor]", state)  # (full_state_dict: whole tensors, no DTensors)


def _trainable_names(model: torch.nn.Module) -> list[str]:
    """The trained parameters' names, in the order the Learner's AdamW holds them."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def full_optim_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The whole AdamW state on rank 0 (CPU) in the single learner's format (``opt.state_dict()``:
    parameters by index), {} elsewhere. A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    st: dict[str, Any] = get_optimizer_state_dict(model, opt, options=options)  # (Any: its values' types vary)
    if not st:
        return {}
    index = {n: i for i, n in enumerate(_trainable_names(model))}
    return {"state": {index[n]: v for n, v in st["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in st["param_groups"]]}


def load_full_state(model: torch.nn.Module, opt: torch.optim.Optimizer, weights: dict, optim: dict) -> None:
    """Every rank loads its shards of a whole model state dict and a single learner's AdamW state
    dict (:func:`full_optim_state`'s format)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, \
        set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, weights, options=opts)
    names = _trainable_names(model)
    by_name: dict[str, Any] = {"state": {names[i]: v for i, v in optim["state"].items()},
                               "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                                for g in optim["param_groups"]]}
    set_optimizer_state_dict(model, opt, by_name, options=opts)


# ====================================================================== the strategy

class Sharded:
    """The FSDP2 update strategy of a ``group.LearnerGroup`` (module docstring): every rank builds
    its shards inside the process group, computes its share of every update and of the old
    log-probs, and takes part in every read of the weights (gathers)."""

    name = "fsdp2"
    sharded = True

    def build(self, spec: LearnerSpec, world: int, mesh_device: str) -> Learner:
        from torch.distributed.device_mesh import init_device_mesh

        learner = build_sharded(spec, init_device_mesh(mesh_device, (world,)))
        resolve_token_budget(learner, spec.gradient_checkpointing, world)  # (ppo.micro_batch_tokens=-1)
        return learner

    def update(self, learner: Learner, exp: Experience, step: int, rank: int, world: int, critic: bool
               ) -> dict[str, float]:
        return fsdp_update(learner, exp, step, rank, world, critic)

    def old_logprobs(self, learner: Learner, exp: Experience, version: int, rank: int, world: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return fsdp_old_logprobs(learner, exp, version, rank, world)

    def model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return full_model_state(model)

    def optim_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
        return full_optim_state(model, opt)

    def load_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer, weights: dict, optim: dict) -> None:
        load_full_state(model, opt, weights, optim)


__all__ = ["Sharded", "build_sharded", "fsdp_old_logprobs", "fsdp_update", "full_model_state", "full_optim_state",
           "load_full_state", "shard_model"]
