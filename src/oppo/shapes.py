"""Shapes from a small fixed set (``ppo.shape_buckets``): what the GPU stack keys its work on.

cuDNN builds an attention plan per exact shape, a CUDA graph replays one shape, ``torch.compile``
specialises on shapes: a forward whose rows, width or KV length are new pays for a plan, a capture
or a recompilation (tens of milliseconds), and oppo's forwards would make a new shape almost every
call (packed micro-batches change rows x width, a streamed chunk's KV grows by a chunk). Rounded up
to a *ladder*, every size comes from a few values, so each shape is paid once per run. The added
positions are padding (masked, or rows and columns of their own), so the numbers do not change; the
learner counts them in ``perf/train_padded_frac``.

The ladder with ``per_octave`` steps between powers of two: 2 per octave is 1, 2, 3, 4, 6, 8, 12,
16, 24, 32, ... (at most half added, a sixth on average); 4 per octave is ..., 16, 20, 24, 28, 32, 40,
48, ... (at most a quarter, about a tenth on average). Pure functions of integers: the same on CPU and GPU, so the CPU tests see the shapes a
GPU would (``benchmarks/shape_probe.py`` counts them).
"""

from __future__ import annotations

MODES = ("auto", "on", "off")

ROWS_PER_OCTAVE = 2
"""Row counts (sequences of an unpacked forward, packed rows, streamed rows): a padded row costs a
whole row, so few values."""

WIDTH_PER_OCTAVE = 4
"""Widths of the learner's and the one-shot scorers' rows: finer, padding a width costs less."""

SMALLEST_WIDTH = 16


def ladder(n: int, per_octave: int = ROWS_PER_OCTAVE, smallest: int = 1) -> int:
    """The smallest value of the ladder (module docstring) that is >= ``n`` and >= ``smallest``;
    ``per_octave`` a power of two. 0 stays 0 (nothing to lay out)."""
    if per_octave < 1 or per_octave & (per_octave - 1):
        raise ValueError(f"per_octave must be a power of two, got {per_octave}")
    if n <= 0:
        return 0
    n = max(n, smallest)
    top = n.bit_length() - 1  # 2**top <= n
    step = 1 << max(0, top - (per_octave.bit_length() - 1))
    return -(-n // step) * step


def width(n: int) -> int:
    """A row's width on the width ladder (at least :data:`SMALLEST_WIDTH`)."""
    return ladder(n, WIDTH_PER_OCTAVE, SMALLEST_WIDTH)


def rows(n: int) -> int:
    """A row count on the row ladder."""
    return ladder(n, ROWS_PER_OCTAVE)


def rows_ladder(limit: int) -> list[int]:
    """Every row count of the ladder from 1 up to ``limit``."""
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n = rows(n + 1)
    return out


def resolve(mode: str, device) -> bool:
    """``ppo.shape_buckets`` for a model on ``device``: auto is on where shapes cost (CUDA)."""
    if mode not in MODES:
        raise ValueError(f"ppo.shape_buckets must be one of {', '.join(MODES)}, got {mode!r}")
    return mode == "on" or (mode == "auto" and str(getattr(device, "type", device)).startswith("cuda"))
