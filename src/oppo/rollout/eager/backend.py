"""The eager rollout backend: batched KV-cache sampling with slots.

Rows join (``admit``), decode in lock-step (``decode_step``), emit chunks of new tokens
(``take_chunks``), and may stay in the backend across PPO steps, continuing under new weights. Each
token records its behaviour log-prob (``Rollout.logprobs``, after top-k/top-p), its untruncated
log-prob (``Rollout.policy_logprobs``, what the learner computes) and the oldest policy version
that shaped it. The records stay in device buffers, read by the host only where a row ends or a
chunk is due; on CUDA the stop flags are read every :data:`STOP_CHECK_EVERY` steps. Every public
method runs on the actor's role stream.

Design notes (the two log-probs, the host reads, deferred stop checks, streams):
docs/static-backend.md, "The eager backend it extends"."""

from __future__ import annotations

import functools
import heapq
import math

import torch

from ...kernels import streams

from ...guard import NonFiniteError, sampling_message
from ...kv import KVRows, left_pad
from ...api.protocols import WeightSource
from ...api.records import Chunk, ChunkReady, Event, Rollout, RolloutStats, SequenceFinished
from ..chunks import take_chunks
from ..registry import BackendSettings

__all__ = ["Chunk", "KVBudgetError", "Rollout", "EagerBackend", "sample_tokens", "take_chunks"]


def sample_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from ``logits`` [R, V]; return (tokens [R], behaviour logprobs [R]):
    the log-probs of the truncated, renormalised distribution the token was drawn from."""
    scaled = logits.float() / temperature  # [R, V]
    filtered = scaled
    if top_k > 0 and top_k < filtered.shape[-1]:
        kth = torch.topk(filtered, top_k, dim=-1).values[:, -1:]  # [R, 1]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sorted_logits)
    logp = torch.log_softmax(filtered, dim=-1)  # [R, V]; -inf outside the kept set
    probs = logp.exp()
    # A row with NaN or inf logits (a diverged policy) has NaN log-probs: it draws from ones instead,
    # so multinomial neither raises (CPU) nor asserts on the device (CUDA), and its NaN log-prob
    # marks it for the backend's check where the host reads the tokens (guard.py: no extra sync).
    probs = probs.masked_fill(torch.isnan(probs).any(-1, keepdim=True), 1.0)
    # torch.multinomial's own algorithm for one sample (argmax of p / q, q ~ Exp(1): the same draws,
    # the same tokens on the CPU, checked against it), without its argument checks, which read the
    # device to raise (a CPU-GPU sync per decode step on CUDA that would undo the deferred stop check;
    # not yet confirmed on a GPU: torch.cuda.set_sync_debug_mode would show it). vLLM's sampler
    # does the same for the same reason (``_multinomial``). The NaN rows were replaced above.
    q = torch.empty_like(probs).exponential_(generator=generator)  # [R, V]
    tokens = (probs / q).argmax(-1)  # [R]
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


class KVBudgetError(ValueError):
    """The actor's KV cache outgrew ``generation.kv_budget_mb``; the message names the fix."""


STOP_CHECK_EVERY = 8
"""Decode steps between two reads of the stop flags on CUDA (module docstring). A row that ended
decodes at most this many - 1 steps more (of a step's few hundred, long-tailed): a few percent of
one row's work, against a CPU-GPU sync per token that waits for the whole queued forward (the
H200's decode loop took 1.5x its backend's step in sequential, issue 50)."""

ACTOR_WORK = ("admit", "recompute", "abort", "load_weights", "decode_step", "advance", "in_flight", "take_chunks", "step",
              "generate_all")
"""The backend's methods that run on the actor's stream (wrapped by ``on_actor``, subclasses' too)."""


def on_actor(method):
    """Run ``method`` on its backend's actor stream (``kernels.streams.Role``)."""
    if getattr(method, "_on_actor", False):
        return method

    @functools.wraps(method)
    def run(self, *a, **k):
        with self.role:
            return method(self, *a, **k)

    run._on_actor = True
    return run


class EagerBackend:
    """Slots of in-flight sequences over one policy model (see the module docstring)."""

    def __init_subclass__(cls, **kwargs):
        """A subclass's own ``ACTOR_WORK`` methods run on the actor's stream too (the static backend's
        ``admit``, ``decode_step``, ...)."""
        super().__init_subclass__(**kwargs)
        for name in ACTOR_WORK:
            if name in cls.__dict__:
                setattr(cls, name, on_actor(cls.__dict__[name]))

    def __init__(self, model, eos_id: int | tuple[int, ...], pad_id: int, max_new_tokens: int,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, greedy: bool = False):
        """``eos_id``: the id, or every id, that ends a response (``models.stop_token_ids``)."""
        from ...models import backbone_and_head

        self.model = model
        self.backbone, self.head = backbone_and_head(model)
        self.device = next(model.parameters()).device
        # the actor's own stream, high priority; its first entry waits for the model's loading
        self.role = streams.role("actor", self.device, streams.ACTOR_PRIORITY, follow=False)
        self.stop_check_every = STOP_CHECK_EVERY if self.device.type == "cuda" else 1  # module docstring
        self.eos_ids = frozenset([eos_id] if isinstance(eos_id, int) else eos_id)
        self.eos_id = eos_id if isinstance(eos_id, int) else eos_id[0]  # forced-length benchmarks end with it
        self.pad_id = pad_id
        self.max_new_tokens = max_new_tokens
        self.temperature, self.top_k, self.top_p, self.greedy = temperature, top_k, top_p, greedy
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.version = 0
        self.rows: list[Rollout] = []
        self.kv = KVRows(self.device)
        self.next_logits = torch.zeros(0, 0, device=self.device)  # [R, V]
        self.finished: list[Rollout] = []  # retired since the last take_chunks()
        self.peak_cache_bytes = 0
        self.decode_steps = 0  # decode steps taken so far (``perf/decode_step_ms``)
        self.host_reads = 0  # device-to-host reads by the backend itself (``tests/test_host_reads.py``)
        self._eos_index: dict[torch.device, torch.Tensor] = {}  # the stop ids as an index (``_forced``)
        self.kv_budget_mb: float | None = None  # generation.kv_budget_mb; None: unlimited
        # Device records, one slot per row (the static backend: its KV slot), grown by _grow. [S]:
        # response tokens so far, forced length (0: none), the policy version of the row's next-token
        # logits and the oldest in its KV cache. [4, S, N]: per response position, the token, its
        # behaviour and untruncated log-probs and its version, as float64 (exact for token ids below
        # 2**53 and for float32 log-probs): one gather reads them all.
        self.slot_of: list[int] = []  # each row's slot, parallel to self.rows
        self._free: list[int] = []  # free slots, a heap: lowest first
        self._slots = torch.zeros(0, dtype=torch.long, device=self.device)  # [R] slot_of on the device
        self._length, self._target, self._lv, self._kvv = (
            torch.zeros(0, dtype=torch.long, device=self.device) for _ in range(4))
        self._records = torch.zeros(4, 0, max_new_tokens, dtype=torch.float64, device=self.device)
        # [S] with stop_check_every > 1: 1 the row ended (unread), 2 its log-prob is not finite (bits)
        self._stopped = torch.zeros(0, dtype=torch.uint8, device=self.device)
        self._ended_seen: set[int] = set()  # uids a pull found ended, retired at the next check
        self._settled: list[Rollout] = []  # rows retired outside decode (``_settle``), reported by the next advance
        self._settling = False
        # Host facts derived once per admission or retirement, not per token: a row's length is
        # _clock - _born[i]; _end[i] is the step it ends at by its length alone (token budget or
        # forced length); _deadline the first of those; _due the step a chunk is first due.
        self._clock = 0  # decode steps, for the row lengths (decode_steps is the metrics')
        self._born: list[int] = []
        self._end: list[int] = []
        self._deadline = math.inf
        self._eos_possible = False  # a row without a forced length: it may end by EOS at any step
        self._any_target = False
        self._due: tuple[int, float] | None = None  # (chunk size, step) cache of take_chunks

    def _check_budget(self) -> None:
        """Raise before the cache outgrows its budget, rather than dying of an out-of-memory
        error somewhere in a long-tailed step (or swapping on a CPU)."""
        n = self.kv.nbytes()
        self.peak_cache_bytes = max(self.peak_cache_bytes, n)
        if self.kv_budget_mb is not None and n > self.kv_budget_mb * 1024 * 1024:
            raise KVBudgetError(
                f"The actor's KV cache reached {n / 2**20:.3g} MiB ({self.kv.rows} rows x {self.kv.length} columns), "
                f"over generation.kv_budget_mb={self.kv_budget_mb:g}. Lower ppo.batch_size, "
                f"overlap.delta_max or generation.max_new_tokens (or data.max_prompt_tokens), or raise "
                f"generation.kv_budget_mb if the device has room.")

    @property
    def active(self) -> int:
        """Rows decoding, and rows retired outside ``decode_step`` that the next one reports (``_settle``)."""
        return len(self.rows) + len(self._settled)

    def uids(self) -> list[int]:
        return [r.uid for r in self.rows]

    def in_flight(self) -> list[Rollout]:
        """The rows decoding (``RolloutBackend.in_flight``), as copies of the backend's records
        brought up to date (a caller that changes them changes nothing here)."""
        self._settle()
        self._pull()
        return [r.copy() for r in self.rows]

    @property
    def logits_version(self) -> list[int]:
        """Which policy version computed each row's next_logits (a device read: for tests)."""
        with self.role:
            return self._lv[self._slots].tolist()

    @property
    def kv_version(self) -> list[int]:
        """The oldest policy version in each row's KV cache (a device read: for tests)."""
        with self.role:
            return self._kvv[self._slots].tolist()

    # ------------------------------------------------------------------ slots and records

    def _grow(self, slots: int, width: int = 0) -> None:
        """Records for at least ``slots`` slots of at least ``width`` positions (copying the old ones)."""
        old, n = self._records, self._length.numel()
        width = max(width, old.shape[2])
        if slots <= n and width == old.shape[2]:
            return
        slots = max(slots, n)
        self._records = old.new_zeros(4, slots, width)
        self._records[:, :n, :old.shape[2]] = old
        self._length, self._target, self._lv, self._kvv, self._stopped = (
            torch.cat([t, t.new_zeros(slots - n)]) for t in (self._length, self._target, self._lv, self._kvv,
                                                               self._stopped))
        for s in range(n, slots):
            heapq.heappush(self._free, s)

    def _take_slots(self, n: int) -> list[int]:
        if len(self._free) < n:
            self._grow(max(2 * self._length.numel(), self._length.numel() + n - len(self._free), 8))
        return [heapq.heappop(self._free) for _ in range(n)]

    def _add_rows(self, rollouts: list[Rollout], slots: list[int]) -> None:
        """Append ``rollouts`` (prefilled into ``slots``) to the batch: their device state set in one copy."""
        self._grow(0, max(len(r.response_ids) for r in rollouts) + 1)
        state = torch.tensor([[len(r.response_ids) for r in rollouts], [r.target_length or 0 for r in rollouts],
                              [self.version] * len(rollouts), [self.version] * len(rollouts)])  # [4, n]
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        state = state.to(self.device)
        for t, v in zip((self._length, self._target, self._lv, self._kvv), state):
            t.index_copy_(0, idx, v)
        self._stopped.index_fill_(0, idx, 0)
        for r in rollouts:
            limit = min(r.target_length or self.max_new_tokens, self.max_new_tokens)
            self._born.append(self._clock - len(r.response_ids))
            self._end.append(max(self._born[-1] + limit, self._clock + 1))
        self.rows.extend(rollouts)
        self.slot_of.extend(slots)
        self._rows_changed()

    def _retire(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (indices, in order); free the others' slots."""
        kept = set(keep)
        for i, s in enumerate(self.slot_of):
            if i not in kept:
                heapq.heappush(self._free, s)
        self.rows = [self.rows[i] for i in keep]
        self.slot_of = [self.slot_of[i] for i in keep]
        self._born = [self._born[i] for i in keep]
        self._end = [self._end[i] for i in keep]
        self._rows_changed()

    def _rows_changed(self) -> None:
        """Rederive the host facts that change only when rows join or leave."""
        self._slots = torch.tensor(self.slot_of, dtype=torch.long, device=self.device)
        self._deadline = min(self._end, default=math.inf)
        self._eos_possible = any(r.target_length is None for r in self.rows)
        self._any_target = any(r.target_length is not None for r in self.rows)
        self._due = None
        self._ended_seen &= {r.uid for r in self.rows}

    @property
    def _deferred(self) -> bool:
        """Stop flags read every few steps (module docstring): rows may have ended unread."""
        return self.stop_check_every > 1 and self._eos_possible

    def _pull(self) -> None:
        """Copy every row's tokens, log-probs and versions sampled since the last pull from the
        device records into its Rollout: one read (a CPU-GPU sync point) for all of them."""
        have = [len(r.response_ids) for r in self.rows]
        now = [self._clock - b for b in self._born]
        k = max((n - h for h, n in zip(have, now)), default=0)
        if k <= 0:
            return
        cols = torch.tensor(have, dtype=torch.long, device=self.device)[:, None] + torch.arange(k, device=self.device)
        cols = cols.clamp_(max=self._records.shape[2] - 1)  # [R, k] (past a row's length: unused)
        records = self._records[:, self._slots[:, None], cols]  # [4, R, k]
        if self._deferred:  # each row's device length and flag in the same read: a row may have ended unread
            R = len(self.rows)
            state = torch.stack([self._length[self._slots], self._stopped[self._slots].long()]).double()  # [2, R]
            flat = torch.cat([records.reshape(-1), state.reshape(-1)]).tolist()  # CPU-GPU sync point
            host = [[flat[(j * R + i) * k:(j * R + i + 1) * k] for i in range(R)] for j in range(4)]
            lengths, flags = flat[4 * R * k: 4 * R * k + R], flat[4 * R * k + R:]
            now = [min(n, int(n_dev)) for n, n_dev in zip(now, lengths)]
            self._ended_seen |= {r.uid for r, f in zip(self.rows, flags) if f}
        else:
            host = records.tolist()  # [4, R, k]
        self.host_reads += 1
        bad = []
        for i, (row, h, n) in enumerate(zip(self.rows, have, now)):
            m = n - h
            lp, plp = host[1][i][:m], host[2][i][:m]
            if math.isnan(sum(lp) + sum(plp)):  # (log-probs are <= 0: a sum is NaN only with a NaN in it)
                bad.append(i)
            row.response_ids.extend(map(int, host[0][i][:m]))
            row.logprobs.extend(lp)
            row.policy_logprobs.extend(plp)
            row.versions.extend(map(int, host[3][i][:m]))
        if bad:  # (forced lengths only: other steps check their flags at once)
            row = self.rows[bad[0]]
            at = next(t for t, (a, b) in enumerate(zip(row.logprobs, row.policy_logprobs)) if a != a or b != b)
            raise NonFiniteError(sampling_message(bad, [self.rows[i].uid for i in bad], row.versions[at]))

    # ------------------------------------------------------------------ admission

    @torch.no_grad()
    def _prefill(self, seqs: list[list[int]]) -> tuple[KVRows, torch.Tensor]:
        kv = KVRows(self.device)
        ids, valid = left_pad(seqs, self.pad_id, self.device)
        hidden = kv.forward(self.backbone, ids, valid)  # [R, P, H]
        return kv, self.head(hidden[:, -1]).float()  # left padding: the last column is real for every row

    @torch.no_grad()
    def admit(self, rollouts: list[Rollout]) -> None:
        """Prefill the new rows' prompts (and any response so far) and add them to the batch."""
        if not rollouts:
            return
        rollouts = [r.copy() for r in rollouts]  # the backend's own records (RolloutBackend.admit)
        kv, logits = self._prefill([r.prompt_ids + r.response_ids for r in rollouts])
        self.kv.merge(kv)
        self._add_rows(rollouts, self._take_slots(len(rollouts)))
        self.next_logits = logits if self.next_logits.numel() == 0 else torch.cat([self.next_logits, logits])
        self._check_budget()

    @torch.no_grad()
    def recompute(self) -> None:
        """Rebuild every row's KV cache and next-token logits under the current weights
        (``overlap.stale_kv=recompute``)."""
        self._settle()
        self._pull()
        rows = self.rows
        self._retire([])
        self.kv = KVRows(self.device)
        self.next_logits = torch.zeros(0, 0, device=self.device)
        self.admit(rows)

    def abort(self, uids: set[int]) -> None:
        """Drop in-flight rows (a checkpoint drain requeues their prompts)."""
        self._settle()
        self._drop(uids)
        self._settled = [r for r in self._settled if r.uid not in uids]

    def _drop(self, uids: set[int]) -> None:
        """Take rows ``uids`` out of the batch (their slots and KV rows freed)."""
        keep = [i for i, r in enumerate(self.rows) if r.uid not in uids]
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.kv.select(idx)
        self._retire(keep)
        self.next_logits = self.next_logits.index_select(0, idx) if keep else torch.zeros(0, 0, device=self.device)
        self.finished = [r for r in self.finished if r.uid not in uids]

    def set_version(self, version: int) -> None:
        self.version = version

    def load_weights(self, weights: WeightSource, version: int) -> None:
        """The trained policy's weights into the model this backend samples with (a no-op when it
        is that model: fp32 without in-flight updates), then sample as ``version``. Rows in
        flight keep their KV cache (``recompute`` rebuilds it)."""
        from ...weights.sync import load_source

        load_source(self.model, weights, self.role)  # (ordered after the learner's write by an event)
        self.set_version(version)

    def advance(self, chunk_size: int | None) -> list[Event]:
        """One decode step (``RolloutBackend.advance``): the rows that ended, then the chunks due."""
        events: list[Event] = [SequenceFinished(r) for r in self._take_settled() + self.decode_step()]
        if chunk_size is None:
            self.finished.clear()  # no scorer streams: no final chunks to send
            return events
        return events + [ChunkReady(c) for c in self.take_chunks(chunk_size)]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """A state from another kind of backend (one that seeds per request) leaves the
        generator at its seed: the resume samples validly but not as the uninterrupted run."""
        gen = state.get("generator")
        if gen is None:
            return
        if isinstance(gen, list):  # saved by Ray rollout replicas (one state each): rank 0's, as theirs do
            gen = gen[0]
        self.generator.set_state(gen)

    def take_stats(self) -> RolloutStats:
        stats = RolloutStats(self.peak_cache_bytes, self.decode_steps)
        self.peak_cache_bytes, self.decode_steps = 0, 0
        return stats

    def close(self) -> None:
        pass

    def _sample_and_record(self) -> tuple[torch.Tensor, list[int] | None, list[Rollout]]:
        """Sample one token per row from ``next_logits`` and write it, its behaviour and untruncated
        log-probs and its version into the rows' device records. Returns (tokens [R], the indices of
        the rows that go on or None when none ended, the rows that ended: their records pulled,
        marked finished). Shared by every backend's ``decode_step``."""
        self.decode_steps += 1
        self._clock += 1
        self.role.read(self.model)  # this step's forward after the learner's last write (once per write)
        slots = self._slots  # [R]
        length = self._length[slots]  # [R] response tokens so far = the column this token takes
        logits = self._forced(self.next_logits, length, self._target[slots]) if self._any_target else self.next_logits
        if self.greedy:
            tokens, logp = logits.argmax(-1), None  # [R]
        else:
            tokens, logp = sample_tokens(logits, self.temperature, self.top_k, self.top_p, self.generator)
        if logp is None or logits is not self.next_logits or self.top_k > 0 or self.top_p < 1.0:
            # the model's own (untruncated) log-prob: what the learner's forward computes
            untruncated = torch.log_softmax(self.next_logits.float() / self.temperature, -1).gather(
                1, tokens[:, None])[:, 0]
        else:
            untruncated = logp
        if logp is None or logits is not self.next_logits:
            # greedy, or forced lengths (bench: timing only, ``bench.timing_only``): nothing was
            # drawn from a distribution of the policy's, so the policy's own log-prob stands in
            logp = untruncated
        version = torch.minimum(self._lv[slots], self._kvv[slots])  # [R]
        values = torch.stack([tokens.double(), logp.double(), untruncated.double(), version.double()])  # [4, R]
        if self._deferred:
            return tokens, *self._record_deferred(slots, length, values, tokens, logp, untruncated)
        self._records[:, slots, length] = values
        self._length[slots] = length + 1
        if self._eos_possible:
            stop = torch.isin(tokens, self._eos(tokens.device)) | (length + 1 >= self.max_new_tokens)  # [R]
            nonfinite = torch.isnan(logp) | torch.isnan(untruncated)  # non-finite logits (sample_tokens)
            flags = (stop.to(torch.uint8) + 2 * nonfinite.to(torch.uint8)).tolist()  # CPU-GPU sync point
            self.host_reads += 1
            if not any(flags):
                return tokens, None, []
            bad = [i for i, f in enumerate(flags) if f >= 2]
            if bad:  # the guard's message, not multinomial's
                bad_version = int(self._lv[slots][bad[0]])
                raise NonFiniteError(sampling_message(bad, [self.rows[i].uid for i in bad], bad_version))
            ended = [i for i, f in enumerate(flags) if f]
        elif self._clock >= self._deadline:  # forced lengths only: the host knows who ends
            ended = [i for i, e in enumerate(self._end) if e <= self._clock]
        else:
            return tokens, None, []
        self._pull()  # every row's new tokens (the scheduler and the metrics read the rows at a finish)
        done = [self.rows[i] for i in ended]
        for row in done:
            row.finished, row.ended_with_eos = True, row.response_ids[-1] in self.eos_ids
        gone = set(ended)
        return tokens, [i for i in range(len(self.rows)) if i not in gone], done

    def _record_deferred(self, slots: torch.Tensor, length: torch.Tensor, values: torch.Tensor, tokens: torch.Tensor,
                         logp: torch.Tensor, untruncated: torch.Tensor) -> tuple[list[int] | None, list[Rollout]]:
        """``_sample_and_record``'s device records and stop check with ``stop_check_every`` > 1
        (module docstring): a row that ended keeps its records and length; the flags are read at a
        check step (every ``stop_check_every`` steps, and at a step where a row ends by its length)."""
        live = self._stopped[slots] == 0  # [R]
        col = length.clamp(max=self._records.shape[2] - 1)  # [R] (an ended row may be at the last column)
        self._records[:, slots, col] = torch.where(live, values, self._records[:, slots, col])  # [4, R]
        self._length[slots] = length + live
        stop = torch.isin(tokens, self._eos(tokens.device)) | (length + 1 >= self.max_new_tokens)  # [R]
        nonfinite = torch.isnan(logp) | torch.isnan(untruncated)  # non-finite logits (sample_tokens)
        self._stopped[slots] |= (stop.to(torch.uint8) + 2 * nonfinite.to(torch.uint8)) * live
        if self._clock % self.stop_check_every and self._clock < self._deadline:
            return None, []
        ended = self._check()
        if not ended:
            return None, []
        done = self._finish(ended)
        gone = set(ended)
        return [i for i in range(len(self.rows)) if i not in gone], done

    def _check(self) -> list[int]:
        """The rows whose stop flag is set (one read of the flags); their records pulled when any."""
        flags = self._stopped[self._slots].tolist()  # CPU-GPU sync point, every stop_check_every steps
        self.host_reads += 1
        ended = [i for i, f in enumerate(flags) if f]
        if ended:
            self._pull()  # (raises NonFiniteError, naming the row, if a log-prob was not finite)
        return ended

    def _finish(self, ended: list[int]) -> list[Rollout]:
        done = [self.rows[i] for i in ended]
        for row in done:
            row.finished, row.ended_with_eos = True, row.response_ids[-1] in self.eos_ids
        return done

    def _take_settled(self) -> list[Rollout]:
        """The rows ``_settle`` retired, as ended now (``advance``, ``step`` and ``generate_all`` report
        them before the next decode step's)."""
        settled, self._settled = self._settled, []
        self.finished.extend(settled)
        return settled

    def _settle(self) -> None:
        """With deferred checks, retire the rows that ended unread now (a caller is about to read
        or change the rows in flight: ``in_flight``, ``recompute``, ``abort``); the next ``advance``
        reports them as ended (``_take_settled``)."""
        if not self._deferred or not self.rows or self._settling:
            return
        ended = self._check()
        if ended:
            done = self._finish(ended)
            self._settling = True
            try:
                self.abort({r.uid for r in done})  # (a subclass's own retirement: the static backend's slots)
            finally:
                self._settling = False
            self._settled.extend(done)

    @torch.no_grad()
    def decode_step(self) -> list[Rollout]:
        """One decode step: sample a token for every row; retire the rows that ended and return
        them (their records pulled); the other rows' records stay on the device."""
        if not self.rows:
            return []
        tokens, keep, done = self._sample_and_record()
        if done:
            assert keep is not None  # rows ended: keep lists the others
            self.peak_cache_bytes = max(self.peak_cache_bytes, self.kv.nbytes())
            idx = torch.tensor(keep, dtype=torch.long, device=self.device)
            self.kv.select(idx)
            self._retire(keep)
            tokens = tokens.index_select(0, idx)
            self.finished.extend(done)
        if self.rows:
            hidden = self.kv.forward(self.backbone, tokens[:, None], torch.ones_like(tokens)[:, None])  # [R, 1, H]
            self._check_budget()
            self.next_logits = self.head(hidden[:, -1]).float()  # [R, V]
            self._lv.index_fill_(0, self._slots, self.version)
        else:
            self.next_logits = torch.zeros(0, 0, device=self.device)
        return done

    def step(self) -> list[Rollout]:
        """``decode_step``, then every row's records brought up to date (one read per step: for callers
        that read the rows after every token; the trainer's loop calls ``advance``)."""
        done = self._take_settled() + self.decode_step()
        self._pull()
        return done

    def _eos(self, device: torch.device) -> torch.Tensor:
        eos = self._eos_index.get(device)
        if eos is None:  # once per device, not per step
            eos = self._eos_index[device] = torch.tensor(sorted(self.eos_ids), device=device)
        return eos

    def _forced(self, logits: torch.Tensor, length: torch.Tensor | None = None,
                target: torch.Tensor | None = None) -> torch.Tensor:
        """Synthetic-length workloads (``oppo bench``'s forced workloads and ``--tail``): EOS is
        banned before a row's target length and forced at it, so the length distribution is set
        directly while the model still does all the real work. The tokens are then not samples
        of the policy, so such runs are timing-only (``bench.timing_only``): the recorded
        log-prob is the policy's own, and no learning metric of theirs is reported.

        ``length`` [R]: each row's response tokens so far, ``target`` [R]: its target length (0:
        none), on the device (the backend's records); by default from ``self.rows``."""
        if length is None or target is None:  # (given together)
            if all(r.target_length is None for r in self.rows):
                return logits
            length = torch.tensor([len(r.response_ids) for r in self.rows], device=logits.device)
            target = torch.tensor([r.target_length or 0 for r in self.rows], device=logits.device)
        # as tensor operations over every row (a few kernels per step, not two per row)
        force = (target > 0) & (length + 1 >= target)  # [R]
        ban = (target > 0) & ~force  # [R]
        eos = self._eos(logits.device)
        logits = logits.clone()
        logits.index_copy_(1, eos, logits.index_select(1, eos).masked_fill(ban[:, None], float("-inf")))
        forced = torch.full_like(logits[:1], float("-inf"))  # [1, V]: EOS and nothing else
        forced[0, self.eos_id] = 0.0
        return torch.where(force[:, None], forced, logits)

    def take_chunks(self, chunk_size: int) -> list[Chunk]:
        """Chunks for the scorers (:func:`take_chunks`) of the rows retired since the last call
        and of the rows decoding. The rows' records are pulled only at a step where one is due."""
        if self._due is None or self._due[0] != chunk_size:  # row i is due at step born + emitted + chunk
            self._due = (chunk_size, min((b + r.emitted + chunk_size for r, b in zip(self.rows, self._born)
                                          if r.uid not in self._ended_seen), default=math.inf))
        active = []
        if self._clock >= self._due[1]:
            self._pull()
            # (a row that ended unread sends its tokens in its final chunk, at its retirement)
            active = [r for r in self.rows if r.uid not in self._ended_seen] if self._ended_seen else self.rows
            self._due = None
        out = take_chunks(self.finished, active, chunk_size)
        self.finished = []
        return out

    def generate_all(self) -> list[Rollout]:
        """Decode until every row has ended (the sequential rollout, with early exit)."""
        done = []
        while self.rows or self._settled:
            done.extend(self._take_settled() + self.decode_step())
        self.finished = []
        return done


for _name in ACTOR_WORK:  # (the base class's own: __init_subclass__ wraps a subclass's)
    setattr(EagerBackend, _name, on_actor(getattr(EagerBackend, _name)))
