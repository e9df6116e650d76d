"""Masks and masked reductions, shared by ``losses`` and ``advantages`` (imports only torch).

Alignment of per-token tensors (every module of the maths uses it)
-----------------------------------------------------------------
Per-token tensors are ``[B, T]`` and cover the *response only*, right-padded after each
response. For a row whose response is ``a_0 .. a_{T-1}``::

    logprobs[t] = log pi(a_t | prompt, a_<t)    values[t] = V(prompt, a_<t)
    mask[t]     = 1 .. 1 (T of them), then 0     score: at index mask.sum(1) - 1

The episode ends at the last response token (bootstrap value 0). Whatever lies at masked
positions never changes an output at an unmasked one, and outputs there are 0. Masks may be
bool or 0/1 float. Functions that return statistics return *detached 0-d tensors* (no device
sync in here). docs/implementation-details.md draws the off-by-one between logits and tokens.
"""

from __future__ import annotations

from typing import Dict, Optional, Union

import torch

Tensor = torch.Tensor
Stats = Dict[str, Tensor]
Number = Union[int, float]

__all__ = ["Number", "Stats", "Tensor", "keep", "zero_masked", "stat", "masked_sum", "masked_mean", "masked_var"]


def keep(mask: Tensor) -> Tensor:
    """Boolean view of a (bool or 0/1 float) mask."""
    return mask if mask.dtype == torch.bool else mask != 0


def zero_masked(x: Tensor, mask: Tensor) -> Tensor:
    """x with masked positions exactly 0 (also removes inf/NaN there). Applied *before* any
    nonlinearity, so padding can neither leak into outputs nor give NaN gradients (0 * inf)."""
    return torch.where(keep(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def stat(x: Tensor) -> Tensor:
    """A statistic: detached, 0-d."""
    return x.detach().reshape(())


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of x over unmasked entries (over everything if dim is None)."""
    m = mask.to(x.dtype)
    xm = zero_masked(x, mask) * m  # [*]  (non-0/1 float masks act as weights)
    return xm.sum() if dim is None else xm.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of x over unmasked entries; where the mask sums to 0 the result is 0."""
    num = masked_sum(x, mask, dim)
    den = mask.to(x.dtype)
    den = den.sum() if dim is None else den.sum(dim=dim)
    nonzero = den != 0
    return torch.where(nonzero, num / torch.where(nonzero, den, torch.ones_like(den)), torch.zeros_like(num))


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of x over all unmasked entries (0-d). ``unbiased``: the n/(n-1) correction when
    n > 1; for n <= 1 the biased variance (0), never inf/NaN."""
    mean = masked_mean(x, mask)  # []
    var = masked_mean((x - mean) ** 2, mask)  # []
    if unbiased:
        n = mask.to(x.dtype).sum()  # []
        big = n > 1
        var = torch.where(big, var * n / torch.where(big, n - 1, torch.ones_like(n)), var)
    return var
