"""The rollout engine: batched KV-cache sampling with slots.

Rows join (``admit``: prefill the prompt, merge into the running batch), decode in lock-step
(``step``: sample one token per row, retire the rows that ended, feed the others), emit chunks of
new tokens (``take_chunks``), and may stay in the engine across PPO steps (inter-step overlap),
continuing under new weights. Each sampled token records its behaviour log-prob and the oldest
policy version that shaped its distribution: the version of the weights that computed its logits,
or, with ``overlap.stale_kv=keep``, the older version that computed part of the row's KV cache
(new weights over an old prefix are a hybrid policy, not pi_k: such tokens are off-policy).

Each token records two log-probs. ``Rollout.logprobs``: the behaviour log-prob, that of the
distribution actually sampled (``log_softmax(logits / temperature)`` after top-k/top-p truncation
and renormalisation). ``Rollout.policy_logprobs``: the same logits' untruncated log-prob,
``log_softmax(logits / temperature)`` at the token, which is what the learner's forward computes.
Off-policy (staleness) weights compare the learner's pi_k with ``policy_logprobs``, never with the
truncated one: a fresh token's weight is 1, so a carried token with no weight change must get 1
too, whatever top-k/top-p (``Learner.old_logprobs``). Without truncation the two lists hold the
same floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..guard import NonFiniteError, sampling_message
from ..kv import KVRows, left_pad
from ..api.records import Chunk, ChunkReady, Event, Rollout, SequenceFinished

__all__ = ["Chunk", "EngineSettings", "KVBudgetError", "Rollout", "RolloutEngine", "resolve_engine",
           "sample_tokens", "take_chunks"]


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
    # marks it for the engine's check where the host reads the tokens (guard.py: no extra sync).
    probs = probs.masked_fill(torch.isnan(probs).any(-1, keepdim=True), 1.0)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # [R]
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


class KVBudgetError(ValueError):
    """The actor's KV cache outgrew ``generation.kv_budget_mb``; the message names the fix."""


class RolloutEngine:
    """Slots of in-flight sequences over one policy model (see the module docstring)."""

    def __init__(self, model, eos_id: int | tuple[int, ...], pad_id: int, max_new_tokens: int,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, greedy: bool = False):
        """``eos_id``: the id, or every id, that ends a response (``models.stop_token_ids``)."""
        from ..models import backbone_and_head

        self.model = model
        self.backbone, self.head = backbone_and_head(model)
        self.device = next(model.parameters()).device
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
        self.logits_version: list[int] = []  # which policy version computed each row's next_logits
        self.kv_version: list[int] = []  # oldest policy version in each row's KV cache
        self.finished: list[Rollout] = []  # retired since the last take_chunks()
        self.peak_cache_bytes = 0
        self.decode_steps = 0  # decode steps taken so far (``perf/decode_step_ms``)
        self._eos_index: dict[torch.device, torch.Tensor] = {}  # the stop ids as an index (``_forced``)
        self.kv_budget_mb: float | None = None  # generation.kv_budget_mb; None: unlimited

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
        return len(self.rows)

    def uids(self) -> list[int]:
        return [r.uid for r in self.rows]

    def in_flight(self) -> list[Rollout]:
        """The rows decoding (``RolloutBackend.in_flight``): the controller's own Rollouts."""
        return list(self.rows)

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
        kv, logits = self._prefill([r.prompt_ids + r.response_ids for r in rollouts])
        self.kv.merge(kv)
        self.rows.extend(rollouts)
        self.next_logits = logits if self.next_logits.numel() == 0 else torch.cat([self.next_logits, logits])
        self.logits_version.extend([self.version] * len(rollouts))
        self.kv_version.extend([self.version] * len(rollouts))
        self._check_budget()

    @torch.no_grad()
    def recompute(self) -> None:
        """Rebuild every row's KV cache and next-token logits under the current weights
        (``overlap.stale_kv=recompute``)."""
        rows = self.rows
        self.rows, self.kv, self.logits_version, self.kv_version = [], KVRows(self.device), [], []
        self.next_logits = torch.zeros(0, 0, device=self.device)
        self.admit(rows)

    def abort(self, uids: set[int]) -> None:
        """Drop in-flight rows (a checkpoint drain requeues their prompts)."""
        keep = [i for i, r in enumerate(self.rows) if r.uid not in uids]
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.kv.select(idx)
        self.rows = [self.rows[i] for i in keep]
        self.logits_version = [self.logits_version[i] for i in keep]
        self.kv_version = [self.kv_version[i] for i in keep]
        self.next_logits = self.next_logits.index_select(0, idx) if keep else torch.zeros(0, 0, device=self.device)
        self.finished = [r for r in self.finished if r.uid not in uids]

    def set_version(self, version: int) -> None:
        self.version = version

    def load_weights(self, weights: torch.nn.Module, version: int) -> None:
        """The trained policy's weights into the model this engine samples with (a no-op when it
        is that model: fp32 without in-flight updates), then sample as ``version``. Rows in
        flight keep their KV cache (``recompute`` rebuilds it)."""
        from ..weights.precision import copy_weights

        copy_weights(weights, self.model)
        self.set_version(version)

    def advance(self, chunk_size: int | None) -> list[Event]:
        """One decode step (``RolloutBackend.advance``): the rows that ended, then the chunks due."""
        events: list[Event] = [SequenceFinished(r) for r in self.step()]
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
        if isinstance(gen, list):  # saved by Ray rollout workers (one state each): rank 0's, as theirs do
            gen = gen[0]
        self.generator.set_state(gen)

    def close(self) -> None:
        pass

    def _sample_and_record(self) -> tuple[torch.Tensor, list[int], list[Rollout]]:
        """Sample one token per row from ``next_logits``, append it to its row with its behaviour
        log-prob and version, and mark the rows that ended. Returns (tokens [R], the indices of
        the rows that go on, the rows that ended). Shared by every engine's ``step``."""
        self.decode_steps += 1
        logits = self._forced(self.next_logits)
        if self.greedy:
            tokens, logp = logits.argmax(-1), None  # [R]
        else:
            tokens, logp = sample_tokens(logits, self.temperature, self.top_k, self.top_p, self.generator)
        untruncated = logp
        if logp is None or logits is not self.next_logits or self.top_k > 0 or self.top_p < 1.0:
            # the model's own (untruncated) log-prob: what the learner's forward computes
            untruncated = torch.log_softmax(self.next_logits.float() / self.temperature, -1).gather(
                1, tokens[:, None])[:, 0]
        if logp is None or logits is not self.next_logits:
            # greedy, or forced lengths (bench: timing only, ``bench.timing_only``): nothing was
            # drawn from a distribution of the policy's, so the policy's own log-prob stands in
            logp = untruncated
        # one device-to-host copy per decode step (the CPU-GPU sync point): tokens and both log-probs
        # as float64 (exact for token ids below 2**53 and for float32 log-probs)
        both = untruncated is logp
        host = torch.stack([tokens.double(), logp.double()] + ([] if both else [untruncated.double()])).tolist()
        tok_list, lp_list = [int(t) for t in host[0]], host[1]
        plp_list = lp_list if both else host[2]
        bad = [i for i, (lp, plp) in enumerate(zip(lp_list, plp_list)) if math.isnan(lp) or math.isnan(plp)]
        if bad:  # non-finite logits (sample_tokens): the guard's message, not multinomial's
            raise NonFiniteError(sampling_message(bad, [self.rows[i].uid for i in bad], self.logits_version[bad[0]]))
        keep, done = [], []
        for i, (row, t, lp, plp) in enumerate(zip(self.rows, tok_list, lp_list, plp_list)):
            row.response_ids.append(t)
            row.logprobs.append(lp)
            row.policy_logprobs.append(plp)
            row.versions.append(min(self.logits_version[i], self.kv_version[i]))
            if t in self.eos_ids or len(row.response_ids) >= self.max_new_tokens:
                row.finished, row.ended_with_eos = True, t in self.eos_ids
                done.append(row)
            else:
                keep.append(i)
        return tokens, keep, done

    @torch.no_grad()
    def step(self) -> list[Rollout]:
        """Sample one token for every row; retire rows that ended; return them."""
        if not self.rows:
            return []
        tokens, keep, done = self._sample_and_record()
        if done:
            self.peak_cache_bytes = max(self.peak_cache_bytes, self.kv.nbytes())
            idx = torch.tensor(keep, dtype=torch.long, device=self.device)
            self.kv.select(idx)
            self.rows = [self.rows[i] for i in keep]
            self.logits_version = [self.logits_version[i] for i in keep]
            self.kv_version = [self.kv_version[i] for i in keep]
            tokens = tokens.index_select(0, idx)
            self.finished.extend(done)
        if self.rows:
            hidden = self.kv.forward(self.backbone, tokens[:, None], torch.ones_like(tokens)[:, None])  # [R, 1, H]
            self._check_budget()
            self.next_logits = self.head(hidden[:, -1]).float()  # [R, V]
            self.logits_version = [self.version] * len(self.rows)
        else:
            self.next_logits = torch.zeros(0, 0, device=self.device)
        return done

    def _forced(self, logits: torch.Tensor) -> torch.Tensor:
        """Synthetic-length workloads (``oppo bench``'s forced workloads and ``--tail``): EOS is
        banned before a row's target length and forced at it, so the length distribution is set
        directly while the model still does all the real work. The tokens are then not samples
        of the policy, so such runs are timing-only (``bench.timing_only``): the recorded
        log-prob is the policy's own, and no learning metric of theirs is reported."""
        targets = [r.target_length for r in self.rows]
        if all(t is None for t in targets):
            return logits
        # as tensor operations over every row (a few kernels per step, not two per row)
        force = [t is not None and len(r.response_ids) + 1 >= t for r, t in zip(self.rows, targets)]
        ban = [t is not None and not f for t, f in zip(targets, force)]
        flags = torch.tensor([force, ban], dtype=torch.bool).to(logits.device, non_blocking=True)  # [2, R]
        eos = self._eos_index.get(logits.device)
        if eos is None:  # once per device, not per step
            eos = self._eos_index[logits.device] = torch.tensor(sorted(self.eos_ids), device=logits.device)
        logits = logits.clone()
        logits.index_copy_(1, eos, logits.index_select(1, eos).masked_fill(flags[1, :, None], float("-inf")))
        forced = torch.full_like(logits[:1], float("-inf"))  # [1, V]: EOS and nothing else
        forced[0, self.eos_id] = 0.0
        return torch.where(flags[0, :, None], forced, logits)

    def take_chunks(self, chunk_size: int) -> list[Chunk]:
        """Chunks for the scorers (:func:`take_chunks`) of the rows retired since the last call
        and of the rows decoding."""
        out = take_chunks(self.finished, self.rows, chunk_size)
        self.finished = []
        return out

    def generate_all(self) -> list[Rollout]:
        """Decode until every row has ended (the sequential rollout, with early exit)."""
        done = []
        while self.rows:
            done.extend(self.step())
        self.finished = []
        return done


def take_chunks(finished, active, chunk_size: int) -> list[Chunk]:
    """Chunks for the streaming scorers: each ``finished`` row's final chunk (possibly empty), and
    each ``active`` row with at least ``chunk_size`` unstreamed tokens; marks them streamed."""
    out = []
    for row in finished:
        out.append(Chunk(row.uid, tuple(row.response_ids[row.emitted:]), True))
        row.emitted = len(row.response_ids)
    for row in active:
        if len(row.response_ids) - row.emitted >= chunk_size:
            out.append(Chunk(row.uid, tuple(row.response_ids[row.emitted:]), False))
            row.emitted = len(row.response_ids)
    return out


@dataclass(frozen=True)
class EngineSettings:
    """What a rollout backend is built with (``generation.*``; ``setup.engine_settings``).
    ``kind``: the backend's name in ``rollout.registry`` (``generation.engine=auto`` resolved:
    :func:`resolve_engine`);
    ``max_rows`` / ``max_len``: the static engine's slots; ``capture``: its decode-step capture
    (``rollout.static.CAPTURE_MODES``); ``reason``: which engine and why, for the run's log."""

    stop_ids: tuple[int, ...]
    pad_id: int
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    kv_budget_mb: float | None = None
    seed: int = 0
    kind: str = "eager"
    max_rows: int = 0
    max_len: int = 0
    capture: str = "none"
    reason: str = ""


def resolve_engine(requested: str, device: torch.device, static_problem) -> tuple[str, str]:
    """The engine ``generation.engine`` names, and a sentence saying which runs and why.

    ``auto``: ``static`` (CUDA graphs) on a CUDA device unless ``static_problem()`` (a callable,
    asked only then: ``rollout.static.static_decode_problem``, which may run a two-token forward) names
    something the static engine refuses; else ``eager``. On CPU the eager engine runs: CPU runs and
    their golden metrics stay as they were (without graphs the static engine is no faster there).
    Any other value is returned as asked.
    """
    if requested != "auto":
        return requested, f"{requested} (generation.engine={requested})"
    if device.type != "cuda":
        return "eager", f"eager (generation.engine=auto: no CUDA graphs on {device.type})"
    problem = static_problem()
    if problem:
        return "eager", f"eager (generation.engine=auto: the static engine cannot decode this policy: {problem})"
    return "static", "static with CUDA graphs (generation.engine=auto; generation.engine=eager is the fallback)"
