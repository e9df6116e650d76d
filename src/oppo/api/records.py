"""What crosses a role boundary: the records of a sequence and the events of a rollout backend.

- :class:`Rollout`: one sequence, in flight or finished, every token with its behaviour log-prob
  and the policy version that sampled it.
- :class:`Chunk`: new tokens of one sequence for the streaming scorers.
- :class:`SequenceFinished`, :class:`ChunkReady`: what a rollout backend reports from
  ``advance`` (``api/protocols.py``).
- :class:`Scores`: what the scorers add to a batch (stage 3).

The batch the learner consumes is ``learner.batch.Experience``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Union


@dataclass
class Rollout:
    """One sequence, in flight or finished.

    ``response_ids[t]`` was sampled by policy version ``versions[t]`` with behaviour log-prob
    ``logprobs[t]`` (the truncated distribution it was drawn from) and untruncated log-prob
    ``policy_logprobs[t]`` under the weights that sampled it (``rollout/eager/backend.py``'s docstring; a backend
    that samples without truncation may leave ``policy_logprobs`` empty: ``logprobs`` are then
    both). ``emitted`` counts the tokens already streamed to the scorers.
    """

    uid: int
    prompt_index: int
    prompt: str
    prompt_ids: list[int]
    start_version: int
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False
    ended_with_eos: bool = False
    emitted: int = 0
    target_length: int | None = None  # benchmark workloads only: force EOS at exactly this length
    group: int | None = None  # GRPO/RLOO: the uid of its group's first member (None: its own uid)
    scored_version: int | None = None  # weights version the scorers held when it was admitted (stale values)

    def __post_init__(self) -> None:
        if self.group is None:
            self.group = self.uid

    def copy(self) -> "Rollout":
        """A copy with lists of its own: what a rollout backend works on, so that it never changes
        the record it was given (it hands its own back: ``SequenceFinished``, ``in_flight``)."""
        return replace(self, prompt_ids=list(self.prompt_ids), response_ids=list(self.response_ids),
                       logprobs=list(self.logprobs), policy_logprobs=list(self.policy_logprobs),
                       versions=list(self.versions))

    def state_dict(self) -> dict:
        """Every field, JSON-serialisable (a checkpoint saves the sequences in flight with it)."""
        return asdict(self)

    @classmethod
    def from_state_dict(cls, d: dict) -> "Rollout":
        """Inverse of :meth:`state_dict` (fields this version does not know are ignored)."""
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {k: (list(v) if isinstance(v, list) else v) for k, v in d.items() if k in known}
        return cls(**kwargs)


@dataclass(frozen=True)
class Chunk:
    """New tokens of one sequence for the streaming scorers; ``final`` marks the sequence's end."""

    uid: int
    tokens: tuple[int, ...]
    final: bool


@dataclass(frozen=True)
class SequenceFinished:
    """A sequence ended (EOS or its token budget): ``rollout`` holds all its tokens, behaviour
    log-probs and per-token versions."""

    rollout: Rollout


@dataclass(frozen=True)
class ChunkReady:
    """New tokens of one sequence for the streaming scorers (``chunk.final``: its last ones)."""

    chunk: Chunk


Event = Union[SequenceFinished, ChunkReady]


@dataclass(frozen=True)
class Scores:
    """Stage 3's results for a batch, in its order: reward scores [B]; the reference's per-token
    log-probs and (PPO) the critic's per-token values, one :class:`ScoredOutputs` each."""

    scores: list[float]
    reference: list
    values: list | None
    terms: dict[str, float] = field(default_factory=dict)  # reward.terms: reward/<name>/mean of each term


@dataclass
class ScoredOutputs:
    """Per-sequence outputs of one scorer role."""

    score: float | None = None  # reward role
    logprobs: list[float] = field(default_factory=list)  # reference role, one per response token
    values: list[float] = field(default_factory=list)  # critic role, one per response token


@dataclass(frozen=True)
class RolloutStats:
    """What a rollout backend measured since the controller last asked (``RolloutBackend.take_stats``,
    once per step): its KV cache's peak in bytes (``memory/actor_kv_peak_mb``; a static backend's is
    its reservation), and the decode steps its backend took (``perf/decode_steps``,
    ``perf/decode_step_ms``; None where the backend does not count them)."""

    kv_peak_bytes: int = 0
    decode_steps: int | None = None
