"""How off-policy a trained batch is, and how far the sampler is from the trainer.

**Staleness** (a token sampled by an older policy version): per token (:func:`token_lag_stats`),
corrected by the importance weights (:func:`weight_stats`); per sequence (:func:`seq_lag_stats`).
**Mismatch** (the same weights' log-probs in the sampler and in the trainer's forward): measured at
the update's first optimizer step (:class:`MismatchProbe`), not corrected, checked against
:data:`MISMATCH_THRESHOLDS`. Both compare untruncated log-probs (``Rollout.policy_logprobs``).

Design notes: docs/implementation-details.md, "Off-policy measures"."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .batch import Experience

MISMATCH_THRESHOLDS = {"mismatch/logprob_abs_diff": 0.0193, "mismatch/kl": 0.01}
"""Upper bounds peers gate on (``docs/implementation-details.md``): SkyRL's CI checks the
mean |log p_trainer - log p_sampler| <= 0.0193, prime-rl's runs check its mismatch KL (the k3
estimate below) < 0.01. ``tests/test_cli.py``'s smoke run checks oppo's against them."""


def ess(w: torch.Tensor) -> float:
    """Normalised effective sample size of weights ``w`` (any shape, the selected tokens only):
    (sum w)^2 / (N sum w^2), in (0, 1]; 1 when every weight is equal, 1/N when one dominates
    (Kong 1992). 1.0 for no tokens."""
    w = w.double().flatten()
    if w.numel() == 0:
        return 1.0
    return float(w.sum() ** 2 / (w.numel() * (w * w).sum()))


def token_lag_stats(versions: torch.Tensor, mask: torch.Tensor, step: int) -> dict[str, float]:
    """Per-token staleness of a batch trained at ``step``: ``overlap/token_lag_mean``, ``_max`` and
    the histogram ``overlap/token_lag_<n>`` (tokens with lag n, every n from 0 to the max).
    versions, mask: [B, T]."""
    lag = (step - versions)[mask > 0]  # [N]
    if lag.numel() == 0:
        return {"overlap/token_lag_mean": 0.0, "overlap/token_lag_max": 0, "overlap/token_lag_0": 0}
    hi = int(lag.max())
    counts = torch.bincount(lag.clamp(min=0), minlength=hi + 1).tolist()
    return {"overlap/token_lag_mean": lag.double().mean().item(), "overlap/token_lag_max": hi,
            **{f"overlap/token_lag_{n}": int(c) for n, c in enumerate(counts)}}


def seq_lag_stats(lags: list[int]) -> dict[str, float]:
    """Per-sequence lag (``step - start_version`` of each trained sequence): ``overlap/seq_lag_mean``,
    ``_max`` and the histogram ``overlap/seq_lag_<n>`` (sequences with lag n)."""
    hist = Counter(lags)
    return {"overlap/seq_lag_max": max(lags), "overlap/seq_lag_mean": sum(lags) / len(lags),
            **{f"overlap/seq_lag_{n}": hist.get(n, 0) for n in range(max(lags) + 1)}}


TRUNCATED_RTOL = 1e-6
"""A weight counts as truncated where the applied one is below the raw one by more than this
(relative): the raw weight is recomputed here, maybe on another device than the learner's."""


def weight_stats(is_weights: torch.Tensor, mask: torch.Tensor, off: torch.Tensor,
                 raw: torch.Tensor | None = None) -> dict[str, float]:
    """The importance weights the loss applies (``is_weights``, after ``ppo.is_truncate``'s cap):
    mean and max over the off-policy tokens, and the normalised ESS over every token (fresh ones
    weigh 1): how much of the batch the staleness correction leaves. With ``raw`` (the untruncated
    pi_k / pi_v), also their mean and max over the off-policy tokens (the applied ones saturate at
    the cap, hiding how stale the batch is) and the share of off-policy tokens whose weight the
    cap cut (``overlap/is_truncated_frac``; 0 without off-policy tokens).
    is_weights, mask, off, raw: [B, T]."""
    w = is_weights[off]
    out = {"overlap/is_weight_mean": w.mean().item() if w.numel() else 1.0,
           "overlap/is_weight_max": w.max().item() if w.numel() else 1.0,
           "overlap/is_weight_ess": ess(is_weights[mask > 0])}
    if raw is not None:
        r = raw[off].to(w.dtype)
        cut = r > w * (1 + TRUNCATED_RTOL)
        out.update({"overlap/is_weight_raw_mean": r.double().mean().item() if r.numel() else 1.0,
                    "overlap/is_weight_raw_max": r.max().item() if r.numel() else 1.0,
                    "overlap/is_truncated_frac": cut.double().mean().item() if r.numel() else 0.0})
    return out


def staleness_stats(exp: Experience, step: int, seq_lags: list[int]) -> dict[str, float]:
    """What a carrying step reports about the staleness of its batch ``exp`` (an ``Experience``
    after ``Learner.old_logprobs``), trained at ``step``, whose sequences waited ``seq_lags``:
    per-token lag, per-sequence lag, the off-policy token share and the importance weights (as
    applied, and untruncated: exp(old - sampler), the weight before ``ppo.is_truncate``)."""
    mask = exp.mask > 0
    off = (exp.versions < step) & mask  # [B, T]
    raw = torch.exp(exp.old_logprobs - exp.sampler_logprobs)  # [B, T] as set_old_logprobs computes it
    return {**seq_lag_stats(list(seq_lags)), **token_lag_stats(exp.versions, exp.mask, step),
            "overlap/offpolicy_token_frac": off.sum().item() / max(1, mask.sum().item()),
            **weight_stats(exp.is_weights, exp.mask, off, raw)}


def optimizer_steps(opt: torch.optim.Optimizer) -> int:
    """Steps ``opt`` has taken (AdamW's per-parameter ``step``; 0 before the first)."""
    return next((int(st["step"]) for st in opt.state.values() if "step" in st), 0)


class MismatchProbe:
    """The sampler-vs-trainer mismatch of one update, on the tokens the weights being trained
    sampled (``versions == version``), read from the training forward of the update's first
    optimizer step, whose weights are still pi_k: no extra forward. It covers the first
    minibatch's rows (a random ``ppo.minibatch_size`` of the batch; all of it when the minibatch
    is the batch).

    Per token, d = log p_trainer - log p_sampler (untruncated, ``Rollout.policy_logprobs``);
    w = exp(d) is the weight that would correct the mismatch. Reported (:meth:`stats`):

    - ``mismatch/logprob_abs_diff``: mean |d| (SkyRL's ``logprobs_diff``), and ``_max``;
    - ``mismatch/kl``: mean of w - 1 - d, the k3 estimate of KL(sampler || trainer), >= 0
      (prime-rl's ``mismatch_kl``);
    - ``mismatch/ess``: (sum w)^2 / (N sum w^2);
    - ``mismatch/tokens``: N.

    ``observe`` accumulates sums (tensors: no sync per micro-batch); data-parallel ranks merge
    theirs with :meth:`merge` before :meth:`stats`. :meth:`partial`, read once at the update's end,
    ends the probe: it removes the optimizer hook that tells it a step was taken (:meth:`close`).
    Before issue 51 the hook was removed only by an ``observe`` after a step, so with one optimizer
    step per update (minibatch = batch, one epoch) every update left one behind: 50 after 50 updates.
    """

    def __init__(self, opt: torch.optim.Optimizer, version: int):
        self.opt, self.version = opt, version
        self.stepped = False  # the update has taken an optimizer step (a hook sets it: no read of AdamW's step)
        self._hook: Any = opt.register_step_post_hook(lambda *_: setattr(self, "stepped", True))
        self._sums: list[torch.Tensor] = []  # per micro-batch: [n, sum|d|, max|d|, sum k3, sum w, sum w^2]

    @torch.no_grad()
    def observe(self, trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, versions: torch.Tensor,
                mask: torch.Tensor) -> None:
        """One micro-batch's training forward: trainer_logprobs, sampler_logprobs, versions, mask
        [b, T]. Ignored once the update has taken an optimizer step. Masked sums, not a boolean
        selection: no read of a device value (a selection's size is one)."""
        if self.stepped:
            self.close()
            return
        sel = ((mask > 0) & (versions == self.version)).double()  # [b, T]
        d = (trainer_logprobs.detach().double() - sampler_logprobs.double()) * sel  # [b, T], 0 off the selection
        w = d.exp()
        a = d.abs()
        self._sums.append(torch.stack([sel.sum(), a.sum(), a.max() if a.numel() else a.new_zeros(()),
                                       ((w - 1 - d) * sel).sum(), (w * sel).sum(), (w * w * sel).sum()]))

    def close(self) -> None:
        """Remove the optimizer hook and ignore later forwards (idempotent): the update has ended."""
        self.stepped = True
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def partial(self) -> list[float]:
        """This process's sums: [n, sum|d|, max|d|, sum k3, sum w, sum w^2]. Read at the update's end: it
        closes the probe (:meth:`close`)."""
        self.close()
        if not self._sums:
            return [0.0] * 6
        s = torch.stack(self._sums)  # [m, 6]
        out = s.sum(0)
        out[2] = s[:, 2].max()
        return out.tolist()  # CPU-GPU sync point (once per update)

    @staticmethod
    def merge(parts: list[list[float]]) -> list[float]:
        """Several ranks' :meth:`partial` sums as one."""
        out = [sum(p[i] for p in parts) for i in range(6)]
        out[2] = max(p[2] for p in parts)
        return out

    @staticmethod
    def stats(sums: list[float]) -> dict[str, float]:
        """The metrics of :class:`MismatchProbe` from (merged) sums; none when no token qualified
        (every token of the first minibatch was stale)."""
        n, abs_sum, abs_max, k3, w, w2 = sums
        if n == 0:
            return {}
        return {"mismatch/logprob_abs_diff": abs_sum / n, "mismatch/logprob_abs_diff_max": abs_max,
                "mismatch/kl": k3 / n, "mismatch/ess": w * w / (n * w2), "mismatch/tokens": int(n)}
