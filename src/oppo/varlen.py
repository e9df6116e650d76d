"""Packed sequences on variable-length attention: sequence offsets, no mask (issue 50).

A packed forward (``forward.packed_hidden`` over a :class:`~oppo.forward.RowLayout`) lays whole
sequences end to end, position ids restarting at 0. transformers keeps them apart by building a
dense block-diagonal 4-D mask from the restarts, after reading the device once per forward to find
them (``masking_utils.find_packed_sequence_indices``); any explicit mask keeps SDPA off its flash
backend and makes it copy K and V to every query head. The peers instead hand the sequences'
offsets to a variable-length kernel (verl's remove-padding, OpenRLHF's packed samples, prime-rl's
packed micro-batches), and so does oppo where the model lets it:

- :func:`register` makes ``oppo_varlen`` a transformers attention function
  (``AttentionInterface``) and deliberately gives it no mask function: for an implementation with
  none, ``create_causal_mask`` returns no mask at once and never looks for packed sequences
  (``masking_utils._preprocess_mask_arguments``), so neither the mask nor its host read happen.
- The forward passes the offsets as the keyword arguments transformers' own flash path uses
  (``cu_seq_lens_q``/``cu_seq_lens_k`` [S+1] int32 and ``max_length_q``/``max_length_k``), built
  on the host from the layout and copied to the device once per forward (:func:`forward_kwargs`),
  plus the same offsets as a host tuple (``oppo_offsets``) for the CPU stand-in. The models pass
  unknown keyword arguments through to their attention function (checked by the packing probe,
  ``forward.row_plan``: a model that does not keeps the packed mask).
- :func:`switched` sets the model's attention to ``oppo_varlen`` for a packed forward only: decode
  and streamed chunks keep their own path and 4-D masks. A module's forwards run one at a time
  (the learner trains the module it reads), so the switch is not seen by another forward; a
  gradient-checkpointed layer recomputes in the backward, so the learner holds the switch over its
  backward too (``learner.local``).

The kernel (:func:`kernel`, chosen per call from the tensors, said once per choice): torch's
``torch.nn.attention.varlen.varlen_attn`` on CUDA in half precision (torch 2.13's signature takes
``window_size`` and ``enable_gqa``; torch 2.11's takes no ``enable_gqa``, so the KV heads are
repeated for it: picked by ``inspect.signature``), else flash-attention's
``flash_attn_varlen_func`` where that package is installed, else (the CPU, fp32, a soft-capped
model on torch's kernel) a stand-in with the same interface: SDPA per sequence (a causal band mask
under a sliding window; the eager formula with a soft cap), so CI drives the plumbing a GPU user
takes. Every segment attends within itself only: a packed row's padding is a segment of its own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

NAME = "oppo_varlen"
HALF = (torch.float16, torch.bfloat16)
_said: set[str] = set()  # kernel lines already said (once per process and choice)
_base: dict[int, str] = {}  # id(config) -> the path it is on outside a switched block (its numbers are the model's)
calls = [0]  # attention calls on this path (the packing probe checks that its forward took it)


def register() -> None:
    """``oppo_varlen`` as a transformers attention function, with no mask function (module
    docstring); idempotent."""
    from transformers import AttentionInterface

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, attention_forward)


def forward_kwargs(offsets: tuple[int, ...], device: torch.device) -> dict[str, Any]:
    """The keyword arguments of a packed forward over segments at ``offsets`` (host, flat
    positions 0 = offsets[0] < ... < offsets[-1] = positions computed): the device copy is made once."""
    cu = torch.tensor(offsets, dtype=torch.int32).to(device, non_blocking=True)  # [S+1] one host-to-device copy
    longest = max(b - a for a, b in zip(offsets, offsets[1:]))
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest, oppo_offsets=offsets)


def _configs(backbone: torch.nn.Module) -> list[Any]:
    """Every distinct config an attention layer of ``backbone`` reads its implementation from
    (cached on the module)."""
    got = backbone.__dict__.get("_oppo_attn_configs")
    if got is None:
        seen: dict[int, Any] = {}
        for m in backbone.modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation"):
                seen.setdefault(id(cfg), cfg)
        got = backbone.__dict__["_oppo_attn_configs"] = list(seen.values())
    return got


def _set(cfg: Any, name: str | None) -> None:
    if hasattr(cfg, "_attn_implementation_internal"):  # (transformers 5.x: the property's own field, no sub-config walk)
        cfg._attn_implementation_internal = name
    else:
        cfg._attn_implementation = name


@contextlib.contextmanager
def switched(backbone: torch.nn.Module, on: bool = True) -> Iterator[None]:
    """``backbone``'s attention on ``oppo_varlen`` inside the block (``on``; nested: the outer one
    restores), its own path again after."""
    depth = backbone.__dict__.get("_oppo_varlen_depth", 0)
    if not on or depth:
        backbone.__dict__["_oppo_varlen_depth"] = depth + (1 if on else 0)
        try:
            yield
        finally:
            backbone.__dict__["_oppo_varlen_depth"] = depth
        return
    register()
    configs = _configs(backbone)
    before = [c._attn_implementation for c in configs]
    backbone.__dict__["_oppo_varlen_depth"] = 1
    try:
        for c, name in zip(configs, before):
            _base[id(c)] = str(name or "eager")
            _set(c, NAME)
        yield
    finally:
        for c, name in zip(configs, before):
            _set(c, name)
            _base.pop(id(c), None)
        backbone.__dict__["_oppo_varlen_depth"] = 0


def held(backbone: torch.nn.Module) -> bool:
    """Whether a :func:`switched` block holds ``backbone`` now."""
    return backbone.__dict__.get("_oppo_varlen_depth", 0) > 0


def _torch_varlen() -> tuple[Callable, Any] | None:
    """(torch's ``varlen_attn``, its parameters) where the installed torch has it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, inspect.signature(varlen_attn).parameters


def _flash_attn() -> Callable | None:
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # (an install that does not import: a CUDA or torch mismatch)
        return None
    return flash_attn_varlen_func


def kernel(device: str, dtype: torch.dtype, window: int | None, softcap: float | None) -> tuple[str, str]:
    """(kernel, why) for queries of ``dtype`` on a ``device`` type under a sliding ``window`` and a
    logit ``softcap``: ``torch``, ``flash_attn`` or ``stand-in`` (module docstring)."""
    if device != "cuda":
        return "stand-in", f"on {device} the variable-length kernels do not run (CUDA only)"
    if dtype not in HALF:
        return "stand-in", f"the variable-length kernels take fp16 or bf16, the queries are {dtype}"
    tv = _torch_varlen()
    if tv is not None:
        params = tv[1]
        if softcap is not None:
            why = "torch's varlen_attn has no logit soft cap"
        elif window is not None and "window_size" not in params:
            why = "this torch's varlen_attn takes no window_size (sliding window)"
        else:
            gqa = "enable_gqa" if "enable_gqa" in params else "KV heads repeated: no enable_gqa in this torch"
            return "torch", f"torch.nn.attention.varlen.varlen_attn ({gqa})"
    else:
        why = f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if _flash_attn() is not None:
        return "flash_attn", f"flash_attn.flash_attn_varlen_func ({why})"
    return "stand-in", f"{why}, and flash_attn is not installed"


def _say(line: str) -> None:
    if line not in _said:
        _said.add(line)
        print(f"oppo: {line}", file=sys.stderr)


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                      cu_seq_lens_q: Tensor | None = None, cu_seq_lens_k: Tensor | None = None,
                      max_length_q: int | None = None, max_length_k: int | None = None,
                      oppo_offsets: tuple[int, ...] | None = None, s_aux: Tensor | None = None,
                      **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function interface: query [B, Hq, L, D], key and value [B, Hkv, L, D]
    of B rows of L positions, flat ``B * L`` positions cut into causal segments at
    ``cu_seq_lens_q`` -> ([B, L, Hq, Dv], None)."""
    if cu_seq_lens_q is None or oppo_offsets is None or max_length_q is None:
        raise RuntimeError(f"internal error: the {NAME} attention runs only oppo's packed forwards (sequence offsets "
                           f"given); this forward passed none")
    if attention_mask is not None:
        raise RuntimeError(f"internal error: the {NAME} attention takes no mask (got one of shape "
                           f"{tuple(attention_mask.shape)})")
    if s_aux is not None:
        raise ValueError(f"{type(module).__name__} has attention sinks (s_aux), which {NAME} does not implement")
    if is_causal is False or not getattr(module, "is_causal", True):
        raise ValueError(f"{type(module).__name__} is not causal attention; {NAME} runs causal segments only")
    if dropout and module.training:
        raise ValueError(f"{NAME} runs no attention dropout (the model is in training mode with dropout {dropout})")
    calls[0] += 1
    if softcap is not None and _drops_softcap(_base.get(id(getattr(module, "config", None)), "sdpa")):
        softcap = None  # the model's own path ignores it: its numbers are the ones to match (sampler, scorers)
    B, Hq, L, _ = query.shape
    Hkv, Dv = key.shape[1], value.shape[-1]
    q, k, v = (x.transpose(1, 2).reshape(B * L, x.shape[1], x.shape[-1]) for x in (query, key, value))  # [N, H, D]
    window = sliding_window if sliding_window is not None and sliding_window < max_length_q else None
    name, why = kernel(q.device.type, q.dtype, window, softcap)
    _say(f"packed forwards: attention {NAME} on {name}: {why}")
    if name == "torch":
        out = _run_torch(q, k, v, cu_seq_lens_q, max_length_q, scaling, window, Hq // Hkv)
    elif name == "flash_attn":
        fa = _flash_attn()
        assert fa is not None  # (kernel() found it)
        out = fa(q, k, v, cu_seq_lens_q, cu_seq_lens_k if cu_seq_lens_k is not None else cu_seq_lens_q,
                 max_length_q, max_length_k or max_length_q, dropout_p=0.0, softmax_scale=scaling, causal=True,
                 window_size=(window - 1, 0) if window is not None else (-1, -1), softcap=softcap or 0.0)
    else:
        out = stand_in(q, k, v, oppo_offsets, scaling, window, softcap)
    return out.view(B, L, Hq, Dv), None


def _drops_softcap(path: str) -> bool:
    """Whether transformers' attention ``path`` ignores an attention logit soft cap (Gemma 2's): its
    SDPA function takes the ``softcap`` argument and drops it (SDPA has none); eager, flash and flex apply it."""
    return path == "sdpa" or path.startswith("oppo_sdpa")


def _run_torch(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest: int, scale: float | None, window: int | None,
               groups: int) -> Tensor:
    """torch's ``varlen_attn``, called as the installed torch's signature allows (module docstring)."""
    found = _torch_varlen()
    assert found is not None  # (kernel() found it)
    fn, params = found
    kw: dict[str, Any] = {}
    if "scale" in params:
        kw["scale"] = scale
    if "window_size" in params:
        kw["window_size"] = (window - 1 if window is not None else -1, 0)  # (-1, 0): causal, no window
    elif "is_causal" in params:
        kw["is_causal"] = True
    if groups > 1:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:  # torch 2.11: every query head its own KV head (repeat_kv's order)
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return fn(q, k, v, cu, cu, longest, longest, **kw)


def stand_in(q: Tensor, k: Tensor, v: Tensor, offsets: tuple[int, ...], scale: float | None = None,
             window: int | None = None, softcap: float | None = None) -> Tensor:
    """The variable-length kernel's interface where no kernel runs: q [N, Hq, D], k and v
    [N, Hkv, D] cut into causal segments at the host ``offsets``; -> [N, Hq, Dv]. Each segment is
    its own SDPA call (causal; a band mask under a sliding ``window``: key j visible to query i iff
    0 <= i - j < window, transformers' ``sliding_window_overlay``), or with a ``softcap`` the eager
    formula (``eager_attention_forward``: scores * scale, capped, masked, softmax in fp32)."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    for a, b in zip(offsets, offsets[1:]):
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))  # [1, H, n, D]
        n = b - a
        band = None
        if window is not None and n > window:
            d = torch.arange(n, device=q.device)
            d = d[:, None] - d[None]
            band = (d >= 0) & (d < window)  # [n, n]
        if softcap is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=band, is_causal=band is None, scale=scale,
                                               enable_gqa=groups > 1)
        else:
            ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
            w = torch.matmul(qs, ks.transpose(2, 3)) * (scale if scale is not None else qs.shape[-1] ** -0.5)
            w = torch.tanh(w / softcap) * softcap
            keep = band if band is not None else torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            w = w.masked_fill(~keep, torch.finfo(w.dtype).min)
            o = torch.matmul(torch.softmax(w, dim=-1, dtype=torch.float32).to(qs.dtype), vs)
        outs.append(o[0].transpose(0, 1))  # [n, Hq, Dv]
    return torch.cat(outs)
