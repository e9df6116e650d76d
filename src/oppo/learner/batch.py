"""The PPO batch: :class:`Experience` (B finished sequences as response-aligned tensors), the
stages that fill it (scores, advantages, old log-probs: stages 4-5 of ``shared/DESIGN.md`` section
2, plain functions the trainer calls in the same order in every mode), the critic's share of it
(:class:`CriticBatch`), and how a minibatch is cut into packed micro-batches."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import guard
from .. import ppo_math as pm
from ..api.records import Rollout, Scores
from ..config import PPOConfig
from ..forward import sequence_batch


@dataclass
class Experience:
    """B finished sequences as response-aligned tensors (alignment: ``ppo_math`` docstring).

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
    trainable: bool = True  # False: non-finite advantages under ppo.nonfinite=skip (compute_advantages)

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
    # an engine that samples without truncation may leave policy_logprobs empty (Rollout)
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


@torch.no_grad()
def compute_advantages(exp: Experience, cfg: PPOConfig, algorithm, step: int = -1) -> Experience:
    """Stages 4 and 5 (a new record): per-token rewards (KL-shaped when the KL goes in the reward), then the
    algorithm's advantages (``algo.Algorithm``: GAE with the critic's values for PPO; group,
    leave-one-out or batch baselines for the critic-free ones) and, for PPO, returns.

    The guard (``guard.py``): every input and output must be finite at response tokens, else
    ``NonFiniteError`` names the first such tensor (inputs first: the cause, not its spread
    through whitening) and its rows; under ``ppo.nonfinite=skip`` a warning, and the record comes
    back ``trainable=False`` (the step's update is skipped: ``control.stages.update``)."""
    assert exp.scores is not None  # (attach_scores runs first)
    ended = torch.tensor([r.ended_with_eos for r in exp.rollouts], device=exp.scores.device)
    scores = pm.missing_eos_penalty(exp.scores, ended, cfg.missing_eos_penalty)
    res = algorithm.advantages(scores, exp.mask, exp.old_logprobs, exp.ref_logprobs, exp.values, exp.group_ids)
    bad = guard.nonfinite_rows({"scores": scores, "values": exp.values, "reference log-probs": exp.ref_logprobs,
                                "old log-probs": exp.old_logprobs, "importance weights": exp.is_weights,
                                "rewards": res.rewards, "advantages": res.advantages, "returns": res.returns},
                               exp.mask)
    if bad is not None:
        name, rows = bad
        guard.report(f"non-finite {name} at {guard.at_step(step)}, advantages: rows {guard.first(rows)} of "
                     f"{exp.mask.shape[0]} (sequences {guard.first([exp.rollouts[i].uid for i in rows])})",
                     skip=cfg.nonfinite == "skip")
    return dataclasses.replace(exp, rewards=res.rewards, kl=res.kl, advantages=res.advantages, returns=res.returns,
                               stats={**(exp.stats or {}), **{k: float(v) for k, v in res.stats.items()}},
                               trainable=bad is None)


def old_logprob_targets(exp: Experience, version: int, recompute_all: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(redo, off), both [B, T] bool: the tokens whose old log-probs the training forward recomputes
    (every response token if ``recompute_all``, else the off-policy ones) and the off-policy tokens
    (sampled by a version older than ``version``). See ``Learner.old_logprobs``."""
    mask = exp.mask > 0
    off = (exp.versions < version) & mask  # [B, T]
    return (mask if recompute_all else off), off


def set_old_logprobs(exp: Experience, rows: torch.Tensor, new: torch.Tensor, redo: torch.Tensor, off: torch.Tensor,
                     cfg: PPOConfig) -> Experience:
    """A new record with ``old_logprobs`` (``new`` [len(rows), T] where ``redo``), ``is_weights``
    and ``stats`` (``Learner.old_logprobs``); wherever ``new`` was computed (one learner, or its
    share by each sharded rank)."""
    if rows.numel() == 0:
        return dataclasses.replace(exp, stats={})
    mask = exp.mask > 0
    sampler = exp.sampler_logprobs  # [B, T] untruncated
    old = exp.old_logprobs.clone()
    old[rows] = torch.where(redo[rows], new.to(old.device), old[rows])
    w = torch.exp(old - sampler)  # [B, T]
    if cfg.is_truncate is not None:
        w = w.clamp(max=cfg.is_truncate)
    stats = {}
    on = mask & ~off & redo
    if on.any():
        ratio = torch.exp(old - sampler)[on]  # the first minibatch's ratio had we not recomputed
        eps_hi = cfg.clip_eps_high if cfg.clip_eps_high is not None else cfg.clip_eps
        stats = {"ppo/sampler_ratio_outside_clip": ((ratio < 1 - cfg.clip_eps) | (ratio > 1 + eps_hi))
                 .float().mean().item()}
    return dataclasses.replace(exp, old_logprobs=old, is_weights=torch.where(off, w, torch.ones_like(w)), stats=stats)


@dataclass
class MicroBatch:
    """Rows of a batch packed left for one training forward (``_micro_slices``).

    ids, valid: [b, W] each row's prompt then response at columns 0..n-1, padding after (W: the
    longest row's real tokens). pre: [b, T] the column whose hidden state predicts response token
    t (prompt length - 1 + t; clamped past a row's end). tokens: [b, T] the response tokens."""

    ids: torch.Tensor
    valid: torch.Tensor
    pre: torch.Tensor
    tokens: torch.Tensor

    @property
    def T(self) -> int:
        return self.tokens.shape[1]


def _micro_slices(exp: "Experience | CriticBatch", rows: torch.Tensor) -> MicroBatch:
    """``rows`` of ``exp`` packed left (``MicroBatch``): a micro-batch's width is its longest row,
    not its longest prompt plus its longest response as in ``exp``'s layout. Exact: every forward
    packs rows left anyway (``forward.full_hidden``), positions are column indices."""
    valid = exp.valid[rows]  # [b, P+T]
    n_prompt = valid[:, : exp.P].sum(1)  # [b]
    n = valid.sum(1)  # [b]
    T = int(exp.mask[rows].sum(1).max())  # CPU-GPU sync point (shapes)
    W = int(n.max())
    col = torch.arange(W, device=valid.device)
    src = ((exp.P - n_prompt)[:, None] + col[None]).clamp(max=valid.shape[1] - 1)  # [b, W]
    inside = col[None] < n[:, None]  # [b, W]
    ids = exp.ids[rows]
    pre = (n_prompt[:, None] - 1 + torch.arange(T, device=valid.device)[None]).clamp(0, W - 1)  # [b, T]
    return MicroBatch(ids.gather(1, src) * inside, inside.to(valid.dtype), pre, ids[:, exp.P: exp.P + T])


def _lengths(batch: "Experience | CriticBatch") -> list[int]:
    """Each row's real tokens (prompt and response), on the host: a packed micro-batch's width is
    its longest row's (``_micro_slices``)."""
    return batch.valid.sum(1).long().tolist()


def micro_batches(batch: "Experience | CriticBatch", mb: torch.Tensor, cfg: PPOConfig,
                  lengths: list[int] | None = None) -> list[torch.Tensor]:
    """``mb``'s rows cut, in order, into the micro-batches of one optimizer step: runs of
    ``ppo.micro_batch_size`` rows; with ``ppo.micro_batch_tokens`` > 0 a run also ends before its
    rows x width would pass the budget, and with ``ppo.micro_batch_padding`` > 0 before its padded
    share of rows x width would pass that share (a micro-batch is as wide as its longest row:
    ``_micro_slices``; at least one row each). The same for actor and critic, every learner rank
    and ``padding_stats``."""
    if not cfg.micro_batch_tokens and not cfg.micro_batch_padding:
        return list(mb.split(cfg.micro_batch_size))
    lengths = lengths or _lengths(batch)
    budget, cap = cfg.micro_batch_tokens or math.inf, cfg.micro_batch_padding or 1.0
    out: list[list[int]] = []
    cur: list[int] = []
    width = real = 0
    for i in mb.tolist():
        n, w = len(cur) + 1, max(width, lengths[i])
        if cur and (n > cfg.micro_batch_size or n * w > budget or 1.0 - (real + lengths[i]) / (n * w) > cap):
            out.append(cur)
            cur, w, real = [], lengths[i], 0
        cur.append(i)
        width, real = w, real + lengths[i]
    out.append(cur)
    return [torch.tensor(c, dtype=mb.dtype, device=mb.device) for c in out]


def padding_stats(exp: Experience, minibatches: list[torch.Tensor], cfg: PPOConfig) -> dict[str, float]:
    """What the actor's update computes: ``perf/train_tokens``, the real (prompt and response) tokens
    of every micro-batch, and ``perf/train_padded_frac``, the share of the computed positions that
    are padding (a micro-batch runs its rows x its longest row: ``_micro_slices``)."""
    lengths = _lengths(exp)
    computed = real = 0
    for mb in minibatches:
        for rows in micro_batches(exp, mb, cfg, lengths):
            r = rows.tolist()
            computed += len(r) * max(lengths[i] for i in r)
            real += sum(lengths[i] for i in r)
    return {"perf/train_tokens": float(real), "perf/train_padded_frac": 1.0 - real / computed if computed else 0.0}


@dataclass
class CriticBatch:
    """What the critic's update needs from an Experience (small enough to send to a worker)."""

    ids: torch.Tensor
    valid: torch.Tensor
    P: int
    mask: torch.Tensor
    values: torch.Tensor
    returns: torch.Tensor

    @classmethod
    def of(cls, exp: Experience) -> "CriticBatch":
        assert exp.values is not None and exp.returns is not None  # (compute_advantages with a critic)
        return cls(exp.ids, exp.valid, exp.P, exp.mask, exp.values, exp.returns)

    def to(self, device) -> "CriticBatch":
        return CriticBatch(self.ids.to(device), self.valid.to(device), self.P, self.mask.to(device),
                           self.values.to(device), self.returns.to(device))
