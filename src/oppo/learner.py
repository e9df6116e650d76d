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
from .models import backbone_and_head


@dataclass
class Experience:
    """B finished sequences as response-aligned tensors (alignment: ``ppo_math`` docstring).

    ids, valid: [B, P+T] left-padded prompts then right-padded responses; ``P`` prompt width.
    mask: [B, T] 1 on response tokens (EOS included). versions: [B, T] policy version per token.
    behaviour_logprobs: [B, T] from the sampler. old_logprobs: [B, T] under pi_k, the policy
    the PPO ratio is clipped around (equal to behaviour for on-policy tokens).
    is_weights: [B, T] pi_k / behaviour for off-policy tokens (truncated), 1 otherwise.
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
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor
    rewards: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None


def _pad_rows(rows: list[list[float]], T: int, device, dtype=torch.float32) -> torch.Tensor:
    out = torch.zeros(len(rows), T, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out.to(device)


def build_experience(rollouts: list[Rollout], scores: list[float], ref: list[ScoredOutputs],
                     values: list[ScoredOutputs], pad_id: int, device) -> Experience:
    """Stack per-sequence results into tensors (no math yet)."""
    ids, valid, P, rmask = sequence_batch([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts],
                                          pad_id, device)
    T = rmask.shape[1]
    lp = _pad_rows([r.logprobs for r in rollouts], T, device)
    return Experience(
        rollouts=rollouts, ids=ids, valid=valid, P=P, mask=rmask.float(),
        versions=_pad_rows([r.versions for r in rollouts], T, device, torch.long),
        behaviour_logprobs=lp, old_logprobs=lp.clone(), is_weights=torch.ones_like(lp),
        ref_logprobs=_pad_rows([o.logprobs for o in ref], T, device),
        values=_pad_rows([o.values for o in values], T, device),
        scores=torch.tensor(scores, dtype=torch.float32, device=device),
    )


@torch.no_grad()
def compute_advantages(exp: Experience, cfg: PPOConfig) -> Experience:
    """Stages 4 and 5: KL-shaped per-token rewards, then GAE advantages and returns."""
    ended = torch.tensor([r.ended_with_eos for r in exp.rollouts], device=exp.scores.device)
    scores = pm.missing_eos_penalty(exp.scores, ended, cfg.missing_eos_penalty)
    exp.rewards, exp.kl = pm.kl_shaped_rewards(scores, exp.old_logprobs, exp.ref_logprobs, exp.mask,
                                               cfg.kl_coef, cfg.kl_estimator)
    adv, exp.returns = pm.gae(exp.rewards, exp.values, exp.mask, cfg.gamma, cfg.lam)
    exp.advantages = pm.masked_whiten(adv, exp.mask) if cfg.whiten_advantages else adv
    return exp


def _micro_slices(exp: Experience, rows: torch.Tensor):
    """Tensors of ``rows`` with columns trimmed to what those rows use."""
    valid = exp.valid[rows]
    first = int(valid[:, : exp.P].argmax(1).min()) if exp.P else 0  # leftmost real prompt column
    T = int(exp.mask[rows].sum(1).max())
    cols = slice(first, exp.P + T)
    return exp.ids[rows][:, cols], valid[:, cols], exp.P - first, T


class Learner:
    """Actor and critic with their optimizers; ``update`` runs the PPO epochs on one batch."""

    def __init__(self, actor, critic, cfg: PPOConfig, temperature: float, seed: int):
        self.actor, self.critic, self.cfg, self.temperature, self.seed = actor, critic, cfg, temperature, seed
        self.actor_opt = torch.optim.AdamW(actor.parameters(), lr=cfg.actor_lr, weight_decay=cfg.weight_decay)
        self.critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, weight_decay=cfg.weight_decay)

    def _actor_logits(self, ids, valid, P):
        backbone, head = backbone_and_head(self.actor)
        hidden = full_hidden(backbone, ids, valid)  # [b, P+T, H]
        return head(hidden[:, P - 1:-1]).float()  # [b, T, V] logits predicting each response token

    @torch.no_grad()
    def proximal_logprobs(self, exp: Experience, version: int) -> None:
        """Off-policy correction for carried sequences (decoupled PPO, as AReaL does).

        Tokens sampled by an older version get old_logprobs recomputed under pi_k (the current
        policy, around which the ratio is clipped) and an importance weight
        pi_k / pi_behaviour, truncated at ``ppo.is_truncate``. On-policy tokens are unchanged.
        """
        off = (exp.versions < version) & (exp.mask > 0)  # [B, T]
        rows = off.any(1).nonzero().squeeze(1)
        if rows.numel() == 0:
            return
        ids, valid, P, T = _micro_slices(exp, rows)
        prox = pm.logprobs_from_logits(self._actor_logits(ids, valid, P), ids[:, P:], self.temperature)  # [b, T]
        old = exp.old_logprobs[rows]
        old[:, :T] = torch.where(off[rows][:, :T], prox, old[:, :T])
        exp.old_logprobs[rows] = old
        w = torch.exp(exp.old_logprobs - exp.behaviour_logprobs)
        if self.cfg.is_truncate is not None:
            w = w.clamp(max=self.cfg.is_truncate)
        exp.is_weights = torch.where(off, w, torch.ones_like(w))

    def update(self, exp: Experience, step: int) -> dict[str, float]:
        """Stage 6: PPO epochs over minibatches; micro-batches accumulate gradients.

        The loss of a minibatch is aggregated with the minibatch's global token (and sequence)
        count, so splitting it into micro-batches changes nothing but memory.
        """
        cfg = self.cfg
        B = exp.mask.shape[0]
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)  # resumable: depends on step only
        sums: dict[str, float] = {}
        n = 0
        for _ in range(cfg.epochs):
            perm = torch.randperm(B, generator=gen).to(exp.mask.device)
            for mb in perm.split(cfg.minibatch_size):
                num_tokens = exp.mask[mb].sum().clamp(min=1)
                self.actor_opt.zero_grad(set_to_none=True)
                self.critic_opt.zero_grad(set_to_none=True)
                for micro in mb.split(cfg.micro_batch_size):
                    stats = self._micro_step(exp, micro, num_tokens, len(mb))
                    w = stats.pop("_frac")  # the micro-batch's share of the minibatch's tokens
                    for k, v in stats.items():
                        # losses are already scaled by the minibatch denominator: they add up;
                        # per-token means are weighted by the micro-batch's token share
                        sums[k] = sums.get(k, 0.0) + (v if k.startswith("loss/") else v * w)
                n += 1
                sums["grad_norm/actor"] = sums.get("grad_norm/actor", 0.0) + _clip(self.actor, cfg.max_grad_norm)
                sums["grad_norm/critic"] = sums.get("grad_norm/critic", 0.0) + _clip(self.critic, cfg.max_grad_norm)
                self.actor_opt.step()
                self.critic_opt.step()
        return {k: v / n for k, v in sums.items()}  # means over optimizer steps

    def _micro_step(self, exp: Experience, rows: torch.Tensor, num_tokens, num_seqs: int) -> dict[str, float]:
        cfg = self.cfg
        ids, valid, P, T = _micro_slices(exp, rows)
        mask = exp.mask[rows][:, :T]
        logits = self._actor_logits(ids, valid, P)  # [b, T, V]
        logprobs = pm.logprobs_from_logits(logits, ids[:, P:], self.temperature)  # [b, T]
        pl, pstats = pm.policy_loss(logprobs, exp.old_logprobs[rows][:, :T], exp.advantages[rows][:, :T], mask,
                                    clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high,
                                    is_weights=exp.is_weights[rows][:, :T], loss_agg=cfg.loss_agg,
                                    num_tokens=num_tokens, num_seqs=num_seqs)
        loss = pl
        if cfg.entropy_coef:  # in the graph only when it is in the loss; otherwise a detached statistic
            entropy = pm.entropy_from_logits(logits / self.temperature)  # [b, T]
            loss = loss - cfg.entropy_coef * pm.aggregate(entropy, mask, cfg.loss_agg, num_tokens, num_seqs)
        else:
            with torch.no_grad():
                entropy = pm.entropy_from_logits(logits / self.temperature)  # [b, T]
        loss.backward()
        critic_dev = next(self.critic.parameters()).device  # the critic may sit on its own device
        values = response_outputs("critic", self.critic, ids.to(critic_dev), valid.to(critic_dev), P)
        values = values.to(mask.device)  # [b, T]
        vl, vstats = pm.value_loss(values, exp.values[rows][:, :T], exp.returns[rows][:, :T], mask,
                                   clip_eps=cfg.value_clip_eps, loss_agg=cfg.loss_agg,
                                   num_tokens=num_tokens, num_seqs=num_seqs)
        vl.backward()
        frac = mask.sum() / num_tokens  # weight of this micro-batch's stats in the minibatch
        return {
            "loss/policy": pl.item(), "loss/value": vl.item(),
            "ppo/clipfrac": pstats["clipfrac"].item(), "ppo/approx_kl": pstats["approx_kl"].item(),
            "ppo/entropy": pm.masked_mean(entropy.detach(), mask).item(),
            "value/clipfrac": vstats["vf_clipfrac"].item(),
            "_frac": frac.item(),
        }


def _clip(model, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    return float(norm)
