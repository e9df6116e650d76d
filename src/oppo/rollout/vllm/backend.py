"""vLLM as a rollout backend (``generation.backend=vllm``): a :class:`RolloutBackend` driven one
engine step at a time (the engine core in this process, the model in vLLM's worker process), so
that chunks stream to the scorers and weights load between two steps. Each request samples with
its own seed; a token's version is the oldest of the weights that computed its logits and its KV;
a recompute re-adds a request with its prefix as the prompt (prefix cache salted per weight load).

The checks are in :mod:`.checks`, the code run in vLLM's worker in :mod:`.worker`, the weight loads
in :mod:`.loads`. How it drives vLLM and why (log-probs, threads, parent death, head padding, tied
heads): ``docs/vllm.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Literal, cast

import torch

from ..chunks import take_chunks
from ..registry import BuildRequest
from ...api.protocols import WeightSource
from ...api.records import Chunk, ChunkReady, Event, Rollout, RolloutStats, SequenceFinished
from ...weights.sync import as_pairs
from . import loads, lora
from .checks import VLLMEngineDied, VLLMUnavailable, check_vllm, served_checkpoint
from .loads import hf_weights
from .weights import SharedWeights
from .worker import UNTRUNCATED_ID, die_with_trainer, install_untruncated_sampler, untruncated_id

_VLLM_DTYPE: dict[torch.dtype, Literal["float32", "bfloat16", "float16"]] = {
    torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
"""vLLM's name of each dtype it serves in (``EngineArgs.dtype``)."""


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
        ``threads``: vLLM's worker's OpenMP threads, unbound (a Ray rollout replica's CPU
        share: docs/vllm.md, "Threads"); None: vLLM binds them itself. ``weight_transport``: how
        :meth:`load_weights` reaches vLLM's worker: "shared" (a buffer both map, ``weights.py``),
        "rpc" (every tensor pickled through ``collective_rpc``), "auto" (shared where it works, else
        rpc, with a warning). ``lora_sync``: how a LoRA policy (``weights`` a peft model) is served:
        "adapter" (base + adapter, each update sends the adapter: ``lora.py``), "merged", "auto"."""
        if weight_transport not in ("auto", "shared", "rpc"):
            raise ValueError(f"weight_transport must be auto, shared or rpc, not {weight_transport!r}")
        check_vllm(model_path, device)
        if temperature <= 0:
            raise VLLMUnavailable("generation.backend=vllm samples (temperature > 0); greedy decoding is not "
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
        self.last_weight_sync_parts: dict = {}  # its timings (weights.py; benchmarks/vllm/bench_weight_load.py)
        self._shared: SharedWeights | None = None
        self._shared_refused = ""  # why the shared buffer cannot be used (then every load goes by rpc)
        self._shared_path = ""
        self._dtype = dtype
        self._on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())

        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        config = json.loads((Path(model_path).expanduser() / "config.json").read_text())
        self._served = served_checkpoint(config, device)  # padded heads, untied head (heads.py)
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
            distributed_executor_backend="mp",  # the model in vLLM's worker process (docs/vllm.md)
            disable_log_stats=True, **lora_args)
        own_threads = torch.get_num_threads()
        t = time.perf_counter()
        # (spawn: a forked vLLM worker would inherit the trainer's threads and memory)
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
        # vLLM's worker dies with this process (docs/vllm.md, "Parent death"); the signal follows the thread that
        # started vLLM's worker (this one), so only from the main thread, which lives as long as the process
        if threading.current_thread() is threading.main_thread():
            self._call("start-up", self.llm.collective_rpc, die_with_trainer, None, (os.getpid(),))
        if serve_adapter and weights is not None:
            self._adapter = lora.AdapterFiles(weights, dtype, self._served.padding if self._served else None)
        self.untruncated = all(self._call("start-up", self.llm.collective_rpc, install_untruncated_sampler))
        if not self.untruncated and (top_k > 0 or top_p < 1.0):
            self.close()
            raise VLLMUnavailable(
                f"generation.backend=vllm with top-k/top-p needs the untruncated log-probs of the sampled tokens "
                f"(the staleness weights of carried tokens), which oppo reads from vLLM's V1 sampler; this vLLM "
                f"({self._vllm_version()}) runs another model runner (VLLM_USE_V2_MODEL_RUNNER="
                f"{os.environ.get('VLLM_USE_V2_MODEL_RUNNER')!r}?). Unset it, or use generation.top_k=0 "
                f"generation.top_p=1.0, or generation.backend=eager.")
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
        """Run an engine call; a dead vLLM worker process is reported with this role."""
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
                    r.response_ids[-1] = self.eos_id  # forced at its target length, as the eager backend does
                    # (timing-only runs: the token was forced, not drawn, so the policy's own,
                    # untruncated log-prob stands in for both, as in the eager backend; the
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
        """As :meth:`oppo.rollout.eager.backend.EagerBackend.take_chunks`."""
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
        """Reload the engine's weights from ``weights`` (a module, (name, tensor) pairs in
        Hugging Face names, or a learner's ``RemoteWeights``) between two engine steps, requests in flight; then sample as
        ``version``. Through the shared buffer where it works (``weights.py``), else through
        vLLM's RPC. A LoRA policy served as an adapter (``lora.py``) sends its adapter only. Times
        itself: ``last_weight_sync_s`` (``last_weight_sync_parts``: its parts)."""
        from ...models import is_peft

        t = time.perf_counter()
        if self._adapter is not None and isinstance(weights, torch.nn.Module) and is_peft(weights):
            loads.load_adapter(self, weights, version, t)
            return
        if self._adapter is not None:  # a plain model, served as it is: no adapter on top, its base not ours
            self._adapter_on = False
            self._adapter.base_sent(None)
        loads.load_pairs(self, list(hf_weights(weights) if isinstance(weights, torch.nn.Module) else as_pairs(weights)), version, t)

    def _drop_shared(self) -> None:
        """Unmap and free the shared weight buffer; the next load makes a new one (:mod:`.loads`)."""
        loads.drop_shared(self)

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
        if shared is not None:  # (after vLLM's worker is gone: it mapped the buffer)
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
    every Ray rollout replica (no model; ``request.threads``: docs/vllm.md, "Threads"). ``max_rows`` (B +
    Delta and refills: at most 2B in flight) bounds vLLM's batch, ``max_len`` its context."""
    s = request.settings
    return VLLMRolloutBackend(
        request.policy_path, s.stop_ids, s.pad_id, s.max_new_tokens, s.temperature, s.top_k, s.top_p, seed=s.seed,
        dtype=request.dtype or torch.float32, max_model_len=s.max_len or None, max_num_seqs=s.max_rows or 256,
        kv_cache_mb=s.kv_budget_mb or None, role=request.role, device=request.device, weights=request.model,
        threads=request.threads, lora_sync=request.own.lora_sync if request.own is not None else "auto")
