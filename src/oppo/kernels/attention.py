"""The attention path every model's forwards take (``ppo.attention``): chosen by a probe, not inherited.

At start on CUDA (``auto``) a short probe runs the policy under each SDPA-style path (:func:`measure`)
and the choice is a pure function of its measurements (:func:`decide`). oppo's own SDPA paths,
registered here as transformers attention functions, pass grouped K/V heads without copies under a
mask (:func:`gqa_forward`), and cuDNN is never pinned where torch would not choose it
(:func:`cudnn_refusal`). The names ``ppo.attention`` takes live in :mod:`oppo.kernels.names`
(torch-free: the settings check reads them before any model loads) and are re-exported here.
Design, the paths and what the probe measures: ``docs/gpu-shapes.md``, "kernels/attention.py".
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from .names import (CUDA_CANDIDATES, GQA, MODES, REFERENCE, SDPA_BACKENDS, TRANSFORMERS_PATHS, VARLEN,
                    check_name, names)

__all__ = ["CUDA_CANDIDATES", "GQA", "MODES", "REFERENCE", "SDPA_BACKENDS", "TRANSFORMERS_PATHS", "VARLEN",
           "check_name", "names"]  # (re-exported: the settings check reads them torch-free from kernels.names)

CUDNN_PREFERRED_FROM = 91501
"""torch prefers cuDNN SDPA only from cuDNN 9.15.1 (``check_prefer_cudnn_attention``: version > 91500)."""
BF16_TOL = 0.05
"""Largest relative error (norm of the difference over the norm) of a path's output and input
gradient against the math path, both in the run's compute dtype: bf16 rounds at 2**-9 relative,
so two correct kernels differ by ~1e-2 over a deep model; a NaN, a leak across packed sequences or a
wrong plan differs by O(1)."""
SHAPES_PER_RUN = 24
"""New learner shapes a run pays a first call for (issue 50: 20-40 rows x width combinations over
a run with buckets), the weight of a path's first-call excess in :func:`decide`."""
CALLS_PER_SHAPE = 500
"""Calls of each shape over a run, the weight of a path's steady time in :func:`decide`."""


def register() -> None:
    """Register oppo's SDPA paths as transformers attention functions (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    for name in (GQA, *SDPA_BACKENDS):
        if name in AttentionInterface._global_mapping:
            continue
        AttentionInterface.register(name, _forward_for(SDPA_BACKENDS.get(name)))
        AttentionMaskInterface.register(name, sdpa_mask)


def _forward_for(backend: str | None) -> Callable[..., Any]:
    """The attention function of one oppo SDPA path: grouped heads not copied (:func:`gqa_forward`),
    pinned to ``backend`` (an ``SDPBackend`` name; None: torch's own order)."""
    if backend is None:
        return gqa_forward

    def forward(*args, **kwargs):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return gqa_forward(*args, _backend=backend, **kwargs)

    return forward


def gqa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                is_causal: bool | None = None, _backend: str | None = None, **kwargs) -> tuple[Any, None]:
    """transformers' ``sdpa_attention_forward`` (same arguments and result), except that under a mask
    grouped K/V heads ``[B, Hkv, L, D]`` go to SDPA as they are (``enable_gqa=True``) instead of
    copied to every query head, where the kernel that will run takes them (:func:`_takes_gqa`).
    Without a mask, or with one head per group, or with position biases, paged caches or attention
    outputs asked for, it is transformers' own function (which passes ``enable_gqa`` itself when no
    mask is given)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    if (attention_mask is None or groups <= 1 or kwargs.get("position_bias") is not None
            or kwargs.get("cache") is not None or kwargs.get("output_attentions")
            or key.shape[-1] != value.shape[-1] or not _takes_gqa(query, key, value, attention_mask, _backend)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    # under a mask transformers' own function runs with is_causal=False too (the mask holds causality)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, is_causal=False,
                                                           enable_gqa=True)  # [B, H, Q, D]
    return out.transpose(1, 2).contiguous(), None


_GQA_OK: dict[tuple, bool] = {}


def _takes_gqa(query, key, value, mask, backend: str | None) -> bool:
    """Whether the SDPA kernel that will run (``backend`` pinned, or torch's own order under a mask:
    cuDNN where torch prefers it, then memory-efficient; flash takes no mask) takes grouped K/V
    heads for these tensors, by torch's own checks (``torch.backends.cuda.can_use_*``), cached per
    shape signature (the shapes come from a small fixed set). Off CUDA and for the math kernel:
    always (the math kernel expands the heads itself)."""
    if query.device.type != "cuda" or backend == "MATH":
        return True
    sig = (query.device, query.dtype, tuple(query.shape), tuple(key.shape), tuple(mask.shape), mask.dtype, backend)
    if sig not in _GQA_OK:
        import torch

        params = torch.backends.cuda.SDPAParams(query, key, value, mask, 0.0, False, True)
        cudnn = bool(torch.backends.cuda.can_use_cudnn_attention(params, False))
        efficient = bool(torch.backends.cuda.can_use_efficient_attention(params, False))
        if backend == "CUDNN_ATTENTION":
            _GQA_OK[sig] = cudnn
        elif backend == "EFFICIENT_ATTENTION":
            _GQA_OK[sig] = efficient
        else:
            _GQA_OK[sig] = efficient or (cudnn and _device_prefers_cudnn(query.device))
    return _GQA_OK[sig]


def torch_prefers_cudnn(cudnn_version: int | None, capability: tuple[int, int], cuda_version: str | None,
                        deprioritized: bool = False) -> bool:
    """Whether torch's own SDPA order puts cuDNN first on this device: torch's
    ``check_prefer_cudnn_attention`` (sdp_utils.cpp) as a pure function. cuDNN above 9.15.0, compute
    capability 9.x or 10.x (with a CUDA below 13: minor 0 or 3 only), and not turned off by
    ``TORCH_CUDNN_SDPA_DEPRIORITIZED``."""
    if deprioritized or cudnn_version is None or cudnn_version < CUDNN_PREFERRED_FROM:
        return False
    major, minor = capability
    if major not in (9, 10):
        return False
    cuda_major = int(str(cuda_version or "0").split(".")[0] or 0)
    return cuda_major >= 13 or minor in (0, 3)


def cudnn_refusal(cudnn_version: int | None, capability: tuple[int, int], cuda_version: str | None,
                  deprioritized: bool = False) -> str | None:
    """Why ``oppo_sdpa_cudnn`` must not be pinned on this device (a sentence for the log), or None
    when torch's own order would pick cuDNN anyway (:func:`torch_prefers_cudnn`)."""
    if torch_prefers_cudnn(cudnn_version, capability, cuda_version, deprioritized):
        return None
    if deprioritized:
        return "TORCH_CUDNN_SDPA_DEPRIORITIZED is set"
    if cudnn_version is None:
        return "no cuDNN"
    if cudnn_version < CUDNN_PREFERRED_FROM:
        return (f"cuDNN {cudnn_version} is older than 9.15.1 ({CUDNN_PREFERRED_FROM}), which fixes lengths not "
                f"divisible by 128; torch prefers cuDNN only from there")
    return (f"torch's own order does not put cuDNN first on compute capability {capability[0]}.{capability[1]} "
            f"with CUDA {cuda_version}")


def _device_prefers_cudnn(device: torch.device) -> bool:
    """:func:`torch_prefers_cudnn` for ``device`` as torch sees it."""
    return _device_cudnn_refusal(device) is None


def _device_cudnn_refusal(device: torch.device) -> str | None:
    """:func:`cudnn_refusal` for ``device`` as torch sees it."""
    import torch

    if device.type != "cuda":
        return "not a CUDA device"
    return cudnn_refusal(torch.backends.cudnn.version(), torch.cuda.get_device_capability(device),
                         torch.version.cuda, os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "") in ("1", "true", "ON"))


def candidates(device: torch.device) -> list[str]:
    """The paths ``auto`` probes on ``device`` (beside :data:`REFERENCE`, which every path is checked
    against): those that take the 4-D masks of the static backend and the scorer slots
    (:func:`other_paths`: the rest)."""
    return ["sdpa", GQA, "eager"] if device.type != "cuda" else list(CUDA_CANDIDATES)


def other_paths() -> list[str]:
    """Paths a user may name (``ppo.attention``) that ``auto`` does not try, because they take no
    4-D mask: the static backend would run eager and the scorers' slots a dynamic cache."""
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
    """Whether a path takes the explicit 4-D masks of the static backend and the scorer slots."""
    from .varlen import base

    name = base(name)  # (oppo_varlen:<path> runs <path> for every forward but the packed ones)
    return name in ("sdpa", "eager", GQA) or name in SDPA_BACKENDS


def decode_path(name: str) -> str:
    """The path of the masked forwards (decode steps, streamed chunks, rows under a 4-D mask) of a
    model whose forwards are to run on ``name``: transformers' ``sdpa`` becomes ``oppo_sdpa_gqa``
    (the same backend order, grouped K/V heads not copied per head: :func:`gqa_forward`), and so does a
    path that takes no 4-D mask (``oppo_varlen``, flex, flash: their masked forwards need an
    SDPA-style one); eager and oppo's SDPA paths stay. (A model's packed forwards then run on
    ``oppo_varlen:<that path>``: ``forward.layout_rule``.)"""
    from .varlen import base

    name = base(name)
    if name in SDPA_BACKENDS or name in (GQA, "eager"):
        return name
    return GQA


def set_path(model: torch.nn.Module, name: str) -> None:
    """Every attention layer of ``model`` on path ``name``; the cached layout rules (``forward.layout_rule``)
    are dropped, since whether sequences may share rows depends on the path."""
    register()
    target: Any = model if hasattr(model, "set_attn_implementation") else getattr(model, "base_model", model)
    if not hasattr(target, "set_attn_implementation"):
        raise ValueError(f"{type(model).__name__} has no set_attn_implementation: ppo.attention cannot set its path; "
                         f"use ppo.attention=inherit")
    target.set_attn_implementation(name)
    for m in model.modules():
        m.__dict__.pop("_oppo_layout_rules", None)


@dataclass(frozen=True)
class Measured:
    """One path's probe (:func:`measure`): what :func:`decide` chooses from."""

    first_ms: float
    """Mean milliseconds of the first forward and backward at each probed width (plan builds included)."""
    steady_ms: float
    """Median milliseconds of a forward and backward at the check width, after its first call."""
    finite: bool
    """Output and every gradient finite at the check width (64 mod 128, padded rows)."""
    max_err: float
    """Relative error of the output and the input gradient against :data:`REFERENCE` (0 for it)."""


def run_cost_ms(m: Measured, shapes: int = SHAPES_PER_RUN, calls: int = CALLS_PER_SHAPE) -> float:
    """A run's attention-path cost in the probe's units: each of ``shapes`` shapes pays its first
    call once and ``calls`` steady calls."""
    return shapes * (max(m.first_ms, m.steady_ms) + (calls - 1) * m.steady_ms)


def decide(measured: Mapping[str, Measured | str], refused: Mapping[str, str] | None = None,
           reference: str = REFERENCE, tol: float = BF16_TOL, shapes: int = SHAPES_PER_RUN,
           calls: int = CALLS_PER_SHAPE) -> tuple[str | None, dict[str, str]]:
    """The path ``auto`` sets, from each path's measurements (a string: why it did not run) and the
    paths ``refused`` before measuring (e.g. cuDNN by :func:`cudnn_refusal`), with a verdict per path
    for the log. A path is refused when its output or gradients are not finite or differ from
    ``reference`` by more than ``tol``; of the rest, the cheapest over a run (:func:`run_cost_ms`)
    wins, ``reference`` itself only when every other path is refused (correct, slow: said). None
    when nothing ran."""
    verdict: dict[str, str] = {k: f"refused: {v}" for k, v in (refused or {}).items()}
    ok: dict[str, float] = {}
    for name, m in measured.items():
        if name in verdict:
            continue
        if isinstance(m, str):
            verdict[name] = f"refused: {m}"
        elif not m.finite:
            verdict[name] = "refused: non-finite output or gradients"
        elif not m.max_err <= tol:  # (NaN error: refused)
            verdict[name] = f"refused: differs from {reference} by {m.max_err:.2g} > {tol:g}"
        else:
            ok[name] = run_cost_ms(m, shapes, calls)
            verdict[name] = f"first {m.first_ms:.1f} ms, steady {m.steady_ms:.2f} ms, error {m.max_err:.1e}"
    fast = {k: v for k, v in ok.items() if k != reference} or ok
    return (min(fast, key=lambda k: fast[k]) if fast else None), verdict


def check_width(width: int) -> int:
    """The width the probe checks gradients and times the steady state at: 64 mod 128 (where cuDNN's
    backward has given NaN), the nearest such at or below ``width`` (64 at least)."""
    return max(64, width - (width - 64) % 128)


def probe_widths(width: int, n: int = 3) -> list[int]:
    """The widths whose first call the probe times: :func:`check_width` first, then the top ``n - 1``
    widths of the width ladder up to ``width`` (``oppo.shapes``): each a shape the buckets pay once."""
    from .. import shapes

    ladder, w = [], shapes.SMALLEST_WIDTH
    while w <= max(width, shapes.SMALLEST_WIDTH):
        ladder.append(w)
        w = shapes.width(w + 1)
    out = [check_width(width)]
    for w in reversed(ladder):
        if len(out) < n and w not in out:
            out.append(w)
    return out


def _rows(vocab: int, rows: int, width: int, device) -> tuple[Any, Any, Any]:
    """(ids, position ids, real) [rows, width] each: two packed sequences and a padding tail per
    row, as ``forward.RowLayout.lay_out`` lays them out (padding its own run of positions from 0),
    ``real`` True on the sequences' tokens."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, max(4, vocab), (rows, width), generator=g)
    pad = max(1, width // 8)
    a = (width - pad) // 2
    b = width - pad - a
    pos = torch.cat([torch.arange(a), torch.arange(b), torch.arange(pad)])[None].expand(rows, width)
    real = (torch.arange(width) < a + b)[None].expand(rows, width)
    return ids.to(device), pos.contiguous().to(device), real.to(device)


def measure(model: torch.nn.Module, rows: int, widths: list[int], paths: list[str], repeats: int = 3,
            sync: Callable[[], None] | None = None, dtype: torch.dtype | None = None,
            ) -> dict[str, Measured | str]:
    """Each of ``paths`` on ``model``'s backbone: the first forward and backward at each of ``widths``
    (``rows`` packed rows with a padding tail: :func:`_rows`), then ``repeats`` more at ``widths[0]``
    (the check width) timed as the steady state, whose output and input gradient are compared with
    :data:`REFERENCE`'s (measured first, whether asked or not), under ``dtype`` autocast (the run's
    compute dtype; None: the weights'). A path that fails, or lets packed sequences see each other,
    gets the reason instead. The model is left on its original path, its gradients cleared."""
    import torch

    from ..models import backbone_and_head
    from .varlen import packing_fails

    original = _path(model)
    backbone = backbone_and_head(model)[0]
    embed: Any = getattr(backbone, "get_input_embeddings")()  # (an nn.Module's method mypy types as a Tensor)
    dev = next(model.parameters()).device
    sync = sync or (torch.cuda.synchronize if dev.type == "cuda" else (lambda: None))
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 16) or 16)
    trains = any(p.requires_grad for p in backbone.parameters())

    offsets_of = {"on": False}

    def call(width: int):
        ids, pos, real = _rows(vocab, rows, width, dev)
        x = embed(ids).detach().requires_grad_(True)
        extra = {}
        if offsets_of["on"]:  # the variable-length path: the rows' sequences and padding run by their offsets
            from . import varlen

            pad = max(1, width // 8)
            a = (width - pad) // 2
            cuts = [r * width + c for r in range(rows) for c in (0, a, width - pad)] + [rows * width]
            extra = varlen.forward_kwargs(tuple(cuts), rows, width, dev)
        with torch.autocast(dev.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            hidden = backbone(inputs_embeds=x, position_ids=pos, use_cache=False, **extra).last_hidden_state
        loss = (hidden.float().square().mean(-1) * real).sum() / real.sum()  # padding takes no part
        loss.backward()
        return hidden.detach()[real].float(), x.grad[real].float()

    def finite(out, grad) -> bool:
        params = [p.grad for p in backbone.parameters() if p.grad is not None] if trains else []
        return bool(torch.isfinite(out).all() and torch.isfinite(grad).all()
                    and all(torch.isfinite(g).all() for g in params))  # CPU-GPU sync point (once a path)

    out: dict[str, Measured | str] = {}
    ref: tuple[Any, Any] | None = None
    try:
        for name in [REFERENCE, *[p for p in paths if p != REFERENCE]]:
            try:
                offsets_of["on"] = name == VARLEN
                if name == VARLEN:  # packed rows by their offsets on oppo's variable-length kernel (varlen),
                    from . import varlen  # the masked forwards on GQA's path

                    set_path(model, GQA)
                    if not varlen.use(backbone):
                        out[name] = "its attention cannot take sequence offsets"
                        continue
                else:
                    set_path(model, name)
                with torch.autocast(dev.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                    why = packing_fails(backbone)  # (in the compute dtype: cuDNN takes no fp32 masters)
                if why is not None:
                    out[name] = f"does not keep packed sequences apart ({why})"
                    continue
                model.zero_grad(set_to_none=True)
                firsts = []
                for w in widths:
                    sync()
                    t = time.perf_counter()
                    call(w)
                    sync()
                    firsts.append(1e3 * (time.perf_counter() - t))
                times = []
                for _ in range(max(1, repeats)):
                    model.zero_grad(set_to_none=True)
                    sync()
                    t = time.perf_counter()
                    got = call(widths[0])
                    sync()
                    times.append(1e3 * (time.perf_counter() - t))
                ok = finite(*got)
                if name == REFERENCE:
                    ref = got
                err = max(_rel(got[0], ref[0]), _rel(got[1], ref[1])) if ref is not None else float("nan")
                out[name] = Measured(sum(firsts) / len(firsts), sorted(times)[len(times) // 2], ok, err)
            except Exception as e:  # a path this model, torch or device does not run
                out[name] = f"failed ({type(e).__name__}: {str(e)[:120]})"
            finally:
                model.zero_grad(set_to_none=True)
    finally:
        set_path(model, original)
        model.zero_grad(set_to_none=True)
    if REFERENCE not in paths:
        out.pop(REFERENCE, None)
    return out


def _rel(x, ref) -> float:
    """||x - ref|| / ||ref|| (NaN where either is not finite)."""
    return float((x - ref).norm() / ref.norm().clamp(min=1e-12))


def probe(model: torch.nn.Module, rows: int, width: int, paths: list[str], repeats: int = 3,
          sync: Callable[[], None] | None = None, dtype: torch.dtype | None = None) -> dict[str, float | str]:
    """Seconds of one steady forward and backward of ``model`` over ``rows`` packed rows of about
    ``width`` tokens under each of ``paths`` (:func:`measure` at :func:`check_width`), or why a path
    did not run or was refused (non-finite, or unlike the math path). The model is left on its
    original path."""
    got = measure(model, rows, [check_width(width)], paths, repeats, sync, dtype)
    _, verdict = decide(got)
    return {k: (v.steady_ms / 1e3 if isinstance(v, Measured) and not verdict[k].startswith("refused") else verdict[k])
            for k, v in got.items()}


def _path(model: torch.nn.Module) -> str:
    """The attention path ``model`` runs now."""
    cfg: Any = getattr(model, "config", None)
    return str(getattr(cfg, "_attn_implementation", None) or "eager")


def choose(policy: torch.nn.Module, others: list[torch.nn.Module], mode: str, rows: int, width: int,
           say: Callable[[str], None], dtype: torch.dtype | None = None,
           measure_fn: Callable[..., Mapping[str, Measured | str]] | None = None,
           cudnn_why: str | None | bool = False) -> str:
    """``ppo.attention`` = ``mode`` for the run: ``inherit`` keeps each model's path as loaded; a
    path name sets it on every model; ``auto`` probes on CUDA (keeps the loaded path on CPU) at
    ``rows`` x the widths of :func:`probe_widths` and sets the path :func:`decide` picks, through
    :func:`decode_path` (so the decode and chunk forwards copy no K/V per head). Returns the path
    (the policy's). A path that takes no 4-D mask is refused for a model that needs one (the static
    backend and the scorer slots check). ``measure_fn`` (default :func:`measure`) and ``cudnn_why``
    (default: the device's :func:`cudnn_refusal`) are for tests, which drive the CUDA branch on the
    CPU with injected measurements."""
    dev = next(policy.parameters()).device
    models = [policy, *others]
    probing = dev.type == "cuda" or measure_fn is not None
    if mode == "inherit" or (mode == "auto" and not probing):
        return _path(policy)
    if mode != "auto":
        for m in models:
            set_path(m, mode)
        if mode == "oppo_sdpa_cudnn" and dev.type == "cuda" and (why := _device_cudnn_refusal(dev)) is not None:
            say(f"attention: warning: oppo_sdpa_cudnn as named (ppo.attention), though {why}")
        say(f"attention: {mode} (ppo.attention)")
        return mode
    paths = CUDA_CANDIDATES  # (on the CPU only with injected measurements: the CUDA branch, driven in tests)
    why_cudnn = _device_cudnn_refusal(dev) if cudnn_why is False else cudnn_why
    refused = {"oppo_sdpa_cudnn": str(why_cudnn)} if why_cudnn is not None else {}
    widths = probe_widths(width)
    got = (measure_fn or measure)(policy, rows, widths, [REFERENCE, *[p for p in paths if p not in refused]],
                                  dtype=dtype)
    best, verdict = decide(got, refused)
    shown = "; ".join(f"{k}: {v}" for k, v in verdict.items())
    if best is None:
        say(f"attention: kept as loaded ({_path(policy)}); no probed path ran: {shown}")
        return _path(policy)
    best = decode_path(best)
    for m in models:
        set_path(m, best)
    why = (" (every faster path refused: correct but slow)" if best == REFERENCE else "")
    say(f"attention: {best}{why}, the cheapest over a run at {rows} rows x widths {widths} (first call and steady "
        f"forward and backward, gradients against {REFERENCE} at width {widths[0]}, padded rows): {shown}")
    return best
