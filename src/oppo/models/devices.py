"""Where a role's model runs and in which dtype, from its settings (``auto``: CUDA when there is one)."""

from __future__ import annotations

import torch

from .errors import ModelLoadError


def resolve_device(spec: str, fallback: str | None = None) -> torch.device:
    if spec == "auto":
        if fallback is not None:
            return torch.device(fallback)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"Device {spec!r} was asked for but CUDA is not available; use cpu.")
    return dev



def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec]
