"""How the trainer's weights reach vLLM's engine between two engine steps: Hugging Face names
(:func:`hf_weights`, a LoRA policy merged), whole weights through the buffer shared with vLLM's
worker (pipelined in runs of layers) or through vLLM's RPC, and a LoRA adapter alone
(``lora.py``). Functions over the state of the backend (``backend.VLLMRolloutBackend``), typed
by :class:`LoadTarget`; its ``load_weights`` chooses among them."""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, cast

import torch

from . import lora
from .checks import VLLMEngineDied, VLLMUnavailable
from .heads import HEAD
from .weights import BufferLayout, SharedWeights, load_in_worker, map_in_worker, unmap_in_worker
from .worker import reload_in_worker

if TYPE_CHECKING:
    from peft import PeftModel

    from .heads import ServedCheckpoint

WEIGHT_RUNS = 4
"""A weight load through the shared buffer is cut into this many runs of layers, pipelined: the
trainer copies run i + 1 while vLLM's worker loads run i (:func:`load_shared`)."""


class LoadTarget(Protocol):
    """The state of a vLLM rollout backend that a weight load reads and sets (the backend,
    ``backend.VLLMRolloutBackend``, is one): the backend imports these loads, so they name only
    what they touch, not the backend."""

    llm: Any  # vLLM's LLMEngine
    role: str
    version: int
    weight_loads: int
    weight_transport: str
    weight_path: str
    last_weight_sync_s: float
    last_weight_sync_parts: dict
    lora_merged_why: str
    _dtype: torch.dtype
    _on_cpu: bool
    _served: ServedCheckpoint | None
    _serves_tied: bool
    _lora_sync: str
    _adapter: lora.AdapterFiles | None
    _adapter_on: bool
    _adapter_served: bool
    _shared: SharedWeights | None
    _shared_refused: str
    _shared_path: str

    def _core(self) -> Any:
        """vLLM's in-process engine core."""

    def _call(self, what: str, fn: Callable, *args: Any) -> Any:
        """Run an engine call; a dead vLLM worker is reported with the backend's role."""


def hf_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s weights under their Hugging Face checkpoint names, detached on the CPU. A
    peft LoRA model yields its merged weights (W + the adapter's ``get_delta_weight``, peft's
    own merge math, per adapted layer: linear layers and embeddings alike).

    A tied base weight (input embedding and output head, one tensor) is named once, as before,
    unless a LoRA adapter sits on one of its layers: then the layers differ as the trainer
    computes them (the embedding looks up W + its delta, the head multiplies by W + its own, or
    by W alone), and each is yielded under its own name, so the engine must serve them untied
    (it does on the CPU: ``heads.ServedCheckpoint``; ``VLLMRolloutBackend.load_weights``
    refuses a head the engine would ignore)."""
    from ...models import is_peft

    if not is_peft(module):
        for name, p in module.named_parameters():
            yield name, p.detach()
        return
    inner = cast("PeftModel", module).get_base_model()  # (is_peft: peft's model)

    def adapters(layer) -> list[str]:
        # peft keeps a linear layer's adapters in lora_A/lora_B, an embedding's in lora_embedding_A/B
        have = set(getattr(layer, "lora_A", {})) | set(getattr(layer, "lora_embedding_A", {}))
        return [a for a in layer.active_adapters if a in have] if hasattr(layer, "get_delta_weight") else []

    lora_layers = {name: m for name, m in inner.named_modules() if adapters(m)}
    names: dict[int, list[str]] = {}  # id(tensor) -> its names (a tied tensor has several)
    params = {}
    for name, p in inner.named_parameters(remove_duplicate=False):
        if "lora_" not in name:
            names.setdefault(id(p), []).append(name)
            params[name] = p
    for tensor_names in names.values():
        owners = [n.rsplit(".", 2)[0] if ".base_layer." in n else None for n in tensor_names]
        adapted = any(o in lora_layers for o in owners)
        for name, owner in list(zip(tensor_names, owners))[:None if adapted else 1]:
            w = params[name].detach()
            layer = lora_layers.get(owner) if owner else None
            if layer is not None and name.endswith(".weight"):
                for adapter in adapters(layer):
                    w = w + layer.get_delta_weight(adapter).to(w.dtype)
            yield name.replace(".base_layer.", "."), w


def load_pairs(eng: LoadTarget, pairs: list[tuple[str, torch.Tensor]], version: int, t: float) -> None:
    """Load these (Hugging Face name, tensor) pairs, whole weights (``VLLMRolloutBackend.load_weights``)."""
    if eng._serves_tied and any(n == HEAD for n, _ in pairs):
        # a LoRA adapter on a tied embedding or head (hf_weights): vLLM ties the head to the
        # embedding and skips a head of its own, so it would sample from another policy
        raise VLLMUnavailable(
            "the policy's output head differs from its tied input embedding (LoRA on embed_tokens or "
            "lm_head of a model with tie_word_embeddings), and vLLM serves this model with a tied head "
            "here (on a GPU oppo does not untie it): it would sample from another policy than the one "
            "trained. Leave the embedding and the head out of lora.target_modules, or use "
            "generation.backend=eager.")
    if eng.weight_transport == "rpc" or eng._shared_refused or not load_shared(eng, pairs, version, t):
        pairs = [(n, w.to("cpu", copy=False).contiguous()) for n, w in pairs]
        if eng._served is not None:
            pairs = list(eng._served.weights(pairs))
        t_rpc = time.perf_counter()
        eng._call("a weight load", eng.llm.collective_rpc, reload_in_worker, None, (pairs,))
        eng.weight_path = "rpc"
        eng.last_weight_sync_parts = {"prepare_s": t_rpc - t, "rpc_s": time.perf_counter() - t_rpc}
    eng.weight_loads += 1
    eng.version = version
    eng.last_weight_sync_s = time.perf_counter() - t

def load_adapter(eng: LoadTarget, module: torch.nn.Module, version: int, t: float) -> None:
    """The peft policy ``module`` as base + adapter (``lora.py``): the base weights where the engine
    does not hold the trainer's yet, then the adapter, reloaded in place between two steps."""
    assert eng._adapter is not None
    parts: dict = {}
    if eng._adapter.base_changed(module):
        load_pairs(eng, list(lora.base_weights(module)), version, t)
        eng._adapter.base_sent(module)
        parts = {"base_s": eng.last_weight_sync_s, "base_path": eng.weight_path}
    t_write = time.perf_counter()
    nbytes = eng._adapter.write(module)
    t_load = time.perf_counter()
    try:
        eng._call("an adapter load", eng.llm.add_lora, eng._adapter.request(load_inplace=True))
    except VLLMEngineDied:
        raise
    except Exception as e:
        if eng._lora_sync != "auto" or eng._adapter_served:
            raise VLLMUnavailable(f"vLLM refused the policy's LoRA adapter (rollout.vllm.lora_sync={eng._lora_sync}): "
                                  f"{type(e).__name__}: {e}. Set rollout.vllm.lora_sync=merged to send merged weights.") from e
        # auto, and vLLM refuses the adapter before it ever served it: merged weights from now on
        why = f"vLLM refused the adapter: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
        warnings.warn(f"vLLM ({eng.role}): the LoRA policy is sent merged, the whole model at every update, "
                      f"because {why}", stacklevel=3)
        eng._adapter.close()
        eng._adapter, eng.lora_merged_why = None, why
        load_pairs(eng, list(hf_weights(module)), version, t)
        return
    eng._adapter_on = eng._adapter_served = True
    eng.weight_path = "adapter"
    eng.last_weight_sync_parts = {**parts, "write_s": t_load - t_write, "load_s": time.perf_counter() - t_load,
                                   "adapter_bytes": nbytes}
    eng.weight_loads += 1
    eng.version = version
    eng.last_weight_sync_s = time.perf_counter() - t

def load_shared(eng: LoadTarget, pairs: list[tuple[str, torch.Tensor]], version: int, t: float) -> bool:
    """Load ``pairs`` through the shared buffer (made and mapped by vLLM's worker at the first load,
    and again if the names or shapes change); False where it cannot be used (warned once)."""
    if eng._served is not None:
        pairs = list(eng._served.weights(pairs, clone=False))  # (copied into the buffer below)
    shared = eng._shared
    index = shared.layout.index(pairs) if shared is not None else None
    if shared is None or index is None:
        drop_shared(eng)
        shared = _map_shared(eng, pairs)
        if shared is None:
            return False
        index = list(range(len(pairs)))
    # pipelined: vLLM's worker loads (and the CPU repacks) one run of layers while this process
    # copies the next into the buffer (vLLM's worker takes RPCs in order; each run's layers whole)
    live = eng._shared_path.endswith("/live")
    runs = shared.layout.runs(index, WEIGHT_RUNS if live else 1)
    t_write, write_s, futures = time.perf_counter(), 0.0, []
    for a, b in runs:
        t_run = time.perf_counter()
        shared.write(pairs[a:b], index[a:b])
        write_s += time.perf_counter() - t_run
        futures.append(_load_rpc(eng, version, index[a:b], len(shared.layout.slots)))
    outs, failed = [], None
    for f in futures:  # (all of them, in order, even after a failure: vLLM's queue of results)
        try:
            outs.append(eng._call("a weight load", f))  # (each: vLLM's workers' results)
        except Exception as e:  # noqa: BLE001 (re-raised below)
            failed = failed or e
    if failed is not None:
        raise failed
    if any(o["version"] != version for out in outs for o in out):
        raise RuntimeError(f"vLLM's worker loaded version {[o['version'] for out in outs for o in out]}, "
                           f"not {version}")
    eng.weight_path = eng._shared_path
    worker = {k: sum(out[0][k] for out in outs) for k in outs[0][0] if k.endswith("_s") or k == "layers"}
    eng.last_weight_sync_parts = {"prepare_s": t_write - t, "write_s": write_s, "runs": len(runs),
                                   "wall_s": time.perf_counter() - t_write, **worker}
    return True

def _load_rpc(eng: LoadTarget, version: int, index: list[int], slots: int):
    """Start vLLM's worker's load of these slots (of ``slots`` in the buffer); returns a callable
    that waits for its results. Not blocking where vLLM's executor takes ``non_block`` (its
    multiprocessing one)."""
    every = index == list(range(slots))
    args = (version, None if every else index)
    executor = getattr(eng._core(), "model_executor", None)
    if executor is None or "non_block" not in inspect.signature(executor.collective_rpc).parameters:
        out = eng._call("a weight load", eng.llm.collective_rpc, load_in_worker, None, args)
        return lambda: out  # (another executor: one call at a time)
    return eng._call("a weight load", lambda: executor.collective_rpc(load_in_worker, args=args,
                                                                       non_block=True)).result

def _map_shared(eng: LoadTarget, pairs: list[tuple[str, torch.Tensor]]) -> SharedWeights | None:
    """Make the shared buffer for ``pairs``' layout and have vLLM's worker map it; None where it
    cannot be used."""
    shared = None
    try:
        layout = BufferLayout.of(pairs, eng._dtype)
        device = torch.device("cpu") if eng._on_cpu else torch.device("cuda", torch.cuda.current_device())
        shared = SharedWeights(layout, device)
        how = eng._call("mapping the shared weights", eng.llm.collective_rpc, map_in_worker, None,
                         (shared.handle(), layout))
    except VLLMEngineDied:
        if shared is not None:
            shared.close()
        raise
    except Exception as e:  # noqa: BLE001 (any failure to share: the RPC path still works)
        if shared is not None:
            shared.close()
        eng._shared_refused = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
        if eng.weight_transport == "shared":
            raise VLLMUnavailable(f"weight_transport=shared, but the weights cannot be shared with vLLM's "
                                  f"worker: {eng._shared_refused}") from e
        warnings.warn(f"vLLM ({eng.role}): weights go through vLLM's RPC, the whole model pickled at every "
                      f"update, because a shared buffer cannot be used: {eng._shared_refused}", stacklevel=3)
        return None
    eng._shared = shared
    eng._shared_path = f"{shared.kind}/{how[0]}"
    return shared

def drop_shared(eng: LoadTarget) -> None:
    shared, eng._shared = eng._shared, None
    if shared is None:
        return
    if getattr(eng, "llm", None) is not None:
        with contextlib.suppress(Exception):
            eng.llm.collective_rpc(unmap_in_worker)
    shared.close()
