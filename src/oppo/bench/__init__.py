"""``oppo bench``: the same workload in every mode, side by side, in one invocation.

- :mod:`.cli`: the command line (``main``);
- :mod:`.runner`: the modes' Trainers, their steps interleaved (``run_modes``);
- :mod:`.workloads`: forced response lengths and synthetic models;
- :mod:`.probe`: the rollout backend's decode step alone;
- :mod:`.summaries`: bench.json's figures and bench.md's tables.

What it measures and why (interleaving, warm-up, timing-only runs, the stage profile): ``docs/bench.md``.
"""

from __future__ import annotations

from .cli import main
from .probe import backend_step_probe
from .runner import (CHECKED, LEARNING_PREFIXES, LOCAL_BASELINE, QUICK, mode_overrides, run_modes, slug, split_mode,
                     timing_only)
from .summaries import (HARDWARE, hardware_markdown, jsonable, machine, settings_yaml, stage_profile,
                        stage_profile_markdown, summarize, to_markdown)
from .workloads import (MODEL_SIZES, WORKLOADS, LengthWorkload, LlamaShape, length_sampler, pct, synthetic_config,
                        synthetic_sampler, synthetic_tokenizer, write_synthetic_models)

__all__ = ["CHECKED", "HARDWARE", "LEARNING_PREFIXES", "LOCAL_BASELINE", "MODEL_SIZES", "QUICK", "WORKLOADS",
           "LengthWorkload", "LlamaShape", "backend_step_probe", "hardware_markdown", "machine", "main",
           "mode_overrides", "run_modes", "split_mode", "stage_profile", "stage_profile_markdown", "summarize",
           "synthetic_config", "synthetic_tokenizer", "timing_only", "to_markdown", "write_synthetic_models"]
