"""The PPO batch: :class:`Experience` (B finished sequences as response-aligned tensors), the
stages that fill it (scores, old log-probs; the advantages: ``algo.stage``; plain functions the
trainer calls in the same order in every mode), the critic's share of it
(:class:`CriticBatch`), and how a minibatch is cut into micro-batches and laid out in packed rows."""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..algo.actor_loss import importance_weights, sampler_ratio_outside_clip
from ..api.records import Rollout, Scores
from ..forward import RowLayout, LayoutRule, sequence_batch

if TYPE_CHECKING:  # (the config lists the learner engines: no import back at run time)
    from ..config import PPOConfig


@dataclass(frozen=True)
class MicroBatching:
    """How a minibatch is cut into micro-batches and laid out in rows (``ppo.packing``,
    ``micro_batch_size``, ``micro_batch_tokens``, ``micro_batch_padding``, ``shape_buckets``): a
    record built once from the ``ppo`` section (:meth:`of`), so that the cutting reads no config."""

    packing: str = "auto"
    micro_batch_size: int = 8
    micro_batch_tokens: int = 0
    micro_batch_padding: float = 0.0
    shape_buckets: str = "auto"

    @classmethod
    def of(cls, ppo: PPOConfig) -> "MicroBatching":
        """The settings a ``ppo`` section holds (its token budget as given: -1 until ``learner.budget``
        resolves it)."""
        return cls(ppo.packing, ppo.micro_batch_size, ppo.micro_batch_tokens, ppo.micro_batch_padding,
                   ppo.shape_buckets)


@dataclass(frozen=True)
class OldLogprobSettings:
    """What :func:`set_old_logprobs` reads of the ``ppo`` section: the importance weights'
    truncation (``ppo.is_truncate``) and the ratio's clip range its statistic counts against
    (``clip_eps``, ``clip_eps_high``)."""

    is_truncate: float | None = 2.0
    clip_eps: float = 0.2
    clip_eps_high: float | None = None

    @classmethod
    def of(cls, ppo: PPOConfig) -> "OldLogprobSettings":
        return cls(ppo.is_truncate, ppo.clip_eps, ppo.clip_eps_high)


@dataclass
class Experience:
    """B finished sequences as response-aligned tensors (alignment: ``algo.masks`` docstring).

    ids, valid: [B, P+T] left-padded prompts then right-padded responses; ``P`` prompt width.
    mask: [B, T] 1 on response tokens (EOS included). versions: [B, T] policy version per token.
    behaviour_logprobs: [B, T] from the sampler (the distribution actually sampled: its precision,
    its top-k/top-p truncation). policy_logprobs: [B, T] from the sampler too, untruncated: the
    sampling weights' own log-probs (``Rollout.policy_logprobs``; equal to behaviour_logprobs
    without truncation). old_logprobs: [B, T] under pi_k by the training forward, the policy the
    PPO ratio is clipped around (the sampler's untruncated ones, unrecomputed, where the two
    cannot differ: see ``Learner.old_logprobs``). is_weights: [B, T] pi_k / pi_version (both
    untruncated) for off-policy tokens (truncated at ``ppo.is_truncate``), 1 otherwise.
    ``stats``: for the metrics. ref_logprobs, values, rewards, kl, advantages, returns: [B, T].
    scores: [B].
    """

    rollouts: list[Rollout]
    ids: torch.Tensor
    valid: torch.Tensor
    P: int
    mask: torch.Tensor
    versions: torch.Tensor
    behaviour_logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    is_weights: torch.Tensor
    policy_logprobs: torch.Tensor | None = None  # None: behaviour_logprobs (built by hand, no truncation)
    ref_logprobs: torch.Tensor | None = None  # set by attach_scores (a new record)
    values: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    stats: dict[str, float] | None = None
    group_ids: torch.Tensor | None = None  # [B] the group of each row (GRPO/RLOO): its first member's uid
    trainable: bool = True  # False: non-finite advantages under ppo.nonfinite=skip (algo.stage)

    @property
    def sampler_logprobs(self) -> torch.Tensor:
        """[B, T] the sampling weights' untruncated log-probs: ``policy_logprobs``, or the behaviour
        ones where none were recorded (the two are equal without truncation)."""
        return self.policy_logprobs if self.policy_logprobs is not None else self.behaviour_logprobs


def _pad_rows(rows: Sequence[Sequence[float]], T: int, device, dtype=torch.float32) -> torch.Tensor:
    out = torch.zeros(len(rows), T, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out.to(device)


def build_experience(rollouts: list[Rollout], pad_id: int, device) -> Experience:
    """Stack the rollouts' tokens, versions and behaviour log-probs into tensors (no scores yet)."""
    ids, valid, P, rmask = sequence_batch([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts],
                                          pad_id, device)
    T = rmask.shape[1]
    lp = _pad_rows([r.logprobs for r in rollouts], T, device)
    for r in rollouts:
        if r.policy_logprobs and len(r.policy_logprobs) != len(r.logprobs):
            raise RuntimeError(f"internal error: sequence {r.uid} has {len(r.logprobs)} behaviour log-probs but "
                               f"{len(r.policy_logprobs)} untruncated ones")
    # a rollout backend that samples without truncation may leave policy_logprobs empty (Rollout)
    plp = _pad_rows([r.policy_logprobs or r.logprobs for r in rollouts], T, device)
    return Experience(
        rollouts=rollouts, ids=ids, valid=valid, P=P, mask=rmask.float(),
        versions=_pad_rows([r.versions for r in rollouts], T, device, torch.long),
        behaviour_logprobs=lp, old_logprobs=plp.clone(), is_weights=torch.ones_like(lp), policy_logprobs=plp,
        group_ids=torch.tensor([r.group for r in rollouts], dtype=torch.long, device=device))


def attach_scores(exp: Experience, scored: Scores) -> Experience:
    """A new record with stage 3's results, per sequence, as [B, T] tensors aligned with the
    responses (``scored.values`` None: a critic-free algorithm)."""
    T, device = exp.mask.shape[1], exp.mask.device
    return dataclasses.replace(
        exp, ref_logprobs=_pad_rows([o.logprobs for o in scored.reference], T, device),
        values=_pad_rows([o.values for o in scored.values], T, device) if scored.values is not None else None,
        scores=torch.tensor(scored.scores, dtype=torch.float32, device=device))


def old_logprob_targets(exp: Experience, version: int, recompute_all: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(redo, off), both [B, T] bool: the tokens whose old log-probs the training forward recomputes
    (every response token if ``recompute_all``, else the off-policy ones) and the off-policy tokens
    (sampled by a version older than ``version``). See ``Learner.old_logprobs``."""
    mask = exp.mask > 0
    off = (exp.versions < version) & mask  # [B, T]
    return (mask if recompute_all else off), off


def set_old_logprobs(exp: Experience, rows: torch.Tensor, new: torch.Tensor, redo: torch.Tensor, off: torch.Tensor,
                     settings: OldLogprobSettings) -> Experience:
    """A new record with ``old_logprobs`` (``new`` [len(rows), T] where ``redo``), ``is_weights``
    (``algo.actor_loss.importance_weights``) and ``stats`` (``Learner.old_logprobs``); wherever
    ``new`` was computed (one learner, or its share by each sharded rank)."""
    if rows.numel() == 0:
        return dataclasses.replace(exp, stats={})
    mask = exp.mask > 0
    sampler = exp.sampler_logprobs  # [B, T] untruncated
    old = exp.old_logprobs.clone()
    old[rows] = torch.where(redo[rows], new.to(old.device), old[rows])
    weights = importance_weights(old, sampler, off, settings.is_truncate)  # [B, T]
    stats = sampler_ratio_outside_clip(old, sampler, mask & ~off & redo, settings.clip_eps, settings.clip_eps_high)
    return dataclasses.replace(exp, old_logprobs=old, is_weights=weights,
                               stats={k: v.item() for k, v in stats.items()})


@dataclass
class MicroBatch:
    """A micro-batch's b sequences laid out for one training forward (``micro_slices``).

    layout: the forward's rows (``forward.RowLayout``: packed end to end, or one sequence a row);
    source, first: the flat token ids the sequences are read from and each one's first token
    [b]. Per response token, N in all: pre [N] the flat position (row * width + column) of the
    hidden state that predicts it (its prompt length - 1 + t into its sequence), dest [N] its
    place in the [b, T] response layout (row * T + t), tokens [N] the token. T: the longest
    response of the micro-batch."""

    layout: RowLayout
    source: torch.Tensor
    first: torch.Tensor
    pre: torch.Tensor
    dest: torch.Tensor
    tokens: torch.Tensor
    b: int
    T: int

    def spread(self, x: torch.Tensor) -> torch.Tensor:
        """[N] per response token -> [b, T], 0 past each response's end (differentiable)."""
        return torch.zeros(self.b * self.T, dtype=x.dtype, device=x.device).index_copy(0, self.dest, x).view(self.b, self.T)


def host_lengths(batch: "Experience | CriticBatch") -> tuple[list[int], list[int], list[int]]:
    """(real tokens, prompt tokens, response tokens) of every row, on the host: read once per
    record (cached on it) in one transfer, so that no micro-step reads a device value to learn a
    shape (issue 46: every such read drains the queue the host had run ahead to fill)."""
    cached = batch.__dict__.get("_host_lengths")
    if cached is not None and cached[0] is batch.valid:
        return cached[1]
    valid = batch.valid.long()
    both = torch.stack([valid.sum(1), valid[:, : batch.P].sum(1), batch.mask.sum(1).long()])  # [3, B]
    total, prompt, response = both.tolist()  # CPU-GPU sync point (once per record)
    batch.__dict__["_host_lengths"] = (batch.valid, (total, prompt, response))
    return total, prompt, response


def micro_slices(exp: "Experience | CriticBatch", rows: "torch.Tensor | list[int]", plan: LayoutRule,
                 micro: MicroBatching | None = None) -> MicroBatch:
    """``rows`` of ``exp`` laid out by ``plan`` (``MicroBatch``): whole sequences, prompt then
    response, packed end to end where the model can, else one a row as wide as the longest (never
    ``exp``'s longest prompt plus longest response). ``micro``: its micro_batch_tokens and
    micro_batch_padding bound the rows (``forward.lay_out_rows``). Positions count from 0 along each
    sequence either way, so the numbers are each sequence's own forward's.

    ``rows``: a host list (the learner's loop; a tensor is read to the host first). Every index is
    built on the host from :func:`host_lengths` and copied to the device in one transfer: no read of
    a device value here."""
    idx = rows if isinstance(rows, list) else rows.tolist()
    total, prompt, response = host_lengths(exp)
    n = [total[i] for i in idx]
    n_prompt = [prompt[i] for i in idx]
    resp = [response[i] for i in idx]
    layout = plan.layout(n, token_budget(micro) if micro else 0, micro.micro_batch_padding if micro else 0.0)
    b, T, L, P = len(idx), max(resp, default=0), exp.valid.shape[1], exp.P
    first = [i * L + P - k for i, k in zip(idx, n_prompt)]  # [b] each sequence's first token, flat
    pre: list[int] = []
    dest: list[int] = []
    src: list[int] = []
    for j, (i, k, r) in enumerate(zip(idx, n_prompt, resp)):
        at = layout.start[j] + k - 1  # the state before the first response token
        pre.extend(range(at, at + r))
        dest.extend(range(j * T, j * T + r))
        src.extend(range(i * L + P, i * L + P + r))
    N = len(pre)
    dev = exp.valid.device
    flat = torch.tensor(first + pre + dest + src, dtype=torch.long).to(dev, non_blocking=True)  # one copy
    first_t, pre_t, dest_t, src_t = flat.split([b, N, N, N])
    source = exp.ids.reshape(-1)
    return MicroBatch(layout, source, first_t, pre_t, dest_t, source[src_t], b, T)


def row_lengths(batch: "Experience | CriticBatch") -> list[int]:
    """Each row's real tokens (prompt and response), on the host (:func:`host_lengths`)."""
    return host_lengths(batch)[0]


def balanced(items: list[int], lengths: list[int], parts: int, budget: float = math.inf) -> list[list[int]]:
    """``items`` cut into at least ``parts`` groups of similar token counts (``lengths[i]`` each):
    longest first, each to the least-loaded group (longest-processing-time first: the heaviest group
    is within the longest item of the mean); more groups while one of several items passes
    ``budget``. A function of the items as a set (ties by index), in order of decreasing load,
    each group longest first."""
    order = sorted(items, key=lambda i: (-lengths[i], i))
    k = max(1, min(parts, len(order)))
    while True:
        heap = [(0, g) for g in range(k)]
        groups: list[list[int]] = [[] for _ in range(k)]
        for i in order:
            load, g = heapq.heappop(heap)
            groups[g].append(i)
            heapq.heappush(heap, (load + lengths[i], g))
        over = any(len(g) > 1 and sum(lengths[i] for i in g) > budget for g in groups)
        if not over or k >= len(order):
            break
        k += 1
    groups = [g for g in groups if g]
    return sorted(groups, key=lambda g: (-sum(lengths[i] for i in g), g[0]))


Rows = "list[int] | torch.Tensor"
"""A minibatch's rows: a host list (the learner's own loop), or an index tensor (read once)."""


def micro_batches(batch: "Experience | CriticBatch | None", mb: torch.Tensor, micro: MicroBatching,
                  lengths: list[int] | None = None) -> list[torch.Tensor]:
    """``mb``'s rows cut into the micro-batches of one optimizer step (the same for actor and critic,
    every learner rank and ``padding_stats``; ``lengths``: every row's real tokens, else ``batch``'s).

    Packed (``ppo.packing`` auto or on): minibatch_size / micro_batch_size micro-batches of similar
    token counts (:func:`balanced`; a micro-batch holds as many sequences as make its share), more
    where one would pass ``ppo.micro_batch_tokens``. A function of ``mb``'s rows as a set: the
    learner's minibatches list their rows micro-batch after micro-batch (``draw_minibatches``), so
    each is a run of its minibatch.

    Unpacked (off): runs of ``ppo.micro_batch_size`` rows in ``mb``'s order (longest first); with
    ``ppo.micro_batch_tokens`` > 0 a run also ends before its rows x width would pass the budget,
    and with ``ppo.micro_batch_padding`` > 0 before its padded share of rows x width would pass that
    share (a micro-batch is as wide as its longest row; at least one row each)."""
    groups = micro_groups(batch, mb.tolist(), micro, lengths)
    return [torch.tensor(g, dtype=mb.dtype, device=mb.device) for g in groups]


def token_budget(micro: MicroBatching) -> int:
    """``ppo.micro_batch_tokens`` in effect: -1 (sized to the device) not resolved for one
    (``learner.budget.sized``: the local learner resolves it) is no budget."""
    return max(0, micro.micro_batch_tokens)


def micro_groups(batch: "Experience | CriticBatch | None", mb: list[int], micro: MicroBatching,
                 lengths: list[int] | None = None) -> list[list[int]]:
    """:func:`micro_batches` on the host: ``mb``'s rows (a list) -> each micro-batch's rows (lists)."""
    if micro.packing != "off":
        lengths = lengths if lengths is not None else row_lengths(batch)  # type: ignore[arg-type]
        return balanced(mb, lengths, -(-len(mb) // micro.micro_batch_size), token_budget(micro) or math.inf)
    if not token_budget(micro) and not micro.micro_batch_padding:
        return [mb[i: i + micro.micro_batch_size] for i in range(0, len(mb), micro.micro_batch_size)]
    lengths = lengths if lengths is not None else row_lengths(batch)  # type: ignore[arg-type]
    budget, cap = token_budget(micro) or math.inf, micro.micro_batch_padding or 1.0
    out: list[list[int]] = []
    cur: list[int] = []
    width = real = 0
    for i in mb:
        n, w = len(cur) + 1, max(width, lengths[i])
        if cur and (n > micro.micro_batch_size or n * w > budget or 1.0 - (real + lengths[i]) / (n * w) > cap):
            out.append(cur)
            cur, w, real = [], lengths[i], 0
        cur.append(i)
        width, real = w, real + lengths[i]
    out.append(cur)
    return out


def rank_of(j: int, world: int) -> int:
    """The data-parallel rank that computes a minibatch's micro-batch ``j`` of ``world``: round
    j // world in snake order (0..M-1, then M-1..0), so that micro-batches in order of decreasing
    tokens (``micro_batches``) give every rank the same total over two rounds, not rank 0 the
    heaviest of every round."""
    r = j % world
    return r if (j // world) % 2 == 0 else world - 1 - r


def padding_stats(exp: Experience, minibatches: "list[list[int]] | list[torch.Tensor]", micro: MicroBatching,
                  plan: LayoutRule | None = None) -> dict[str, float]:
    """What the actor's update computes: ``perf/train_tokens``, the real (prompt and response) tokens
    of every micro-batch, and ``perf/train_padded_frac``, the share of the computed positions (each
    forward's rows x width: ``plan``'s layout, the actor's; None: one sequence a row) that are
    padding."""
    lengths = row_lengths(exp)
    plan = plan or LayoutRule(False)
    computed = real = 0
    for mb in minibatches:
        for rows in micro_groups(exp, mb if isinstance(mb, list) else mb.tolist(), micro, lengths):
            n = [lengths[i] for i in rows]
            computed += plan.layout(n, token_budget(micro), micro.micro_batch_padding).computed
            real += sum(n)
    return {"perf/train_tokens": float(real), "perf/train_padded_frac": 1.0 - real / computed if computed else 0.0}


@dataclass
class CriticBatch:
    """What the critic's update needs from an Experience (small enough to send to the scorer worker)."""

    ids: torch.Tensor
    valid: torch.Tensor
    P: int
    mask: torch.Tensor
    values: torch.Tensor
    returns: torch.Tensor

    @classmethod
    def of(cls, exp: Experience) -> "CriticBatch":
        assert exp.values is not None and exp.returns is not None  # (algo.stage.compute_advantages with a critic)
        return cls(exp.ids, exp.valid, exp.P, exp.mask, exp.values, exp.returns)

    def to(self, device) -> "CriticBatch":
        return CriticBatch(self.ids.to(device), self.valid.to(device), self.P, self.mask.to(device),
                           self.values.to(device), self.returns.to(device))
