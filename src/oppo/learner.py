"""Experience (the typed PPO batch) and the learner (PPO epochs for actor and critic).

Stages 4-6 of the PPO step (``shared/DESIGN.md`` section 2) live here as plain functions of an
:class:`Experience`; the trainer calls them in the same order in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ppo_math as pm
from .config import PPOConfig
from .rollout import Rollout
from .scoring import ScoredOutputs, full_hidden, response_outputs, sequence_batch
from .models import backbone_and_head, checkpointing
from .weights import autocast


@dataclass
class Experience:
    """B finished sequences as response-aligned tensors (alignment: ``ppo_math`` docstring).

    ids, valid: [B, P+T] left-padded prompts then right-padded responses; ``P`` prompt width.
    mask: [B, T] 1 on response tokens (EOS included). versions: [B, T] policy version per token.
    behaviour_logprobs: [B, T] from the sampler (the distribution actually sampled: its precision,
    its top-k/top-p truncation). old_logprobs: [B, T] under pi_k by the training forward, the
    policy the PPO ratio is clipped around (the sampler's, unrecomputed, where the two cannot
    differ: see ``Learner.old_logprobs``). is_weights: [B, T] pi_k / behaviour for off-policy
    tokens (truncated), 1 otherwise. ``stats``: the sampler-vs-trainer gap, for the metrics.
    ref_logprobs, values, rewards, kl, advantages, returns: [B, T]. scores: [B].
    """

    rollouts: list[Rollout]
    ids: torch.Tensor
    valid: torch.Tensor
    P: int
    mask: torch.Tensor
    versions: torch.Tensor
    behaviour_logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    is_weights: torch.Tensor
    ref_logprobs: torch.Tensor | None = None  # filled by attach_scores
    values: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    stats: dict[str, float] | None = None
    group_ids: torch.Tensor | None = None  # [B] the group of each row (GRPO/RLOO): its first member's uid


def _pad_rows(rows: list[list[float]], T: int, device, dtype=torch.float32) -> torch.Tensor:
    out = torch.zeros(len(rows), T, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out.to(device)


def build_experience(rollouts: list[Rollout], pad_id: int, device) -> Experience:
    """Stack the rollouts' tokens, versions and behaviour log-probs into tensors (no scores yet)."""
    ids, valid, P, rmask = sequence_batch([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts],
                                          pad_id, device)
    T = rmask.shape[1]
    lp = _pad_rows([r.logprobs for r in rollouts], T, device)
    return Experience(
        rollouts=rollouts, ids=ids, valid=valid, P=P, mask=rmask.float(),
        versions=_pad_rows([r.versions for r in rollouts], T, device, torch.long),
        behaviour_logprobs=lp, old_logprobs=lp.clone(), is_weights=torch.ones_like(lp),
        group_ids=torch.tensor([r.group for r in rollouts], dtype=torch.long, device=device))


def attach_scores(exp: Experience, scores: list[float], ref: list[ScoredOutputs],
                  values: list[ScoredOutputs] | None) -> Experience:
    """Stage 3's results, per sequence, as [B, T] tensors aligned with the responses
    (``values`` None: a critic-free algorithm)."""
    T, device = exp.mask.shape[1], exp.mask.device
    exp.ref_logprobs = _pad_rows([o.logprobs for o in ref], T, device)
    exp.values = _pad_rows([o.values for o in values], T, device) if values is not None else None
    exp.scores = torch.tensor(scores, dtype=torch.float32, device=device)
    return exp


@torch.no_grad()
def compute_advantages(exp: Experience, cfg: PPOConfig, algorithm) -> Experience:
    """Stages 4 and 5: per-token rewards (KL-shaped when the KL goes in the reward), then the
    algorithm's advantages (``algo.Algorithm``: GAE with the critic's values for PPO; group,
    leave-one-out or batch baselines for the critic-free ones) and, for PPO, returns."""
    ended = torch.tensor([r.ended_with_eos for r in exp.rollouts], device=exp.scores.device)
    scores = pm.missing_eos_penalty(exp.scores, ended, cfg.missing_eos_penalty)
    res = algorithm.advantages(scores, exp.mask, exp.old_logprobs, exp.ref_logprobs, exp.values, exp.group_ids)
    exp.rewards, exp.kl, exp.advantages, exp.returns = res.rewards, res.kl, res.advantages, res.returns
    exp.stats = {**(exp.stats or {}), **{k: float(v) for k, v in res.stats.items()}}
    return exp


def _micro_slices(exp: "Experience | CriticBatch", rows: torch.Tensor):
    """Tensors of ``rows`` with columns trimmed to what those rows use."""
    valid = exp.valid[rows]
    first = int(valid[:, : exp.P].argmax(1).min()) if exp.P else 0  # leftmost real prompt column
    T = int(exp.mask[rows].sum(1).max())
    cols = slice(first, exp.P + T)
    return exp.ids[rows][:, cols], valid[:, cols], exp.P - first, T


class Learner:
    """Actor and critic with their optimizers; ``update`` runs the PPO epochs on one batch.

    ``actor`` and ``critic`` are the trained weights (fp32 masters under mixed precision,
    ``weights.py``); their forwards run under ``compute_dtype`` autocast. ``recompute_old``:
    recompute every token's ``old_logprobs`` with this training forward (see ``old_logprobs``).
    """

    def __init__(self, actor, critic, cfg: PPOConfig, temperature: float, seed: int,
                 compute_dtype: torch.dtype = torch.float32, recompute_old: bool = False, algorithm=None):
        """``critic`` None: a critic-free algorithm. ``algorithm`` (``algo.Algorithm``): adds its
        term to the actor loss (the KL, when it goes in the loss); None: plain PPO."""
        self.actor, self.critic, self.cfg, self.temperature, self.seed = actor, critic, cfg, temperature, seed
        self.compute_dtype, self.recompute_old, self.algorithm = compute_dtype, recompute_old, algorithm
        self.device = next(actor.parameters()).device
        # only what trains: with LoRA, the adapters
        self.actor_opt = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=cfg.actor_lr,
                                           weight_decay=cfg.weight_decay)
        self.critic_opt = (torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, weight_decay=cfg.weight_decay)
                           if critic is not None else None)

    def _actor_logits(self, ids, valid, P):
        backbone, head = backbone_and_head(self.actor)
        with autocast(self.device, self.compute_dtype):
            hidden = full_hidden(backbone, ids, valid)  # [b, P+T, H]
            return head(hidden[:, P - 1:-1]).float()  # [b, T, V] logits predicting each response token

    @torch.no_grad()
    def old_logprobs(self, exp: Experience, version: int) -> None:
        """Set ``exp.old_logprobs`` (the ratio's centre, pi_k) and ``exp.is_weights``.

        - Off-policy tokens (sampled by a version older than ``version``, or, with
          ``stale_kv=keep``, by new weights over an older KV prefix: ``RolloutEngine``) get
          old_logprobs recomputed under pi_k by the training forward, and an importance weight
          pi_k / pi_behaviour truncated at ``ppo.is_truncate`` (decoupled PPO, as AReaL does).
        - On-policy tokens keep the sampler's log-probs unless ``recompute_old``: then the
          training forward recomputes them too (as OpenRLHF and verl do), because the sampler
          can differ from it (bf16 KV-cached decode: mean |dlogp| 0.024 measured, enough to
          push 0.7% of tokens outside the clip range at a ratio that should be exactly 1;
          top-k/top-p truncation). Their weight stays 1: the gap is numerical (or the
          truncation), reported as ``ppo/sampler_logprob_gap`` (mean |dlogp|), ``ppo/sampler_kl``
          and ``ppo/sampler_ratio_outside_clip``, not a policy change.
        """
        mask = exp.mask > 0
        off = (exp.versions < version) & mask  # [B, T]
        redo = mask if self.recompute_old else off  # [B, T]
        rows = redo.any(1).nonzero().squeeze(1)
        exp.stats = {}
        if rows.numel() == 0:
            return
        old = exp.old_logprobs.clone()
        for chunk in rows.split(self.cfg.micro_batch_size):  # the training forward's memory footprint
            ids, valid, P, T = _micro_slices(exp, chunk)
            new = pm.logprobs_from_logits(self._actor_logits(ids, valid, P), ids[:, P:], self.temperature)  # [b, T]
            sub = old[chunk]
            sub[:, :T] = torch.where(redo[chunk][:, :T], new, sub[:, :T])
            old[chunk] = sub
        exp.old_logprobs = old
        w = torch.exp(old - exp.behaviour_logprobs)  # [B, T]
        if self.cfg.is_truncate is not None:
            w = w.clamp(max=self.cfg.is_truncate)
        exp.is_weights = torch.where(off, w, torch.ones_like(w))
        on = mask & ~off & redo
        if on.any():
            gap = (old - exp.behaviour_logprobs).abs()[on]
            ratio = torch.exp(exp.behaviour_logprobs - old)[on]  # the first minibatch's ratio had we not recomputed
            eps_hi = self.cfg.clip_eps_high if self.cfg.clip_eps_high is not None else self.cfg.clip_eps
            r = (old - exp.behaviour_logprobs)[on]  # log pi_train / pi_sampler at tokens drawn from the sampler
            exp.stats = {"ppo/sampler_logprob_gap": gap.mean().item(), "ppo/sampler_logprob_gap_max": gap.max().item(),
                         # KL(sampler || trainer), k3 estimator (exp(r) - 1 - r >= 0, unbiased): the mismatch
                         # peers bound (mean |dlogp| <= 0.02, KL <= 0.01 in bf16)
                         "ppo/sampler_kl": (torch.exp(r) - 1 - r).mean().item(),
                         "ppo/sampler_ratio_outside_clip": ((ratio < 1 - self.cfg.clip_eps) | (ratio > 1 + eps_hi))
                         .float().mean().item()}

    def minibatches(self, B: int, step: int) -> list[torch.Tensor]:
        """Row indices of each minibatch, every epoch: a fresh permutation seeded by the step only
        (so a resumed run draws the same ones)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return [mb for _ in range(self.cfg.epochs) for mb in torch.randperm(B, generator=gen).split(self.cfg.minibatch_size)]

    def update(self, exp: Experience, step: int, critic: bool = True) -> dict[str, float]:
        """Stage 6: PPO epochs over minibatches for the actor, then (``critic``) for the critic.

        The two updates share nothing but the minibatches, so running them one after the other
        (here) or at the same time (the critic on the scorer worker, ``critic_update``) gives the
        same weights. ``critic=False`` leaves the critic to the caller.
        """
        mbs = [mb.to(exp.mask.device) for mb in self.minibatches(exp.mask.shape[0], step)]
        stats = _train(self.actor, self.actor_opt, exp.mask, mbs, self.cfg, "actor",
                       lambda rows, nt, ns: self._actor_micro_step(exp, rows, nt, ns))
        if critic and self.critic is not None:
            stats.update(critic_update(self.critic, self.critic_opt, CriticBatch.of(exp), mbs, self.cfg,
                                       compute_dtype=self.compute_dtype))
        return stats

    def _actor_micro_step(self, exp: Experience, rows: torch.Tensor, num_tokens, num_seqs: int) -> dict[str, float]:
        cfg = self.cfg
        ids, valid, P, T = _micro_slices(exp, rows)
        mask = exp.mask[rows][:, :T]
        with checkpointing(self.actor):  # recomputes activations in backward if policy.gradient_checkpointing
            logits = self._actor_logits(ids, valid, P)  # [b, T, V]
        logprobs = pm.logprobs_from_logits(logits, ids[:, P:], self.temperature)  # [b, T]
        pl, pstats = pm.policy_loss(logprobs, exp.old_logprobs[rows][:, :T], exp.advantages[rows][:, :T], mask,
                                    clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high,
                                    is_weights=exp.is_weights[rows][:, :T], loss_agg=cfg.loss_agg,
                                    num_tokens=num_tokens, num_seqs=num_seqs)
        loss = pl
        extra_stats = {}
        if self.algorithm is not None and self.algorithm.kl_in_loss:  # GRPO-style KL term
            kl_term, kstats = self.algorithm.actor_loss_extra(
                logprobs, exp.ref_logprobs[rows][:, :T], mask, is_weights=exp.is_weights[rows][:, :T],
                loss_agg=cfg.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
            loss = loss + kl_term
            extra_stats = {"loss/kl": kl_term.item(), **{k: v.item() for k, v in kstats.items()}}
        if cfg.entropy_coef:  # in the graph only when it is in the loss; otherwise a detached statistic
            entropy = pm.entropy_from_logits(logits / self.temperature)  # [b, T]
            loss = loss - cfg.entropy_coef * pm.aggregate(entropy, mask, cfg.loss_agg, num_tokens, num_seqs)
        else:
            with torch.no_grad():
                entropy = pm.entropy_from_logits(logits / self.temperature)  # [b, T]
        loss.backward()
        return {
            "loss/policy": pl.item(), "ppo/clipfrac": pstats["clipfrac"].item(),
            "ppo/approx_kl": pstats["approx_kl"].item(),
            "ppo/entropy": pm.masked_mean(entropy.detach(), mask).item(),
            "_frac": (mask.sum() / num_tokens).item(),  # weight of this micro-batch's stats in the minibatch
            **extra_stats,
        }


@dataclass
class CriticBatch:
    """What the critic's update needs from an Experience (small enough to send to a worker)."""

    ids: torch.Tensor
    valid: torch.Tensor
    P: int
    mask: torch.Tensor
    values: torch.Tensor
    returns: torch.Tensor

    @classmethod
    def of(cls, exp: Experience) -> "CriticBatch":
        return cls(exp.ids, exp.valid, exp.P, exp.mask, exp.values, exp.returns)

    def to(self, device) -> "CriticBatch":
        return CriticBatch(self.ids.to(device), self.valid.to(device), self.P, self.mask.to(device),
                           self.values.to(device), self.returns.to(device))


def critic_update(critic, opt: torch.optim.Optimizer, batch: CriticBatch, minibatches: list[torch.Tensor],
                  cfg: PPOConfig, before_micro=None, compute_dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Stage 6 for the critic: clipped value loss over the given minibatches.

    A plain function of its arguments, so the scorer worker that holds the critic can run it
    while the actor trains (``overlap.critic_on_worker``). ``before_micro()``, if given, runs
    before each micro-batch (the worker adapts its thread count there). ``critic`` holds the
    trained (master) weights; its forward runs under ``compute_dtype`` autocast.
    """
    dev = next(critic.parameters()).device
    batch = batch.to(dev)

    def micro(rows, num_tokens, num_seqs):
        if before_micro is not None:
            before_micro()
        return critic_micro_step(critic, batch, rows, num_tokens, num_seqs, cfg, compute_dtype)

    return _train(critic, opt, batch.mask, [mb.to(dev) for mb in minibatches], cfg, "critic", micro)


def critic_micro_step(critic, batch: CriticBatch, rows: torch.Tensor, num_tokens, num_seqs: int, cfg: PPOConfig,
                      compute_dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """One micro-batch of the critic's update: clipped value loss, backward (gradients accumulate)."""
    ids, valid, P, T = _micro_slices(batch, rows)
    mask = batch.mask[rows][:, :T]
    with autocast(ids.device, compute_dtype), checkpointing(critic):
        values = response_outputs("critic", critic, ids, valid, P)  # [b, T]
    vl, vstats = pm.value_loss(values, batch.values[rows][:, :T], batch.returns[rows][:, :T], mask,
                               clip_eps=cfg.value_clip_eps, loss_agg=cfg.loss_agg,
                               num_tokens=num_tokens, num_seqs=num_seqs)
    vl.backward()
    return {"loss/value": vl.item(), "value/clipfrac": vstats["vf_clipfrac"].item(),
            "_frac": (mask.sum() / num_tokens).item()}


def _train(model, opt, mask: torch.Tensor, minibatches: list[torch.Tensor], cfg: PPOConfig, name: str,
           micro_step) -> dict[str, float]:
    """Optimizer steps over ``minibatches``; each is split into micro-batches that accumulate gradients.

    The loss of a minibatch is aggregated with the minibatch's global token (and sequence) count,
    so splitting it into micro-batches changes nothing but memory. Returns means over optimizer
    steps: losses add up across micro-batches (they are already scaled by the minibatch
    denominator), per-token statistics are weighted by each micro-batch's token share.
    """
    sums: dict[str, float] = {}
    for mb in minibatches:
        num_tokens = mask[mb].sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        for rows in mb.split(cfg.micro_batch_size):
            stats = micro_step(rows, num_tokens, len(mb))
            w = stats.pop("_frac")
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + (v if k.startswith("loss/") else v * w)
        sums[f"grad_norm/{name}"] = sums.get(f"grad_norm/{name}", 0.0) + _clip(model, cfg.max_grad_norm)
        if cfg.lr_warmup_steps > 0:
            warm_up(opt, cfg.actor_lr if name == "actor" else cfg.critic_lr, cfg.lr_warmup_steps)
        opt.step()
    return {k: v / len(minibatches) for k, v in sums.items()}


def warm_up(opt: torch.optim.Optimizer, lr: float, warmup_steps: int) -> None:
    """Set the learning rate of the optimizer step about to be taken, the n-th (from 1):
    ``lr * min(1, n / warmup_steps)``. n comes from the optimizer's own step count (AdamW's
    per-parameter ``step``, in its state dict), so a resumed run, the scorer worker's shared
    critic optimizer and every data-parallel rank agree without a scheduler of their own."""
    done = next((int(st["step"]) for st in opt.state.values() if "step" in st), 0)
    for group in opt.param_groups:
        group["lr"] = lr * min(1.0, (done + 1) / warmup_steps)


def _clip(model, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    return float(norm)
