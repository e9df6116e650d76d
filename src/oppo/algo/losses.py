"""Losses (pure, torch only): KL estimators, loss aggregation, the clipped policy loss, the value
loss, KL as a loss term, and the log-prob/entropy readers of logits.

Conventions (alignment, masks, statistics) are in :mod:`oppo.algo.masks`. A loss returns
``(value, stats)``, stats detached 0-d tensors. Which gradient each KL estimator gives as a loss
term is derived in docs/implementation-details.md ("KL estimators as a loss").
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from .choices import KL_KINDS, LOSS_AGGS
from .masks import Number, Stats, Tensor, keep, masked_mean, masked_sum, masked_var, stat, zero_masked

__all__ = [
    "KL_KINDS",
    "LOSS_AGGS",
    "kl_estimate",
    "aggregate",
    "policy_loss",
    "value_loss",
    "kl_loss",
    "entropy_from_logits",
    "logprobs_from_logits",
    "explained_variance",
]


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k1") -> Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled tokens' log-probs.

    With d = logprobs - ref_logprobs (tokens sampled from pi):
      "k1":  d                          (unbiased, can be negative)
      "k2":  0.5 * d^2                  (biased, low variance, >= 0)
      "k3":  exp(-d) + d - 1            (Schulman's unbiased, >= 0)
      "abs": |d|
    """
    d = logprobs - ref_logprobs  # [B, T]
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        # exp(ref - logp) - (ref - logp) - 1, written with expm1 for accuracy near 0
        return torch.expm1(-d) + d
    if kind == "abs":
        return d.abs()
    raise ValueError(f"unknown kl kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")


def _check_count(name: str, n) -> None:
    if isinstance(n, (int, float)) and n <= 0:
        raise ValueError(f"{name} must be positive, got {n}")


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    loss_agg: str = "token_mean",
    num_tokens: Optional[Union[Number, Tensor]] = None,
    num_seqs: Optional[Union[Number, Tensor]] = None,
) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    "token_mean":          sum(loss * mask) / D,  D = num_tokens or mask.sum()
    "seq_mean_token_mean": sum_rows(row token mean) / S,  S = num_seqs or B
    "seq_mean_token_sum":  sum_rows(row token sum) / S,   S = num_seqs or B

    Pass the minibatch's num_tokens / num_seqs when it is cut into micro-batches: the pieces'
    losses (and gradients) then sum to the minibatch's. Without them an all-masked batch gives 0
    for "token_mean"; rows with no tokens give 0 in the seq modes but still count in B.
    """
    if loss_agg == "token_mean":
        if num_tokens is None:
            return masked_mean(per_token, mask)
        _check_count("num_tokens", num_tokens)
        return masked_sum(per_token, mask) / num_tokens
    if loss_agg in ("seq_mean_token_mean", "seq_mean_token_sum"):
        if loss_agg == "seq_mean_token_mean":
            per_seq = masked_mean(per_token, mask, dim=-1)  # [B]
        else:
            per_seq = masked_sum(per_token, mask, dim=-1)  # [B]
        if num_seqs is None:
            num_seqs = per_seq.numel()
            if num_seqs == 0:
                return per_seq.sum()
        _check_count("num_seqs", num_seqs)
        return per_seq.sum() / num_seqs
    raise ValueError(f"unknown loss_agg {loss_agg!r}; valid: {', '.join(LOSS_AGGS)}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    is_weights: Optional[Tensor] = None,
    loss_agg: str = "token_mean",
    num_tokens: Optional[Union[Number, Tensor]] = None,
    num_seqs: Optional[Union[Number, Tensor]] = None,
) -> Tuple[Tensor, Stats]:
    """PPO clipped surrogate loss per token (to minimise).

      ratio = exp(logprobs - old_logprobs)
      pg    = max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps_high))
      dual clip (A < 0 only): pg = min(pg, -A * dual_clip)
      pg   *= is_weights            (detached per-token weights, optional)

    Stats (over this call's unmasked tokens): "clipfrac" (share where the clipped branch was
    strictly larger), "approx_kl" (mean 0.5*(logprobs-old)^2), "ratio_mean", "ratio_max", and
    "dual_clipfrac" when dual_clip is set.
    """
    if dual_clip is not None and not 1.0 < dual_clip < float("inf"):  # (NaN fails too)
        raise ValueError(f"dual_clip must be a finite number > 1, got {dual_clip}")
    high = clip_eps if clip_eps_high is None else clip_eps_high

    log_ratio = zero_masked(logprobs - old_logprobs, mask)  # [B, T]
    adv = zero_masked(advantages, mask).to(log_ratio.dtype)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    pg_unclipped = -adv * ratio  # [B, T]
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)  # [B, T]
    pg = torch.maximum(pg_unclipped, pg_clipped)  # [B, T]
    clipped = pg_clipped > pg_unclipped  # [B, T]

    stats: Stats = {}
    if dual_clip is not None:
        cap = -adv * dual_clip  # [B, T]
        dual = (adv < 0) & (pg > cap)  # [B, T]
        pg = torch.where(dual, cap, pg)  # [B, T]
        stats["dual_clipfrac"] = stat(masked_mean(dual.to(pg.dtype), mask))

    if is_weights is not None:
        w = zero_masked(is_weights.detach(), mask).to(pg.dtype)  # [B, T]
        pg = pg * w  # [B, T]

    loss = aggregate(pg, mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)

    with torch.no_grad():
        kept = keep(mask)
        ratio_d = ratio.detach()
        stats["clipfrac"] = stat(masked_mean(clipped.to(pg.dtype), mask))
        stats["approx_kl"] = stat(masked_mean(0.5 * log_ratio.detach() ** 2, mask))
        stats["ratio_mean"] = stat(masked_mean(ratio_d, mask))
        rmax = ratio_d.masked_fill(~kept, float("-inf")).max() if ratio_d.numel() else ratio_d.new_zeros(())
        stats["ratio_max"] = stat(torch.where(kept.any(), rmax, torch.zeros_like(rmax)))  # 0 if no tokens
    return loss, stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: Optional[float] = 0.2,
    loss_agg: str = "token_mean",
    num_tokens: Optional[Union[Number, Tensor]] = None,
    num_seqs: Optional[Union[Number, Tensor]] = None,
) -> Tuple[Tensor, Stats]:
    """Clipped value loss: 0.5 * max((v - R)^2, (clip(v, old - eps, old + eps) - R)^2).

    ``clip_eps=None`` gives the plain 0.5 * (v - R)^2. Stats: "vf_clipfrac" (share where the
    clipped term was strictly larger), "values_mean".
    """
    v = zero_masked(values, mask)  # [B, T]
    old = zero_masked(old_values, mask).to(v.dtype)  # [B, T]
    ret = zero_masked(returns, mask).to(v.dtype)  # [B, T]
    loss_unclipped = (v - ret) ** 2  # [B, T]
    if clip_eps is None:
        per_token = 0.5 * loss_unclipped  # [B, T]
        clipped = torch.zeros_like(v, dtype=torch.bool)  # [B, T]
    else:
        v_clipped = old + torch.clamp(v - old, -clip_eps, clip_eps)  # [B, T]
        loss_clipped = (v_clipped - ret) ** 2  # [B, T]
        per_token = 0.5 * torch.maximum(loss_unclipped, loss_clipped)  # [B, T]
        clipped = loss_clipped > loss_unclipped  # [B, T]
    loss = aggregate(per_token, mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        stats: Stats = {
            "vf_clipfrac": stat(masked_mean(clipped.to(v.dtype), mask)),
            "values_mean": stat(masked_mean(v.detach(), mask)),
        }
    return loss, stats


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kind: str = "k3",
    max_value: Optional[float] = None,
    is_weights: Optional[Tensor] = None,
    loss_agg: str = "token_mean",
    num_tokens: Optional[Union[Number, Tensor]] = None,
    num_seqs: Optional[Union[Number, Tensor]] = None,
) -> Tuple[Tensor, Stats]:
    """Per-token KL(pi || ref) estimate aggregated like the policy loss (GRPO's KL term).

    ``ref_logprobs`` are constants. ``max_value`` clamps the per-token estimate from above (k3
    grows like ``exp(log ref - log pi)``; verl clamps at 10); clamped tokens give no gradient.
    ``is_weights`` (detached) weigh off-policy tokens as in :func:`policy_loss`; the
    denominators are :func:`aggregate`'s, so the term adds to the policy loss of the same
    micro-batch. Stats: ``kl/loss_mean`` (unweighted masked mean of the estimate).
    """
    if max_value is not None and not max_value > 0:
        raise ValueError(f"max_value must be > 0 or None, got {max_value}")
    lp = zero_masked(logprobs, mask)  # [B, T]
    ref = zero_masked(ref_logprobs.detach(), mask).to(lp.dtype)  # [B, T]
    per_token = kl_estimate(lp, ref, kind)  # [B, T]
    if max_value is not None:
        per_token = per_token.clamp(max=max_value)  # [B, T]
    with torch.no_grad():
        stats = {"kl/loss_mean": masked_mean(per_token.detach(), mask).reshape(())}
    if is_weights is not None:
        per_token = per_token * zero_masked(is_weights.detach(), mask).to(per_token.dtype)  # [B, T]
    loss = aggregate(per_token, mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, stats


# ---------------------------------------------------------------------------
# logits
# ---------------------------------------------------------------------------

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: [..., V] -> [...].

    H = logsumexp(z) - sum(softmax(z) * z) on z - max(z) (large logits lose no precision).
    Half/bfloat16 logits are computed in float32 (float32 result); -inf logits are allowed.
    """
    z = logits.float() if logits.dtype in _LOW_PRECISION else logits  # [..., V]
    z = z - z.detach().amax(dim=-1, keepdim=True)  # [..., V]  (max entry is 0)
    lse = torch.logsumexp(z, dim=-1)  # [...]
    p = torch.softmax(z, dim=-1)  # [..., V]
    z_finite = torch.where(torch.isneginf(z), torch.zeros((), dtype=z.dtype, device=z.device), z)  # [..., V]
    return lse - (p * z_finite).sum(dim=-1)  # [...]


def logprobs_from_logits(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log_softmax(logits / temperature) gathered at ``tokens``: [B, T, V], [B, T] -> [B, T].

    ``logits[:, t]`` must already predict ``tokens[:, t]`` (shifted by one from the input ids).
    Half/bfloat16 logits are upcast to float32 one row at a time (bounded peak memory); the
    result is float32 for them and the input dtype otherwise.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    idx = tokens.long().unsqueeze(-1)  # [B, T, 1]
    if logits.dtype in _LOW_PRECISION:
        rows = []
        for b in range(logits.shape[0]):
            z = logits[b].float()  # [T, V]
            if temperature != 1.0:
                z = z / temperature
            rows.append(torch.log_softmax(z, dim=-1).gather(-1, idx[b]).squeeze(-1))  # [T]
        if rows:
            return torch.stack(rows, dim=0)  # [B, T]
        return logits.new_zeros(tokens.shape, dtype=torch.float32)
    z = logits / temperature if temperature != 1.0 else logits  # [B, T, V]
    return torch.log_softmax(z, dim=-1).gather(-1, idx).squeeze(-1)  # [B, T]


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var(returns - values) / Var(returns) over unmasked entries (detached 0-d), the critic's
    fit; NaN when Var(returns) is 0 (including fewer than two tokens)."""
    with torch.no_grad():
        v = zero_masked(values.detach(), mask)  # [B, T]
        r = zero_masked(returns.detach(), mask).to(v.dtype)  # [B, T]
        var_r = masked_var(r, mask, unbiased=False)  # []
        var_d = masked_var(r - v, mask, unbiased=False)  # []
        ok = var_r > 0
        ev = 1.0 - var_d / torch.where(ok, var_r, torch.ones_like(var_r))
        return torch.where(ok, ev, torch.full_like(ev, float("nan")))
