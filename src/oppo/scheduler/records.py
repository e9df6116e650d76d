"""The scheduler's messages (a ticket per admitted sequence, the decisions ``Admit`` and
``CloseStep``, the phases) and the argument checks its state machines share."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

STATE_FORMAT = 1
PARTIAL_GROUPS = ("carry", "wait")


@dataclass(frozen=True)
class StepTiming:
    """What a step that ran with an overlap controller's setting tells the controller (its
    ``observe``): its ``seconds``, the response ``tokens`` it trained and the ``stale_share`` of them
    sampled by an older policy; for a planner, the trained response ``lengths``, the lock-step
    ``decode_steps`` and the ``generate_s`` seconds of its decode loop."""

    seconds: float
    tokens: float = 0.0
    stale_share: float = 0.0
    lengths: tuple[int, ...] = ()
    decode_steps: float = 0.0
    generate_s: float = 0.0


@dataclass(frozen=True)
class SeqTicket:
    """One admitted sequence.

    uid: unique, increasing, never reused (also across checkpoint/resume).
    prompt_index: data-stream position of its prompt (the caller maps it to a prompt).
    start_version: step (= policy version) at which it was admitted; its first token's version.
    group: the uid of its group's first member (see "Groups" in ``docs/scheduler.md``); the G
        members of a group share ``prompt_index`` and ``start_version`` and have consecutive
        uids ``group .. group + G - 1``. Left out, it is ``uid`` (a group of one).
    """

    uid: int
    prompt_index: int
    start_version: int
    group: int

    # Written out (the dataclass keeps it) so that ``group`` may be left out yet is an int.
    def __init__(self, uid: int, prompt_index: int, start_version: int, group: int | None = None) -> None:
        object.__setattr__(self, "uid", uid)
        object.__setattr__(self, "prompt_index", prompt_index)
        object.__setattr__(self, "start_version", start_version)
        object.__setattr__(self, "group", uid if group is None else group)


@dataclass(frozen=True)
class Admit:
    """Start generating these sequences now (possibly none); whole groups, members adjacent."""

    seqs: tuple[SeqTicket, ...]

    @property
    def groups(self) -> tuple[tuple[SeqTicket, ...], ...]:
        """``seqs`` split into their groups, in admission order."""
        out: dict[int, list[SeqTicket]] = {}
        for t in self.seqs:
            out.setdefault(t.group, []).append(t)
        return tuple(tuple(g) for g in out.values())


@dataclass(frozen=True)
class CloseStep:
    """Train step ``step`` on exactly B finished sequences: B / group_size whole groups.

    Groups are ordered by (start_version, completion order), so due ones come first; the
    members of a group are adjacent, in uid order (with ``group_size`` 1: every sequence by
    (start_version, finish order)). ``start_versions`` is parallel to ``uids``.
    """

    step: int
    uids: tuple[int, ...]
    start_versions: tuple[int, ...]
    group_size: int = 1

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """``uids`` cut into the batch's groups (G adjacent uids each)."""
        g = self.group_size
        return tuple(self.uids[i : i + g] for i in range(0, len(self.uids), g))

    @property
    def group_index(self) -> tuple[int, ...]:
        """Per-sequence group number in this batch, parallel to ``uids``: ``0,..,0,1,..``."""
        return tuple(i // self.group_size for i in range(len(self.uids)))

    @property
    def lags(self) -> tuple[int, ...]:
        """Per-sequence lag ``step - start_version``, parallel to ``uids``."""
        return tuple(self.step - v for v in self.start_versions)

    def lag_histogram(self) -> dict[int, int]:
        """``{lag: number of sequences}`` for this batch (for metrics)."""
        out: dict[int, int] = {}
        for lag in self.lags:
            out[lag] = out.get(lag, 0) + 1
        return dict(sorted(out.items()))


class Phase(enum.Enum):
    IDLE = "idle"  # between steps: before begin_step(), after end_step()
    OPEN = "open"  # step admitted; waiting for a closable batch
    UPDATING = "updating"  # batch handed out; PPO update running until end_step()


def check_int(name: str, value: Any, minimum: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__}); {fix}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}; {fix}")
    return value


def check_reward(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(
            f"{what} must be a finite number, got {value!r}; check the reward computation "
            "(a NaN/inf mean reward usually means the policy or reward model diverged)"
        )
    return float(value)


def state_mismatch(what: str, saved: Any, mine: Any) -> ValueError:
    return ValueError(
        f"checkpoint {what} is {saved!r} but this object was built with {mine!r}; construct it "
        "with the same settings as the run that wrote the checkpoint"
    )

