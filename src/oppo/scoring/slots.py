"""A streaming scorer's KV cache in slots of bucketed shape (``ppo.shape_buckets``).

:class:`SlotKV` keeps each sequence in a slot of a preallocated ``[rows, kv_heads, columns, dim]``
tensor per layer, its tokens at columns ``0 .. n-1`` (no holes, no repacking), and runs each chunk
forward over bucketed rows x chunk width x columns with a 4-D mask from the slots' lengths, so
every attention shape is paid once per run (the dynamic :class:`~oppo.kv.KVRows` makes one nearly
every call). The numbers equal the dynamic cache's up to summation order; sliding-window models
keep the dynamic cache.

Design notes (the ladders, padding and its position ids): docs/gpu-shapes.md, "A streaming scorer's
cache in slots"."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import shapes
from ..kernels.graphs import Capture, CapturedGraphs
from ..kv import kv_layers

if TYPE_CHECKING:
    from ..kv_slots import SlotCache


def slots_suit(model) -> str | None:
    """Why ``model``'s streamed chunks cannot run in slots (a sentence), or None when they can: an
    attention path that takes no 4-D mask, a sliding window (it counts cache columns), layers
    other than full attention (the static backend's test, for chunks)."""
    from ..kernels.attention import takes_4d_mask
    from ..models import uses_sliding_window

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    impl = getattr(cfg, "_attn_implementation", None) or "eager"
    if not takes_4d_mask(impl):
        return f"its attention path {impl!r} takes no 4-D mask"
    if uses_sliding_window(model):
        return "its sliding window counts cache columns"
    other = sorted(set(getattr(cfg, "layer_types", None) or ()) - {"full_attention"})
    if other:
        return f"it has {', '.join(other)} layers"
    return None


class SlotKV:
    """Slots of KV cache for a streaming scorer (module docstring). Rows are addressed as
    :class:`~oppo.kv.KVRows` addresses them: by their index in the scorer's list of sequences
    (``slot_of[i]`` is row i's slot)."""

    def __init__(self, device: torch.device, graphs: bool | None = None, capture: Capture | None = None):
        """``graphs``: replay each (Rb, Cb, Lb) chunk forward from a CUDA graph captured on its first
        call (None: on CUDA); a model whose forward cannot be captured runs eagerly, said once.
        ``capture``: a stand-in for the CUDA capture (:class:`oppo.kernels.graphs.CapturedGraphs`), which
        lets ``graphs`` run on a CPU (tests)."""
        self.device = device
        self.graphs = device.type == "cuda" if graphs is None else graphs
        if self.graphs and device.type != "cuda" and capture is None:
            raise ValueError("CUDA graphs need the scorer's model on a CUDA device")
        self._graphs: CapturedGraphs[tuple[int, int, int]] = CapturedGraphs(device, capture)
        self._tok = torch.zeros(0, 0, dtype=torch.long, device=device)  # static inputs of the captured forwards
        self._start = torch.zeros(0, dtype=torch.long, device=device)
        self._n = torch.zeros(0, dtype=torch.long, device=device)
        self.cache: SlotCache | None = None
        self.slot_of: list[int] = []
        self.pos: list[int] = []  # per slot: tokens in it (= the column its next token takes), on the host
        self._mask_dtype = torch.float32
        self.shapes_seen: set[tuple[int, int, int]] = set()  # (Rb, Cb, Lb) of the chunk forwards so far

    @property
    def rows(self) -> int:
        return len(self.slot_of)

    @property
    def captures(self) -> int:
        """Chunk forwards captured in CUDA graphs so far."""
        return self._graphs.captures

    def capture_stats(self) -> dict[str, Any]:
        """Captures, their seconds and (Rb, Cb, Lb) keys (:meth:`oppo.kernels.graphs.CapturedGraphs.stats`)."""
        return self._graphs.stats()

    # ------------------------------------------------------------------ capacity

    def _capacity(self) -> tuple[int, int]:
        if self.cache is None:
            return 0, 0
        k = self.cache.slot_layers[0].keys
        return k.shape[0], k.shape[2]

    def _ensure(self, layers: list[tuple[tuple[int, ...], tuple[int, ...]]] | None, dtype: torch.dtype | None,
                rows: int, cols: int) -> None:
        """At least ``rows`` slots of ``cols`` columns (grown by the ladders, contents kept);
        ``layers``: each layer's key and value shape per token (heads, dim), from a prefill."""
        from ..kv_slots import slot_cache_class

        have_rows, have_cols = self._capacity()
        if rows <= have_rows and cols <= have_cols:
            return
        R, L = max(have_rows, shapes.rows(rows)), max(have_cols, shapes.ladder(cols, 2, 16))
        if self.cache is None:
            assert layers is not None and dtype is not None  # (the first call is a prefill's)
            shapes_: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((R, kh, L, kd), (R, vh, L, vd))
                                                                    for (kh, kd), (vh, vd) in layers]
            self.cache = slot_cache_class()(shapes_, dtype, self.device)
            self._mask_dtype = dtype
            self.pos = [0] * R
            return
        self._graphs.clear()  # they read the old slots' memory
        for layer in self.cache.slot_layers:  # grow: copy what is there into larger slots
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = old.new_zeros((R, old.shape[1], L, old.shape[3]))
                new[: old.shape[0], :, : old.shape[2]] = old
                setattr(layer, name, new)
        self.pos += [0] * (R - len(self.pos))

    def _free_slots(self, n: int) -> list[int]:
        """The ``n`` lowest free slots (lowest first keeps Rb small)."""
        used = set(self.slot_of)
        out: list[int] = []
        s = 0
        while len(out) < n:
            if s not in used:
                out.append(s)
            s += 1
        return out

    # ------------------------------------------------------------------ prefill and chunks

    def admit(self, backbone: torch.nn.Module, prompts: list[list[int]], pad_id: int,
              at: list[int] | None = None) -> torch.Tensor:
        """Prefill ``prompts`` into free slots (appended after the current rows); return each
        one's hidden state [R, H] at index ``at`` of its prompt (None: its last token; a reward
        scorer asks for its scored token, ``streaming.scored_index``). One eager forward of
        bucketed rows x width."""
        from transformers import DynamicCache

        R, P = len(prompts), max(len(p) for p in prompts)
        Rb, Pb = shapes.rows(R), shapes.width(P)
        seqs = prompts + [prompts[0]] * (Rb - R)  # rows of a repeated prompt: computed, dropped
        ids = torch.full((Rb, Pb), pad_id, dtype=torch.long)
        valid = torch.zeros((Rb, Pb), dtype=torch.long)
        for i, p in enumerate(seqs):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
            valid[i, : len(p)] = 1
        # padding's position ids stay at its row's last real one: a learned-position table or dynamic
        # RoPE sees no position past what the real tokens reach (module docstring)
        pos_ids = torch.minimum(torch.arange(Pb)[None], torch.tensor([len(p) - 1 for p in seqs])[:, None])  # [Rb, Pb]
        ids, valid = ids.to(self.device, non_blocking=True), valid.to(self.device, non_blocking=True)
        pos_ids = pos_ids.to(self.device, non_blocking=True)
        dyn = DynamicCache()
        out = backbone(input_ids=ids, attention_mask=valid, position_ids=pos_ids, past_key_values=dyn, use_cache=True)
        layers = kv_layers(dyn)
        slots = self._free_slots(R)
        self._ensure([((l.keys.shape[1], l.keys.shape[3]), (l.values.shape[1], l.values.shape[3])) for l in layers],
                     layers[0].keys.dtype, max(slots) + 1, Pb)
        assert self.cache is not None  # (allocated by _ensure)
        idx = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        for mine, theirs in zip(self.cache.slot_layers, layers):
            # columns past a row's length hold padding's keys: masked until its next chunk overwrites them
            mine.keys[:, :, :Pb].index_copy_(0, idx, theirs.keys[:R].to(mine.keys.dtype))
            mine.values[:, :, :Pb].index_copy_(0, idx, theirs.values[:R].to(mine.values.dtype))
        for s, p in zip(slots, prompts):
            self.pos[s] = len(p)
        self.slot_of.extend(slots)
        last = torch.tensor([len(p) - 1 for p in prompts] if at is None else at,
                            dtype=torch.long).to(self.device, non_blocking=True)
        return out.last_hidden_state[:R].gather(1, last[:, None, None].expand(R, 1, out.last_hidden_state.shape[-1]))[:, 0]

    def feed(self, backbone: torch.nn.Module, rows: list[int], seqs: list[list[int]], pad_id: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the chunks ``seqs`` to rows ``rows`` (indices into the rows, as ``KVRows.forward_rows``);
        return their hidden states [S, C, H] and tokens [S, C] (right-padded), C the longest chunk. One forward over slots [:Rb], Cb
        tokens each, against columns [:Lb] (module docstring)."""
        assert self.cache is not None  # (rows are admitted first)
        C = max(len(s) for s in seqs)
        Cb = shapes.ladder(C, 1)
        fed = [self.slot_of[i] for i in rows]
        Rb = shapes.rows(max(self.slot_of) + 1)
        Lb = shapes.ladder(max(self.pos[s] for s in range(Rb)) + Cb, 2, 16)
        self._ensure(None, None, Rb, Lb)
        Lb = min(Lb, self._capacity()[1])
        tokens = torch.full((Rb, Cb), pad_id, dtype=torch.long)
        for s, seq in zip(fed, seqs):
            tokens[s, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        start = torch.tensor(self.pos[:Rb], dtype=torch.long)
        n = torch.zeros(Rb, dtype=torch.long)  # [Rb] real tokens per slot this round (0: padding only)
        n[fed] = torch.tensor([len(seq) for seq in seqs], dtype=torch.long)
        tokens, start, n = (t.to(self.device, non_blocking=True) for t in (tokens, start, n))
        self.shapes_seen.add((Rb, Cb, Lb))
        if self.graphs:
            hidden = self._replay(backbone, tokens, start, n, Rb, Cb, Lb)
        else:
            hidden = self._forward(backbone, tokens, start, n, Rb, Cb, Lb)  # [Rb, Cb, H]
        for s, seq in zip(fed, seqs):
            self.pos[s] += len(seq)
        sel = torch.tensor(fed, dtype=torch.long).to(self.device, non_blocking=True)
        return hidden.index_select(0, sel)[:, :C], tokens.index_select(0, sel)[:, :C]

    def _forward(self, backbone, tokens: torch.Tensor, start: torch.Tensor, n: torch.Tensor, rb: int, cb: int,
                 lb: int) -> torch.Tensor:
        """The chunk forward: ``tokens`` [Rb, Cb] at columns ``start`` [Rb] onwards, the first ``n``
        [Rb] of each row real; hidden [Rb, Cb, H].

        A token's keys go to its column and its mask is its column's (``start + t``), padding
        included; its position id is its column for a real token, the row's last real position
        for padding after a chunk, and 0 in a slot with no chunk this round. Padding columns past
        ``start + n`` would otherwise reach positions no real token has (up to ``start + Cb - 1``
        in every slot of [:Rb]): past a learned-position table (an index error; a device-side
        assert on CUDA), or past dynamic RoPE's length, which rescales every row's frequencies."""
        cache = self.cache
        assert cache is not None
        cache.rb, cache.lb, cache.cols = rb, lb, start
        step = torch.arange(cb, device=tokens.device)
        at = start[:, None] + step[None]  # [Rb, Cb] each token's column
        last = (n - 1).clamp(min=0)[:, None]  # [Rb, 1]
        pos = torch.where(n[:, None] > 0, start[:, None] + torch.minimum(step[None], last), 0)  # [Rb, Cb]
        col = torch.arange(lb, device=tokens.device)
        seen = col[None, None, :] <= at[:, :, None]  # [Rb, Cb, Lb] the row's own earlier columns and itself
        neg = torch.finfo(self._mask_dtype).min
        zero = torch.zeros((), dtype=self._mask_dtype, device=tokens.device)
        mask = torch.where(seen, zero, neg)[:, None]  # [Rb, 1, Cb, Lb] additive
        out = backbone(input_ids=tokens, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        return out.last_hidden_state

    def _replay(self, backbone, tokens: torch.Tensor, start: torch.Tensor, n: torch.Tensor, rb: int, cb: int,
                lb: int) -> torch.Tensor:
        """:meth:`_forward` from a CUDA graph per (Rb, Cb, Lb), captured on first use by the recipe
        the static backend's steps share (:mod:`oppo.kernels.graphs`: warm-ups, then a thread-local
        capture on this scorer's one side stream into its one pool, so the actor's thread may run
        CUDA work meanwhile). The inputs are copied into static buffers; the output is copied out
        (graphs share a pool)."""
        if self._tok.shape[0] < rb or self._tok.shape[1] < cb:
            self._tok = torch.zeros(max(rb, self._tok.shape[0]), max(cb, self._tok.shape[1]), dtype=torch.long,
                                    device=self.device)
            self._start = torch.zeros(self._tok.shape[0], dtype=torch.long, device=self.device)
            self._n = torch.zeros(self._tok.shape[0], dtype=torch.long, device=self.device)
            self._graphs.clear()  # they read the old buffers
        self._tok[:rb, :cb].copy_(tokens)
        self._start[:rb].copy_(start)
        self._n[:rb].copy_(n)
        tok, start_, n_ = self._tok[:rb, :cb], self._start[:rb], self._n[:rb]  # the captured forward's inputs
        try:
            graph, out = self._graphs.get((rb, cb, lb), lambda: self._forward(backbone, tok, start_, n_, rb, cb, lb))
        except Exception as e:  # a forward that cannot be captured (host reads, dynamic control flow)
            import warnings

            self.graphs = False
            warnings.warn(f"The streamed scorer's chunk forward could not be captured in a CUDA graph "
                          f"({type(e).__name__}: {e}); it runs eagerly.", stacklevel=2)
            return self._forward(backbone, tokens, start, n, rb, cb, lb)
        graph.replay()
        return out.clone()

    def select(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (indices, in the new order); free the other rows' slots."""
        kept = [self.slot_of[i] for i in keep]
        for s in set(self.slot_of) - set(kept):
            self.pos[s] = 0
        self.slot_of = kept

    def nbytes(self) -> int:
        return self.cache.nbytes() if self.cache is not None else 0
