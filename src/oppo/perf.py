"""Model FLOPs and the device's peaks: what a stage's utilisation (MFU) is computed from.

MFU = the stage's model FLOPs (real, unpadded tokens; no recomputation) / the stage's time / a
peak, reported against two peaks: the measured one (:func:`peak_flops`, a square matmul timed in
the same process) and the device's spec (:func:`spec_peak_flops`, :data:`SPEC_BF16_TFLOPS`; none
on CPU, unknown GPUs or float32). A token costs ``2 * matmul_params`` plus attention's
``4 * layers * heads * head_dim * context``; a backward twice its forward.

Design notes: docs/metrics.md, "How MFU is computed"."""

from __future__ import annotations

import time
from functools import lru_cache

import torch


def matmul_params(model: torch.nn.Module) -> int:
    """Weights a token multiplies through: every ``nn.Linear``'s and transformers ``Conv1D``'s
    weight (GPT-2's projections; a tied head counted as a matmul), LoRA adapters included; of a
    fused mixture-of-experts layer (transformers 5's ``...Experts`` modules: 3-D parameters of
    ``[experts, out, in]``), the share a token runs, top-k of the experts (``num_experts_per_tok``
    of ``num_local_experts`` / ``num_experts`` / ``n_routed_experts`` in the model's config), and
    its router (a 2-D ``weight`` of ``[experts, hidden]`` applied with ``F.linear``)."""
    top_k, experts = _experts(model)
    total = 0.0
    for m in model.modules():
        weight = getattr(m, "weight", None)
        if isinstance(weight, torch.Tensor) and (isinstance(m, torch.nn.Linear)
                                                 or (type(m).__name__ == "Conv1D" and weight.dim() == 2)):
            total += weight.numel()
        elif experts and not isinstance(m, torch.nn.Embedding):
            for name, p in m.named_parameters(recurse=False):
                if p.dim() == 3 and p.shape[0] == experts:  # fused experts: a token runs top_k of them
                    total += p.numel() * top_k / experts
                elif p.dim() == 2 and p.shape[0] == experts and name == "weight":  # the router
                    total += p.numel()
    return round(total)


def _experts(model: torch.nn.Module) -> tuple[int, int]:
    """(experts a token is routed to, experts per layer) from the model's config; (0, 0) for a dense model."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    experts = next((n for a in ("num_local_experts", "num_experts", "n_routed_experts")
                    if isinstance(n := getattr(cfg, a, None), int) and n > 1), 0)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    return (top_k if isinstance(top_k, int) and top_k >= 1 else 1, experts) if experts else (0, 0)


def _attention_width(model: torch.nn.Module) -> tuple[int, int]:
    """(layers, heads * head_dim) of the model's attention, from its config (0, 0 if unknown)."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    layers = getattr(cfg, "num_hidden_layers", 0) or 0
    heads = getattr(cfg, "num_attention_heads", 0) or 0
    dim = getattr(cfg, "head_dim", None) or ((getattr(cfg, "hidden_size", 0) or 0) // max(heads, 1))
    return layers, heads * dim


def forward_flops(model: torch.nn.Module, lengths: list[int]) -> float:
    """Forward FLOPs of ``model`` over sequences of ``lengths`` real tokens each (causal: token i
    attends to i + 1 tokens)."""
    n = matmul_params(model)
    layers, width = _attention_width(model)
    tokens = sum(lengths)
    attended = sum(L * (L + 1) / 2 for L in lengths)  # sum over tokens of their context
    return 2.0 * n * tokens + 4.0 * layers * width * attended


SPEC_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    # (a piece of torch.cuda.get_device_name(), dense bf16 TFLOP/s without sparsity), the vendors'
    # datasheets; the more specific names first (an "H200 NVL" is not an "H200" SXM)
    ("GH200", 989.0), ("H200 NVL", 835.0), ("H200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0),
    ("H100", 989.0), ("H800", 989.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0),
    ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0), ("A10", 125.0),
    ("RTX 4090", 165.0), ("MI300X", 1307.0),
)
"""The devices whose spec peak :func:`spec_peak_flops` knows. An "H100" with neither "PCIe" nor
"NVL" in its name is the SXM part (``NVIDIA H100 80GB HBM3``)."""


def spec_peak_flops(device: str, dtype: torch.dtype, name: str | None = None) -> float | None:
    """The device's dense bf16/fp16 peak in FLOP/s by its name (``name``, else
    ``torch.cuda.get_device_name``), from :data:`SPEC_BF16_TFLOPS`; None on CPU, in another dtype,
    or for a device the table does not name (no guess)."""
    dev = torch.device(device)
    if dtype not in (torch.bfloat16, torch.float16) or (name is None and dev.type != "cuda"):
        return None
    if name is None:
        name = torch.cuda.get_device_name(dev)
    for key, tflops in SPEC_BF16_TFLOPS:
        if key.lower() in name.lower():
            return tflops * 1e12
    return None


@lru_cache(maxsize=None)
def peak_flops(device: str, dtype: torch.dtype, threads: int | None = None) -> float:
    """FLOP/s of a square matmul in ``dtype`` on ``device`` (median of a few timed runs after a
    warm-up): 8192 on CUDA, 1024 on CPU (with the current torch thread count). Cached per
    process; costs about 0.1-0.5 s."""
    dev = torch.device(device)
    n = 8192 if dev.type == "cuda" else 1024
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    times = []
    for i in range(6):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        torch.mm(a, b)  # (on CPU synchronous; on CUDA timed by the synchronize below)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i:  # the first is the warm-up
            times.append(time.perf_counter() - t)
    times.sort()
    return 2.0 * n ** 3 / times[len(times) // 2]
