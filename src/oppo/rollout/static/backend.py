"""A static-shape rollout backend: preallocated KV slots and a decode step that can be captured.

:class:`StaticBackend` is a drop-in for :class:`oppo.rollout.eager.backend.EagerBackend` (same
constructor arguments, methods, attributes and outputs). Each layer's keys and values are one
tensor ``[max_rows, kv_heads, max_len, dim]`` allocated once; a row takes the lowest free slot, its
tokens in columns ``0 .. n-1`` (position ids = column indices, so a sliding window means what it
means in a single-sequence forward). One decode step is one ``[Rb, 1]`` forward over the used slots
and columns (rounded up to buckets) with a 4-D mask built from each slot's length; with
``capture="cuda_graph"`` it is recorded into a CUDA graph on the first step of each bucket a run
reaches and replayed (``oppo.kernels.graphs``: captured thread-locally on a side stream of its own, so the
scorer and learner threads may work meanwhile), with ``"compile"`` run through ``torch.compile``,
with ``"none"`` eagerly. Weight updates copy into
the same parameters, so graphs read the new weights. Prefill stays eager. Only ``sdpa`` and
``eager`` attention take the 4-D mask; other implementations are refused at construction.
``docs/static-backend.md`` has the design in full and why capture is safe beside other threads.
"""

from __future__ import annotations

import heapq
import inspect
import time
from typing import TYPE_CHECKING, Any, Callable, cast

import torch

from ...kernels.graphs import Capture, CapturedGraphs
from ...kv import kv_layers, right_pad
from ...kv_slots import SlotCache, slot_cache_class
from ..eager.backend import EagerBackend, KVBudgetError, Rollout

if TYPE_CHECKING:
    from transformers import DynamicCache

CAPTURE_MODES = ("none", "cuda_graph", "compile")


class UnsupportedForStaticDecode(ValueError):
    """The model cannot run in the static backend; the message says why and what to use instead."""


def bucket_size(n: int, cap: int, smallest: int = 16) -> int:
    """The smallest of ``smallest`` (a power of two), then 1.5x / 2x alternately (16, 24, 32, 48,
    64, 96, ...; from 1: 1, 2, 3, 4, 6, 8, ...) that is >= n, at most ``cap``: a few captured
    graphs cover every size with at most a third of a step wasted."""
    b = smallest
    while b < n:
        b = b * 3 // 2 if b >= 2 and b & (b - 1) == 0 else (b // 3) * 4 if b % 3 == 0 else b * 2
    return min(b, cap)


class StaticBackend(EagerBackend):
    """:class:`EagerBackend` over preallocated KV slots with a capturable decode step (module
    docstring). It subclasses the eager backend to share what does not touch the cache (the device
    records of tokens, log-probs and versions, whose slots are its KV slots; forced lengths,
    chunks, ``generate_all``); everything that does is overridden here. The slots' lengths live
    on the device too (``_pos``, advanced in place after each forward); the host derives Rb and Lb
    from the step count when rows join or leave, not per token.

    ``max_rows``: slots, the most rows ever in flight (B without carrying; 2B with it: B + Delta
    and the scheduler's refill cap are both at most 2B). Admitting more raises.
    ``max_len``: columns per slot (longest prompt + max_new_tokens; default: 512 + max_new_tokens,
    capped at the model's ``max_position_embeddings`` when it has one).
    ``capture``: ``none`` (eager, exact shapes), ``cuda_graph`` (needs CUDA) or ``compile``
    (``torch.compile``; on CUDA in ``reduce-overhead`` mode, i.e. with CUDA graphs too). A bucket's
    graph (or compiled variant) is made on its first decode step, so a run pays only for the
    (Rb, Lb) buckets its rows reach (:meth:`capture_stats` counts them).
    ``graph_capture``: a stand-in for the CUDA capture (:class:`oppo.kernels.graphs.CapturedGraphs`), with
    which ``cuda_graph`` runs on a CPU (tests: the bookkeeping and the bucketed prefill).
    """

    def __init__(self, model, eos_id: int | tuple[int, ...], pad_id: int, max_new_tokens: int,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, greedy: bool = False,
                 max_rows: int = 64, max_len: int | None = None, capture: str = "none",
                 graph_capture: Capture | None = None):
        super().__init__(model, eos_id, pad_id, max_new_tokens, temperature, top_k, top_p, seed, greedy)
        del self.kv  # the eager backend's cache; this backend has slots instead
        if capture not in CAPTURE_MODES:
            raise ValueError(f"capture must be one of {', '.join(CAPTURE_MODES)}, got {capture!r}.")
        if capture == "cuda_graph" and self.device.type != "cuda" and graph_capture is None:
            raise ValueError("capture='cuda_graph' needs the model on a CUDA device; use capture='none' on CPU.")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}.")
        cfg = _text_config(model)
        max_pos = getattr(cfg, "max_position_embeddings", None)
        if max_len is None:
            max_len = max_new_tokens + 512
            if max_pos:
                max_len = min(max_len, max_pos)
        problem = static_decode_problem(model, max_len)
        if problem is not None:
            raise UnsupportedForStaticDecode(problem)
        if max_len <= max_new_tokens:
            raise ValueError(f"max_len={max_len} leaves no room for a prompt before {max_new_tokens} new tokens.")
        self.max_rows, self.max_len, self.capture = max_rows, max_len, capture
        self.bucket_prefill = capture == "cuda_graph"  # prefill rows x width on the ladders (oppo.shapes)
        self.window = _window(model, max_len)
        self._masks_as_dict = self.window is not None and _forward_takes_mask_dict(self.backbone)
        self.cache: SlotCache | None = None  # allocated at the first admit
        self._grow(max_rows)  # the records' slots are the KV slots: lowest free first keeps Rb small
        self._tok = torch.full((max_rows, 1), pad_id, dtype=torch.long, device=self.device)  # static input
        # static input: tokens in each slot's cache (= the column the next fed token takes; 0 when free)
        self._pos = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self._rb, self._lb = 0, 0  # Rb (highest used slot + 1); Lb = _lb + the step count (_rows_changed)
        # cuda_graph: (Rb, Lb) -> (graph, logits), captured on the bucket's first step
        self._graphs: CapturedGraphs[tuple[int, int]] = CapturedGraphs(self.device, graph_capture)
        self._traced: set[tuple[int, int]] = set()  # compile: the (Rb, Lb) buckets traced so far
        self._traced_s = 0.0  # compile: seconds of each bucket's first (tracing) call
        self._compiled: Callable[[int, int], torch.Tensor] | None = None

    # ------------------------------------------------------------------ setup

    @property
    def captures(self) -> int:
        """Decode graphs captured (``cuda_graph``) or compiled variants traced (``compile``) so far."""
        return self._graphs.captures + len(self._traced)

    def capture_stats(self) -> dict[str, Any]:
        """What capturing cost so far: ``captures`` (graphs or compiled variants), ``seconds``
        (host seconds of the captures; for ``compile``, of each bucket's first call) and the
        (Rb, Lb) ``keys`` made. The bench reports it (``oppo.bench.summaries``)."""
        if self.capture == "compile":
            return {"captures": len(self._traced), "seconds": self._traced_s, "keys": sorted(self._traced)}
        return self._graphs.stats()

    @property
    def peak_cache_bytes(self) -> int:
        """The slots' bytes: reserved once, the same at every step (assignments are ignored: the
        trainer resets the eager backend's per-step peak, which has no meaning here)."""
        return self.cache.nbytes() if self.cache is not None else 0

    @peak_cache_bytes.setter
    def peak_cache_bytes(self, value: int) -> None:
        pass

    def _allocate(self, prefill_cache: DynamicCache) -> SlotCache:
        problem = _plain_kv_problem(prefill_cache)
        if problem is not None:
            raise UnsupportedForStaticDecode(problem)
        layers = kv_layers(prefill_cache)  # plain keys/values in every layer (_plain_kv_problem)
        shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        for layer in layers:
            k, v = layer.keys, layer.values  # [n, H, P, D]
            shapes.append(((self.max_rows, k.shape[1], self.max_len, k.shape[3]),
                           (self.max_rows, v.shape[1], self.max_len, v.shape[3])))
        dtype = layers[0].keys.dtype
        need = sum(self.max_rows * self.max_len * (ks[1] * ks[3] + vs[1] * vs[3]) for ks, vs in shapes)
        need *= torch.empty(0, dtype=dtype).element_size()
        budget = getattr(self, "kv_budget_mb", None)
        if budget:
            if need > budget * 2**20:
                raise KVBudgetError(
                    f"The static backend's KV slots take {need / 2**20:.3g} MiB ({self.max_rows} slots x "
                    f"{self.max_len} columns), over generation.kv_budget_mb={budget:g}. Lower the slots "
                    f"(ppo.batch_size, overlap.delta_max) or the columns (generation.max_new_tokens, "
                    f"data.max_prompt_tokens), or raise generation.kv_budget_mb if the device has room.")
        self._mask_dtype = dtype
        return slot_cache_class()(shapes, dtype, self.device)

    # ------------------------------------------------------------------ prefill

    @torch.no_grad()
    def _prefill_into(self, rows: list[Rollout], slots: list[int]) -> torch.Tensor:
        """Prefill ``rows`` (prompt + response so far) and copy their KV into ``slots``; return the
        next-token logits [n, V] (float32)."""
        from transformers import DynamicCache

        seqs = [r.prompt_ids + r.response_ids for r in rows]
        lens = [len(s) for s in seqs]
        for r, n in zip(rows, lens):
            if len(r.prompt_ids) + self.max_new_tokens - 1 > self.max_len:
                raise ValueError(
                    f"A row of {len(r.prompt_ids)} prompt tokens + {self.max_new_tokens} new tokens does not fit "
                    f"the static backend's max_len={self.max_len} columns; raise max_len (longest prompt + "
                    f"max_new_tokens).")
        n = len(rows)
        if self.bucket_prefill:  # prefill shapes from the ladders too (oppo.shapes): rows of a
            # repeated sequence (computed, dropped) and columns of padding, so cuDNN plans recur
            from ... import shapes

            width = min(shapes.width(max(lens)), self.max_len)
            seqs = seqs + [seqs[0]] * (shapes.rows(n) - n)
            ids, valid = right_pad([x + [self.pad_id] * (width - len(x)) for x in seqs], self.pad_id, self.device)
            valid[:, :] = 0
            for i, x in enumerate(seqs):
                valid[i, : len(x)] = 1
        else:
            ids, valid = right_pad(seqs, self.pad_id, self.device)  # [n, P]: columns = slot columns
        P = ids.shape[1]
        # padding's position ids stay at its row's last real one (its columns and mask stay its own):
        # a bucketed width must not reach past a learned-position table or dynamic RoPE's length
        # (scoring/slots.py does the same for the scorers' slots)
        last = torch.tensor([len(x) - 1 for x in seqs], device=self.device)  # [rows]
        pos = torch.minimum(torch.arange(P, device=self.device)[None], last[:, None])  # [rows, P]
        dyn = DynamicCache()
        out = self.backbone(input_ids=ids, attention_mask=valid, position_ids=pos, past_key_values=dyn,
                            use_cache=True)
        last = torch.tensor([k - 1 for k in lens], device=self.device)
        hidden = out.last_hidden_state[torch.arange(n, device=self.device), last]  # [n, H]
        logits = self.head(hidden).float()  # [n, V]
        if self.cache is None:
            self.cache = self._allocate(dyn)
        if len(dyn.layers) != len(self.cache.slot_layers):
            raise UnsupportedForStaticDecode("the prefill cache changed its number of layers between calls.")
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        for mine, theirs in zip(self.cache.slot_layers, kv_layers(dyn)):
            # columns beyond a row's length hold padding's keys: masked until decode overwrites them
            mine.keys[:, :, :P].index_copy_(0, idx, theirs.keys[:n].to(mine.keys.dtype))
            mine.values[:, :, :P].index_copy_(0, idx, theirs.values[:n].to(mine.values.dtype))
        self._pos.index_copy_(0, idx, torch.tensor(lens, dtype=torch.long, device=self.device))
        return logits

    @torch.no_grad()
    def admit(self, rollouts: list[Rollout]) -> None:
        """Prefill the new rows into free slots and add them to the batch."""
        if not rollouts:
            return
        if len(rollouts) > len(self._free):
            raise ValueError(
                f"The static backend has {len(self._free)} free slots of max_rows={self.max_rows} for {len(rollouts)} "
                f"new rows; raise max_rows to the most rows in flight (ppo.batch_size + overlap.delta_max, in "
                f"groups times algo.group_size).")
        rollouts = [r.copy() for r in rollouts]  # the backend's own records (RolloutBackend.admit)
        slots = self._take_slots(len(rollouts))
        try:
            logits = self._prefill_into(rollouts, slots)
        except Exception:
            for s in slots:
                heapq.heappush(self._free, s)
            raise
        self._add_rows(rollouts, slots)
        self.next_logits = logits if self.next_logits.numel() == 0 else torch.cat([self.next_logits, logits])

    @torch.no_grad()
    def recompute(self) -> None:
        """Rebuild every row's KV cache and next-token logits under the current weights, in the
        same slots (``overlap.stale_kv=recompute``)."""
        if not self.rows:
            return
        self._pull()
        self.next_logits = self._prefill_into(self.rows, self.slot_of)
        self._lv.index_fill_(0, self._slots, self.version)
        self._kvv.index_fill_(0, self._slots, self.version)

    def _retire(self, keep: list[int]) -> None:
        kept = set(keep)
        gone = [s for i, s in enumerate(self.slot_of) if i not in kept]
        if gone:  # a free slot decodes into its column 0 (docs/static-backend.md)
            self._pos.index_fill_(0, torch.tensor(gone, dtype=torch.long, device=self.device), 0)
        super()._retire(keep)

    def _rows_changed(self) -> None:
        super()._rows_changed()
        self._rb = max(self.slot_of, default=-1) + 1
        # a slot holds prompt + response: len(prompt) + _clock - born tokens after this step's
        self._lb = max((len(r.prompt_ids) - b for r, b in zip(self.rows, self._born)), default=0)

    def abort(self, uids: set[int]) -> None:
        """Drop in-flight rows (a checkpoint drain requeues their prompts); free their slots."""
        keep = [i for i, r in enumerate(self.rows) if r.uid not in uids]
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.next_logits = self.next_logits.index_select(0, idx) if keep else torch.zeros(0, 0, device=self.device)
        self._retire(keep)
        self.finished = [r for r in self.finished if r.uid not in uids]

    # ------------------------------------------------------------------ decode

    @torch.no_grad()
    def decode_step(self) -> list[Rollout]:
        """Sample one token for every row; retire rows that ended; return them (as the eager backend)."""
        if not self.rows:
            return []
        tokens, keep, done = self._sample_and_record()
        if done:
            assert keep is not None  # rows ended: keep lists the others
            self._retire(keep)
            tokens = tokens.index_select(0, torch.tensor(keep, dtype=torch.long, device=self.device))
            self.finished.extend(done)
        if self.rows:
            slots = self._slots  # [R]
            self._tok.index_copy_(0, slots, tokens[:, None])
            # the fed token takes column _pos[s] (= its position id); free slots write their column 0
            out = self._step_logits(self._rb, self._lb + self._clock)  # [Rb, V]
            self._pos.index_add_(0, slots, torch.ones_like(slots))
            self.next_logits = out.index_select(0, slots).float()  # [R, V] (a copy: graph outputs are reused)
            self._lv.index_fill_(0, slots, self.version)
        else:
            self.next_logits = torch.zeros(0, 0, device=self.device)
        return done

    def _step_logits(self, rows: int, cols: int) -> torch.Tensor:
        """One decode forward over slots [:Rb] and columns [:Lb]; returns logits [Rb, V]."""
        if self.capture == "none":
            return self._captured_step(rows, cols)
        rb, lb = bucket_size(rows, self.max_rows, smallest=1), bucket_size(cols, self.max_len)
        if self.capture == "compile":
            if self._compiled is None:
                import torch._dynamo

                torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
                mode = "reduce-overhead" if self.device.type == "cuda" else None
                self._compiled = torch.compile(self._captured_step, mode=mode, dynamic=False)
            new = (rb, lb) not in self._traced
            t0 = time.perf_counter()
            out = self._compiled(rb, lb)
            if new:
                self._traced.add((rb, lb))
                self._traced_s += time.perf_counter() - t0
            return out.clone() if self.device.type == "cuda" else out
        # captured on the bucket's first step (oppo.kernels.graphs: the recipe the scorers' slots share)
        graph, out = self._graphs.get((rb, lb), lambda: self._captured_step(rb, lb))
        graph.replay()
        # graphs share one memory pool: another bucket's replay may overwrite this output, so the
        # caller copies it (index_select) before the next replay
        return out

    def _captured_step(self, rb: int, lb: int) -> torch.Tensor:
        """The captured region: static inputs ``_tok``/``_pos`` in, logits [rb, V] out."""
        pos = self._pos[:rb]  # [Rb] the fed token's column = position id
        cache = self.cache
        assert cache is not None  # allocated by the first admit, before any row decodes
        cache.rb, cache.lb, cache.cols = rb, lb, pos
        col = torch.arange(lb, device=pos.device)  # [Lb]
        seen = col[None, :] <= pos[:, None]  # [Rb, Lb] causal within the row's own columns
        neg = torch.finfo(self._mask_dtype).min
        zero = torch.zeros((), dtype=self._mask_dtype, device=pos.device)
        full = torch.where(seen, zero, neg)[:, None, None, :]  # [Rb, 1, 1, Lb] additive
        mask: torch.Tensor | dict[str, torch.Tensor] = full
        if self.window is not None:
            windowed = torch.where(seen & (col[None, :] > pos[:, None] - self.window), zero, neg)[:, None, None, :]
            mask = {"full_attention": full, "sliding_attention": windowed} if self._masks_as_dict else windowed
        out = self.backbone(input_ids=self._tok[:rb], attention_mask=mask, position_ids=pos[:, None],
                            past_key_values=cache, use_cache=True)
        return self.head(out.last_hidden_state[:, -1]).float()  # [Rb, V]


def _text_config(model):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def _window(model, max_len: int | None) -> int | None:
    """The attention window in cache columns when it can bite within ``max_len`` (None: any
    window), else None."""
    from ...models import uses_sliding_window

    w = getattr(_text_config(model), "sliding_window", None)
    if not uses_sliding_window(model) or w is None or (max_len is not None and w >= max_len):
        return None
    return int(w)


def _plain_kv_problem(cache) -> str | None:
    """Why a prefill's ``DynamicCache`` cannot move into slots (a layer keeping no plain
    keys/values: state-space, convolution or linear-attention layers), or None."""
    from transformers.cache_utils import DynamicLayer

    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer or layer.keys is None:
            return (f"layer {i} keeps a {type(layer).__name__} cache (not plain keys/values): the static "
                    f"backend supports attention-only decoders; use the eager backend (generation.backend=eager).")
    return None if cache.layers else "the model's forward filled no KV cache; use the eager backend."


def static_decode_problem(model, max_len: int | None = None, probe: bool = False) -> str | None:
    """Why :class:`StaticBackend` cannot decode ``model``, as a sentence naming the fix, or
    None when it can. From the config: an attention implementation that takes no 4-D mask, layers
    other than full or sliding-window attention, or windowed and full layers under a forward that
    takes no per-type masks (``max_len``: the slots' columns, a window at least that wide never
    bites; None: any window counts). With ``probe``, also what the first admission would find, by
    one forward of two tokens: a layer that keeps no plain keys/values, or a forward that takes no
    ``DynamicCache``. The constructor refuses on the config's reasons
    (``UnsupportedForStaticDecode``); ``generation.backend=auto`` asks with ``probe`` before
    choosing this backend (:func:`oppo.rollout.registry.resolve_backend`), so such a policy runs eager."""
    from ...models import backbone_and_head

    cfg = _text_config(model)
    from ...kernels.attention import takes_4d_mask

    impl = getattr(cfg, "_attn_implementation", None) or "eager"
    if not takes_4d_mask(impl):
        return (f"The static backend passes a 4-D attention mask, which attention implementation {impl!r} "
                f"does not take; load the policy with attn_implementation='sdpa' or use the eager backend "
                f"(generation.backend=eager).")
    other = sorted(set(getattr(cfg, "layer_types", None) or ()) - {"full_attention", "sliding_attention"})
    if other:  # state-space, convolution, linear or chunked attention: not plain keys/values under our masks
        return (f"{type(model).__name__} has {', '.join(other)} layers; the static backend runs full and "
                f"sliding-window attention only; use the eager backend (generation.backend=eager).")
    backbone = backbone_and_head(model)[0]
    if _window(model, max_len) is not None and not _forward_takes_mask_dict(backbone) \
            and len(set(getattr(cfg, "layer_types", None) or ())) > 1:
        return (f"{type(model).__name__} mixes windowed and full attention layers but its forward takes no "
                f"per-type masks; use the eager backend (generation.backend=eager).")
    if not probe:
        return None
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    ids = torch.zeros((1, 2), dtype=torch.long, device=dev)
    cache = DynamicCache()
    try:
        with torch.no_grad():
            backbone(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(2, device=dev)[None],
                     past_key_values=cache, use_cache=True)
    except Exception as e:  # a forward the slots cannot host; the eager backend names its own errors
        return f"a trial prefill into a DynamicCache failed ({type(e).__name__}: {e}); use the eager backend."
    return _plain_kv_problem(cache)


def _forward_takes_mask_dict(backbone) -> bool:
    """Whether the backbone's forward uses a ``{layer type: mask}`` dict as given (transformers'
    models with per-layer attention types do: ``isinstance(causal_mask_mapping := attention_mask, dict)``)."""
    try:
        src = inspect.getsource(type(backbone).forward)
    except (OSError, TypeError):
        return False
    return "attention_mask, dict)" in src
