"""The local learner: PPO epochs for actor and critic on one :class:`~.batch.Experience` (stage 6
of the PPO step), and the micro-step, clipping and optimizer helpers the
data-parallel and FSDP2 learners share (``dp.py``, ``fsdp.py``)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import guard
from ..algo.actor_loss import ActorLossSettings, ActorTokens, actor_loss
from ..algo.losses import value_loss
from ..forward import LayoutRule, head_logprobs, packed_hidden, layout_rule
from ..kernels import streams
from .batch import (CriticBatch, Experience, MicroBatch, MicroBatching, OldLogprobSettings, balanced, micro_groups,
                    micro_slices, old_logprob_targets, padding_stats, row_lengths, set_old_logprobs, token_budget)
from ..models import backbone_and_head, checkpointing
from .offpolicy import MismatchProbe
from ..weights.precision import autocast, cast_once

if TYPE_CHECKING:  # (the config lists the learner engines: no import back at run time)
    from ..config import PPOConfig


@dataclass(frozen=True)
class Draw:
    """How a learner draws its minibatches (:func:`draw_rows`): ``ppo.epochs`` permutations of the
    rows, seeded by ``run.seed`` and the step, cut into minibatches of ``ppo.minibatch_size``
    rows, each listed micro-batch after micro-batch (``micro``)."""

    epochs: int
    minibatch_size: int
    seed: int
    micro: MicroBatching

    @classmethod
    def of(cls, ppo: PPOConfig, seed: int) -> "Draw":
        return cls(ppo.epochs, ppo.minibatch_size, seed, MicroBatching.of(ppo))


@dataclass(frozen=True)
class UpdateSettings:
    """One model's optimizer steps (:func:`train_minibatches`): its micro-batches, its learning rate
    (``ppo.actor_lr`` or ``ppo.critic_lr``: AdamW's, and the warm-up's ramp) and weight decay, the
    gradient clipping (``ppo.max_grad_norm``), the warm-up (``ppo.lr_warmup_steps``) and what the
    guard does with a non-finite step (``ppo.nonfinite``)."""

    micro: MicroBatching
    lr: float
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    lr_warmup_steps: int = 0
    nonfinite: str = "error"

    @classmethod
    def of(cls, ppo: PPOConfig, model: str) -> "UpdateSettings":
        """``model``'s (``"actor"`` or ``"critic"``: the learning rate) from a ``ppo`` section."""
        lr = ppo.actor_lr if model == "actor" else ppo.critic_lr
        return cls(MicroBatching.of(ppo), lr, ppo.weight_decay, ppo.max_grad_norm, ppo.lr_warmup_steps, ppo.nonfinite)


@dataclass(frozen=True)
class CriticSettings:
    """The critic's update (:func:`critic_update`): its optimizer steps and its value loss
    (``ppo.value_clip_eps``, ``ppo.loss_agg``); what a scorer that trains the critic receives."""

    update: UpdateSettings
    value_clip_eps: float | None = 0.2
    loss_agg: str = "token_mean"

    @classmethod
    def of(cls, ppo: PPOConfig) -> "CriticSettings":
        return cls(UpdateSettings.of(ppo, "critic"), ppo.value_clip_eps, ppo.loss_agg)


def adamw(params, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over ``params``: the fused CUDA kernel (one launch per step for every parameter, as
    torchtitan uses) when every parameter is a plain CUDA tensor; PyTorch's default (foreach)
    otherwise: on CPU, and for FSDP2's DTensor shards."""
    params = list(params)
    fused = bool(params) and all(p.is_cuda and type(p.data) is torch.Tensor for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True if fused else None)


def response_hidden(backbone, mb: MicroBatch) -> torch.Tensor:
    """[1, N, H] the hidden states that predict each response token of ``mb`` (``MicroBatch.pre``)."""
    return packed_hidden(backbone, mb.layout, mb.source, mb.first)[mb.pre][None]


def on_learner(hand_back: bool = False):
    """Run the decorated method on the learner's stream (``kernels.streams``; after the work its caller
    queued: the experience it was given). ``hand_back``: it returns device tensors, so the caller's
    stream waits for them."""
    def wrap(method):
        @functools.wraps(method)
        def run(self, *a, **k):
            with self.role:
                out = method(self, *a, **k)
                if hand_back:
                    self.role.hand_back()
                return out
        return run
    return wrap


class Learner:
    """Actor and critic with their optimizers; ``update`` runs the PPO epochs on one batch.

    ``actor`` and ``critic`` are the trained weights (fp32 masters under mixed precision,
    ``weights.py``); their forwards run under ``compute_dtype`` autocast. ``recompute_old``:
    recompute every token's ``old_logprobs`` with this training forward (see ``old_logprobs``).

    It reads its ``ppo`` section once, into the records its parts take (:attr:`ppo`): ``micro``,
    ``draw``, ``loss``, ``old``, ``actor_update``, ``critic_settings``.
    """

    def __init__(self, actor: torch.nn.Module, critic: torch.nn.Module | None, ppo: PPOConfig, temperature: float,
                 seed: int, compute_dtype: torch.dtype = torch.float32, recompute_old: bool = False, algorithm=None):
        """``critic`` None: a critic-free algorithm. ``algorithm`` (``algo.Algorithm``): adds its
        term to the actor loss (the KL, when it goes in the loss); None: plain PPO."""
        self.actor, self.critic, self.temperature, self.seed = actor, critic, temperature, seed
        self.ppo = ppo
        self.compute_dtype, self.recompute_old, self.algorithm = compute_dtype, recompute_old, algorithm
        self.device = next(actor.parameters()).device
        self.role = streams.role("learner", self.device)  # its own stream (kernels.streams)
        # only what trains: with LoRA, the adapters
        self.actor_opt = adamw([p for p in actor.parameters() if p.requires_grad], ppo.actor_lr, ppo.weight_decay)
        self.critic_opt = adamw(critic.parameters(), ppo.critic_lr, ppo.weight_decay) if critic is not None else None

    @property
    def ppo(self) -> PPOConfig:
        """The ``ppo`` section it trains with; setting it (``dp.resolve_token_budget``: the token
        budget resolved on a rank) builds the records its parts read again."""
        return self._ppo

    @ppo.setter
    def ppo(self, ppo: PPOConfig) -> None:
        self._ppo = ppo
        self.micro = MicroBatching.of(ppo)
        self.draw = Draw.of(ppo, self.seed)
        self.loss = ActorLossSettings.of(ppo)
        self.old = OldLogprobSettings.of(ppo)
        self.actor_update = UpdateSettings.of(ppo, "actor")
        self.critic_settings = CriticSettings.of(ppo)
        self.entropy_grad = bool(ppo.entropy_coef)

    def layout_rule(self) -> LayoutRule:
        """How the actor's forwards lay out their sequences (``forward.layout_rule``, ``ppo.packing``)."""
        return layout_rule(backbone_and_head(self.actor)[0], self.micro.packing, self.micro.shape_buckets)

    def _actor_logprobs(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, entropies) [b, T] of ``mb``'s response tokens under the actor, from the head
        in chunks of tokens (``forward.head_logprobs``: no [b, T, V] logits tensor) over the response
        tokens only. The entropy is differentiable only when it is in the loss (``ppo.entropy_coef``);
        otherwise a statistic, and the head's backward forms no term for it."""
        backbone, head = backbone_and_head(self.actor)
        with autocast(self.device, self.compute_dtype):
            logprobs, entropy = head_logprobs(head, response_hidden(backbone, mb), mb.tokens[None], self.temperature,
                                              entropy=True, entropy_grad=self.entropy_grad)  # [1, N]
        assert entropy is not None  # (asked for)
        return mb.spread(logprobs[0]), mb.spread(entropy[0])

    @on_learner(hand_back=True)
    @torch.no_grad()
    def old_logprobs(self, exp: Experience, version: int) -> Experience:
        """A new record with ``old_logprobs`` (the ratio's centre, pi_k) and ``is_weights`` set.

        - Off-policy tokens (sampled by a version older than ``version``, or, with
          ``stale_kv=keep``, by new weights over an older KV prefix: ``EagerBackend``) get
          old_logprobs recomputed under pi_k by the training forward, and an importance weight
          pi_k / pi_v truncated at ``ppo.is_truncate`` (decoupled PPO, as AReaL does). pi_v is
          the sampling version's untruncated log-prob (``Experience.policy_logprobs``), not the
          top-k/top-p-truncated one it was drawn from: a fresh token's weight is 1 (below), so
          a carried token whose weights did not change must weigh 1 too.
        - On-policy tokens keep the sampler's (untruncated) log-probs unless ``recompute_old``:
          then the training forward recomputes them too, since the sampler's numerics differ.
          Their weight stays 1 (the gap is numerical, reported as ``mismatch/*`` and
          ``ppo/sampler_ratio_outside_clip``). Figures: ``docs/implementation-details.md``,
          "Behaviour vs old log-probs".
        """
        redo, off = old_logprob_targets(exp, version, self.recompute_old)
        rows = redo.any(1).nonzero().squeeze(1)
        return set_old_logprobs(exp, rows, self.recompute_logprobs(exp, rows), redo, off, self.old)

    @on_learner(hand_back=True)
    @torch.no_grad()
    def recompute_logprobs(self, exp: Experience, rows: torch.Tensor, budget: bool = True) -> torch.Tensor:
        """[len(rows), T] log-probs of ``rows``' response tokens under the current weights, in
        micro-batches (the training forward's memory footprint: ``ppo.micro_batch_tokens`` too, unless
        ``budget`` is False: sharded ranks count on ceil(rows / micro_batch_size) forwards each);
        0 beyond a micro-batch's width."""
        out = torch.zeros(len(rows), exp.mask.shape[1], device=exp.mask.device)
        if not len(rows):
            return out
        rule, total = self.layout_rule(), row_lengths(exp)
        host = rows.tolist()  # CPU-GPU sync point (once per update)
        lengths = [total[i] for i in host]
        # ceil(rows / micro_batch_size) forwards (fsdp_old_logprobs counts on it), of balanced token counts
        tokens = (token_budget(self.micro) or math.inf) if budget else math.inf
        for group in balanced(list(range(len(host))), lengths, -(-len(host) // self.micro.micro_batch_size), tokens):
            at = torch.tensor(group, device=rows.device)
            mb = micro_slices(exp, [host[g] for g in group], rule, self.micro)
            out[at, :mb.T] = self._actor_logprobs(mb)[0]  # [b, T]
        return out

    def minibatches(self, B: int, step: int, lengths: "torch.Tensor | list[int] | None" = None
                    ) -> "list[list[int]]":
        """Row indices of each minibatch, every epoch: a fresh permutation seeded by the step only
        (so a resumed run draws the same ones). ``lengths`` [B] (each row's real tokens): each
        minibatch's rows are listed micro-batch after micro-batch (``micro_batches``: packed, of
        balanced token counts; unpacked, longest first, so that a micro-batch's rows are of similar
        length and pad little: ``padding_stats``). Which rows make a minibatch is unchanged, so is
        its loss: only the summation order of its gradient."""
        return draw_rows(self.draw, B, step, lengths)

    @on_learner()
    def update(self, exp: Experience, step: int, critic: bool = True) -> dict[str, float]:
        """Stage 6: PPO epochs over minibatches for the actor, then (``critic``) for the critic.

        The two updates share nothing but the minibatches, so running them one after the other
        (here) or at the same time (the critic on the scorer worker, ``critic_update``) gives the
        same weights. ``critic=False`` leaves the critic to the caller.

        On the learner's stream: it first waits for the roles that read the weights (a decode step
        still queued on the actor's stream, when both share the model), and marks them written at
        the end (the rollout backend's next load or decode step waits on that event).
        """
        trained = [self.actor] + ([self.critic] if critic and self.critic is not None else [])
        for module in trained:
            self.role.write(module)
        stats = self._update(exp, step, critic)
        for module in trained:
            self.role.wrote(module)
        return stats

    def _update(self, exp: Experience, step: int, critic: bool) -> dict[str, float]:
        # the minibatches' rows stay on the host: the loop reads them, the device never needs them whole
        mbs = self.minibatches(exp.mask.shape[0], step, row_lengths(exp))
        probe = MismatchProbe(self.actor_opt, step)
        stats = train_minibatches(self.actor, self.actor_opt, exp, mbs, self.actor_update, "actor",
                       lambda rows, nt, ns: self._actor_micro_step(exp, rows, nt, ns, probe), step,
                       compute_dtype=self.compute_dtype)
        stats.update(MismatchProbe.stats(probe.partial()))
        stats.update(padding_stats(exp, mbs, self.micro, self.layout_rule()))
        if critic and self.critic is not None:
            assert self.critic_opt is not None  # (built with the critic)
            stats.update(critic_update(self.critic, self.critic_opt, CriticBatch.of(exp), mbs,
                                       self.critic_settings, compute_dtype=self.compute_dtype, step=step))
        return stats

    def weights_out(self) -> torch.nn.Module:
        """The trained policy (the rollout backend copies from it: ``RolloutBackend.load_weights``)."""
        return self.actor

    @on_learner(hand_back=True)
    def checkpoint_state(self) -> dict:
        """The optimizer states a checkpoint saves: ``{"actor"[, "critic"]}``."""
        out = {"actor": self.actor_opt.state_dict()}
        if self.critic is not None:
            assert self.critic_opt is not None  # (built with the critic)
            out["critic"] = self.critic_opt.state_dict()
        return out

    @on_learner()
    def load_checkpoint_state(self, optim: dict) -> None:
        """Inverse of :meth:`checkpoint_state` (the weights are loaded into the modules first). A
        sharded learner's checkpoint (``{"sharded": path}``) is read whole (``sharded_checkpoint``)."""
        from .sharded import dense_optim_state

        optim = dense_optim_state(optim, self.actor, self.critic)
        self.actor_opt.load_state_dict(optim["actor"])
        if self.critic is not None:
            assert self.critic_opt is not None  # (built with the critic)
            # in place: with placement.local.critic_on_worker its state tensors are shared with the scorer process
            load_optimizer_state_in_place(self.critic_opt, optim["critic"])

    def close(self) -> None:
        pass

    def _actor_micro_step(self, exp: Experience, host_rows: list[int], num_tokens, num_seqs: int,
                          probe: MismatchProbe | None = None) -> dict[str, torch.Tensor]:
        """One micro-batch of the actor's update (``host_rows``: its rows, a host list): the forward,
        the loss (``algo.actor_loss``: policy, KL, entropy), the backward; the statistics stay on
        the device (``train_minibatches`` reads them once per update)."""
        assert exp.advantages is not None  # (compute_advantages runs before the update)
        host_rows = host_rows if isinstance(host_rows, list) else host_rows.tolist()
        mb = micro_slices(exp, host_rows, self.layout_rule(), self.micro)
        rows = torch.tensor(host_rows, dtype=torch.long).to(exp.mask.device, non_blocking=True)
        T = mb.T
        mask = exp.mask[rows][:, :T]
        with checkpointing(self.actor):  # recomputes activations in backward if policy.gradient_checkpointing
            logprobs, entropy = self._actor_logprobs(mb)  # [b, T] each
        if probe is not None:  # (the first optimizer step's forward is pi_k's: the sampler-vs-trainer gap)
            probe.observe(logprobs, exp.sampler_logprobs[rows][:, :T], exp.versions[rows][:, :T], mask)
        kl_in_loss = self.algorithm is not None and self.algorithm.kl_in_loss
        ref = exp.ref_logprobs[rows][:, :T] if kl_in_loss and exp.ref_logprobs is not None else None
        tokens = ActorTokens(exp.old_logprobs[rows][:, :T], exp.advantages[rows][:, :T], mask,
                             exp.is_weights[rows][:, :T], ref)
        loss, stats = actor_loss(self.algorithm, logprobs, entropy, tokens, self.loss, num_tokens, num_seqs)
        loss.backward()
        return {**stats, "_frac": mask.sum() / num_tokens}  # (_frac: this micro-batch's weight in the minibatch)


def draw_minibatches(draw: Draw, B: int, step: int, lengths: "torch.Tensor | list[int] | None" = None
                     ) -> list[torch.Tensor]:
    """:meth:`Learner.minibatches` of a learner with these settings (``Draw.of(ppo, run.seed)``): the
    data-parallel group's controller draws the ranks' minibatches without a learner of its own."""
    return [torch.tensor(rows, dtype=torch.long) for rows in draw_rows(draw, B, step, lengths)]


def draw_rows(draw: Draw, B: int, step: int, lengths: "torch.Tensor | list[int] | None" = None
              ) -> list[list[int]]:
    """:func:`draw_minibatches` as host lists (what the learner's loop reads; ``lengths``: a host
    list, or a tensor read once)."""
    gen = torch.Generator().manual_seed(draw.seed * 1_000_003 + step)
    perms = [torch.randperm(B, generator=gen) for _ in range(draw.epochs)]
    order = torch.cat(perms).tolist() if perms else []  # (host tensors: no device read)
    mbs = [order[e * B + i: e * B + min(B, i + draw.minibatch_size)]
           for e in range(draw.epochs) for i in range(0, B, draw.minibatch_size)]
    if lengths is None:
        return mbs
    host = lengths if isinstance(lengths, list) else lengths.cpu().long().tolist()
    if draw.micro.packing != "off":
        return [[r for g in micro_groups(None, mb, draw.micro, host) for r in g] for mb in mbs]
    return [sorted(mb, key=lambda r: -host[r]) for mb in mbs]  # longest first (stable: ties keep the draw's order)


def critic_update(critic, opt: torch.optim.Optimizer, batch: CriticBatch, minibatches: "list[list[int]] | list[torch.Tensor]",
                  settings: CriticSettings, before_micro=None, compute_dtype: torch.dtype = torch.float32,
                  step: int = -1) -> dict[str, float]:
    """Stage 6 for the critic: clipped value loss over the given minibatches.

    A plain function of its arguments, so the scorer worker that holds the critic can run it
    while the actor trains (``placement.local.critic_on_worker``). ``before_micro()``, if given, runs
    before each micro-batch (the scorer worker adapts its thread count there). ``critic`` holds the
    trained (master) weights; its forward runs under ``compute_dtype`` autocast.
    """
    dev = next(critic.parameters()).device
    batch = batch.to(dev)

    def micro(rows, num_tokens, num_seqs):
        if before_micro is not None:
            before_micro()
        return critic_micro_step(critic, batch, rows, num_tokens, num_seqs, settings, compute_dtype)

    return train_minibatches(critic, opt, batch, minibatches, settings.update, "critic", micro, step,
                  compute_dtype=compute_dtype)


def critic_micro_step(critic, batch: CriticBatch, host_rows: list[int], num_tokens, num_seqs: int,
                      settings: CriticSettings, compute_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """One micro-batch of the critic's update: clipped value loss, backward (gradients accumulate);
    ``host_rows`` a host list, the statistics left on the device."""
    backbone, head = backbone_and_head(critic)
    host_rows = host_rows if isinstance(host_rows, list) else host_rows.tolist()
    micro = settings.update.micro
    mb = micro_slices(batch, host_rows, layout_rule(backbone, micro.packing, micro.shape_buckets), micro)
    rows = torch.tensor(host_rows, dtype=torch.long).to(batch.mask.device, non_blocking=True)
    T = mb.T
    mask = batch.mask[rows][:, :T]
    with autocast(rows.device, compute_dtype), checkpointing(critic):
        values = mb.spread(head(response_hidden(backbone, mb)).float().reshape(-1))  # [b, T]
    vl, vstats = value_loss(values, batch.values[rows][:, :T], batch.returns[rows][:, :T], mask,
                            clip_eps=settings.value_clip_eps, loss_agg=settings.loss_agg, num_tokens=num_tokens,
                            num_seqs=num_seqs)
    vl.backward()
    return {"loss/value": vl.detach(), "value/clipfrac": vstats["vf_clipfrac"].detach(), "_frac": mask.sum() / num_tokens}


def train_minibatches(model, opt, batch: "Experience | CriticBatch", minibatches: "list[list[int]] | list[torch.Tensor]",
                      update: UpdateSettings, name: str,
           micro_step, step: int = -1, agree=None, compute_dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Optimizer steps over ``minibatches`` of ``batch``'s rows; each is cut into micro-batches
    (:func:`micro_batches`) that accumulate gradients.

    The loss of a minibatch is aggregated with the minibatch's global token (and sequence) count,
    so splitting it into micro-batches changes nothing but memory. Returns means over optimizer
    steps: losses add up across micro-batches (they are already scaled by the minibatch
    denominator), per-token statistics are weighted by each micro-batch's token share.

    The guard (``guard.py``): before each optimizer step the minibatch's losses and its total
    gradient norm must be finite, else ``ppo.nonfinite`` raises ``NonFiniteError`` (no step taken)
    or skips that step (zeroed gradients; its statistics are left out of the means) and counts it
    (``guard/skipped/<name>``); after the last step the trained weights must be finite. On
    data-parallel / FSDP2 ranks the norm is already global (all-reduced gradients, DTensor norm)
    and ``agree(flag) -> flag`` (a collective) makes the loss flag every rank's, so all decide alike.

    Under a low-precision ``compute_dtype`` each master weight is cast once per optimizer step
    (``weights.precision.cast_once``), not once per micro-batch.
    """
    sums: dict[str, object] = {}
    taken = skipped = 0
    stage = f"{name} update"
    mask = batch.mask
    micro = update.micro
    lengths = row_lengths(batch) if token_budget(micro) or micro.packing != "off" else None
    rows_of: list = list(minibatches)
    for i, mb_rows in enumerate(rows_of):
        mb: list[int] = mb_rows if isinstance(mb_rows, list) else mb_rows.tolist()  # (the learner's are host lists)
        num_tokens = mask[torch.tensor(mb, dtype=torch.long).to(mask.device, non_blocking=True)].sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        with cast_once(mask.device, compute_dtype):
            mb_sums, losses = _accumulate(micro_step, micro_groups(batch, mb, micro, lengths), num_tokens, len(mb))
        params = [p for p in model.parameters() if p.grad is not None]
        norm = _grad_norm(params)
        norm_f, bad_rows, bad_loss = _guard_reads(norm, losses, agree)
        if bad_loss or not math.isfinite(norm_f):
            guard.report(guard.grad_norm_message(model, norm_f, bad_rows, step, stage, i, len(minibatches)),
                         skip=update.nonfinite == "skip")
            opt.zero_grad(set_to_none=True)  # skipped: AdamW leaves parameters without gradients alone
            skipped += 1
            continue
        if norm is not None and update.max_grad_norm > 0:
            _clip(params, update.max_grad_norm, norm)
        mb_sums[f"grad_norm/{name}"] = norm_f
        for k, v in mb_sums.items():
            sums[k] = sums.get(k, 0.0) + v  # type: ignore[operator]
        taken += 1
        if update.lr_warmup_steps > 0:
            warm_up(opt, update.lr, update.lr_warmup_steps)
        opt.step()
    if taken:
        guard.check_weights(model, step, stage)
    keys = list(sums)
    out = {k: v / taken for k, v in zip(keys, host_values([sums[k] for k in keys]))}  # (one read per update)
    if update.nonfinite == "skip":
        out[f"guard/skipped/{name}"] = skipped
    return out


def _accumulate(micro_step, groups: list[list[int]], num_tokens, num_seqs: int
                ) -> tuple[dict[str, object], list[tuple[list[int], list]]]:
    """One minibatch's micro-batches ``groups`` through ``micro_step`` (gradients accumulate): the
    minibatch's statistics, losses summed and per-token statistics weighted by each micro-batch's
    token share (``_frac``), and each micro-batch's rows with its loss terms (for the guard). Left
    on the device: ``train_minibatches`` reads them once per optimizer step."""
    sums: dict[str, object] = {}
    losses: list[tuple[list[int], list]] = []
    for rows in groups:
        stats = micro_step(rows, num_tokens, num_seqs)
        w = stats.pop("_frac")
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + (v if k.startswith("loss/") else v * w)
        losses.append((rows, [v for k, v in stats.items() if k.startswith("loss/")]))
    return sums, losses


def _guard_reads(norm: torch.Tensor | None, losses: list[tuple[list[int], list]], agree
                 ) -> tuple[float, list[int], bool]:
    """What the guard decides on before an optimizer step: (the gradient norm, the rows of the
    micro-batches whose losses are not finite, whether any rank has such a loss: ``agree``).
    The norm and every micro-batch's losses are read in one transfer (one CPU-GPU sync point per
    optimizer step)."""
    read = host_values([norm if norm is not None else 0.0] + [_all_finite(ls) for _, ls in losses])
    bad_rows = [r for (rows, _), ok in zip(losses, read[1:]) if not ok for r in rows]
    return read[0], bad_rows, bool(bad_rows) if agree is None else agree(bool(bad_rows))


def _all_finite(values: list) -> object:
    """Whether every one of ``values`` (numbers or 0-dim tensors) is finite: a bool, or a 0-dim
    tensor left on the device when any of them is one."""
    tensors = [v.detach().reshape(()).float() for v in values if torch.is_tensor(v)]
    numbers = all(math.isfinite(v) for v in values if not torch.is_tensor(v))
    if not tensors:
        return numbers
    ok = torch.isfinite(torch.stack(tensors)).all()
    return ok if numbers else torch.zeros_like(ok)


def host_values(values: list) -> list[float]:
    """Numbers and 0-dim tensors -> floats, every tensor read in one transfer (one CPU-GPU sync point
    where a loop would make one per value)."""
    out = [0.0 if torch.is_tensor(v) else float(v) for v in values]
    at = [i for i, v in enumerate(values) if torch.is_tensor(v)]
    if at:
        # a DTensor (FSDP2's gradient norm) as its full value, so that it stacks with plain tensors (a
        # redistribution every rank makes at the same point of the loop, as float(norm) did before)
        local = [values[i].full_tensor() if hasattr(values[i], "full_tensor") else values[i] for i in at]
        dev = local[0].device
        read = torch.stack([v.detach().reshape(()).to(dev, torch.float64) for v in local]).tolist()
        for i, v in zip(at, read):
            out[i] = v
    return out


def warm_up(opt: torch.optim.Optimizer, lr: float, warmup_steps: int) -> None:
    """Set the learning rate of the optimizer step about to be taken, the n-th (from 1):
    ``lr * min(1, n / warmup_steps)``. n comes from the optimizer's own step count (AdamW's
    per-parameter ``step``, in its state dict), so a resumed run, the scorer worker's shared
    critic optimizer and every data-parallel rank agree without a scheduler of their own."""
    done = next((int(st["step"]) for st in opt.state.values() if "step" in st), 0)
    for group in opt.param_groups:
        group["lr"] = lr * min(1.0, (done + 1) / warmup_steps)


def _grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor | None:
    """The total 2-norm of the gradients of ``params`` (global for DTensor gradients), unclipped, so
    the guard can still name the parameters whose gradients are not finite; None without any."""
    if not params:
        return None
    grads = [p.grad for p in params if p.grad is not None]  # (all of them: train_minibatches passes those with gradients)
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: what clip_grad_norm_ computes
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def _clip(params: list[torch.nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """``clip_grad_norm_``'s scaling with the norm already computed (:func:`_grad_norm`)."""
    if hasattr(torch.nn.utils, "clip_grads_with_norm_"):  # torch >= 2.6
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:  # (all of them: train_minibatches passes those with gradients)
            p.grad.mul_(coef.to(p.grad.device))


def load_optimizer_state_in_place(opt: torch.optim.Optimizer, state_dict: dict) -> None:
    """``opt.load_state_dict`` that keeps the existing state tensors (shared memory stays shared)."""
    old = {p: dict(st) for p, st in opt.state.items()}
    opt.load_state_dict(state_dict)
    for p, st in opt.state.items():
        for k, v in st.items():
            prev = old.get(p, {}).get(k)
            if torch.is_tensor(v) and torch.is_tensor(prev) and prev.shape == v.shape:
                prev.copy_(v)
                st[k] = prev
