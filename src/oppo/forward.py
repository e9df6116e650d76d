"""Forwards the scorers and the learner share: whole sequences as one batch
(:func:`sequence_batch`), their hidden states with no fully masked query row (:func:`full_hidden`),
and the sampled tokens' log-probs and entropy from hidden states, in chunks (:func:`head_logprobs`).

Log-probs and entropy of the sampled tokens straight from hidden states, in chunks of tokens.

The learner needs, per response token, ``log_softmax(lm_head(h) / temperature)`` at the sampled
token (actor log-probs, old log-probs, reference log-probs) and the entropy of that distribution.
Computing ``lm_head(h)`` for a whole micro-batch holds a ``[b, T, V]`` logits tensor, its fp32
copy and, for the backward, the log-softmax's output: at V = 32k (Llama) to 152k (Qwen), b = 16 and
T = 512 that is 1-5 GB per copy, usually the learner's largest activation.

:func:`head_logprobs` never holds more than ``chunk_bytes`` of fp32 logits: a custom autograd
function (the fused linear-cross-entropy idea of Liger-Kernel and torchtune's chunked loss) runs
the head over ``n`` tokens at a time and keeps only the per-token log-sum-exp; its backward
recomputes each chunk's logits and forms the gradient ``dz = g_lp * (onehot - p)
+ g_ent * p * (E_p[z] - z)`` in place of autograd's saved ``[N, V]`` tensors. Numerics follow the
plain path: the head's matmul runs in ``compute_dtype`` (the autocast dtype: bf16 on GPU), its
output is upcast to fp32 before the softmax, and gradients leave through matmuls in
``compute_dtype``; the weight's gradient is accumulated over chunks in fp32.

The fused path takes a plain ``nn.Linear`` head (optionally scaled, as Cohere and Granite do).
Anything else (a soft-capped head, a LoRA-wrapped or sharded one) goes through the plain path:
the same results, with the full logits in memory.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kv import left_pad, right_pad

DEFAULT_CHUNK_BYTES = 256 * 2**20  # fp32 logits per chunk


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, mult, compute_dtype, rows, want_entropy):
        # hidden [N, H], weight [V, H], tokens [N]; mult = scale / temperature
        N = hidden.shape[0]
        w = weight.to(compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        lp = torch.empty(N, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(lp)
        ent = torch.empty_like(lp) if want_entropy else None
        for s in range(0, N, rows):
            z = _logits(hidden[s:s + rows], w, b, compute_dtype, mult)  # [n, V] fp32
            lse[s:s + rows] = torch.logsumexp(z, -1)
            lp[s:s + rows] = z.gather(1, tokens[s:s + rows, None])[:, 0] - lse[s:s + rows]
            if ent is not None:
                p = torch.exp(z - lse[s:s + rows, None])  # [n, V]
                ent[s:s + rows] = lse[s:s + rows] - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, ent if ent is not None else lse)
        ctx.mult, ctx.compute_dtype, ctx.rows, ctx.has_ent = mult, compute_dtype, rows, ent is not None
        return lp, (ent if ent is not None else torch.zeros_like(lp))

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, tokens, lse, ent = ctx.saved_tensors
        dt, mult, rows = ctx.compute_dtype, ctx.mult, ctx.rows
        w = weight.to(dt)
        b = bias.to(dt) if bias is not None else None
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        use_ent = ctx.has_ent and g_ent is not None
        for s in range(0, hidden.shape[0], rows):
            h = hidden[s:s + rows]
            z = _logits(h, w, b, dt, mult)  # [n, V] fp32, recomputed
            p = torch.exp(z - lse[s:s + rows, None])  # [n, V]
            gl = g_lp[s:s + rows, None] if g_lp is not None else torch.zeros_like(lse[s:s + rows, None])
            dz = p * (-gl)  # d lp / d z = onehot - p
            dz.scatter_add_(1, tokens[s:s + rows, None], gl)
            if use_ent:  # d H / d z_j = p_j (E_p[z] - z_j), E_p[z] = lse - H
                mean_z = (lse[s:s + rows] - ent[s:s + rows])[:, None]
                dz += g_ent[s:s + rows, None] * p * (mean_z - z)
            dlogits = (dz * mult).to(dt)  # [n, V] the gradient at the head's output
            if need_h:
                dh[s:s + rows] = (dlogits @ w).to(hidden.dtype)
            if need_w:
                dw += (dlogits.t() @ h.to(dt)).float()
            if need_b:
                db += dlogits.float().sum(0)
        return (dh, dw.to(weight.dtype) if need_w else None, db.to(bias.dtype) if need_b else None,
                None, None, None, None, None)


def _logits(h: Tensor, w: Tensor, b: Tensor | None, dtype: torch.dtype, mult: float) -> Tensor:
    z = torch.nn.functional.linear(h.to(dtype), w, b).float()  # [n, V]
    return z * mult if mult != 1.0 else z


def fused_head(head) -> tuple[Tensor, Tensor | None, float] | None:
    """(weight, bias, scale) of a head the fused path can take, or None (see the module docstring)."""
    from .models import LogitsHead

    scale = 1.0
    if isinstance(head, LogitsHead):
        if head.softcap is not None:
            return None
        scale, head = head.scale, head.lm_head
    if type(head) is not torch.nn.Linear:  # a LoRA wrapper, a quantised layer, ...
        return None
    w = head.weight
    if type(w) is not torch.nn.Parameter and type(w) is not Tensor:  # a DTensor (FSDP2) or other subclass
        return None
    return w, head.bias, scale


def head_logprobs(head, hidden: Tensor, tokens: Tensor, temperature: float = 1.0, entropy: bool = False,
                  compute_dtype: torch.dtype | None = None,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[Tensor, Tensor | None]:
    """Per-token ``log_softmax(head(hidden) / temperature)[tokens]`` and (``entropy``) the entropy of
    that distribution: hidden [b, T, H], tokens [b, T] -> ([b, T], [b, T] or None), fp32,
    differentiable in ``hidden`` and the head's weights. ``compute_dtype``: the dtype of the head's
    matmul (default: the autocast dtype when autocast is on, else the weight's)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    b, T = tokens.shape
    parts = fused_head(head)
    if parts is None:  # the plain path
        from .ppo_math import entropy_from_logits, logprobs_from_logits

        logits = head(hidden).float()  # [b, T, V]
        lp = logprobs_from_logits(logits, tokens, temperature)
        return lp, (entropy_from_logits(logits / temperature) if entropy else None)
    weight, bias, scale = parts
    if compute_dtype is None:
        dev = hidden.device.type
        compute_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
    rows = max(1, chunk_bytes // (4 * weight.shape[0]))
    with torch.autocast(hidden.device.type, enabled=False):
        lp, ent = _HeadLogprobs.apply(hidden.reshape(b * T, -1), weight, bias, tokens.reshape(-1).long(),
                                      scale / temperature, compute_dtype, rows, entropy)
    return lp.view(b, T), (ent.view(b, T) if entropy else None)


def sequence_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device: torch.device):
    """Left-padded prompts + right-padded responses: (ids [R, P+T], valid [R, P+T], P, response_mask [R, T])."""
    p_ids, p_valid = left_pad(prompts, pad_id, device)
    r_ids, r_valid = right_pad(responses, pad_id, device)
    return torch.cat([p_ids, r_ids], 1), torch.cat([p_valid, r_valid], 1), p_ids.shape[1], r_valid


def full_hidden(backbone: torch.nn.Module, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """One forward without cache over rows whose real tokens are contiguous (left-padded prompt
    then right-padded response); hidden states [R, L, H] in the input's layout.

    Every training forward (actor log-probs, critic values) and every one-shot scoring forward
    runs here, and none of them has a query position that attends to no key. Each row is rolled
    left by its count of leading pads, so its real tokens sit at columns 0..n-1 and all its
    padding is on the right; the forward then needs no padding mask at all, only the causal one
    (a real token attends to earlier columns, all real; a right pad attends to the row's real
    tokens and to earlier pads: finite numbers that nothing reads). The hidden states are rolled
    back, so callers keep the [left pad | prompt | response | right pad] layout of
    ``sequence_batch``.

    Why (issue 26): with the old left-padded forward under a padding mask, every left-pad query
    row was fully masked: its softmax's log-sum-exp is -inf. The rows are masked out of every
    loss, but their backward still runs, and the cuDNN SDPA backward that torch 2.11-2.13 picks
    by default on H100/H200 for a masked attention returns NaN ``grad_q`` for any query row whose
    log-sum-exp is below -ln(FLT_MAX) = -88.7 when the key length is 64 mod 128 (pytorch#196678,
    trl#7181; the forward stays finite). One such row makes every gradient NaN through the shared
    projections: a 1B policy on an H100 got NaN gradient norms in actor and critic with a finite
    loss, and AdamW (even at learning rate 0) wrote NaN into every weight. A fully masked row is
    also what makes older kernels return NaN in the forward (pytorch#110213). With no padding mask
    the fused kernels run in their causal form (``is_causal``), which is also the fastest.
    Positions are the column indices (0..n-1 on real tokens), as before.
    """
    R, L = ids.shape
    col = torch.arange(L, device=ids.device)  # [L]
    lead = valid.to(torch.long).argmax(1)  # [R] leading pad columns (0 for an all-pad row)
    src = (col[None] + lead[:, None]) % L  # [R, L] packed column c reads input column src
    packed_valid = valid.gather(1, src)  # [R, L]
    if bool((packed_valid[:, 1:] > packed_valid[:, :-1]).any()):  # CPU-GPU sync point (one per forward)
        raise ValueError("internal error: full_hidden needs each row's real tokens contiguous "
                         "(left-padded prompt, then right-padded response)")
    pos = col[None].expand(R, L)  # [R, L]
    hidden = backbone(input_ids=ids.gather(1, src), position_ids=pos, use_cache=False).last_hidden_state
    back = (col[None] - lead[:, None]) % L  # [R, L] input column c is packed column back
    return hidden.gather(1, back[..., None].expand(R, L, hidden.shape[-1]))  # [R, L, H]
