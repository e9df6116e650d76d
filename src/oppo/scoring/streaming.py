"""Scorers: reward score, reference log-probs and critic values, one-shot or streamed.

Reference log-probs and values for response token t are read at the hidden state of position
P + t - 1 (the state before ``a_t`` is sampled); the score at the last token that is not the
reward model's pad token (:func:`scored_index`, :func:`reward_pad_id`), where its own forward reads
it. The one-shot path packs whole sequences into rows (:func:`score_full`); the streaming path
(:class:`StreamingScorer`) keeps a KV cache per sequence, prefilled chunk by chunk. Both give the
same numbers up to summation order. Sliding-window models' caches are repacked after every round.

Design notes (the alignment, where the score is read, sliding windows): docs/overlap.md, "The
scorers"."""

from __future__ import annotations

import warnings
from typing import Callable, Literal, Mapping, Sequence

import torch

from ..api.records import ScoredOutputs
from ..kv import KVRows, left_pad, right_pad
from ..models import backbone_and_head, text_config, uses_sliding_window
from ..forward import full_hidden, head_logprobs, packed_hidden, layout_rule, uses_buckets
from .slots import SlotKV, slots_suit
from ..forward import sequence_batch  # noqa: F401  (re-exported: benchmarks/nan_probe.py imports it from here)

Kind = Literal["reward", "reference", "critic"]


def reward_pad_id(model) -> int | None:
    """The token a sequence classifier's own forward skips when it picks the position to score:
    its (text) config's ``pad_token_id`` (module docstring); None: it scores the last token."""
    pad = getattr(text_config(model.config), "pad_token_id", None)
    return None if pad is None else int(pad)


def scored_index(tokens: Sequence[int], pad: int | None, fallback: int = 0) -> int:
    """Index in ``tokens`` of the rightmost token that is not ``pad`` (the last one when ``pad`` is
    None), ``fallback`` when there is none: Hugging Face's ``last_non_pad_token`` (its argmax over
    an all-pad row gives 0). Scans from the right: one or two steps for a response."""
    if pad is None:
        return len(tokens) - 1 if tokens else fallback
    for j in range(len(tokens) - 1, -1, -1):
        if tokens[j] != pad:
            return j
    return fallback


def _per_token(kind: Kind, head: torch.nn.Module, pre: torch.Tensor, tokens: torch.Tensor,
               temperature: float) -> torch.Tensor:
    """Head outputs for hidden states ``pre`` [R, C, H] that predict ``tokens`` [R, C] -> [R, C]."""
    if kind == "reference":  # in chunks of tokens: never the [R, C, V] logits at once
        return head_logprobs(head, pre, tokens, temperature)[0]  # [R, C]
    return head(pre).float().squeeze(-1)  # critic: [R, C]


def response_outputs(kind: Kind, model, ids: torch.Tensor, valid: torch.Tensor, P: int,
                     temperature: float = 1.0, packing: str | None = None) -> torch.Tensor:
    """Per-response-token outputs [R, T] of a full forward (log-probs or values); differentiable.

    Used by the one-shot scorers and by the learner (actor log-probs use kind="reference").
    """
    backbone, head = backbone_and_head(model)
    hidden = full_hidden(backbone, ids, valid, packing)  # [R, P+T, H]
    return _per_token(kind, head, hidden[:, P - 1:-1], ids[:, P:], temperature)


@torch.no_grad()
def score_full(kind: Kind, model, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
               temperature: float = 1.0, packing: str | None = None) -> list[ScoredOutputs]:
    """One-shot scoring of whole sequences (the sequential mode's scorer): one forward over them
    packed end to end where the model can (``forward.layout_rule``; ``packing``: ``ppo.packing``, None:
    the model's own, ``forward.set_packing``),
    the head run on the response tokens (the reward head on each sequence's scored token,
    :func:`scored_index`) only."""
    device = next(model.parameters()).device
    backbone, head = backbone_and_head(model)
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    n = [len(x) for x in seqs]
    layout = layout_rule(backbone, packing).layout(n)
    source = torch.tensor([t for x in seqs for t in x], dtype=torch.long, device=device)
    first = torch.tensor([0] + n[:-1], device=device).cumsum(0)  # [R] each sequence's first token in source
    hidden = packed_hidden(backbone, layout, source, first, pad_id)  # [rows * width, H]
    start = torch.tensor(layout.start, device=device)  # [R]
    if kind == "reward":
        pad = reward_pad_id(model)
        scored = start + torch.tensor([scored_index(x, pad) for x in seqs], device=device)  # [R] the scored token
        return [ScoredOutputs(score=s) for s in head(hidden[scored]).float().squeeze(-1).tolist()]
    T = [len(r) for r in responses]
    t = torch.tensor(T, device=device)
    seq = torch.repeat_interleave(torch.arange(len(seqs), device=device), t)  # [N] owner of each response token
    step = torch.arange(len(seq), device=device) - torch.repeat_interleave(t.cumsum(0) - t, t)  # [N] t
    P = torch.tensor([len(p) for p in prompts], device=device)
    pre = start[seq] + P[seq] - 1 + step  # [N] the state before each response token
    tokens = source[first[seq] + P[seq] + step]  # [N]
    out = _per_token(kind, head, hidden[pre][None], tokens[None], temperature)[0].tolist()  # [N]
    res, at = [], 0
    for k in T:
        row, at = out[at: at + k], at + k
        res.append(ScoredOutputs(logprobs=row) if kind == "reference" else ScoredOutputs(values=row))
    return res


class StreamingScorer:
    """One role's streaming scorer: a KV cache per sequence, fed prompt then chunks.

    ``admit`` prefills prompts; ``feed`` prefills the chunks on hand in one batched forward; a
    final chunk completes the sequence, frees its cache rows and makes its outputs available
    from ``take_done``.

    ``prev_hidden`` holds, per row, the hidden state the next outputs need: for the reference and
    the critic that of the last token fed (it predicts the next chunk's first token); for the reward,
    that of the last token fed that is not the reward model's pad token (module docstring), so a
    final EOS that is its pad token leaves the row's score at the token before it.
    """

    def __init__(self, kind: Kind, model, pad_id: int, temperature: float = 1.0):
        self.kind, self.model, self.pad_id, self.temperature = kind, model, pad_id, temperature
        self.score_pad = reward_pad_id(model) if kind == "reward" else None  # (reward: the token its forward skips)
        self.backbone, self.head = backbone_and_head(model)
        self.device = next(model.parameters()).device
        self.contiguous = uses_sliding_window(model)  # no holes in the cache (module docstring)
        self.kv: KVRows | SlotKV = KVRows(self.device)
        if uses_buckets(self.backbone):  # ppo.shape_buckets: chunk forwards of a few shapes (scoring.slots)
            why = slots_suit(model)
            if why is None:
                self.kv = SlotKV(self.device)
            else:
                # (warnings' own filter says it once per kind)
                warnings.warn(f"The {kind} scorer streams into a dynamic KV cache (a new attention shape per chunk), "
                              f"not bucketed slots: {why}.", stacklevel=2)
        self.uids: list[int] = []
        self.prev_hidden = torch.zeros(0, 0, device=self.device)  # [R, H] hidden of each row's last fed token
        self.outputs: dict[int, ScoredOutputs] = {}
        self.done: dict[int, ScoredOutputs] = {}
        # outputs stay on the device until take_done reads every finished sequence's at once (issue 50):
        # uid -> per-token pieces [n] (reference, critic) or the score [1] (reward)
        self.pieces: dict[int, list[torch.Tensor]] = {}
        self.done_pieces: dict[int, list[torch.Tensor]] = {}
        self.peak_cache_bytes = 0

    @torch.no_grad()
    def admit(self, uids: list[int], prompts: list[list[int]]) -> None:
        if not uids:
            return
        # the prompt token whose hidden state each row carries (module docstring; reward: its scored
        # token so far, the first when every prompt token is pad, as Hugging Face's argmax gives)
        at = ([scored_index(p, self.score_pad) for p in prompts] if self.kind == "reward"
              else [len(p) - 1 for p in prompts])
        if isinstance(self.kv, SlotKV):
            last = self.kv.admit(self.backbone, prompts, self.pad_id, at)  # [R, H]
        else:
            kv = KVRows(self.device)
            ids, valid = left_pad(prompts, self.pad_id, self.device)
            hidden = kv.forward(self.backbone, ids, valid)  # [R, P, H] left-padded
            col = torch.tensor([ids.shape[1] - len(p) + j for p, j in zip(prompts, at)], device=self.device)  # [R]
            last = hidden[torch.arange(len(prompts), device=self.device), col]  # [R, H]
            self.kv.merge(kv)
        self.uids.extend(uids)
        self.prev_hidden = last if self.prev_hidden.numel() == 0 else torch.cat([self.prev_hidden, last])
        for u in uids:
            self.outputs[u] = ScoredOutputs()

    @torch.no_grad()
    def feed(self, chunks: dict[int, tuple[tuple[int, ...], bool]]) -> None:
        """Prefill ``chunks``: uid -> (tokens, final). Only rows with tokens on hand run through the
        model; the other rows get masked cache columns and no compute."""
        if not chunks:
            return
        # only rows with tokens on hand run through the model (the rest get masked columns)
        sel = [i for i, u in enumerate(self.uids) if u in chunks and chunks[u][0]]
        if sel:
            seqs = [list(chunks[self.uids[i]][0]) for i in sel]
            rows = torch.tensor(sel, dtype=torch.long, device=self.device)  # [S]
            lens = torch.tensor([len(s) for s in seqs], device=self.device)  # [S]
            if isinstance(self.kv, SlotKV):  # (the slots pad the chunks themselves: one copy to the device)
                hidden, ids = self.kv.feed(self.backbone, sel, seqs, self.pad_id)  # [S, C, H], [S, C]
            else:
                ids, valid = right_pad(seqs, self.pad_id, self.device)  # [S, C]
                hidden = self.kv.forward_rows(self.backbone, rows, ids, valid)  # [S, C, H]
            prev = self.prev_hidden.index_select(0, rows)  # [S, H]
            pre = torch.cat([prev[:, None], hidden[:, :-1]], 1)  # [S, C, H] state before each token
            if self.kind != "reward":
                per_tok = _per_token(self.kind, self.head, pre, ids, self.temperature)  # [S, C] (stays on the device)
                for j, i in enumerate(sel):
                    self.pieces.setdefault(self.uids[i], []).append(per_tok[j, : len(seqs[j])])
            if self.kind != "reward":
                last = hidden[torch.arange(len(sel), device=self.device), lens - 1]  # [S, H]
                self.prev_hidden = self.prev_hidden.index_copy(0, rows, last)
            else:  # the chunk's rightmost token that is not the reward model's pad, where it has one
                at = [scored_index(x, self.score_pad, -1) for x in seqs]
                has = [j for j, k in enumerate(at) if k >= 0]
                if has:
                    pick = torch.tensor(has, dtype=torch.long, device=self.device)  # [S']
                    cols = torch.tensor([at[j] for j in has], dtype=torch.long, device=self.device)  # [S']
                    self.prev_hidden = self.prev_hidden.index_copy(0, rows.index_select(0, pick), hidden[pick, cols])
        finals = [i for i, u in enumerate(self.uids) if u in chunks and chunks[u][1]]
        if finals:
            if self.kind == "reward":
                scores = self.head(self.prev_hidden[finals]).float().reshape(len(finals))  # [F] (on the device)
                for j, i in enumerate(finals):
                    self.pieces[self.uids[i]] = [scores[j: j + 1]]
            for i in finals:
                u = self.uids[i]
                self.done[u] = self.outputs.pop(u)
                self.done_pieces[u] = self.pieces.pop(u, [])
            self.peak_cache_bytes = max(self.peak_cache_bytes, self.kv.nbytes())
            final_rows = set(finals)
            keep = [i for i in range(len(self.uids)) if i not in final_rows]
            idx = torch.tensor(keep, dtype=torch.long, device=self.device)
            if isinstance(self.kv, SlotKV):
                self.kv.select(keep)
            else:
                self.kv.select(idx)
            self.prev_hidden = self.prev_hidden.index_select(0, idx)
            self.uids = [self.uids[i] for i in keep]
        self.peak_cache_bytes = max(self.peak_cache_bytes, self.kv.nbytes())
        # drop the holes left by rows that had no chunk in some rounds: when they pile up, or always
        # for a sliding window (module docstring); slots have none
        if isinstance(self.kv, KVRows):
            self.kv.repack(max_fill=1.0 if self.contiguous else 0.5)

    def forget(self, uids: set[int]) -> None:
        """Drop in-flight rows (e.g. after a checkpoint drain)."""
        keep = [i for i, u in enumerate(self.uids) if u not in uids]
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        if isinstance(self.kv, SlotKV):
            self.kv.select(keep)
        else:
            self.kv.select(idx)
        self.prev_hidden = self.prev_hidden.index_select(0, idx) if self.prev_hidden.numel() else self.prev_hidden
        self.uids = [self.uids[i] for i in keep]
        for u in uids:
            self.outputs.pop(u, None)
            self.pieces.pop(u, None)

    def take_done(self) -> dict[int, ScoredOutputs]:
        """The sequences finished since the last call, their outputs read from the device in one
        read for all of them (the scorer worker calls it once per barrier)."""
        done, self.done = self.done, {}
        pieces, self.done_pieces = self.done_pieces, {}
        flat = [p for u in done for p in pieces[u]]
        if not flat:
            return done
        host = torch.cat(flat).tolist()  # CPU-GPU sync point: once per barrier
        at = 0
        for u, out in done.items():
            n = sum(p.numel() for p in pieces[u])
            if self.kind == "reward":
                out.score = host[at]
            elif self.kind == "reference":
                out.logprobs = host[at: at + n]
            else:
                out.values = host[at: at + n]
            at += n
        return done


class RewardFunctionError(RuntimeError):
    """The user's reward function raised. The message names the function, the step and the
    batch; the function's own exception is chained (``__cause__``), so its traceback prints
    first."""


class RewardFunction:
    """A plain Python reward: ``fn(prompts, responses) -> list[float]`` on text (and, by keyword,
    what it asks for of the batch's records: ``scoring.reward_fn``).

    ``retries``: times a call that raised is made again, on the same batch, before the run stops
    (``reward.retries``: scorers behind a network); the n-th retry waits ``backoff_s * 2**(n-1)``
    seconds. A call that returns a wrong number of scores, or a score that is not a finite
    number, is not retried: it would return the same.
    """

    def __init__(self, fn: Callable, name: str, retries: int = 0, backoff_s: float = 1.0,
                 sleep: Callable[[float], None] | None = None):
        import time

        self.fn, self.name, self.retries, self.backoff_s = fn, name, retries, backoff_s
        self.sleep = sleep or time.sleep

    def __call__(self, prompts: list[str], responses: list[str], step: int | None = None,
                 indices: list[int] | None = None, context: Mapping[str, list] | None = None) -> list[float]:
        """Scores of ``responses`` to ``prompts``; ``step`` and ``indices`` (the prompts' indices in
        the prompt set) only name the batch in an error; ``context``: the records' other inputs
        (``data.PromptSet.context``), passed as the function asks (``reward_fn.call_reward``)."""
        import math
        import numbers

        from .reward_fn import call_reward

        where = self._where(prompts, step, indices)
        for attempt in range(self.retries + 1):
            try:
                out = call_reward(self.fn, prompts, responses, context)
                break
            except Exception as e:
                if attempt == self.retries:
                    tries = f" (tried {attempt + 1} times: reward.retries={self.retries})" if self.retries else ""
                    raise RewardFunctionError(
                        f"Reward function {self.name} raised {type(e).__name__}: {e}{tries} {where}. Its traceback "
                        f"is above. Fix the function (or, for a flaky remote scorer, set reward.retries); what the "
                        f"run kept, and how to go on, is printed with this error.") from e
                self.sleep(self.backoff_s * 2 ** attempt)
        if out is None or isinstance(out, (str, bytes)) or not hasattr(out, "__iter__"):
            said = "None (no return statement?)" if out is None else f"a {type(out).__name__}"
            raise ValueError(f"Reward function {self.name} returned {said} {where}; it must return a list with one "
                             f"float per response.")
        scores = list(out)
        if len(scores) != len(prompts):
            raise ValueError(f"Reward function {self.name} returned {len(scores)} scores for {len(prompts)} "
                             f"responses {where}; it must return one float per response.")
        for p, s in zip(prompts, scores):
            # numbers.Real: int, float, bool and numpy's scalars (np.float32 is no Python float)
            if not isinstance(s, numbers.Real) or not math.isfinite(float(s)):
                raise ValueError(f"Reward function {self.name} returned {s!r} for the prompt {p!r} {where}; "
                                 f"rewards must be finite numbers.")
        return [float(s) for s in scores]

    @staticmethod
    def _where(prompts: list[str], step: int | None, indices: list[int] | None) -> str:
        """'at step 3, on a batch of 8 responses to prompts 12, 40, ... (the first: '...')'."""
        at = f"at step {step}, " if step is not None else ""
        shown = ""
        if indices:
            shown = ", ".join(map(str, indices[:8])) + (", ..." if len(indices) > 8 else "")
            shown = f" to prompts {shown} of the prompt set"
        first = prompts[0] if prompts else ""
        first = first if len(first) <= 60 else first[:57] + "..."
        return f"{at}on a batch of {len(prompts)} responses{shown} (the first prompt: {first!r})"
