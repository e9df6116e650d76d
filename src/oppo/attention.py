"""The attention path every model's forwards take (``ppo.attention``): chosen by a probe, not inherited.

With torch 2.11+ on Hopper, SDPA tries cuDNN first; whether that, the memory-efficient kernel,
FlexAttention or a variable-length flash kernel is fastest for oppo's forwards (packed rows under a
block-diagonal mask, streamed chunks against a slot cache under a 4-D mask) depends on the device,
the shapes and the installed packages. So at start on CUDA (``auto``) a short probe times one
forward and backward of the policy at the run's bucketed shape under each path that keeps packed
sequences apart, and every model takes the fastest; the choice and the timings are logged.
``auto`` tries only the paths that take an explicit 4-D mask (the SDPA ones), which the static
decode engine and the scorer slots pass; FlexAttention and the flash kernels are there to name.

The paths (those the installed torch and transformers bring; nothing is downloaded):

- ``sdpa``: transformers' SDPA with torch's own backend order;
- ``oppo_sdpa_cudnn``, ``oppo_sdpa_efficient``, ``oppo_sdpa_math``: the same, pinned to one SDPA
  backend (``torch.nn.attention.sdpa_kernel``; registered here as transformers attention functions
  with SDPA's mask);
- ``flex_attention``: torch's FlexAttention (transformers builds a document mask from the packed
  position ids);
- ``flash_attention_2`` / ``flash_attention_3``: the variable-length kernels, when the
  ``flash_attn`` package is installed (they keep packed sequences apart within one row only:
  ``forward.row_plan``'s two-row probe then packs one row).

Whether a path keeps packed sequences apart is decided by the packing probe
(``forward._packing_fails``), not by its name. The static decode engine and the scorer slots pass a
4-D mask, which only SDPA-style and eager paths take: they keep an SDPA path (``decode_path``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

SDPA_BACKENDS = {"oppo_sdpa_cudnn": "CUDNN_ATTENTION", "oppo_sdpa_efficient": "EFFICIENT_ATTENTION",
                 "oppo_sdpa_math": "MATH"}
MODES = ("auto", "inherit")


def register() -> None:
    """Register the pinned SDPA paths as transformers attention functions (idempotent)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    for name, backend in SDPA_BACKENDS.items():
        if name in AttentionInterface._global_mapping:
            continue

        def forward(*args, _backend=getattr(SDPBackend, backend), **kwargs):
            with sdpa_kernel([_backend]):
                return sdpa_attention_forward(*args, **kwargs)

        AttentionInterface.register(name, forward)
        AttentionMaskInterface.register(name, sdpa_mask)


def candidates(device: torch.device) -> list[str]:
    """The paths ``auto`` probes on ``device``: those that take the 4-D masks of the static decode
    engine and the scorer slots (:func:`other_paths`: the rest)."""
    if device.type != "cuda":
        return ["sdpa", "oppo_sdpa_math", "eager"]
    return ["sdpa", "oppo_sdpa_cudnn", "oppo_sdpa_efficient"]


def other_paths() -> list[str]:
    """Paths a user may name (``ppo.attention``) that ``auto`` does not try, because they take no
    4-D mask: the static decode engine would run eager and the scorers' slots a dynamic cache."""
    import importlib.util

    out = []
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

        out.append("flex_attention")
    except ImportError:
        pass
    if importlib.util.find_spec("flash_attn") is not None:
        out.append("flash_attention_2")
    return out


def takes_4d_mask(name: str) -> bool:
    """Whether a path takes the explicit 4-D masks of the static decode engine and the scorer slots."""
    from .varlen import base

    name = base(name)  # (oppo_varlen:<path> runs <path> for every forward but the packed ones)
    return name in ("sdpa", "eager") or name in SDPA_BACKENDS


def set_path(model: torch.nn.Module, name: str) -> None:
    """Every attention layer of ``model`` on path ``name``; the cached row plans (``forward.row_plan``)
    are dropped, since whether sequences may share rows depends on the path."""
    register()
    target: Any = model if hasattr(model, "set_attn_implementation") else getattr(model, "base_model", model)
    if not hasattr(target, "set_attn_implementation"):
        raise ValueError(f"{type(model).__name__} has no set_attn_implementation: ppo.attention cannot set its path; "
                         f"use ppo.attention=inherit")
    target.set_attn_implementation(name)
    for m in model.modules():
        m.__dict__.pop("_oppo_row_plans", None)


def probe(model: torch.nn.Module, rows: int, width: int, paths: list[str], repeats: int = 3,
          sync: Callable[[], None] | None = None, dtype: torch.dtype | None = None) -> dict[str, float | str]:
    """Seconds of one forward and backward of ``model`` over ``rows`` packed rows of ``width``
    tokens (two sequences each, position ids restarting) under each of ``paths``, median of
    ``repeats`` after a warm-up, under ``dtype`` autocast (the run's compute dtype; None: the
    weights'); a path that fails, or lets packed sequences see each other, gets the reason instead.
    The model is left on its original path."""
    from .forward import _packing_fails
    from .models import backbone_and_head

    original = _path(model)
    backbone = backbone_and_head(model)[0]
    dev = next(model.parameters()).device
    sync = sync or (torch.cuda.synchronize if dev.type == "cuda" else (lambda: None))
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 16) or 16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, max(4, vocab), (rows, width), generator=g).to(dev)
    half = width // 2
    pos = torch.cat([torch.arange(half), torch.arange(width - half)])[None].expand(rows, width).to(dev)
    out: dict[str, float | str] = {}
    try:
        for name in paths:
            try:
                set_path(model, name)
                why = _packing_fails(backbone)
                if why is not None:
                    out[name] = f"does not keep packed sequences apart ({why})"
                    continue
                times = []
                for i in range(repeats + 1):
                    sync()
                    t = time.perf_counter()
                    with torch.autocast(dev.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                        hidden = backbone(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
                    if any(p.requires_grad for p in backbone.parameters()):
                        hidden.float().square().mean().backward()
                    sync()
                    if i:
                        times.append(time.perf_counter() - t)
                model.zero_grad(set_to_none=True)
                out[name] = sorted(times)[len(times) // 2]
            except Exception as e:  # a path this model, torch or device does not run
                out[name] = f"failed ({type(e).__name__}: {str(e)[:120]})"
    finally:
        set_path(model, original)
        model.zero_grad(set_to_none=True)
    return out


def _path(model: torch.nn.Module) -> str:
    """The attention path ``model`` runs now."""
    cfg: Any = getattr(model, "config", None)
    return str(getattr(cfg, "_attn_implementation", None) or "eager")


def choose(policy: torch.nn.Module, others: list[torch.nn.Module], mode: str, rows: int, width: int,
           say: Callable[[str], None], dtype: torch.dtype | None = None) -> str:
    """``ppo.attention`` = ``mode`` for the run: ``inherit`` keeps each model's path as loaded; a
    path name sets it on every model; ``auto`` probes on CUDA (keeps the loaded path on CPU) at
    ``rows`` x ``width`` and sets the fastest that keeps packed sequences apart. Returns the path
    (the policy's). A path that takes no 4-D mask is refused for a model that needs one
    (``decode_path``: the caller keeps such models on SDPA)."""
    dev = next(policy.parameters()).device
    models = [policy, *others]
    if mode == "inherit" or (mode == "auto" and dev.type != "cuda"):
        return _path(policy)
    if mode != "auto":
        for m in models:
            set_path(m, mode)
        say(f"attention: {mode} (ppo.attention)")
        return mode
    timings = probe(policy, rows, width, candidates(dev), dtype=dtype)
    ok = {k: v for k, v in timings.items() if isinstance(v, float)}
    if not ok:
        say("attention: kept as loaded; no probed path ran: " + "; ".join(f"{k}: {v}" for k, v in timings.items()))
        return _path(policy)
    best = min(ok, key=lambda k: ok[k])
    for m in models:
        set_path(m, best)
    shown = ", ".join(f"{k} {1e3 * v:.2f} ms" if isinstance(v, float) else f"{k}: {v}" for k, v in timings.items())
    say(f"attention: {best}, the fastest at {rows} x {width} packed tokens, forward and backward ({shown})")
    return best
