"""Pure tensor math for PPO-based RLHF.

Everything here is a stateless function of tensors: no config objects, no
module state, no I/O.  Loss functions return ``(value, stats)`` where
``stats`` maps names to *detached 0-d tensors* (callers call ``.item()`` when
they want python numbers, so no device sync happens in here).

Alignment of per-token tensors
------------------------------
All per-token tensors are ``[B, T]`` and cover the *response only*, right-padded
after the end of each response.  For one row whose response has T tokens
``a_0 .. a_{T-1}`` (the last one being EOS when the model stopped by itself)::

    sequence:    p_0 .. p_{P-1} | a_0      a_1      ...  a_{T-1}  | pad  pad
                                  ^        ^             ^
    logprobs[t]  = log pi(a_t | prompt, a_<t)   (log-prob of the sampled token)
    values[t]    = V(prompt, a_<t)              (state *before* a_t is sampled)
    mask[t]      = 1        1       ...  1          0    0
    rewards[t]   = -kl_coef*kl[t]   ...  -kl_coef*kl[t] + score   0    0
                                                  ^ last unmasked index
                                                    = mask.sum(1) - 1

    t:             0        1       ...  T-1        T    T+1

With a causal LM over ``prompt + response``, the logits that score ``a_t`` sit
at sequence position ``P + t - 1`` (one to the left of the token), and the
value head output at that same position is ``values[t]``.

The episode ends at the last response token: the bootstrap value after
``a_{T-1}`` is 0.  Whatever lies at masked positions (padding) of any input is
ignored: it never changes an output at an unmasked position, and outputs at
masked positions are 0.  Masks may be bool or 0/1 float tensors.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch

Tensor = torch.Tensor
Stats = Dict[str, Tensor]
Number = Union[int, float]

KL_KINDS = ("k1", "k2", "k3", "abs")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")

__all__ = [
    "KL_KINDS",
    "LOSS_AGGS",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "kl_estimate",
    "kl_shaped_rewards",
    "gae",
    "aggregate",
    "policy_loss",
    "value_loss",
    "entropy_from_logits",
    "logprobs_from_logits",
    "explained_variance",
    "missing_eos_penalty",
]


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _keep(mask: Tensor) -> Tensor:
    """Boolean view of a (bool or 0/1 float) mask."""
    return mask if mask.dtype == torch.bool else mask != 0


def _zero_masked(x: Tensor, mask: Tensor) -> Tensor:
    """x with masked positions set to exactly 0 (also removes inf/NaN there).

    Used *before* any nonlinearity so that garbage in padding can neither leak
    into outputs nor produce NaN gradients (0 * inf) in backward.
    """
    return torch.where(_keep(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _stat(x: Tensor) -> Tensor:
    return x.detach().reshape(())


# ---------------------------------------------------------------------------
# masked reductions
# ---------------------------------------------------------------------------


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of x over unmasked entries (over everything if dim is None)."""
    m = mask.to(x.dtype)
    xm = _zero_masked(x, mask) * m  # [*]  (non-0/1 float masks act as weights)
    return xm.sum() if dim is None else xm.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of x over unmasked entries; where the mask sums to 0 the result is 0."""
    num = masked_sum(x, mask, dim)
    den = mask.to(x.dtype)
    den = den.sum() if dim is None else den.sum(dim=dim)
    nonzero = den != 0
    return torch.where(nonzero, num / torch.where(nonzero, den, torch.ones_like(den)), torch.zeros_like(num))


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of x over all unmasked entries (0-d).

    With ``unbiased`` the n/(n-1) correction is applied when n > 1; for n <= 1
    the (biased, i.e. 0) variance is returned instead of inf/NaN.
    """
    mean = masked_mean(x, mask)  # []
    var = masked_mean((x - mean) ** 2, mask)  # []
    if unbiased:
        n = mask.to(x.dtype).sum()  # []
        big = n > 1
        var = torch.where(big, var * n / torch.where(big, n - 1, torch.ones_like(n)), var)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) with masked mean/(unbiased) var over all
    unmasked entries.  If ``shift_mean`` is False the mean is added back (only
    the scale is normalised).  Masked positions of the output are 0."""
    mean = masked_mean(x, mask)  # []
    var = masked_var(x, mask, unbiased=True)  # []
    xz = _zero_masked(x, mask)  # [*]
    out = (xz - mean) * torch.rsqrt(var + 1e-8)  # [*]
    if not shift_mean:
        out = out + mean
    return _zero_masked(out, mask)


# ---------------------------------------------------------------------------
# KL and rewards
# ---------------------------------------------------------------------------


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


def kl_shaped_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kl_coef: float,
    kl_kind: str = "k1",
) -> Tuple[Tensor, Tensor]:
    """Per-token rewards: -kl_coef * kl everywhere in the response, plus the
    sequence score added at the last unmasked position of each row
    (index mask.sum(1) - 1; the mask must be right-padded).

    Returns ``(rewards [B, T], kl [B, T])``, both 0 at masked positions.  Rows
    with an all-zero mask get no score (and are all zeros).  Nothing is
    detached here; call under ``torch.no_grad()``.
    """
    lp = _zero_masked(logprobs, mask)  # [B, T]
    ref = _zero_masked(ref_logprobs, mask)  # [B, T]
    kl = _zero_masked(kl_estimate(lp, ref, kl_kind), mask)  # [B, T]
    rewards = -kl_coef * kl  # [B, T]
    lengths = mask.to(torch.long).sum(dim=1)  # [B]
    has_tokens = lengths > 0  # [B]
    last = (lengths - 1).clamp(min=0)  # [B]
    s = scores.to(rewards.dtype).reshape(-1)  # [B]
    s = torch.where(has_tokens, s, torch.zeros_like(s))  # [B]
    if rewards.shape[1] == 0:
        return rewards, kl
    rewards = rewards.scatter_add(1, last.unsqueeze(1), s.unsqueeze(1))  # [B, T]
    return rewards, kl


# ---------------------------------------------------------------------------
# advantages
# ---------------------------------------------------------------------------


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> Tuple[Tensor, Tensor]:
    """Generalised advantage estimation over right-padded rows.

      delta_t = r_t + gamma * V_{t+1} - V_t      (V_{t+1} = 0 past the row end)
      A_t     = delta_t + gamma * lam * A_{t+1}  (A = 0 past the row end)
      R_t     = A_t + V_t

    Returns ``(advantages [B, T], returns [B, T])``, 0 at masked positions.
    Nothing is detached; call under ``torch.no_grad()``.
    """
    m = mask.to(rewards.dtype)  # [B, T]
    r = _zero_masked(rewards, mask)  # [B, T]
    v = _zero_masked(values, mask).to(rewards.dtype)  # [B, T]
    B, T = r.shape
    next_value = r.new_zeros(B)  # [B]
    next_adv = r.new_zeros(B)  # [B]
    next_keep = r.new_zeros(B)  # [B]  mask[t+1]; 0 beyond the end
    adv_rev = []
    for t in range(T - 1, -1, -1):
        delta = r[:, t] + gamma * next_value * next_keep - v[:, t]  # [B]
        adv_t = (delta + gamma * lam * next_keep * next_adv) * m[:, t]  # [B]
        adv_rev.append(adv_t)
        next_value, next_adv, next_keep = v[:, t], adv_t, m[:, t]
    advantages = torch.stack(adv_rev[::-1], dim=1) if T > 0 else r.clone()  # [B, T]
    returns = (advantages + v) * m  # [B, T]
    return advantages, returns


# ---------------------------------------------------------------------------
# loss aggregation
# ---------------------------------------------------------------------------


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

    Pass the *global* num_tokens (unmasked tokens in the whole batch) or
    num_seqs (rows in the whole batch) when the batch is split into micro- or
    mini-batches: summing the returned losses (and their gradients) over the
    pieces then gives exactly the full-batch value.  num_tokens is only used by
    "token_mean", num_seqs only by the "seq_mean_*" modes.  Without a global
    count, an all-masked batch gives 0 for "token_mean"; rows with no tokens
    contribute 0 to the seq modes but still count in B.
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


# ---------------------------------------------------------------------------
# losses
# ---------------------------------------------------------------------------


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
    """PPO clipped surrogate loss (to minimise).

      ratio = exp(logprobs - old_logprobs)
      pg    = max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps_high))
      dual clip (A < 0 only): pg = min(pg, -A * dual_clip)
      pg   *= is_weights            (detached per-token weights, optional)

    Stats (detached 0-d tensors, over this call's unmasked tokens):
    "clipfrac" (fraction of tokens where the clipped branch was strictly
    larger), "approx_kl" (mean 0.5*(logprobs-old)^2), "ratio_mean",
    "ratio_max", and "dual_clipfrac" when dual_clip is set.
    """
    if dual_clip is not None and not 1.0 < dual_clip < float("inf"):  # (NaN fails too)
        raise ValueError(f"dual_clip must be a finite number > 1, got {dual_clip}")
    high = clip_eps if clip_eps_high is None else clip_eps_high

    log_ratio = _zero_masked(logprobs - old_logprobs, mask)  # [B, T]
    adv = _zero_masked(advantages, mask).to(log_ratio.dtype)  # [B, T]
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
        stats["dual_clipfrac"] = _stat(masked_mean(dual.to(pg.dtype), mask))

    if is_weights is not None:
        w = _zero_masked(is_weights.detach(), mask).to(pg.dtype)  # [B, T]
        pg = pg * w  # [B, T]

    loss = aggregate(pg, mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)

    with torch.no_grad():
        keep = _keep(mask)
        ratio_d = ratio.detach()
        stats["clipfrac"] = _stat(masked_mean(clipped.to(pg.dtype), mask))
        stats["approx_kl"] = _stat(masked_mean(0.5 * log_ratio.detach() ** 2, mask))
        stats["ratio_mean"] = _stat(masked_mean(ratio_d, mask))
        rmax = ratio_d.masked_fill(~keep, float("-inf")).max() if ratio_d.numel() else ratio_d.new_zeros(())
        stats["ratio_max"] = _stat(torch.where(keep.any(), rmax, torch.zeros_like(rmax)))  # 0 if no tokens
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

    ``clip_eps=None`` gives the plain 0.5 * (v - R)^2.  Stats: "vf_clipfrac"
    (fraction of tokens where the clipped term was strictly larger),
    "values_mean" (mean of the current values).
    """
    v = _zero_masked(values, mask)  # [B, T]
    old = _zero_masked(old_values, mask).to(v.dtype)  # [B, T]
    ret = _zero_masked(returns, mask).to(v.dtype)  # [B, T]
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
            "vf_clipfrac": _stat(masked_mean(clipped.to(v.dtype), mask)),
            "values_mean": _stat(masked_mean(v.detach(), mask)),
        }
    return loss, stats


# ---------------------------------------------------------------------------
# logits utilities
# ---------------------------------------------------------------------------

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: [..., V] -> [...].

    H = logsumexp(z) - sum(softmax(z) * z), computed on z - max(z) so that
    large logits lose no precision.  Half/bfloat16 logits are computed in
    float32 (result is float32).  -inf logits (banned tokens) are allowed.
    """
    z = logits.float() if logits.dtype in _LOW_PRECISION else logits  # [..., V]
    z = z - z.detach().amax(dim=-1, keepdim=True)  # [..., V]  (max entry is 0)
    lse = torch.logsumexp(z, dim=-1)  # [...]
    p = torch.softmax(z, dim=-1)  # [..., V]
    z_finite = torch.where(torch.isneginf(z), torch.zeros((), dtype=z.dtype, device=z.device), z)  # [..., V]
    return lse - (p * z_finite).sum(dim=-1)  # [...]


def logprobs_from_logits(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log_softmax(logits / temperature) gathered at ``tokens``: [B, T, V], [B, T] -> [B, T].

    ``logits[:, t]`` must already be the logits that predict ``tokens[:, t]``
    (i.e. shifted by one relative to the input ids).  Half/bfloat16 logits are
    upcast to float32 one row at a time to bound peak memory; the result is
    float32 for them and the input dtype otherwise.
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


# ---------------------------------------------------------------------------
# diagnostics and reward post-processing
# ---------------------------------------------------------------------------


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var(returns - values) / Var(returns) over unmasked entries (detached 0-d).

    NaN when Var(returns) is 0 (including when fewer than two tokens)."""
    with torch.no_grad():
        v = _zero_masked(values.detach(), mask)  # [B, T]
        r = _zero_masked(returns.detach(), mask).to(v.dtype)  # [B, T]
        var_r = masked_var(r, mask, unbiased=False)  # []
        var_d = masked_var(r - v, mask, unbiased=False)  # []
        ok = var_r > 0
        ev = 1.0 - var_d / torch.where(ok, var_r, torch.ones_like(var_r))
        return torch.where(ok, ev, torch.full_like(ev, float("nan")))


def missing_eos_penalty(scores: Tensor, ended_with_eos: Tensor, penalty: Optional[float]) -> Tensor:
    """scores - penalty for rows that did not end with EOS (ended_with_eos bool [B]).

    ``penalty`` None or 0 returns ``scores`` unchanged (the same tensor);
    otherwise a new tensor is returned (no in-place modification)."""
    if penalty is None or penalty == 0:
        return scores
    missing = (~ended_with_eos.bool()).to(scores.dtype)  # [B]
    return scores - penalty * missing
