"""Data-parallel learner ranks: the :class:`Replicated` update strategy of a
``group.LearnerGroup``. Each rank holds a whole replica of actor and critic with their AdamW.

The update (:func:`dp_update`) is the single learner's, split by rows: every rank draws the same
minibatches, computes its share of each minibatch's micro-batches (``batch.rank_of``) with losses
divided by the minibatch's global counts, and the gradients are summed over the ranks (one
all-reduce of one flat buffer), so clipping and AdamW stay identical on every rank. No DDP wrapper.

Design notes (why a sum, why not DDP, how to size micro-batches): docs/distributed.md,
"Data-parallel replicas"."""

from __future__ import annotations

from typing import Callable

import torch

from .batch import CriticBatch, Experience, old_logprob_targets, padding_stats, rank_of, row_lengths
from .group import LearnerSpec, cpu_state
from .local import Learner, train_minibatches, critic_micro_step
from .offpolicy import MismatchProbe


class Replicated:
    """Each rank a whole replica (:func:`dp_update`); reads of the weights ask rank 0 alone."""

    name = "replicate"
    sharded = False

    def build(self, spec: LearnerSpec, world: int, mesh_device: str) -> Learner:
        """The spec's Learner, rank 0's weights broadcast (a fresh head or adapter differs per process)."""
        import torch.distributed as dist

        learner = spec.build()
        with torch.no_grad():
            for model in (learner.actor, learner.critic):
                if model is None:
                    continue
                for t in list(model.parameters()) + list(model.buffers()):
                    dist.broadcast(t.data, src=0)
        resolve_token_budget(learner, spec.gradient_checkpointing, world)
        return learner

    def update(self, learner: Learner, exp: Experience, step: int, rank: int, world: int, critic: bool
               ) -> dict[str, float]:
        return dp_update(learner, exp, step, rank, world, critic)

    def old_logprobs(self, learner: Learner, exp: Experience, version: int, rank: int, world: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row to recompute (the group asks rank 0 alone)."""
        redo, _ = old_logprob_targets(exp, version, learner.recompute_old)
        rows = redo.any(1).nonzero().squeeze(1)
        return rows, learner.recompute_logprobs(exp, rows)

    def model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return cpu_state(model)

    def optim_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
        return cpu_state(opt)

    def load_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer, weights: dict, optim: dict) -> None:
        model.load_state_dict(weights)
        opt.load_state_dict(optim)


# ====================================================================== the math on one rank

def dp_update(learner: Learner, exp: Experience, step: int, rank: int, world: int, critic: bool = True
              ) -> dict[str, float]:
    """``learner.update(exp, step, critic)`` as rank ``rank`` of ``world`` in the default process
    group (module docstring). Every rank gets the whole batch and returns the same stats."""
    mbs = learner.minibatches(exp.mask.shape[0], step, row_lengths(exp))  # (host rows)
    probe = MismatchProbe(learner.actor_opt, step)  # each rank sees its share of the first minibatch
    actor_steps = _Shard(mbs, rank, world, learner.actor,
                         lambda rows, nt, ns: learner._actor_micro_step(exp, rows, nt, ns, probe))
    agree = any_rank(world, learner.device)
    stats = train_minibatches(learner.actor, learner.actor_opt, exp, mbs, learner.actor_update, "actor", actor_steps,
                              step, agree, compute_dtype=learner.compute_dtype)
    actor_steps.check_done()
    if critic and learner.critic is not None:
        batch = CriticBatch.of(exp)
        critic_steps = _Shard(mbs, rank, world, learner.critic,
                              lambda rows, nt, ns: critic_micro_step(learner.critic, batch, rows, nt, ns,
                                                                      learner.critic_settings, learner.compute_dtype))
        stats.update(train_minibatches(learner.critic, learner.critic_opt, batch, mbs, learner.critic_settings.update,
                                       "critic", critic_steps, step, agree, compute_dtype=learner.compute_dtype))
        critic_steps.check_done()
    return {**merge_rank_stats(stats, world, probe), **padding_stats(exp, mbs, learner.micro, learner.layout_rule())}


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
    """The micro-step ``learner.train_minibatches`` calls, for one rank: computes its share of each minibatch's
    micro-batches, passes over the others, and all-reduces the gradients after each minibatch's
    last micro-batch (before ``train_minibatches`` clips and steps)."""

    def __init__(self, minibatches: "list[list[int]] | list[torch.Tensor]", rank: int, world: int, model: torch.nn.Module,
                 micro_step: Callable):
        self.mbs: list[list[int]] = [m if isinstance(m, list) else m.tolist() for m in minibatches]  # host rows, compared with the loop's
        self.rank, self.world, self.model, self.micro_step = rank, world, model, micro_step
        self.i = self.pos = self.j = 0  # minibatch, rows of it seen, micro-batches of it seen

    def __call__(self, rows: list[int], num_tokens: torch.Tensor, num_seqs: int) -> dict:
        mb = self.mbs[self.i]
        if list(rows) != mb[self.pos: self.pos + len(rows)]:
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


def resolve_token_budget(learner: Learner, checkpointing: bool, world: int,
                         smallest: Callable[[int], int] | None = None, say: Callable[[str], None] | None = None) -> None:
    """``ppo.micro_batch_tokens=-1`` resolved on a learner rank, for its own device, as the local
    learner's is on the controller's (``budget.sized``: on CUDA a share of the free memory at start,
    the budget alone cutting a minibatch; elsewhere no budget); sets ``learner.ppo``. Every rank must
    cut the same micro-batches (data-parallel ranks pass over each other's; sharded ranks' forwards are
    collectives), so the budget is the smallest of the ranks' (``smallest``: that reduction, one
    all-reduce by default; a collective, so every rank calls this). Rank 0 logs it (``say``: stderr).
    Before issue 51 the ranks kept -1, which means no budget: on CUDA, data-parallel and FSDP2 learners
    cut minibatches by ``micro_batch_size`` alone."""
    import dataclasses
    import sys

    from .budget import sized

    if learner.ppo.micro_batch_tokens != -1:
        return
    lines: list[str] = []
    ppo = sized(learner.ppo, [m for m in (learner.actor, learner.critic) if m is not None], checkpointing,
                say=lines.append)
    if world > 1:
        agreed = (smallest or _smallest_over_ranks(learner.device))(ppo.micro_batch_tokens)
        if agreed != ppo.micro_batch_tokens:
            lines.append(f"micro-batches: up to {agreed} tokens each on every learner rank (the smallest of the "
                         f"{world} ranks' budgets)")
        ppo = dataclasses.replace(ppo, micro_batch_tokens=agreed)
    learner.ppo = ppo  # (its records read the resolved budget)
    if say is None:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() != 0:
            return
        say = lambda line: print(f"oppo: {line}", file=sys.stderr)  # noqa: E731
    for line in lines:
        say(line)


def _smallest_over_ranks(device: torch.device) -> Callable[[int], int]:
    import torch.distributed as dist

    def smallest(n: int) -> int:
        t = torch.tensor([n], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())  # CPU-GPU sync point (once, at build)

    return smallest


def any_rank(world: int, device: torch.device) -> Callable[[bool], bool] | None:
    """The guard's ``agree`` for ``learner.train_minibatches`` on ``world`` ranks (None for one): a flag true on
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


__all__ = ["Replicated", "all_reduce_grads", "any_rank", "dp_update", "merge_rank_stats"]
