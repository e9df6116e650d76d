"""Packed sequences on variable-length attention: sequence offsets, no mask (issue 50).

:func:`use` puts a model on an alias of its own path, ``oppo_varlen:<path>`` (:func:`register`):
its packed forwards take the offsets :func:`forward_kwargs` builds, its other forwards run the path's
own functions. The kernel (:func:`kernel`, per call): torch's ``varlen_attn``, flash-attention's, or
a stand-in of the same interface (:func:`stand_in`, the CPU's). :func:`packing_fails` is the packing
probe: whether a model's packed forwards keep their sequences apart.
Design: ``docs/gpu-shapes.md``, "kernels/varlen.py".
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

PREFIX = "oppo_varlen:"
"""A model on variable-length attention runs ``oppo_varlen:<its path>`` (:func:`use`)."""
HALF = (torch.float16, torch.bfloat16)
_said: set[str] = set()  # kernel lines already said (once per process and choice)
calls = [0]  # attention calls given offsets (the packing probe checks that its forward took this path)


def takes_offsets(path: str) -> bool:
    """Whether a model on transformers' attention ``path`` can be put on :func:`use`'s alias: the
    paths that take the explicit masks of decode and streamed chunks (SDPA, its pinned backends,
    eager), whose functions the alias calls for every forward without offsets."""
    return path in ("sdpa", "eager") or path.startswith("oppo_sdpa")


def base(path: str) -> str:
    """The path an ``oppo_varlen:`` alias stands for (``path`` itself if it is none)."""
    return path[len(PREFIX):] if path.startswith(PREFIX) else path


def register(path: str) -> str:
    """The alias of ``path``, registered (idempotent) as a transformers attention function and mask
    function (``docs/gpu-shapes.md``, "kernels/varlen.py"); returns its name."""
    from transformers import AttentionInterface, AttentionMaskInterface

    name = PREFIX + path
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, attention_forward)
        AttentionMaskInterface.register(name, mask_forward)
    return name


def use(backbone: torch.nn.Module, on: bool = True) -> bool:
    """Put every attention layer of ``backbone`` on its path's alias (``on``), or back on the
    path itself; False if some layer's path cannot take one (:func:`takes_offsets`)."""
    configs = _configs(backbone)
    paths = [base(str(c._attn_implementation or "eager")) for c in configs]
    if on and not all(takes_offsets(p) for p in paths):
        return False
    for c, p in zip(configs, paths):
        _set(c, register(p) if on else p)
    return True


def forward_kwargs(offsets: tuple[int, ...], rows: int, width: int, device: torch.device) -> dict[str, Any]:
    """The keyword arguments of a packed forward of ``rows`` x ``width`` positions cut into
    segments at ``offsets`` (host, flat: 0 = offsets[0] < ... < offsets[-1] = rows * width): the
    offsets copied to the device once, and the marked all-ones mask that makes the alias's mask
    function build none (the marker travels with the tensor, so concurrent forwards of the same
    model on other threads, the scorer streaming chunks beside a one-shot score, keep their masks)."""
    cu = torch.tensor(offsets, dtype=torch.int32).to(device, non_blocking=True)  # [S+1] one host-to-device copy
    longest = max(b - a for a, b in zip(offsets, offsets[1:]))
    marker = torch.ones(rows, width, dtype=torch.bool, device=device)  # (never read: no mask is built from it)
    marker._oppo_offsets = True  # type: ignore[attr-defined]
    return dict(attention_mask=marker, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                max_length_k=longest, oppo_offsets=offsets, oppo_cache={})


def _configs(backbone: torch.nn.Module) -> list[Any]:
    """Every distinct config an attention layer of ``backbone`` reads its path from."""
    seen: dict[int, Any] = {}
    for m in backbone.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            seen.setdefault(id(cfg), cfg)
    return list(seen.values())


def _set(cfg: Any, name: str) -> None:
    if hasattr(cfg, "_attn_implementation_internal"):  # (transformers 5.x: the property's own field, no sub-config walk)
        cfg._attn_implementation_internal = name
    else:
        cfg._attn_implementation = name


def mask_forward(*args, attention_mask: Tensor | None = None, config: Any = None, **kwargs):
    """The alias's mask function: none for a packed forward's marked mask (:func:`forward_kwargs`),
    else the aliased path's own."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if attention_mask is not None and getattr(attention_mask, "_oppo_offsets", False):
        return None
    path = base(str(config._attn_implementation))
    return ALL_MASK_ATTENTION_FUNCTIONS[path](*args, attention_mask=attention_mask, config=config, **kwargs)


@torch.no_grad()
def packing_fails(backbone: torch.nn.Module, rows: int = 1, varlen: bool = False) -> str | None:
    """None if a packed row's second sequence gets the hidden states it gets alone (within 5%:
    bf16 rounding is ~1%, a leak across the boundary changes them wholesale), else why not.
    ``rows`` = 2: two such rows in one forward (each with its own pair), every second sequence
    checked: a kernel that reads only one row's boundaries lets the other row's sequences meet.
    ``varlen``: the packed forward with sequence offsets (:func:`forward_kwargs`), on the alias :func:`use` put
    the model on (on CUDA under bf16 autocast when the weights are fp32, so that the kernel a
    training forward takes is the one probed), the sequences alone without (the aliased path's own
    function)."""
    dev = next(backbone.parameters()).device
    vocab = int(getattr(getattr(backbone, "config", None), "vocab_size", 16) or 16)
    pairs = [([(3 + i) % vocab for i in range(3)], [(7 + 3 * i) % vocab for i in range(4)]),
             ([(5 + 2 * i) % vocab for i in range(3)], [(11 + i) % vocab for i in range(4)])][:rows]
    modes = [(m, m.training) for m in backbone.modules()]
    backbone.eval()  # (dropout would differ between the two forwards)
    half = varlen and dev.type == "cuda" and next(backbone.parameters()).dtype == torch.float32
    before = calls[0]
    try:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=half):
            ids = torch.tensor([a + b for a, b in pairs], device=dev)
            pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]] * len(pairs), device=dev)
            if varlen:
                cuts = (*(7 * k + j for k in range(len(pairs)) for j in (0, 3)), 7 * len(pairs))  # each row: 3 + 4
                both = backbone(input_ids=ids, position_ids=pos, use_cache=False,
                                **forward_kwargs(cuts, len(pairs), 7, dev)).last_hidden_state[:, 3:]
            else:
                both = backbone(input_ids=ids, use_cache=False, position_ids=pos).last_hidden_state[:, 3:]  # [rows, 4, H]
            alone = torch.cat([backbone(input_ids=torch.tensor([b], device=dev),
                                        position_ids=torch.arange(4, device=dev)[None],
                                        use_cache=False).last_hidden_state for _, b in pairs])  # [rows, 4, H], each alone
    except Exception as e:  # a model that takes no position ids (or, on varlen, no offsets)
        what = "sequence offsets" if varlen else "restarting position ids"
        return f"its forward with {what} raised {type(e).__name__}: {e}"
    finally:
        for m, training in modes:
            m.training = training
    if varlen and calls[0] == before:
        return "its forward did not call the attention interface (no transformers attention functions)"
    err = float((both.float() - alone.float()).norm() / alone.float().norm().clamp(min=1e-12))
    where = "a sequence packed after another" if rows == 1 else f"in {rows} packed rows, a sequence packed after another"
    return None if err < 0.05 else f"{where} differs from itself alone by {err:.0%}"


def _path_function(module: torch.nn.Module, path: str) -> Callable:
    """The attention function of ``path`` for ``module``: a registered one, or eager, which each
    model defines in its own modeling file (as ``get_interface``'s default)."""
    from transformers import AttentionInterface

    if path in AttentionInterface._global_mapping:
        return AttentionInterface._global_mapping[path]
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"{type(module).__name__}: no attention function for {path!r} (oppo_varlen's alias)")
    return fn


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
    logit ``softcap``: ``torch``, ``flash_attn`` or ``stand-in`` (``docs/gpu-shapes.md``, "kernels/varlen.py")."""
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
                      oppo_offsets: tuple[int, ...] | None = None, oppo_cache: dict | None = None,
                      s_aux: Tensor | None = None,
                      **kwargs) -> tuple[Tensor, Tensor | None]:
    """The alias's attention function (transformers' interface). With offsets (a packed forward):
    query [B, Hq, L, D], key and value [B, Hkv, L, D] of B rows of L positions, the flat ``B * L``
    positions cut into causal segments at ``cu_seq_lens_q`` -> ([B, L, Hq, Dv], None). Without
    (decode, streamed chunks, any other forward): the aliased path's own function, as if unaliased."""
    config: Any = module.config
    path = base(str(config._attn_implementation))
    if cu_seq_lens_q is None:
        extra = {k: v for k, v in (("sliding_window", sliding_window), ("softcap", softcap), ("is_causal", is_causal),
                                   ("s_aux", s_aux)) if v is not None}
        return _path_function(module, path)(module, query, key, value, attention_mask, dropout=dropout,
                                             scaling=scaling, **extra, **kwargs)
    if oppo_offsets is None or max_length_q is None:
        raise RuntimeError("internal error: a packed forward on oppo_varlen passes oppo_offsets and max_length_q")
    if attention_mask is not None:
        raise ValueError(f"{type(module).__name__} built a mask from the packed forward's marked one (its forward "
                         f"changes the 2-D mask it is given), so oppo_varlen cannot take its offsets")
    if s_aux is not None:
        raise ValueError(f"{type(module).__name__} has attention sinks (s_aux), which oppo_varlen does not implement")
    if is_causal is False or not getattr(module, "is_causal", True):
        raise ValueError(f"{type(module).__name__} is not causal attention; oppo_varlen runs causal segments only")
    if dropout and module.training:
        raise ValueError(f"oppo_varlen runs no attention dropout (the model is in training mode with dropout {dropout})")
    calls[0] += 1
    if softcap is not None and _drops_softcap(path):
        softcap = None  # the model's own path ignores it: its numbers are the ones to match (sampler, scorers)
    B, Hq, L, _ = query.shape
    Hkv, Dv = key.shape[1], value.shape[-1]
    q, k, v = (x.transpose(1, 2).reshape(B * L, x.shape[1], x.shape[-1]) for x in (query, key, value))  # [N, H, D]
    window = sliding_window if sliding_window is not None and sliding_window < max_length_q else None
    name, why = kernel(q.device.type, q.dtype, window, softcap)
    _say(f"packed forwards: attention oppo_varlen ({path} otherwise) on {name}: {why}")
    if name == "torch":
        out = _run_torch(q, k, v, cu_seq_lens_q, max_length_q, scaling, window, Hq // Hkv)
    elif name == "flash_attn":
        fa = _flash_attn()
        assert fa is not None  # (kernel() found it)
        out = fa(q, k, v, cu_seq_lens_q, cu_seq_lens_k if cu_seq_lens_k is not None else cu_seq_lens_q,
                 max_length_q, max_length_k or max_length_q, dropout_p=0.0, softmax_scale=scaling, causal=True,
                 window_size=(window - 1, 0) if window is not None else (-1, -1), softcap=softcap or 0.0)
    else:
        out = stand_in(q, k, v, oppo_offsets, scaling, window, softcap, oppo_cache)
    return out.view(B, L, Hq, Dv), None


def _drops_softcap(path: str) -> bool:
    """Whether transformers' attention ``path`` ignores an attention logit soft cap (Gemma 2's): its
    SDPA function takes the ``softcap`` argument and drops it (SDPA has none); eager, flash and flex apply it."""
    return path == "sdpa" or path.startswith("oppo_sdpa")


def _run_torch(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest: int, scale: float | None, window: int | None,
               groups: int) -> Tensor:
    """torch's ``varlen_attn``, called as the installed torch's signature allows: 2.13's takes ``window_size``
    and ``enable_gqa``, 2.11's no ``enable_gqa`` (the K/V heads repeated for it)."""
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
             window: int | None = None, softcap: float | None = None, cache: dict | None = None) -> Tensor:
    """The variable-length kernel's interface where no kernel runs: q [N, Hq, D], k and v
    [N, Hkv, D] cut into causal segments at the host ``offsets``; -> [N, Hq, Dv]. One SDPA call
    over the whole row under one block-diagonal causal mask (:func:`block_mask`, built once per
    forward: ``cache``, the forward's own dict), so a forward makes one attention call of the row's
    shape per layer, as the kernel does (what ``benchmarks/shape_probe.py`` counts on the CPU); with a
    ``softcap`` the eager formula (``eager_attention_forward``: scores * scale, capped, masked,
    softmax in fp32). Every segment, padding included, attends to itself: no query attends to nothing."""
    groups = q.shape[1] // k.shape[1]
    mask = cache.get(("mask", window)) if cache is not None else None
    if mask is None:
        mask = block_mask(offsets, window, q.device)
        if cache is not None:
            cache[("mask", window)] = mask
    qs, ks, vs = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, N, D]
    if softcap is None:
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=groups > 1)
    else:
        ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
        w = torch.matmul(qs, ks.transpose(2, 3)) * (scale if scale is not None else qs.shape[-1] ** -0.5)
        w = torch.tanh(w / softcap) * softcap
        w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
        o = torch.matmul(torch.softmax(w, dim=-1, dtype=torch.float32).to(qs.dtype), vs)
    return o[0].transpose(0, 1)  # [N, Hq, Dv]


def block_mask(offsets: tuple[int, ...], window: int | None, device: torch.device) -> Tensor:
    """[N, N] bool: key j visible to query i iff both lie in one segment and 0 <= i - j (< ``window``:
    transformers' ``sliding_window_overlay``)."""
    lengths = torch.tensor(offsets).diff()
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)  # [N] (one host-to-device copy)
    i = torch.arange(len(seg), device=device)
    d = i[:, None] - i[None]
    keep = (seg[:, None] == seg[None]) & (d >= 0)
    return keep & (d < window) if window is not None else keep
