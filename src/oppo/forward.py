"""Forwards the scorers and the learner share: whole sequences as one batch
(:func:`sequence_batch`), laid out in packed rows (:func:`lay_out_rows`, :func:`layout_rule`: end to end,
position ids restarting at 0, kept apart by variable-length attention with the sequences' offsets,
:mod:`oppo.kernels.varlen`, or else by the model's own packed mask) and run with no fully masked query row
(:func:`packed_hidden`, :func:`full_hidden`), and the sampled tokens' log-probs and entropy from
hidden states, in chunks (:func:`head_logprobs`).

:func:`head_logprobs` never holds more than ``chunk_bytes`` of fp32 logits (a custom autograd
function that recomputes each chunk's logits in backward) where the full ``[b, T, V]`` logits
would take 1-5 GB; a head other than a plain ``nn.Linear`` takes the plain path.

Design notes: docs/implementation-details.md, "Packed forwards and chunked log-probs"."""

from __future__ import annotations

import heapq
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from . import shapes
from .kv import left_pad, right_pad

DEFAULT_CHUNK_BYTES = 256 * 2**20  # fp32 logits per chunk


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, w, b, tokens, mult, rows, want_entropy):
        # hidden [N, H], weight [V, H] and bias (the trained ones: their gradients), w, b: them in the
        # compute dtype, detached (``precision.cast_weight``: cast once per optimizer step);
        # tokens [N]; mult = scale / temperature
        ctx.set_materialize_grads(False)  # an unused entropy output gets None, not zeros: its term is skipped
        N, compute_dtype = hidden.shape[0], w.dtype
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
        ctx.save_for_backward(hidden, w, b, tokens, lse, ent if ent is not None else lse)
        ctx.mult, ctx.rows, ctx.has_ent = mult, rows, ent is not None
        ctx.w_dtype, ctx.b_dtype = weight.dtype, bias.dtype if bias is not None else None
        return lp, (ent if ent is not None else torch.zeros_like(lp))

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, w, b, tokens, lse, ent = ctx.saved_tensors
        dt, mult, rows = w.dtype, ctx.mult, ctx.rows
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        db = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) if need_b else None
        use_ent = ctx.has_ent and g_ent is not None  # None: the entropy is not in the loss
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
            if db is not None:
                db += dlogits.float().sum(0)
        return (dh, dw.to(ctx.w_dtype) if need_w else None, db.to(ctx.b_dtype) if db is not None else None,
                None, None, None, None, None, None)


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
                  compute_dtype: torch.dtype | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                  entropy_grad: bool = True) -> tuple[Tensor, Tensor | None]:
    """Per-token ``log_softmax(head(hidden) / temperature)[tokens]`` and (``entropy``) the entropy of
    that distribution: hidden [b, T, H], tokens [b, T] -> ([b, T], [b, T] or None), fp32,
    differentiable in ``hidden`` and the head's weights (the entropy only with ``entropy_grad``:
    else a statistic, and no backward term is formed for it). ``compute_dtype``: the dtype of the
    head's matmul (default: the autocast dtype when autocast is on, else the weight's); the
    weight is cast by ``weights.precision.cast_weight``, once per optimizer step in the learner."""
    from .weights.precision import cast_weight

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    b, T = tokens.shape
    parts = fused_head(head)
    if parts is None:  # the plain path
        from .algo.losses import entropy_from_logits, logprobs_from_logits

        logits = head(hidden).float()  # [b, T, V]
        lp = logprobs_from_logits(logits, tokens, temperature)
        if not entropy:
            return lp, None
        return lp, entropy_from_logits((logits if entropy_grad else logits.detach()) / temperature)
    weight, bias, scale = parts
    if compute_dtype is None:
        dev = hidden.device.type
        compute_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
    w = cast_weight(weight, compute_dtype)
    bc = cast_weight(bias, compute_dtype) if bias is not None else None
    rows = max(1, chunk_bytes // (4 * weight.shape[0]))
    with torch.autocast(hidden.device.type, enabled=False):
        lp, ent = _HeadLogprobs.apply(hidden.reshape(b * T, -1), weight, bias, w, bc, tokens.reshape(-1).long(),
                                      scale / temperature, rows, entropy)
    if entropy and not entropy_grad:
        ent = ent.detach()
    return lp.view(b, T), (ent.view(b, T) if entropy else None)


def sequence_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device: torch.device):
    """Left-padded prompts + right-padded responses: (ids [R, P+T], valid [R, P+T], P, response_mask [R, T])."""
    p_ids, p_valid = left_pad(prompts, pad_id, device)
    r_ids, r_valid = right_pad(responses, pad_id, device)
    return torch.cat([p_ids, r_ids], 1), torch.cat([p_valid, r_valid], 1), p_ids.shape[1], r_valid


def full_hidden(backbone: torch.nn.Module, ids: torch.Tensor, valid: torch.Tensor, packing: str | None = None
                ) -> torch.Tensor:
    """One forward without cache over rows whose real tokens are contiguous (left-padded prompt
    then right-padded response); hidden states [R, L, H] in the input's layout (zeros at padding).

    The rows' real tokens are laid out afresh (:func:`lay_out_rows`): packed end to end where the
    model can (``ppo.packing``, :func:`layout_rule`), else each row's tokens at columns 0..n-1 with
    all its padding on the right. Either way the forward takes no padding mask, so no query
    position attends to no key, and position ids count from 0 along each sequence.

    No padding mask because a fully masked query row (a left pad under one) gets NaN gradients
    from cuDNN's SDPA backward on H100/H200, and one such row poisons every weight
    (``docs/implementation-details.md``, "No query attends to nothing"). Packed rows keep this:
    padding is a run of its own (``RowLayout.lay_out``), attending to itself.
    """
    R, L = ids.shape
    lead = valid.to(torch.long).argmax(1)  # [R] leading pad columns (0 for an all-pad row)
    n = valid.to(torch.long).sum(1)  # [R]
    col = torch.arange(L, device=ids.device)
    inside = (col[None] >= lead[:, None]) & (col[None] < (lead + n)[:, None])  # [R, L]
    if bool((inside != valid.bool()).any()):  # CPU-GPU sync point (one per forward)
        raise ValueError("internal error: full_hidden needs each row's real tokens contiguous "
                         "(left-padded prompt, then right-padded response)")
    layout = layout_rule(backbone, packing).layout(n.tolist())
    hidden = packed_hidden(backbone, layout, ids.reshape(-1), torch.arange(R, device=ids.device) * L + lead)
    start = torch.tensor(layout.start, device=ids.device)  # [R]
    src = (start[:, None] + col[None] - lead[:, None]).clamp(0, layout.computed - 1)  # [R, L]
    out = hidden[src.reshape(-1)].view(R, L, hidden.shape[-1])
    return out * inside[..., None].to(out.dtype)  # [R, L, H]


# ---------------------------------------------------------------------------------------------
# Packed rows: whole sequences end to end in a row, position ids restarting at 0 for
# each. Where the model lets it (layout_rule's probe), the forward passes the sequences' offsets to a
# variable-length kernel (oppo.kernels.varlen: torch's varlen_attn, flash-attention's, a CPU stand-in) and
# no mask, as the peers do (issue 50). Elsewhere, with no attention mask, transformers (>= 4.54,
# 5.x) reads the restarts as sequence boundaries and builds a block-diagonal causal mask itself
# (``masking_utils.find_packed_sequence_indices``, applied by ``create_causal_mask`` and the
# sliding-window mask for the sdpa, eager and flex implementations; the flash-attention
# implementations take the same position ids as variable-length sequences, one row only). No
# hand-made mask either way.

PACKING_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class RowLayout:
    """Where S sequences sit in ``rows`` rows of ``width`` columns: sequence s's ``lengths[s]``
    tokens at the flat positions ``start[s] ..`` (flat: row * width + column), in order; every other
    position is padding, at the end of its row. ``packed``: rows may hold several sequences (their
    position ids restart at 0); otherwise one sequence a row, position ids the column indices
    (padding: the row's last real position). ``varlen``: the forward passes :meth:`offsets`."""

    rows: int
    width: int
    start: tuple[int, ...]
    lengths: tuple[int, ...]
    packed: bool
    varlen: bool = False  # the forward passes sequence offsets to oppo's variable-length attention (kernels.varlen)

    @property
    def computed(self) -> int:
        """Positions the forward computes (rows x width), real or padding."""
        return self.rows * self.width

    def offsets(self) -> tuple[int, ...]:
        """Where the forward's causal segments start, flat, and where the last ends (``computed``):
        every sequence is one, and so is each run of padding (it attends to itself only, so no query
        attends to nothing). Host integers: a variable-length kernel's ``cu_seqlens``."""
        cuts = {0, self.computed}
        cuts.update(k * self.width for k in range(self.rows))
        for s, n in zip(self.start, self.lengths):
            cuts.update((s, s + n))
        return tuple(sorted(cuts))

    def lay_out(self, source: Tensor, first: Tensor, pad_id: int) -> tuple[Tensor, Tensor]:
        """(ids, position_ids), both [rows, width]: sequence s's tokens read from the flat ``source``
        at ``first[s]`` [S] onwards. Padding is its own run of positions from 0 (capped at the longest
        sequence's last), so the packed mask never joins it to a real sequence (and no query row is
        fully masked: pytorch#110213)."""
        dev, N, W = source.device, self.computed, self.width
        n = torch.tensor(self.lengths, device=dev)  # [S]
        seq = torch.repeat_interleave(torch.arange(len(n), device=dev), n)  # [total] owner of each token
        offset = torch.arange(len(seq), device=dev) - torch.repeat_interleave(n.cumsum(0) - n, n)  # [total]
        at = torch.tensor(self.start, device=dev)[seq] + offset  # [total] flat position in the layout
        ids = torch.full((N,), pad_id, dtype=source.dtype, device=dev).index_copy(0, at, source[first[seq] + offset])
        col = torch.arange(N, device=dev) % W  # [N]
        if not self.packed:  # padding at the row's last real position (0 in a row of padding): never past the
            # model's limit (learned positions) nor past the real ones (dynamic RoPE rescales by the largest)
            last = torch.zeros(self.rows, dtype=torch.long, device=dev)
            last[: len(n)] = (n - 1).clamp(min=0)
            return ids.view(self.rows, W), torch.minimum(col.view(self.rows, W), last[:, None])
        used = torch.zeros(self.rows, dtype=torch.long, device=dev).index_add_(0, at // W, torch.ones_like(at))
        pos = (col - used[torch.arange(N, device=dev) // W]).index_copy(0, at, offset)  # pads: col - row's real tokens
        # ... up to the longest sequence's last position: a wide row's padding run never passes the model's
        # limit nor the real positions (as above); past it each pad is a run of one, attending to itself
        pos = pos.clamp(max=max(self.lengths, default=1) - 1)
        return ids.view(self.rows, W), pos.view(self.rows, W)



def lay_out_rows(lengths: list[int], packed: bool, attention_cost: float = 0.0, max_positions: int = 0,
              max_padding: float = 0.0, buckets: bool = False) -> RowLayout:
    """The rows of one forward over sequences of ``lengths``.

    Unpacked: one sequence a row, as wide as the longest. Packed: the sequences, longest first,
    each go to the least-filled of r rows (longest-processing-time first), and r is the one that
    makes the cheapest forward by a FLOP count: every position costs 1 through the linear layers,
    and every (query, key) pair of a row ``attention_cost`` (an sdpa or eager forward computes a
    whole row's pairs, masked or not; 0 for kernels that skip other sequences: then one row, no
    padding). Candidates over ``max_positions`` (rows x width) or ``max_padding`` (padded share)
    are passed over while one fits; ties go to fewer rows.

    ``buckets`` (``ppo.shape_buckets``, :mod:`oppo.shapes`): the width is on the width ladder and
    the rows on the row ladder (unpacked: rows of padding added; packed: r chosen among the
    ladder's counts), so the forward's shape comes from a small fixed set."""
    S = len(lengths)
    if not packed or S <= 1:
        W = max(lengths, default=0)
        R = S
        if buckets and S:
            W, R = shapes.width(W), shapes.rows(S)
        return RowLayout(R, W, tuple(s * W for s in range(S)), tuple(lengths), False)
    order = sorted(range(S), key=lambda s: (-lengths[s], s))
    total, longest = sum(lengths), lengths[order[0]]
    limit = min(S, -(-total // longest) + 1)
    best: tuple[tuple[bool, float], int, list[list[int]], int] | None = None
    for r in (shapes.rows_ladder(limit) if buckets else range(1, limit + 1)):
        heap = [(0, k) for k in range(r)]  # (tokens, row)
        rows: list[list[int]] = [[] for _ in range(r)]
        for s in order:
            load, k = heapq.heappop(heap)
            rows[k].append(s)
            heapq.heappush(heap, (load + lengths[s], k))
        W = max(load for load, _ in heap)
        if buckets:  # the narrowest ladder width that r rows can hold (first fit, longest first), else LPT's
            W, rows = _narrowest(lengths, order, r, max(longest, -(-total // r)), W) or (shapes.width(W), rows)
        over = bool(max_positions and r * W > max_positions) or bool(max_padding and 1 - total / (r * W) > max_padding)
        key = (over, r * W * (1.0 + attention_cost * W))
        if best is None or key < best[0]:
            best = (key, r, rows, W)
    assert best is not None  # (r = 1 is always a candidate)
    _, r, rows, W = best
    start = [0] * S
    for k, row in enumerate(rows):
        at = k * W
        for s in row:
            start[s], at = at, at + lengths[s]
    return RowLayout(r, W, tuple(start), tuple(lengths), True)


def _narrowest(lengths: list[int], order: list[int], r: int, low: int, lpt: int) -> tuple[int, list[list[int]]] | None:
    """The narrowest width of the ladder, from ``width(low)`` up to ``width(lpt)`` (what the
    longest-processing-time rows need), into which ``r`` rows take every sequence by first fit
    (``order``: longest first), and those rows; None if none below ``width(lpt)`` does."""
    W, top = shapes.width(low), shapes.width(lpt)
    while W < top:
        rows: list[list[int]] = [[] for _ in range(r)]
        loads = [0] * r
        for s in order:
            k = next((k for k in range(r) if loads[k] + lengths[s] <= W), None)
            if k is None:
                break
            rows[k].append(s)
            loads[k] += lengths[s]
        else:
            return W, rows
        W = shapes.width(W + 1)
    return None


@dataclass(frozen=True)
class LayoutRule:
    """How a model's forwards over many sequences lay them out (:func:`layout_rule`): packed or one a
    row, and the relative cost of an attention pair (:func:`lay_out_rows`)."""

    packed: bool
    attention_cost: float = 0.0
    buckets: bool = False  # shapes on the ladders (ppo.shape_buckets, oppo.shapes)
    one_row: bool = False  # packed sequences are kept apart within one row only (a varlen kernel's mask)
    varlen: bool = False  # packed forwards pass sequence offsets to oppo's variable-length attention (kernels.varlen)

    def layout(self, lengths: list[int], max_positions: int = 0, max_padding: float = 0.0) -> RowLayout:
        """The rows of one forward over sequences of ``lengths``. On oppo's variable-length
        attention (``varlen``), one row of every sequence end to end (even one: no packed-sequence
        detection then either), as wide as their tokens or, with ``buckets``, the next size of the
        coarse token ladder (:func:`varlen_width`: a few shapes a run, padding a segment of its
        own); ``max_positions`` and ``max_padding`` bound the micro-batch, not its one row."""
        if self.varlen and self.packed and lengths:
            W = total = sum(lengths)
            if self.buckets:  # (a rung past the token budget is cut back to it: the budget is one more size)
                W = varlen_width(total)
                W = max_positions if max_positions and total <= max_positions < W else W
            return RowLayout(1, W, tuple(_starts(lengths)), tuple(lengths), True, varlen=True)
        if self.one_row and self.packed and len(lengths) > 1:
            W = sum(lengths)
            W = shapes.width(W) if self.buckets else W
            return RowLayout(1, W, tuple(_starts(lengths)), tuple(lengths), True)
        return lay_out_rows(lengths, self.packed, self.attention_cost, max_positions, max_padding, self.buckets)


VARLEN_ROW_PER_OCTAVE = 2
"""Sizes of a varlen micro-batch's one row per octave of tokens (``shapes.ladder``): 2 gives ...,
1024, 1536, 2048, 3072, 4096, ... (at most a third padding); ``docs/gpu-shapes.md`` has the
measured shapes and padded share."""

SMALLEST_VARLEN_ROW = shapes.SMALLEST_WIDTH


def varlen_width(n: int) -> int:
    """The width of a varlen forward's one row over ``n`` tokens under ``ppo.shape_buckets``: a
    micro-batch's token count varies around the same size all run (its share of a minibatch), so a
    coarse ladder gives it a few shapes (the learner's cuDNN/flash plans, graphs, compiled kernels
    are paid a few times a run) where the width ladder would give one per minibatch."""
    return shapes.ladder(n, VARLEN_ROW_PER_OCTAVE, SMALLEST_VARLEN_ROW)


def _starts(lengths: list[int]) -> list[int]:
    """Each sequence's first position when they lie end to end."""
    out = [0]
    for n in lengths[:-1]:
        out.append(out[-1] + n)
    return out


def set_packing(model: torch.nn.Module, mode: str, buckets: str | None = None) -> None:
    """Record ``ppo.packing`` (and ``ppo.shape_buckets``, when given) on ``model`` (a scorer's: the
    one-shot scoring forwards read them through :func:`layout_rule`, wherever the model goes, as they
    travel with the module)."""
    if mode not in PACKING_MODES:
        raise ValueError(f"ppo.packing must be one of {', '.join(PACKING_MODES)}, got {mode!r}")
    if buckets is not None and buckets not in shapes.MODES:
        raise ValueError(f"ppo.shape_buckets must be one of {', '.join(shapes.MODES)}, got {buckets!r}")
    for m in {id(model): model, id(_backbone_of(model)): _backbone_of(model)}.values():
        m.__dict__["_oppo_packing"] = mode
        if buckets is not None:
            m.__dict__["_oppo_buckets"] = buckets


def uses_buckets(backbone: torch.nn.Module, mode: str | None = None) -> bool:
    """``ppo.shape_buckets`` = ``mode`` (None: the one :func:`set_packing` recorded on the model,
    else auto) resolved for the model's device (:func:`oppo.shapes.resolve`)."""
    mode = mode if mode is not None else backbone.__dict__.get("_oppo_buckets", "auto")
    return shapes.resolve(mode, next(backbone.parameters()).device)


def _backbone_of(model: torch.nn.Module) -> torch.nn.Module:
    from .models import backbone_and_head

    try:
        return backbone_and_head(model)[0]
    except Exception:  # (a bare backbone)
        return model


def layout_rule(backbone: torch.nn.Module, mode: str | None = None, buckets: str | None = None) -> LayoutRule:
    """The :class:`LayoutRule` of ``backbone`` under ``ppo.packing`` = ``mode`` (None: the mode
    :func:`set_packing` recorded on it, else auto), found once per model and mode (cached on the
    module, as ``models.backbone_and_head`` caches its split).

    auto and on pack if the model's attention keeps packed sequences apart: checked, not assumed,
    by one forward of two sequences in one row against the second one alone (a model whose mask
    ignores restarting position ids, e.g. remote code or an attention implementation without
    packed masks, would let the second see the first). auto then warns once and runs padded; on
    raises. The attention cost: 1/(6 d) for sdpa and eager (a pair costs ~4d FLOPs against ~24d^2
    for a position through a layer's projections and MLP), 0 for flash and flex (they skip the
    masked blocks).

    A model whose attention keeps packed sequences apart in one row but not across rows (a
    variable-length kernel that reads one row's position ids as its sequences, as a hub flash
    kernel does) packs into one row only: the probe runs two rows of two sequences each.

    Packed forwards run on oppo's variable-length attention (:mod:`oppo.kernels.varlen`: sequence offsets,
    no mask, no packed-sequence detection and its host read) where the same probe passes on it:
    through the model's attention interface (the calls are counted) and equal to each sequence
    alone on the model's own path. A model whose attention cannot take offsets (remote code, an
    architecture that does not pass keyword arguments to its attention function, attention sinks)
    keeps transformers' packed mask, said once (a warning).

    ``buckets``: ``ppo.shape_buckets`` (None: as recorded on the model by :func:`set_packing`)."""
    from .kernels import varlen

    mode = mode if mode is not None else backbone.__dict__.get("_oppo_packing", "auto")
    if mode not in PACKING_MODES:
        raise ValueError(f"ppo.packing must be one of {', '.join(PACKING_MODES)}, got {mode!r}")
    bucketed = uses_buckets(backbone, buckets)
    cache = backbone.__dict__.setdefault("_oppo_layout_rules", {})
    if (mode, bucketed) in cache:
        return cache[(mode, bucketed)]
    rule = LayoutRule(False, buckets=bucketed)
    if mode != "off":
        cfg = getattr(backbone, "config", None)
        impl = varlen.base(str(getattr(cfg, "_attn_implementation", None) or "eager"))
        why = varlen.packing_fails(backbone)
        no_varlen = _varlen_fails(backbone) if why is None else why
        if why is None and no_varlen is None:
            rule = LayoutRule(True, buckets=bucketed, varlen=True)
        elif why is None:
            quadratic = not impl.startswith(("flash", "flex"))
            one_row = varlen.packing_fails(backbone, rows=2) is not None
            rule = LayoutRule(True, 1.0 / (6 * getattr(cfg, "hidden_size", 1024)) if quadratic and not one_row else 0.0,
                           buckets=bucketed, one_row=one_row)
            if varlen.takes_offsets(impl):  # (flash and flex paths build no dense mask anyway)
                warnings.warn(f"{type(backbone).__name__} (attention: {impl}): packed forwards keep transformers' "
                              f"packed mask, not oppo's variable-length attention: on it, {no_varlen}.", stacklevel=2)
        elif mode == "on":
            raise ValueError(f"ppo.packing=on, but {type(backbone).__name__} (attention: {impl}) cannot run packed "
                             f"rows: {why}. Set ppo.packing=auto (runs it padded, with a warning) or off.")
        else:
            warnings.warn(f"{type(backbone).__name__} (attention: {impl}) cannot run packed rows: {why}; its "
                          f"forwards run padded (ppo.packing=off silences this).", stacklevel=2)
    cache[(mode, bucketed)] = rule
    return rule


def _varlen_fails(backbone: torch.nn.Module) -> str | None:
    """None if ``backbone``'s packed forwards run on oppo's variable-length attention: it is left
    on the alias (:func:`oppo.kernels.varlen.use`), its other forwards unchanged; else why not, and it is
    left on its own path."""
    from .kernels import varlen

    if not varlen.use(backbone):
        return "its attention path is not one oppo_varlen stands in for (sdpa, eager)"
    why = varlen.packing_fails(backbone, rows=2, varlen=True)
    if why is not None:
        varlen.use(backbone, False)
    return why


def packed_hidden(backbone: torch.nn.Module, layout: RowLayout, source: Tensor, first: Tensor, pad_id: int = 0) -> Tensor:
    """Hidden states [rows * width, H] of one forward over ``layout`` (flat, as ``RowLayout.start``):
    sequence s's tokens read from the flat ``source`` from ``first[s]`` on. No attention mask:
    unpacked rows need only the causal one (their padding is at the end), packed ones get
    oppo's variable-length attention with the layout's offsets (``layout.varlen``: :mod:`oppo.kernels.varlen`;
    a gradient-checkpointed layer recomputes with the same arguments, so on the same path) or else
    the model's own packed mask from the position ids."""
    from .kernels import varlen

    ids, pos = layout.lay_out(source, first, pad_id)  # [rows, width] each
    cfg = getattr(backbone, "config", None)
    if layout.varlen and not str(getattr(cfg, "_attn_implementation", "")).startswith(varlen.PREFIX) \
            and not varlen.use(backbone):  # (a layout made for another model: its own path would mix the sequences)
        raise ValueError(f"{type(backbone).__name__}'s attention cannot take sequence offsets; lay it out with its "
                         f"own layout rule (forward.layout_rule)")
    extra = varlen.forward_kwargs(layout.offsets(), layout.rows, layout.width, ids.device) if layout.varlen else {}
    hidden = backbone(input_ids=ids, position_ids=pos, use_cache=False, **extra).last_hidden_state
    return hidden.reshape(layout.computed, hidden.shape[-1])
