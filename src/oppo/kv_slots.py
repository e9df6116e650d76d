"""KV cache slots of fixed shape, shared by the static backend (``rollout/static``) and the
streaming scorers' slots (``scoring/slots``): each layer's keys and values are one tensor
``[rows, kv_heads, columns, dim]`` allocated once; a forward over slots ``[:Rb]`` writes its tokens'
keys and values at each slot's own columns and attends over columns ``[:Lb]`` (a transformers
``Cache``, defined on first use: importing this module imports no transformers)."""

from __future__ import annotations

from typing import Any, Callable, Protocol, cast

import torch


class _SlotLayer:
    """One layer's slots: keys/values ``[max_rows, kv_heads, max_len, dim]``.

    ``update`` writes the fed tokens' keys/values at each slot's own column (``cols``, set by the
    backend before the forward) and returns the ``[:Rb, :, :Lb]`` view the attention reads.
    Duck-types transformers' ``CacheLayerMixin`` (the methods a decoder layer calls).
    """

    is_compileable = True
    is_sliding = False
    is_initialized = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, cache: SlotCache):
        self.keys, self.values, self.cache = keys, values, cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rb, lb, cols = self.cache.rb, self.cache.lb, self.cache.cols  # cols [Rb] long: each slot's first column
        _, h, c, d = key_states.shape  # [Rb, H, C, D]: C = 1 (decode) or a streamed chunk (scoring.slots)
        at = cols[:, None] + torch.arange(c, device=cols.device)[None] if c > 1 else cols[:, None]  # [Rb, C]
        idx = at[:, None, :, None].expand(rb, h, c, d)
        k, v = self.keys[:rb], self.values[:rb]
        k.scatter_(2, idx, key_states.to(k.dtype))
        v.scatter_(2, at[:, None, :, None].expand(rb, h, c, value_states.shape[-1]), value_states.to(v.dtype))
        return k[:, :, :lb], v[:, :, :lb]

    def get_seq_length(self) -> int:
        return self.cache.lb

    def get_max_length(self) -> int:
        return self.keys.shape[2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.lb, 0


class SlotCache(Protocol):
    """What the backend and its layers use of the ``_SlotCache`` that :func:`slot_cache_class`
    defines (a transformers ``Cache``, defined on first use: importing this module imports no
    transformers)."""

    rb: int
    lb: int
    cols: torch.Tensor
    slot_layers: list[_SlotLayer]
    """``layers``, typed: the same list."""

    def nbytes(self) -> int: ...


def slot_cache_class() -> Callable[[list[tuple[tuple[int, ...], tuple[int, ...]]], torch.dtype, torch.device],
                                    SlotCache]:
    from transformers.cache_utils import Cache

    class _SlotCache(Cache):
        """The slots of every layer, passed as ``past_key_values`` to the decode forward.
        ``rb``/``lb``/``cols`` describe the current step (see :class:`_SlotLayer`)."""

        def __init__(self, shapes: list[tuple[tuple[int, ...], tuple[int, ...]]], dtype: torch.dtype,
                     device: torch.device):
            self.slot_layers: list[_SlotLayer] = []
            super().__init__(layers=cast("list[Any]", self.slot_layers))  # _SlotLayer duck-types CacheLayerMixin
            self.rb, self.lb = 0, 0
            self.cols = torch.zeros(0, dtype=torch.long, device=device)
            for kshape, vshape in shapes:
                self.slot_layers.append(_SlotLayer(torch.zeros(kshape, dtype=dtype, device=device),
                                                   torch.zeros(vshape, dtype=dtype, device=device), self))

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return self.lb

        def nbytes(self) -> int:
            return sum(l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size()
                       for l in self.slot_layers)

    return _SlotCache
