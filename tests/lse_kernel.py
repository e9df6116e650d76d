"""A CPU stand-in for the fused attention kernel that poisoned 1B training on an H100 (issue 26).

torch 2.11-2.13 picks cuDNN's SDPA on H100/H200 for a masked attention. Its backward returns NaN
``grad_q`` for every query row whose softmax log-sum-exp is below -ln(FLT_MAX) = -88.7 (when the
key length is 64 mod 128: pytorch#196678), while its forward is finite (0 on a row that attends
to nothing). A fully masked query row (a left pad under a padding mask) has log-sum-exp -inf.
CPU kernels have no such bug, so this module registers an attention implementation,
``"lse_kernel"``, whose forward is ordinary masked attention (0 on fully masked rows) and whose
backward is exact except that it writes NaN into ``grad_q`` on exactly those rows, as that
kernel does (for every key length: the test then does not depend on the length's residue).
``LOW_LSE_ROWS`` counts the rows it saw with such a log-sum-exp in forwards that take gradients.
"""

from __future__ import annotations

import torch

NAME = "lse_kernel"
LSE_FLOOR = -88.7  # -ln(FLT_MAX)
LOW_LSE_ROWS = [0]


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, allowed, scaling):
        ctx.save_for_backward(q, k, v, allowed)
        ctx.scaling = scaling
        out, lse = _math(q, k, v, allowed, scaling)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, allowed = ctx.saved_tensors
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
            out, lse = _math(q_, k_, v_, allowed, ctx.scaling)
            dq, dk, dv = torch.autograd.grad(out, (q_, k_, v_), grad_out)
        bad = (lse < LSE_FLOOR)[..., None]  # [B, H, Lq, 1]
        return torch.where(bad, torch.full_like(dq, float("nan")), dq), dk, dv, None, None


def _math(q, k, v, allowed, scaling):
    """Masked attention in fp32 with 0 on rows that attend to nothing, and each row's log-sum-exp."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scaling  # [B, H, Lq, Lk]
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)  # [B, H, Lq]
    p = torch.exp(s - lse.clamp(min=-1e30)[..., None]).nan_to_num(0.0)
    return (p @ v.float()).to(q.dtype), lse


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None, **kwargs):
    """transformers' attention-interface signature; query/key/value [B, H, L, D]."""
    B, H, Lq, D = query.shape
    Lk = key.shape[2]
    if key.shape[1] != H:  # grouped-query attention
        key = key.repeat_interleave(H // key.shape[1], dim=1)
        value = value.repeat_interleave(H // value.shape[1], dim=1)
    if attention_mask is None:  # the causal form: query i (of the last Lq) sees keys <= its position
        allowed = torch.ones(Lq, Lk, dtype=torch.bool, device=query.device).tril(Lk - Lq)[None, None]
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask[:, :, :, :Lk]
    else:
        allowed = attention_mask[:, :, :, :Lk] > torch.finfo(attention_mask.dtype).min / 2
    allowed = allowed.expand(B, 1, Lq, Lk)
    scaling = scaling if scaling is not None else D ** -0.5
    if torch.is_grad_enabled() and query.requires_grad:
        s = (query.detach().float() @ key.detach().float().transpose(-1, -2)) * scaling
        lse = torch.logsumexp(s.masked_fill(~allowed, float("-inf")), -1)
        LOW_LSE_ROWS[0] += int((lse < LSE_FLOOR).sum())
    out = _Attention.apply(query, key, value, allowed, scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the implementation (idempotent); returns its name for ``set_attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
