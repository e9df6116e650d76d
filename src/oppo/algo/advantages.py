"""Pure tensor math for the critic-free algorithms: GRPO, RLOO, REINFORCE++, and KL as a loss.

Same conventions as :mod:`oppo.ppo_math` (read its docstring for the response alignment):
per-token tensors are ``[B, T]``, response only, right-padded; masks are bool or 0/1 float;
whatever lies at masked positions never changes an output, and outputs there are 0. Functions
return their value and, where useful, a dict of *detached 0-d tensors* (no device sync in here).
This module imports only torch (and ``ppo_math``, which imports only torch).

Groups
------
GRPO and RLOO compare the ``G`` responses sampled for one prompt (a *group*). A batch of
per-sequence scores is given either

* shaped ``[n_groups, G]`` (``group_ids=None``): row ``i`` is group ``i``; or
* shaped ``[B]`` with ``group_ids [B]``: any integer labels, any order, groups of any size.

The result has the shape of ``scores``. A group whose scores are all equal (every response
solved, or none) carries no signal: its advantages are exactly 0, not ``0 / eps`` rounding
noise. The fraction of such groups is reported as ``group/zero_std_frac``.

Per-sequence advantages become per-token ones with :func:`broadcast_to_tokens` (every response
token of a sequence gets the sequence's advantage, as in GRPO's outcome supervision).

KL as a loss (GRPO style)
-------------------------
:func:`kl_loss` aggregates a per-token KL(pi || ref) estimate like the policy loss, to be added
to it as ``kl_coef * kl_loss`` (instead of subtracting ``kl_coef * KL`` from the reward). The
estimators differ in *what gradient* they give when differentiated on tokens sampled from pi
(the sample itself is not differentiated), with ``d = log pi - log ref``:

  k1 = d                 grad = grad log pi            expectation 0: no KL pressure at all
  k2 = d^2 / 2           grad = d * grad log pi        expectation = grad KL(pi || ref)
  k3 = e^-d + d - 1      grad = (1 - e^-d) grad log pi expectation = grad KL(ref || pi)

so k3, GRPO's choice (DeepSeekMath, Shao et al. 2024, eq. 4), pulls towards the reference
through the *forward* KL, and k2 is the one whose gradient is that of the reverse KL
(Zhang et al. 2025, "On the design of KL-regularized policy gradient algorithms for LLM
reasoning"). ``tests/test_algo_math.py`` checks all three against exact gradients.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch

from .. import ppo_math as pm

Tensor = torch.Tensor
Stats = Dict[str, Tensor]
Number = Union[int, float]

__all__ = [
    "group_index",
    "grpo_advantages",
    "rloo_advantages",
    "broadcast_to_tokens",
    "discounted_returns",
    "reinforce_pp_advantages",
    "kl_loss",
]


def _keep(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _zero_masked(x: Tensor, mask: Tensor) -> Tensor:
    """x with masked positions exactly 0 (before any nonlinearity: no NaN/inf leaks, no NaN grads)."""
    return torch.where(_keep(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


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

    std is 0 for groups of one (as ``ppo_math.masked_var`` does), never NaN.
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
    return _zero_masked(v, mask)


# ---------------------------------------------------------------------------
# REINFORCE++
# ---------------------------------------------------------------------------


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Return-to-go ``G_t = r_t + gamma * G_{t+1}`` (0 past the row end): [B, T] -> [B, T].

    This is GAE with V = 0 and lambda = 1 (delta_t = r_t), so it reuses ``ppo_math.gae``.
    """
    zeros = torch.zeros_like(rewards)  # [B, T]
    returns, _ = pm.gae(rewards, zeros, mask, gamma=gamma, lam=1.0)  # [B, T]
    return returns


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tuple[Tensor, Tensor, Stats]:
    """REINFORCE++ (Hu 2025): return-to-go of the per-token rewards, whitened over the batch.

    ``rewards`` are the KL-shaped per-token rewards (``ppo_math.kl_shaped_rewards``: score at the
    last token, ``-kl_coef * KL_t`` everywhere). The global whitening (masked mean and std over
    every response token of the batch) is the baseline; there is no critic and no group.
    Returns ``(advantages [B, T], returns [B, T], stats)``; stats ``returns/mean``.
    """
    returns = discounted_returns(rewards, mask, gamma)  # [B, T]
    adv = pm.masked_whiten(returns, mask)  # [B, T]
    stats = {"returns/mean": pm.masked_mean(returns, mask).detach().reshape(())}
    return adv, returns, stats


# ---------------------------------------------------------------------------
# KL as a loss term
# ---------------------------------------------------------------------------


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
    """Per-token KL(pi || ref) estimate aggregated like the policy loss (to minimise).

    ``logprobs`` are the current policy's (with grad), ``ref_logprobs`` the reference's (no grad
    needed; treated as constants). ``kind`` as ``ppo_math.kl_estimate``; the module docstring
    says which gradient each gives. ``max_value`` clamps the per-token estimate from above
    (k3 grows like ``exp(log ref - log pi)`` where pi has all but left the reference; verl
    clamps at 10); clamped tokens give no gradient. ``is_weights`` (detached, optional) multiply
    the per-token term as in ``ppo_math.policy_loss`` (off-policy tokens).
    ``loss_agg``/``num_tokens``/``num_seqs`` as ``ppo_math.aggregate``, so the caller adds this
    term to the policy loss of the same micro-batch with the same denominators.
    Stats: ``kl/loss_mean`` (unweighted masked mean of the per-token estimate).
    """
    if max_value is not None and not max_value > 0:
        raise ValueError(f"max_value must be > 0 or None, got {max_value}")
    lp = _zero_masked(logprobs, mask)  # [B, T]
    ref = _zero_masked(ref_logprobs.detach(), mask).to(lp.dtype)  # [B, T]
    per_token = pm.kl_estimate(lp, ref, kind)  # [B, T]
    if max_value is not None:
        per_token = per_token.clamp(max=max_value)  # [B, T]
    with torch.no_grad():
        stats = {"kl/loss_mean": pm.masked_mean(per_token.detach(), mask).reshape(())}
    if is_weights is not None:
        per_token = per_token * _zero_masked(is_weights.detach(), mask).to(per_token.dtype)  # [B, T]
    loss = pm.aggregate(per_token, mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, stats
