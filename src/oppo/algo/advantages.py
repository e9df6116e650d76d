"""Advantage estimators (pure, torch only): KL-shaped rewards, GAE, whitening, the group
baselines of GRPO and RLOO, and REINFORCE++'s whitened return-to-go.

Conventions (alignment, masks, statistics) are in :mod:`oppo.algo.masks`.

Groups: GRPO and RLOO compare the ``G`` responses to one prompt. Scores come either shaped
``[n_groups, G]`` (``group_ids=None``, row = group) or ``[B]`` with ``group_ids [B]`` (any
integer labels, any order, any group size); the result has the shape of ``scores``. A group
whose scores are all equal carries no signal: its advantages are exactly 0 (not ``0 / eps``
noise), and their share is ``group/zero_std_frac``. :func:`broadcast_to_tokens` puts a
sequence's advantage on each of its tokens (GRPO's outcome supervision).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .losses import kl_estimate
from .masks import Stats, Tensor, masked_mean, masked_var, zero_masked

__all__ = [
    "masked_whiten",
    "kl_shaped_rewards",
    "missing_eos_penalty",
    "gae",
    "group_index",
    "grpo_advantages",
    "rloo_advantages",
    "broadcast_to_tokens",
    "discounted_returns",
    "reinforce_pp_advantages",
]


# ---------------------------------------------------------------------------
# rewards and whitening
# ---------------------------------------------------------------------------


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) with masked mean/(unbiased) var over all
    unmasked entries.  If ``shift_mean`` is False the mean is added back (only
    the scale is normalised).  Masked positions of the output are 0."""
    mean = masked_mean(x, mask)  # []
    var = masked_var(x, mask, unbiased=True)  # []
    xz = zero_masked(x, mask)  # [*]
    out = (xz - mean) * torch.rsqrt(var + 1e-8)  # [*]
    if not shift_mean:
        out = out + mean
    return zero_masked(out, mask)


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
    lp = zero_masked(logprobs, mask)  # [B, T]
    ref = zero_masked(ref_logprobs, mask)  # [B, T]
    kl = zero_masked(kl_estimate(lp, ref, kl_kind), mask)  # [B, T]
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


def missing_eos_penalty(scores: Tensor, ended_with_eos: Tensor, penalty: Optional[float]) -> Tensor:
    """scores - penalty for rows that did not end with EOS (ended_with_eos bool [B]).

    ``penalty`` None or 0 returns ``scores`` unchanged (the same tensor);
    otherwise a new tensor is returned (no in-place modification)."""
    if penalty is None or penalty == 0:
        return scores
    missing = (~ended_with_eos.bool()).to(scores.dtype)  # [B]
    return scores - penalty * missing


# ---------------------------------------------------------------------------
# critic: GAE
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
    r = zero_masked(rewards, mask)  # [B, T]
    v = zero_masked(values, mask).to(rewards.dtype)  # [B, T]
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
# groups
# ---------------------------------------------------------------------------


def group_index(scores: Tensor, group_ids: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, int]:
    """Flatten a grouped batch: returns ``(flat scores [N], group index [N] in 0..n-1, n)``.

    ``scores [n, G]`` with ``group_ids=None`` (row = group), or ``scores [B]`` with
    ``group_ids [B]`` (any integer labels; the index numbers them in sorted label order).
    """
    if group_ids is None:
        if scores.dim() != 2:
            raise ValueError(
                f"scores of shape {tuple(scores.shape)} need group_ids; pass scores shaped "
                "[n_groups, G] or scores [B] with group_ids [B]"
            )
        n, g = scores.shape
        idx = torch.arange(n, device=scores.device).repeat_interleave(g)  # [n*G]
        return scores.reshape(-1), idx, n
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(
            f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must both be "
            "[B]; or pass scores [n_groups, G] without group_ids"
        )
    labels, idx = torch.unique(group_ids, return_inverse=True)  # [n], [B]
    return scores, idx, labels.numel()


def _group_moments(s: Tensor, idx: Tensor, n: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-group ``(count [n], sum [n], unbiased std [n], all-equal [n] bool)`` of flat s [N].

    std is 0 for groups of one (as ``masks.masked_var`` does), never NaN.
    """
    count = torch.bincount(idx, minlength=n).to(s.dtype)  # [n]
    total = torch.zeros(n, dtype=s.dtype, device=s.device).index_add_(0, idx, s)  # [n]
    mean = total / count  # [n]  (every group has >= 1 member)
    sq = torch.zeros_like(total).index_add_(0, idx, (s - mean[idx]) ** 2)  # [n]
    big = count > 1  # [n]
    std = torch.where(big, sq / torch.where(big, count - 1, torch.ones_like(count)), torch.zeros_like(sq)).sqrt()
    lo = torch.full_like(total, float("inf")).scatter_reduce(0, idx, s, "amin")  # [n]
    hi = torch.full_like(total, float("-inf")).scatter_reduce(0, idx, s, "amax")  # [n]
    return count, total, std, lo == hi


def _group_stats(flat_adv: Tensor, flat_equal: Tensor) -> Stats:
    return {
        "group/zero_std_frac": flat_equal.to(flat_adv.dtype).mean().detach().reshape(()),
        "adv/abs_mean": flat_adv.detach().abs().mean().reshape(()),
    }


def grpo_advantages(
    scores: Tensor,
    group_ids: Optional[Tensor] = None,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> Tuple[Tensor, Stats]:
    """GRPO outcome advantages: each score against its group (DeepSeekMath, Shao et al. 2024).

      A_i = (s_i - mean_g) / (std_g + eps)     std_normalize=True  (GRPO; std unbiased)
      A_i =  s_i - mean_g                      std_normalize=False (Dr. GRPO, Liu et al. 2025: the std
                                               up-weights all-but-solved and all-but-failed groups)

    Groups whose scores are all equal give exactly 0; a group of one gives 0. Returns
    ``(advantages shaped like scores, stats)`` with ``group/zero_std_frac`` (over groups) and
    ``adv/abs_mean``. Call under ``torch.no_grad()`` (nothing is detached).
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}; GRPO uses a small positive eps such as 1e-6")
    s, idx, n = group_index(scores, group_ids)
    count, total, std, equal = _group_moments(s, idx, n)
    centred = s - (total / count)[idx]  # [N]
    adv = centred / (std[idx] + eps) if std_normalize else centred  # [N]
    adv = torch.where(equal[idx], torch.zeros_like(adv), adv)  # [N]  exact 0, not rounding noise
    stats = _group_stats(adv, equal)
    return adv.reshape(scores.shape), stats


def rloo_advantages(scores: Tensor, group_ids: Optional[Tensor] = None) -> Tuple[Tensor, Stats]:
    """RLOO advantages: each score against the mean of the *other* G-1 scores of its group
    (Kool et al. 2019; Ahmadian et al. 2024)::

      A_i = s_i - (sum_g - s_i) / (n_g - 1)  =  n_g / (n_g - 1) * (s_i - mean_g)

    The baseline never sees ``s_i``, so the estimator stays unbiased. A group of one has no
    "others": that raises ``ValueError`` rather than silently training without a baseline
    (use GRPO or REINFORCE++ with G = 1, or sample G >= 2). All-equal groups give exactly 0.
    Returns ``(advantages shaped like scores, stats)`` as :func:`grpo_advantages`.
    """
    s, idx, n = group_index(scores, group_ids)
    count, total, _, equal = _group_moments(s, idx, n)
    if bool((count < 2).any()):  # CPU-GPU sync point (once per batch)
        raise ValueError(
            "RLOO needs at least 2 samples per group for a leave-one-out baseline, but a group "
            f"has {int(count.min())}; sample group_size >= 2 responses per prompt"
        )
    others = (total[idx] - s) / (count[idx] - 1)  # [N]
    adv = torch.where(equal[idx], torch.zeros_like(s), s - others)  # [N]
    return adv.reshape(scores.shape), _group_stats(adv, equal)


def broadcast_to_tokens(seq_values: Tensor, mask: Tensor) -> Tensor:
    """A per-sequence value [B] on every response token: [B] -> [B, T], 0 at masked positions."""
    v = seq_values.reshape(-1, 1).expand(mask.shape)  # [B, T]
    return zero_masked(v, mask)


# ---------------------------------------------------------------------------
# REINFORCE++
# ---------------------------------------------------------------------------


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Return-to-go ``G_t = r_t + gamma * G_{t+1}`` (0 past the row end): [B, T] -> [B, T].

    This is GAE with V = 0 and lambda = 1 (delta_t = r_t), so it reuses :func:`gae`.
    """
    zeros = torch.zeros_like(rewards)  # [B, T]
    returns, _ = gae(rewards, zeros, mask, gamma=gamma, lam=1.0)  # [B, T]
    return returns


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tuple[Tensor, Tensor, Stats]:
    """REINFORCE++ (Hu 2025): return-to-go of the per-token rewards, whitened over the batch.

    ``rewards`` are the KL-shaped per-token rewards (:func:`kl_shaped_rewards`: score at the
    last token, ``-kl_coef * KL_t`` everywhere). The global whitening (masked mean and std over
    every response token of the batch) is the baseline; there is no critic and no group.
    Returns ``(advantages [B, T], returns [B, T], stats)``; stats ``returns/mean``.
    """
    returns = discounted_returns(rewards, mask, gamma)  # [B, T]
    adv = masked_whiten(returns, mask)  # [B, T]
    stats = {"returns/mean": masked_mean(returns, mask).detach().reshape(())}
    return adv, returns, stats
