"""Rows of KV cache that can be extended, retired and merged: the slots of the rollout backend
and of the streaming scorers.

A :class:`KVRows` holds, for R rows (one per sequence):

- ``cache``: a Hugging Face ``DynamicCache`` whose layers hold keys/values ``[R, heads, L, dim]``;
- ``mask``: ``[R, L]`` 1 where the cache column holds a real token of that row, 0 for padding;
- ``next_pos``: ``[R]`` the position id the row's next token gets.

Rows are left-padded when they join (``merge``), and may carry masked "holes" in the middle when
a forward pass feeds some rows fewer tokens than others (a chunk that ends at EOS, or a row that
had no chunk this round). Masked columns get exactly zero attention weight, so the results equal
an unpadded forward up to floating-point summation order. Position ids are explicit per row, so
padding never shifts positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, cast

import torch

if TYPE_CHECKING:
    from transformers import DynamicCache


class KVLayer(Protocol):
    """What :class:`KVRows` uses of a ``DynamicCache`` layer: its keys and values
    ``[R, heads, L, dim]``."""

    keys: torch.Tensor
    values: torch.Tensor


def kv_layers(cache: DynamicCache) -> list[KVLayer]:
    """The layers of ``cache``. Hugging Face types them as any layer kind (linear attention
    included) with ``keys: Tensor | None``; the policies and scorers here have attention layers
    only, and their keys/values are read once a forward has set them (``is_initialized``)."""
    return cast("list[KVLayer]", cache.layers)


class KVRows:
    def __init__(self, device: torch.device):
        self.device = device
        self._reset()

    def _reset(self) -> None:
        """No rows: an empty cache."""
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [R, L]
        self.next_pos = torch.zeros(0, dtype=torch.long, device=self.device)  # [R]

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def forward(self, backbone: torch.nn.Module, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` [R, C] (``valid`` [R, C] marks real ones) to ``backbone``; return hidden [R, C, H].

        Invalid entries become masked cache columns; a row's valid tokens need not be contiguous
        from the left but usually are (right padding of short chunks, or left padding of prompts).
        """
        valid = valid.to(torch.long)
        if self.rows == 0:  # a fresh set of rows: this is their prefill
            self.mask = valid.new_zeros(valid.shape[0], 0)
            self.next_pos = valid.new_zeros(valid.shape[0])
        pos = self.next_pos[:, None] + valid.cumsum(1) - 1  # [R, C]
        pos = pos.clamp(min=0)
        mask = torch.cat([self.mask, valid], dim=1)  # [R, L + C]
        out = backbone(input_ids=tokens, attention_mask=mask, position_ids=pos,
                       past_key_values=self.cache, use_cache=True)
        self.mask = mask
        self.next_pos = self.next_pos + valid.sum(1)
        return out.last_hidden_state

    def forward_rows(self, backbone: torch.nn.Module, rows: torch.Tensor, tokens: torch.Tensor,
                     valid: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` [S, C] to rows ``rows`` (LongTensor [S]) only; return hidden [S, C, H].

        The other rows compute nothing: they get C masked columns (no work, only a copy), where
        ``forward`` would have run C padding tokens through every layer for them. Worth it when
        few rows have tokens on hand (the streaming scorers' final chunks arrive one by one).
        """
        if rows.numel() == self.rows:
            return self.forward(backbone, tokens, valid)
        from transformers import DynamicCache

        sub = KVRows(self.device)
        sub.cache = DynamicCache()
        for i, layer in enumerate(kv_layers(self.cache)):
            sub.cache.update(layer.keys.index_select(0, rows), layer.values.index_select(0, rows), i)
        sub.mask, sub.next_pos = self.mask.index_select(0, rows), self.next_pos.index_select(0, rows)
        hidden = sub.forward(backbone, tokens, valid)
        C = tokens.shape[1]
        for mine, theirs in zip(kv_layers(self.cache), kv_layers(sub.cache)):
            mine.keys = _pad_right(mine.keys, C, 2).index_copy_(0, rows, theirs.keys)
            mine.values = _pad_right(mine.values, C, 2).index_copy_(0, rows, theirs.values)
        self.mask = _pad_right(self.mask, C, 1).index_copy_(0, rows, sub.mask)
        self.next_pos = self.next_pos.index_copy(0, rows, sub.next_pos)
        return hidden

    def select(self, keep: torch.Tensor) -> None:
        """Keep only rows ``keep`` (LongTensor of row indices, in the new order); then compact."""
        if keep.numel() == self.rows and bool((keep == torch.arange(self.rows, device=keep.device)).all()):
            return
        if keep.numel() == 0:
            self._reset()
            return
        for layer in kv_layers(self.cache):
            if getattr(layer, "is_initialized", False):
                layer.keys = layer.keys.index_select(0, keep)
                layer.values = layer.values.index_select(0, keep)
        self.mask = self.mask.index_select(0, keep)
        self.next_pos = self.next_pos.index_select(0, keep)
        self.compact()

    def compact(self) -> None:
        """Drop leading columns that no row uses (left padding left behind by retired rows)."""
        if self.rows == 0 or self.length == 0:
            return
        used = self.mask.any(0)
        start = int(used.to(torch.int8).argmax())  # CPU-GPU sync point (once per retire, not per token)
        if start == 0:
            return
        for layer in kv_layers(self.cache):
            if getattr(layer, "is_initialized", False):
                layer.keys = layer.keys[:, :, start:]
                layer.values = layer.values[:, :, start:]
        self.mask = self.mask[:, start:]

    def repack(self, max_fill: float = 0.5) -> bool:
        """Move each row's real columns to the right and drop the holes between them, when the
        fullest row uses at most ``max_fill`` of the columns. Exact: keys are cached after their
        rotary embedding and positions are explicit, so only which columns are masked matters.

        Holes build up where rows get tokens at different times (a streaming scorer's rows that
        had no chunk in a round); every later forward would attend over them and copy them.
        """
        if self.rows == 0 or self.length == 0:
            return False
        keep = int(self.mask.sum(1).max())
        if keep > max_fill * self.length:
            return False
        # stable sort of the 0/1 mask: each row's holes first, then its real columns in order
        idx = torch.argsort(self.mask, dim=1, stable=True)[:, self.length - keep:]  # [R, keep]
        for layer in kv_layers(self.cache):
            if getattr(layer, "is_initialized", False):
                R, H, _, D = layer.keys.shape
                g = idx[:, None, :, None].expand(R, H, keep, D)
                layer.keys = layer.keys.gather(2, g)
                layer.values = layer.values.gather(2, g)
        self.mask = self.mask.gather(1, idx)
        return True

    def merge(self, other: "KVRows") -> None:
        """Append ``other``'s rows after ours, left-padding the shorter cache to a common length."""
        if other.rows == 0:
            return
        if self.rows == 0:
            self.cache, self.mask, self.next_pos = other.cache, other.mask, other.next_pos
            return
        L = max(self.length, other.length)
        for mine, theirs in zip(kv_layers(self.cache), kv_layers(other.cache)):
            mine.keys = torch.cat([_pad_left(mine.keys, L, 2), _pad_left(theirs.keys, L, 2)], 0)
            mine.values = torch.cat([_pad_left(mine.values, L, 2), _pad_left(theirs.values, L, 2)], 0)
        self.mask = torch.cat([_pad_left(self.mask, L, 1), _pad_left(other.mask, L, 1)], 0)
        self.next_pos = torch.cat([self.next_pos, other.next_pos])

    def nbytes(self) -> int:
        return sum(l.keys.numel() * l.keys.element_size() * 2 for l in kv_layers(self.cache)
                   if getattr(l, "is_initialized", False) and l.keys is not None)


def _pad_left(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def _pad_right(x: torch.Tensor, extra: int, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def pad(seqs: list[list[int]], pad_id: int, device: torch.device, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids [R, L], valid [R, L]) padded to the longest on the ``side`` given."""
    L = max((len(x) for x in seqs), default=0)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    valid = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, x in enumerate(seqs):
        if x:
            cols = slice(L - len(x), L) if side == "left" else slice(0, len(x))
            ids[i, cols] = torch.tensor(x, dtype=torch.long)
            valid[i, cols] = 1
    return ids.to(device), valid.to(device)


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return pad(seqs, pad_id, device, "left")


def right_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return pad(seqs, pad_id, device, "right")
