"""The names ``ppo.attention`` takes (``oppo.kernels.attention`` has the paths themselves), importing nothing
of oppo and no torch: the settings check (``config.validate``) reads them before any model loads."""

from __future__ import annotations

SDPA_BACKENDS = {"oppo_sdpa_cudnn": "CUDNN_ATTENTION", "oppo_sdpa_efficient": "EFFICIENT_ATTENTION",
                 "oppo_sdpa_math": "MATH"}
"""oppo's SDPA paths pinned to one backend (``torch.nn.attention.SDPBackend`` names)."""
GQA = "oppo_sdpa_gqa"
"""torch's own SDPA order, grouped K/V heads passed with ``enable_gqa`` under a mask (``oppo.kernels.attention``)."""
REFERENCE = "oppo_sdpa_math"
"""The path every probed path's gradients are checked against."""
VARLEN = "oppo_varlen"
"""Packed rows on variable-length attention (``oppo.kernels.varlen``): not a value of ``ppo.attention``, since a model
whose path can take sequence offsets runs its packed forwards on it by itself (``forward.layout_rule``); the
attention check measures it under this name."""
MODES = ("auto", "inherit")
CUDA_CANDIDATES = (GQA, "oppo_sdpa_cudnn", "oppo_sdpa_efficient")
"""The paths ``auto`` probes on CUDA, beside :data:`REFERENCE` (``oppo.kernels.attention.candidates``)."""
TRANSFORMERS_PATHS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
"""transformers' own implementations a user may name (a hub kernel, ``org/repo``, besides)."""


def names() -> tuple[str, ...]:
    """Every value ``ppo.attention`` takes by name (a hub kernel ``org/repo`` besides)."""
    return (*MODES, GQA, *SDPA_BACKENDS, *TRANSFORMERS_PATHS)


def check_name(value: str) -> str | None:
    """Why ``ppo.attention=value`` cannot be, as a message naming the setting and its choices, or None.
    Torch-free: the settings check calls it before any model (or torch) loads."""
    if value in names() or "/" in value:
        return None  # (org/repo: a hub kernel, loaded by transformers' kernels integration)
    return (f"ppo.attention={value!r} is not an attention path; choose one of {', '.join(names())}, "
            f"or a hub kernel as transformers names it (e.g. kernels-community/flash-attn3).")
