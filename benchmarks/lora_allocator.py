"""Why LoRA's resident peak on CPU exceeds full fine-tuning's: freed memory the allocator keeps.

    python benchmarks/lora_allocator.py full
    python benchmarks/lora_allocator.py lora

One forward of the 32M synthetic policy (``oppo.bench``'s "small") on 8 x 300 tokens, with grad,
in a fresh process (run each mode on its own). Prints, in MiB over the loaded model: the resident
set size after the forward, the same after glibc's ``malloc_trim(0)`` hands freed memory back,
and the tensors the forward saves for backward (distinct storages, parameters excluded).
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from memory import rss_mb, saved_for_backward  # benchmarks/memory.py, beside this script
from oppo.bench import write_synthetic_models
from oppo.models import apply_lora


def main(mode: str) -> int:
    if mode not in ("full", "lora"):
        raise SystemExit("usage: python benchmarks/lora_allocator.py full|lora")
    paths = write_synthetic_models(Path("/tmp/oppo_lora_allocator"), "small", "small", "cpu", torch.float32,
                                   prompt_words=(16, 32))
    model = AutoModelForCausalLM.from_pretrained(paths["policy"])
    if mode == "lora":
        model = apply_lora(model, 8, 16.0, 0.0, [])
    ids = torch.randint(4, 100, (8, 300), generator=torch.Generator().manual_seed(0))
    base = rss_mb()
    with saved_for_backward(model) as saved:
        out = model(input_ids=ids)
    after = rss_mb()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed = rss_mb()
    print(json.dumps({"mode": mode, "resident_after_forward_mb": round(after - base),
                      "after_malloc_trim_mb": round(trimmed - base),
                      "saved_for_backward_mb": round(sum(saved.values()) / 2**20)}))
    del out
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
