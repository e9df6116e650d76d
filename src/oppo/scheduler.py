"""Scheduling state machines for overlapped PPO: admission, step closing, staleness, chunk size.

Everything here is pure: no torch, no threads, no I/O, no clocks. Events go in (a sequence
finished, a step's update is done, a step took this long), decisions come out (admit these
prompts, train these sequences). The runtime owns the engine, the clock and the models.

Scheduler: the inter-step overlap
---------------------------------
Terms. ``B`` is the PPO batch size (sequences per step). A *sequence* is one prompt being
answered; it gets a never-reused ``uid`` when admitted. Step ``k`` is sampled by policy version
``k`` (``pi_k``), so the step index *is* the policy version. A sequence's ``start_version`` is
the step at which it was admitted, i.e. the version that sampled its first token. If it is
trained at step ``k`` its **lag** is ``k - start_version``. Tokens sampled later (after the
sequence was carried into later steps) come from newer versions, so every token of a sequence
trained at step ``k`` was sampled by a version in ``[k - lag, k]``; the engine tags each token
with its version and the PPO loss importance-weights them against their behaviour log-probs.

Phases (a call made in the wrong phase raises ``RuntimeError``)::

    IDLE --begin_step()--> OPEN --try_close() gives a CloseStep--> UPDATING --end_step(r)--> IDLE

    IDLE      between steps: begin_step() tops the admitted-but-untrained sequences up to
              B + Delta. drain_for_checkpoint(), state_dict(), load_state_dict() only here.
    OPEN      step k collects finishes; try_close() returns None until the batch is ready
              (call it again after each round of on_finished()).
    UPDATING  the PPO update runs; the engine may keep decoding carried rows meanwhile.
              end_step() then moves to step k + 1 and updates Delta.
    on_finished(uid) is legal in every phase; with refill=True it may return an Admit while OPEN.

The staleness knob ``max_lag``. A sequence is **due** at step ``k`` when
``k - start_version >= max_lag``: one more carry would push its lag past ``max_lag``. A step
closes (``try_close`` returns a ``CloseStep``) as soon as

1. at least ``B`` sequences are finished and untrained (the *finished pool*), and
2. no due sequence is still running (the step waits for it instead of carrying it again).

The batch is the ``B`` finished sequences with the smallest ``(start_version, finish order)``.
Due sequences have the smallest start versions, so they are always in it. The rest of the
pool (sequences that finished in the same instant) stays for the next step, oldest first;
running sequences are carried with their partial work. Hence every trained sequence has
``0 <= lag <= max_lag``: ``max_lag = 0`` is fully on-policy (nothing is ever carried; with
``Delta = 0`` the schedule is exactly the sequential one: admit B, wait for all B), ``max_lag = 1``
lets a sequence be carried once, and so on.

Delta. At ``begin_step`` the scheduler admits new prompts until ``B + Delta`` sequences are
admitted-but-untrained (carried running ones and carried finished ones count). Delta is fixed
(an ``int``) or read from a :class:`DeltaRule` before every step: ``tuner.TunedDelta`` (the cost-aware
controller, the default) or a :class:`DeltaController` (the paper's reward-slope rule).

Refill (continuous batching, ``refill=True``). While a step is OPEN, a finish frees an engine
slot and the scheduler admits a replacement at once, keeping ``B + Delta`` sequences
*running*, as long as no more than ``2 * B`` sequences are admitted-but-untrained. That cap is
what keeps the carried set at most ``B`` (see the note in ``Scheduler.__init__``). Refill needs
``max_lag >= 1``: with ``max_lag = 0`` a replacement would be due in the very step that
admitted it, and any extra finished sequence could never be carried.

Data position. Prompts are handed out in the order of a data-stream position, an ``int``
counter that starts at ``start_position``; ``SeqTicket.prompt_index`` is that position and the
caller maps it to a prompt (e.g. modulo the dataset size, with a per-epoch shuffle).

Checkpoints. ``state_dict()`` (IDLE) saves every admitted-but-untrained ticket with its finish
order. A caller that can save the sequences' partial work too (the trainer, with a rollout backend
that hands its rows out: ``control.stages.Run.save_in_flight``) restores the tickets as they were
with ``load_state_dict(state, keep_untrained=True)`` and re-admits the running ones with their
partial responses: same uids, start versions (so the same lags and due steps) and batch order.
Otherwise the untrained sequences are requeued: ``drain_for_checkpoint()`` before the save
forgets every admitted-but-untrained sequence (running or finished) and puts its prompt position
on a ``requeue`` list, and ``load_state_dict`` without ``keep_untrained`` does the same with the
tickets it finds; ``begin_step`` (and refill) admit requeued positions first, under new uids and
the current version, before any new position; their generations are discarded and regenerated.
Either way no prompt is lost or trained twice (``tests/test_kill_resume.py``).

Groups (``group_size`` G, for GRPO/RLOO). A prompt is answered G times; its G sequences are a
*group*: admitted together (one data position, one ``start_version``, consecutive uids; the
group's id is its first uid), closed together, carried together, drained together, trained in
the same step. With G = 1 every group is one sequence and everything above holds word for word
(the decisions are identical to the scheduler before groups existed). For G > 1, in groups:

* ``B`` must be a multiple of G; a step trains ``B / G`` whole groups.
* A group is *complete* when its last member finishes. A step closes as soon as ``B / G``
  groups are complete and no due group still has a running member; the batch is the complete
  groups with the smallest ``(start_version, completion order)``, members adjacent in uid order.
* **Delta counts groups**: ``begin_step`` tops the untrained set up to ``B / G + Delta`` groups,
  and ``Delta <= B / G`` (the proof above, in groups). A DeltaController's +-1 is +-G sequences.
* ``max_lag`` applies per group (all members share the start version, so it is also per
  sequence); every token still carries its own version for the loss.
* Refill admits a whole group once G engine slots are free, keeping ``(B / G + Delta) * G``
  sequences running and at most ``2B / G`` groups untrained.
* A drain requeues one position per group; the prompt comes back as a new whole group.

The design decision: **carry whole groups**. When a step closes, every group that is not
complete is carried whole into the next step: its running members keep decoding (with their
partial work) and its finished members wait, scored, in the finished pool until their last
sibling finishes; then the whole group is trained in one step. No group is ever split across
steps, lost, or trained twice (property tests in ``tests/test_scheduler.py``). Why:

* splitting a group (train the finished members now, the rest later) is not an option: the
  group baseline (GRPO's mean and std, RLOO's leave-one-out mean) needs all G scores at once,
  and training the early members with a partial baseline changes the estimator;
* the alternative, *close on groups*, lets a step close only when no admitted group is partly
  finished (or drops the finished members of incomplete groups and regenerates them). The
  first waits for the slowest member of every in-flight group, which removes the inter-step
  overlap exactly where it pays; the second throws away finished decoding and scoring work;
* a group completes only when its slowest member does, so the long tail is heavier with G
  (a group is slow if any of its G members is), which is what extra in-flight groups hide:
  with ``Delta`` spare groups the step closes on the ``B / G`` groups that complete first.
  The price is that finished members of carried groups wait (memory for their tokens and
  scores, not engine slots: they are no longer decoding) and that a group can mix tokens of
  several policy versions, each importance-weighted by its own behaviour log-prob.

``partial_groups="wait"`` is the first alternative, kept to measure the choice
(``benchmarks/groups/``). ``oppo bench`` of GRPO on the long-tailed representative lengths, B = 32,
a fixed Delta of 8 extra sequences, 20 timed steps on 2 vCPUs, each member drawing its own length:

* G = 4: carry 1.64 s per step (1.15x sequential), wait 1.67 s (1.13x);
* G = 2: carry 1.73 s (1.14x), wait 1.78 s (1.11x).

Carrying left 2-3 sequences decoding and 3-5 finished members waiting at each close. Waiting
left none decoding: by the time B / G groups were complete, every other admitted group had a
finished member, so the step waited for all of them. Its remaining gain comes from the spare
groups that complete during the step and start the next one. Carry was ahead at both G, but by
less than the steps' spread, so what settles the default is the argument above. Waiting bought
nothing in return: the lag was the same (0.25 mean), since the spare groups are trained one step
late either way.

DeltaController: ``Delta`` from the slope of the mean reward (OPPO). ChunkSizeTuner: the
chunk size for intra-step overlap, chosen online by timing real steps.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "Admit",
    "ChunkSizeTuner",
    "CloseStep",
    "DeltaController",
    "DeltaRule",
    "Phase",
    "Scheduler",
    "SeqTicket",
]

_STATE_FORMAT = 1
PARTIAL_GROUPS = ("carry", "wait")


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class SeqTicket:
    """One admitted sequence.

    uid: unique, increasing, never reused (also across checkpoint/resume).
    prompt_index: data-stream position of its prompt (the caller maps it to a prompt).
    start_version: step (= policy version) at which it was admitted; its first token's version.
    group: the uid of its group's first member (see "Groups" in the module docstring); the G
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


# --------------------------------------------------------------------------- helpers


def _check_int(name: str, value: Any, minimum: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__}); {fix}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}; {fix}")
    return value


def _check_reward(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(
            f"{what} must be a finite number, got {value!r}; check the reward computation "
            "(a NaN/inf mean reward usually means the policy or reward model diverged)"
        )
    return float(value)


def _state_mismatch(what: str, saved: Any, mine: Any) -> ValueError:
    return ValueError(
        f"checkpoint {what} is {saved!r} but this object was built with {mine!r}; construct it "
        "with the same settings as the run that wrote the checkpoint"
    )


# --------------------------------------------------------------------------- DeltaController


class DeltaRule(Protocol):
    """What the scheduler needs of an adaptive Delta: the value for the next step, its bound, an
    update with the mean reward of each trained step, and a checkpointable state."""

    delta_max: int

    @property
    def delta(self) -> int: ...

    def update(self, mean_reward: float) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, d: dict[str, Any]) -> None: ...


class DeltaController:
    """Adaptive Delta by the reward-slope rule of the OPPO paper (``overlap.delta_rule=reward_slope``).

    ``update(R_t)`` is called once per step with the step's mean reward. With the last
    ``window`` differences ``d_i = R_i - R_{i-1}``, the slope is ``s_t = mean(d)``;
    ``s_t > 0`` -> ``Delta + step``, otherwise (flat or falling) ``Delta - step``; the result is
    clipped to ``[delta_min, delta_max]``. ``step`` is 1, or with ``proportional=True``
    ``max(1, floor(Delta / 4))`` computed from the current Delta. Until ``window`` differences
    exist (the first ``window`` calls) Delta stays at ``delta_init``.
    """

    def __init__(
        self,
        delta_init: int = 0,
        delta_min: int = 0,
        delta_max: int = 8,
        window: int = 5,
        proportional: bool = False,
    ) -> None:
        _check_int("delta_min", delta_min, 0, "use 0 for 'no extra sequences'")
        _check_int("delta_max", delta_max, 0, "use a non-negative bound")
        _check_int("delta_init", delta_init, 0, "use a value in [delta_min, delta_max]")
        _check_int("window", window, 1, "use a window of at least 1 reward difference")
        if delta_min > delta_max:
            raise ValueError(
                f"delta_min ({delta_min}) > delta_max ({delta_max}); swap them or lower delta_min"
            )
        if not delta_min <= delta_init <= delta_max:
            raise ValueError(
                f"delta_init ({delta_init}) must lie in [delta_min, delta_max] = "
                f"[{delta_min}, {delta_max}]; change delta_init or the bounds"
            )
        self.delta_min = delta_min
        self.delta_max = delta_max
        self.delta_init = delta_init
        self.window = window
        self.proportional = bool(proportional)
        self._delta = delta_init
        self._rewards: list[float] = []  # the last window + 1 mean rewards
        self._slope: float | None = None

    @property
    def delta(self) -> int:
        return self._delta

    @property
    def slope(self) -> float | None:
        """Slope computed by the last ``update`` (None until ``window`` differences exist)."""
        return self._slope

    def update(self, mean_reward: float) -> int:
        """Feed one step's mean reward; return the Delta for the next step."""
        self._rewards.append(_check_reward(mean_reward, "mean_reward"))
        del self._rewards[: -(self.window + 1)]
        if len(self._rewards) < self.window + 1:
            return self._delta
        diffs = [b - a for a, b in zip(self._rewards, self._rewards[1:])]
        self._slope = sum(diffs) / self.window
        step = max(1, self._delta // 4) if self.proportional else 1
        new = self._delta + step if self._slope > 0 else self._delta - step
        self._delta = min(self.delta_max, max(self.delta_min, new))
        return self._delta

    def _config(self) -> dict[str, Any]:
        return {
            "delta_init": self.delta_init,
            "delta_min": self.delta_min,
            "delta_max": self.delta_max,
            "window": self.window,
            "proportional": self.proportional,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "config": self._config(),
            "delta": self._delta,
            "rewards": list(self._rewards),
            "slope": self._slope,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d["config"] != self._config():
            raise _state_mismatch("DeltaController config", d["config"], self._config())
        delta = _check_int("delta", d["delta"], 0, "the checkpoint is corrupt")
        if not self.delta_min <= delta <= self.delta_max:
            raise ValueError(f"checkpoint delta {delta} is outside [delta_min, delta_max]")
        self._delta = delta
        self._rewards = [_check_reward(r, "checkpoint reward") for r in d["rewards"]]
        self._slope = None if d["slope"] is None else float(d["slope"])


# --------------------------------------------------------------------------- Scheduler


class Scheduler:
    """Admission, step closing and staleness for inter-step overlap (see the module docstring).

    Args:
        batch_size: B, sequences per PPO step (>= 1; a multiple of ``group_size``).
        max_lag: the largest allowed ``train step - start_version`` (>= 0).
        delta: a fixed Delta (int >= 0) or a :class:`DeltaRule` (a :class:`DeltaController`, or
            ``tuner.TunedDelta``) that this scheduler reads at every ``begin_step`` and updates at
            every ``end_step``. Counted in *groups* (= sequences when
            ``group_size`` is 1).
        refill: continuous batching: replace finished sequences while the step is open.
        start_position: first data-stream position handed out (for a fresh run).
        group_size: G, sequences sampled per prompt and admitted, closed, carried, drained
            and trained together (GRPO/RLOO); 1 (the default) is plain PPO.
        partial_groups: what a closing step does with a group some of whose members finished
            and some still run: ``"carry"`` it whole into the next step (the default), or
            ``"wait"`` for its running members before closing (groups with no finished member
            are carried either way). See "Groups" in the module docstring; not part of the
            checkpointed config, so a resume may change it.
    """

    def __init__(
        self,
        batch_size: int,
        max_lag: int,
        delta: int | DeltaRule,
        refill: bool = False,
        start_position: int = 0,
        group_size: int = 1,
        partial_groups: str = "carry",
    ) -> None:
        _check_int("batch_size", batch_size, 1, "a PPO step needs at least one sequence")
        _check_int("max_lag", max_lag, 0, "use 0 for fully on-policy training")
        _check_int("start_position", start_position, 0, "data positions start at 0")
        _check_int("group_size", group_size, 1, "use 1 for one sequence per prompt")
        if partial_groups not in PARTIAL_GROUPS:
            raise ValueError(f"partial_groups must be one of {', '.join(PARTIAL_GROUPS)}, got {partial_groups!r}")
        if batch_size % group_size:
            raise ValueError(
                f"batch_size ({batch_size}) must be a multiple of group_size ({group_size}): a "
                "step trains whole groups only; change batch_size or group_size"
            )
        n_groups = batch_size // group_size
        self._controller: DeltaRule | None
        if isinstance(delta, int):  # (a bool is refused here)
            _check_int("delta", delta, 0, "use 0 for no extra sequences in flight")
            self._controller = None
            self._fixed_delta = delta
            delta_bound, delta_name = delta, "delta"
        else:
            self._controller = delta
            self._fixed_delta = 0
            delta_bound, delta_name = delta.delta_max, f"{type(delta).__name__}.delta_max"
        # Why Delta <= B. At most B + Delta sequences are admitted-but-untrained when a step
        # closes (with refill: at most 2B, the refill cap), and the step trains B of them, so
        # at most Delta <= B (with refill: B) are carried into the next step. Sequences admitted in step k have lag
        # 0 < max_lag, so only carried ones can be due: at most B due sequences, and a batch of
        # exactly B can always hold them all. With Delta > B, e.g. B=2, Delta=5, max_lag=1,
        # two short sequences close step 0, five are carried and all five are due at step 1:
        # no batch of 2 could take them without exceeding max_lag.
        # With groups the same argument runs in groups: Delta <= B / G.
        if delta_bound > n_groups and group_size == 1:
            raise ValueError(
                f"{delta_name} ({delta_bound}) must be <= batch_size ({batch_size}): more carried "
                "sequences than B could come due together and not fit one batch; lower "
                f"{delta_name} or raise batch_size"
            )
        if delta_bound > n_groups:
            raise ValueError(
                f"{delta_name} ({delta_bound}) must be <= batch_size / group_size ({n_groups}): "
                "Delta counts extra groups, and more carried groups than a batch holds could come "
                f"due together and not fit one batch; lower {delta_name} or raise batch_size"
            )
        if max_lag == 0 and delta_bound != 0:
            raise ValueError(
                f"max_lag=0 forbids carrying any sequence into the next step, but {delta_name}="
                f"{delta_bound} keeps extra sequences in flight that would be carried; set "
                f"{delta_name}=0 or max_lag >= 1"
            )
        if refill and max_lag == 0:
            raise ValueError(
                "refill=True admits replacements mid-step that must be carried into a later "
                "step, which max_lag=0 forbids; set refill=False or max_lag >= 1"
            )
        self.batch_size = batch_size
        self.max_lag = max_lag
        self.refill = bool(refill)
        self.start_position = start_position
        self.group_size = group_size
        self.groups_per_step = n_groups
        self.partial_groups = partial_groups

        self._step = 0
        self._phase = Phase.IDLE
        self._next_uid = 0
        self._next_position = start_position
        self._requeue: list[int] = []  # one data position per drained group
        self._tickets: dict[int, SeqTicket] = {}  # admitted, not trained (admission order)
        self._running: dict[int, None] = {}  # ordered set: still decoding
        self._pool: dict[int, int] = {}  # finished, not trained: uid -> finish order
        self._groups: dict[int, tuple[int, ...]] = {}  # untrained groups: group -> member uids
        self._unfinished: dict[int, int] = {}  # untrained group -> members still running
        self._complete: dict[int, int] = {}  # every member finished: group -> completion order
        self._finish_counter = 0

    # ----------------------------------------------------------------- queries

    @property
    def step(self) -> int:
        """Index of the current (or next, when IDLE) step."""
        return self._step

    @property
    def version(self) -> int:
        """Policy version sampling new tokens now; one update per step, so equal to ``step``."""
        return self._step

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def delta(self) -> int:
        """Delta in force for the current/next step."""
        return self._controller.delta if self._controller is not None else self._fixed_delta

    @property
    def controller(self) -> DeltaRule | None:
        return self._controller

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Uids still decoding, in admission order."""
        return tuple(self._running)

    @property
    def finished_pool(self) -> tuple[int, ...]:
        """Finished, untrained uids in batch-priority order (start_version, finish order)."""
        return tuple(sorted(self._pool, key=self._priority))

    @property
    def untrained(self) -> int:
        """Admitted-but-untrained count: ``len(in_flight) + len(finished_pool)``."""
        return len(self._tickets)

    @property
    def untrained_groups(self) -> int:
        """Admitted-but-untrained groups (``untrained / group_size``)."""
        return len(self._groups)

    @property
    def waiting_members(self) -> int:
        """Finished members of groups that still have a running member: scored sequences that
        wait for a sibling (0 with ``group_size`` 1, and at a close under ``partial_groups="wait"``)."""
        return sum(1 for u in self._pool if self._unfinished[self._tickets[u].group] > 0)

    @property
    def complete_groups(self) -> tuple[int, ...]:
        """Untrained groups whose members have all finished, in batch-priority order
        (start_version, completion order)."""
        return tuple(sorted(self._complete, key=self._group_priority))

    def members(self, group: int) -> tuple[int, ...]:
        """Member uids of an untrained group, in uid order (KeyError otherwise)."""
        return self._groups[group]

    @property
    def due(self) -> tuple[int, ...]:
        """Untrained uids that must be in this step's batch: ``step - start_version >= max_lag``."""
        return tuple(u for u, t in self._tickets.items() if self._is_due(t))

    @property
    def waiting_on(self) -> tuple[int, ...]:
        """Due uids still running: the step cannot close before they finish."""
        return tuple(u for u in self._running if self._is_due(self._tickets[u]))

    @property
    def position(self) -> int:
        """Next fresh data-stream position."""
        return self._next_position

    @property
    def requeue(self) -> tuple[int, ...]:
        """Drained prompt positions waiting to be admitted again (first in line)."""
        return tuple(self._requeue)

    def ticket(self, uid: int) -> SeqTicket:
        """The ticket of an admitted, untrained sequence (KeyError otherwise)."""
        return self._tickets[uid]

    def lag(self, uid: int) -> int:
        """Lag the sequence would have if trained now: ``step - start_version``."""
        return self._step - self._tickets[uid].start_version

    # ----------------------------------------------------------------- events

    def begin_step(self) -> Admit:
        """Open step ``step``; admit prompts until ``B + Delta`` are admitted-but-untrained.

        Requeued positions (from a checkpoint drain) come first. With ``refill=True`` the
        engine is also filled to ``B + Delta`` running, within the ``2B`` untrained cap.
        """
        self._require(Phase.IDLE, "begin_step")
        self._phase = Phase.OPEN
        return Admit(self._fill())

    def on_finished(self, uid: int) -> Admit | None:
        """Sequence ``uid`` produced its last token (EOS or length limit).

        Returns the replacement admissions (``refill=True``, step OPEN), else None.
        Raises ValueError if ``uid`` is not running (unknown, finished, trained or drained).
        The group of ``uid`` becomes complete when its last member finishes.
        """
        if uid not in self._running:
            raise ValueError(
                f"uid {uid} is not in flight (never admitted, already finished, trained or "
                "drained for a checkpoint); the engine must abort drained sequences"
            )
        del self._running[uid]
        self._pool[uid] = self._finish_counter
        group = self._tickets[uid].group
        self._unfinished[group] -= 1
        if self._unfinished[group] == 0:
            self._complete[group] = self._finish_counter
        self._finish_counter += 1
        if self.refill and self._phase is Phase.OPEN:
            seqs = self._fill()
            return Admit(seqs) if seqs else None
        return None

    def try_close(self) -> CloseStep | None:
        """The step's batch, once B / G groups are complete and no due one is still running.

        Call it after every batch of ``on_finished`` events (sequences that finish in the same
        instant are all reported before this call, so the oldest are chosen). Returns None
        while the step must wait; on success the phase becomes UPDATING.
        """
        self._require(Phase.OPEN, "try_close")
        if len(self._complete) < self.groups_per_step:
            return None
        if any(self._is_due(self._tickets[u]) for u in self._running):
            return None
        if self.partial_groups == "wait" and any(
            self._unfinished[self._tickets[u].group] < self.group_size for u in self._running
        ):  # a running member of a partly finished group: wait for it
            return None
        chosen = sorted(self._complete, key=self._group_priority)[: self.groups_per_step]
        picked = set(chosen)  # a set: the planner simulates B in the thousands
        left_due = [g for g in self._complete if g not in picked and self._is_due(self._tickets[g])]
        if left_due:  # impossible while Delta <= B / G and the 2B refill cap hold
            raise RuntimeError(f"internal error: due groups {left_due} do not fit the batch")
        batch = tuple(u for g in chosen for u in self._groups[g])
        versions = tuple(self._tickets[u].start_version for u in batch)
        for g in chosen:
            for u in self._groups.pop(g):
                del self._pool[u]
                del self._tickets[u]
            del self._unfinished[g]
            del self._complete[g]
        self._phase = Phase.UPDATING
        return CloseStep(step=self._step, uids=batch, start_versions=versions, group_size=self.group_size)

    def end_step(self, mean_reward: float) -> None:
        """The PPO update of this step is done: version += 1 and Delta is updated.

        ``mean_reward`` is the mean reward of the batch just trained (used by a
        DeltaController; ignored with a fixed Delta).
        """
        self._require(Phase.UPDATING, "end_step")
        if self._controller is not None:
            self._controller.update(mean_reward)
        self._step += 1
        self._phase = Phase.IDLE

    def suspend(self) -> None:
        """Back from OPEN to IDLE without closing: the step's admitted sequences stay in flight,
        untrained, as carried ones do after ``end_step`` (a pipeline run begins the next step while
        the learner trains; a checkpoint between steps needs IDLE)."""
        self._require(Phase.OPEN, "suspend")
        self._phase = Phase.IDLE

    # ----------------------------------------------------------------- checkpoints

    def drain_for_checkpoint(self) -> list[SeqTicket]:
        """Forget all admitted-but-untrained sequences and requeue their prompt positions.

        Call between steps (IDLE), before ``state_dict()``. Returns the drained tickets in
        admission order; the caller must abort them in the engine (their partial or complete
        generations are discarded; the prompts are regenerated under new uids, first in line
        at the next ``begin_step``). Whole groups only: each drained group's position is
        requeued once and comes back as a whole new group of G.
        """
        self._require(Phase.IDLE, "drain_for_checkpoint")
        drained = list(self._tickets.values())
        self._requeue.extend(self._tickets[g].prompt_index for g in self._groups)
        self._tickets.clear()
        self._running.clear()
        self._pool.clear()
        self._groups.clear()
        self._unfinished.clear()
        self._complete.clear()
        return drained

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (IDLE only): the untrained tickets with what is needed to
        restore them as they are (``load_state_dict(keep_untrained=True)``), or to requeue them."""
        self._require(Phase.IDLE, "state_dict")
        return {
            "format": _STATE_FORMAT,
            "config": self._config(),
            "step": self._step,
            "next_uid": self._next_uid,
            "next_position": self._next_position,
            "requeue": list(self._requeue),
            # [uid, prompt_index, start_version, group], admission order (empty after a drain)
            "untrained": [[t.uid, t.prompt_index, t.start_version, t.group] for t in self._tickets.values()],
            # the finished ones: uid -> finish order; complete groups -> completion order
            "finished": [[u, order] for u, order in self._pool.items()],
            "complete": [[g, order] for g, order in self._complete.items()],
            "finish_counter": self._finish_counter,
            "delta_controller": None if self._controller is None else self._controller.state_dict(),
        }

    def load_state_dict(self, d: dict[str, Any], keep_untrained: bool = False) -> None:
        """Restore ``state_dict()`` output into a fresh scheduler built with the same settings.

        ``start_position`` is taken from the checkpoint. Sequences that were untrained when the
        state was saved (no drain) are restored as they were (running or finished, same uids,
        start versions and finish order) with ``keep_untrained=True``: the caller then re-admits
        the running ones with their partial work (``control.stages.Run.restore_in_flight``).
        Otherwise, or when the state predates finish orders, they are put on the requeue, after
        the saved requeue, one position per group. A checkpoint without ``group_size`` (older)
        has group size 1.
        """
        self._require(Phase.IDLE, "load_state_dict")
        if self._tickets or self._step or self._next_uid:
            raise RuntimeError("load_state_dict needs a freshly constructed Scheduler")
        if d.get("format") != _STATE_FORMAT:
            raise ValueError(f"unknown scheduler state format {d.get('format')!r}")
        saved = dict(d["config"])
        saved.setdefault("group_size", 1)  # written before groups existed
        mine = self._config()
        saved_start = saved.pop("start_position")
        mine.pop("start_position")
        if saved != mine:
            raise _state_mismatch("Scheduler config", saved, mine)
        if (d["delta_controller"] is None) != (self._controller is None):
            raise _state_mismatch("delta kind", saved["delta"], mine["delta"])
        if self._controller is not None:
            self._controller.load_state_dict(d["delta_controller"])
        self.start_position = saved_start
        self._step = _check_int("step", d["step"], 0, "the checkpoint is corrupt")
        self._next_uid = _check_int("next_uid", d["next_uid"], 0, "the checkpoint is corrupt")
        self._next_position = _check_int(
            "next_position", d["next_position"], saved_start, "the checkpoint is corrupt"
        )
        untrained = sorted(d["untrained"], key=lambda row: row[0])
        G = self.group_size
        groups = [untrained[i : i + G] for i in range(0, len(untrained), G)]
        for rows in groups:  # whole groups: G consecutive uids, one position and version
            if len(rows) != G or any(
                (r[0] - rows[0][0], r[1], r[2]) != (i, rows[0][1], rows[0][2]) for i, r in enumerate(rows)
            ):
                raise ValueError(
                    f"checkpoint untrained sequences {rows} are not a whole group of {G}; the "
                    "checkpoint is corrupt or was written with another group_size"
                )
        self._requeue = [int(p) for p in d["requeue"]]
        if not (keep_untrained and "finished" in d):
            self._requeue += [int(rows[0][1]) for rows in groups]
            return
        finished = {int(u): int(order) for u, order in d["finished"]}
        complete = {int(g): int(order) for g, order in d["complete"]}
        for rows in groups:
            group = int(rows[0][0])
            members = tuple(int(r[0]) for r in rows)
            for uid, position, version, *_ in rows:
                self._tickets[uid] = SeqTicket(uid=int(uid), prompt_index=int(position),
                                               start_version=int(version), group=group)
                if uid not in finished:
                    self._running[uid] = None
            self._groups[group] = members
            self._unfinished[group] = sum(u not in finished for u in members)
            if (self._unfinished[group] == 0) != (group in complete):
                raise ValueError(f"checkpoint group {group}: its finished members and completion disagree; "
                                 "the checkpoint is corrupt")
        if not finished.keys() <= self._tickets.keys():
            raise ValueError("checkpoint finished sequences are not all untrained; the checkpoint is corrupt")
        self._pool = dict(sorted(finished.items(), key=lambda kv: kv[1]))
        self._complete = dict(sorted(complete.items(), key=lambda kv: kv[1]))
        self._finish_counter = _check_int("finish_counter", d["finish_counter"], 0, "the checkpoint is corrupt")

    # ----------------------------------------------------------------- internals

    def _config(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "max_lag": self.max_lag,
            "refill": self.refill,
            "delta": "adaptive" if self._controller is not None else self._fixed_delta,
            "start_position": self.start_position,
            "group_size": self.group_size,
        }

    def _require(self, phase: Phase, call: str) -> None:
        if self._phase is not phase:
            order = "begin_step -> (on_finished)* -> try_close -> end_step"
            raise RuntimeError(
                f"{call}() needs phase {phase.value!r} but the scheduler is "
                f"{self._phase.value!r} at step {self._step}; the cycle is {order}"
            )

    def _is_due(self, t: SeqTicket) -> bool:
        return self._step - t.start_version >= self.max_lag

    def _priority(self, uid: int) -> tuple[int, int]:
        return (self._tickets[uid].start_version, self._pool[uid])

    def _group_priority(self, group: int) -> tuple[int, int]:
        return (self._tickets[group].start_version, self._complete[group])

    def _wants_one_more(self) -> bool:
        """Room for one more whole group? (With G = 1: one more sequence.)"""
        G, n = self.group_size, self.groups_per_step
        target = n + self.delta  # groups
        if self.refill:
            # keep (B/G + Delta) groups' worth of sequences running, but never more than 2B/G
            # groups untrained (keeps carried <= B/G groups)
            return len(self._running) + G <= target * G and len(self._groups) < 2 * n
        return len(self._groups) < target

    def _fill(self) -> tuple[SeqTicket, ...]:
        out = []
        while self._wants_one_more():
            if self._requeue:
                position = self._requeue.pop(0)
            else:
                position = self._next_position
                self._next_position += 1
            group = self._next_uid
            for uid in range(group, group + self.group_size):
                t = SeqTicket(uid=uid, prompt_index=position, start_version=self._step, group=group)
                self._tickets[uid] = t
                self._running[uid] = None
                out.append(t)
            self._next_uid += self.group_size
            self._groups[group] = tuple(range(group, group + self.group_size))
            self._unfinished[group] = self.group_size
        return tuple(out)


# --------------------------------------------------------------------------- ChunkSizeTuner


class ChunkSizeTuner:
    """Online choice of the streaming chunk size (tokens per chunk) for intra-step overlap.

    Cycle: a *tuning round* runs each candidate, in the given order, for ``trial_steps`` real
    steps, then keeps the candidate with the lowest median step time (ties: the earlier
    candidate); that ``best`` is used for ``retune_every`` steps, then a new round starts (the
    OPPO paper re-tries candidates about every 50 steps, since response lengths drift). One
    cycle is therefore ``len(candidates) * trial_steps + retune_every`` steps.
    ``retune_every=None`` tunes once. ``fixed=N`` always returns N and never tunes.

    Warm-up: when ``trial_steps >= 2`` the first step of each trial is recorded in ``history``
    but left out of the median, because it still carries work shaped by the previous chunk
    size (sequences carried across the step boundary were partly scored in the old chunking)
    and pays one-off costs of new shapes (allocator growth, kernel selection). With
    ``trial_steps == 1`` the single step is used as is.

    Use: ``size = tuner.current()`` before a step, ``tuner.record(seconds)`` after it.
    """

    def __init__(
        self,
        candidates: Sequence[int] = (8, 16, 32, 64),
        trial_steps: int = 2,
        retune_every: int | None = 50,
        fixed: int | None = None,
    ) -> None:
        cands = tuple(candidates)
        if not cands:
            raise ValueError("candidates is empty; give at least one chunk size (or fixed=N)")
        for c in cands:
            _check_int("chunk size candidate", c, 1, "chunk sizes are positive token counts")
        if len(set(cands)) != len(cands):
            raise ValueError(f"candidates {cands} contain duplicates; list each size once")
        _check_int("trial_steps", trial_steps, 1, "each candidate needs at least one step")
        if retune_every is not None:
            _check_int("retune_every", retune_every, 1, "or None to tune only once")
        if fixed is not None:
            _check_int("fixed", fixed, 1, "or None to tune online")
        self.candidates = cands
        self.trial_steps = trial_steps
        self.retune_every = retune_every
        self.fixed = fixed
        self.history: list[tuple[int, float]] = []  # (chunk size used, step time) per step
        self._best: int | None = fixed
        self._tuning = fixed is None
        self._trial = 0  # index into candidates during a round
        self._round: list[list[float]] = [[] for _ in cands]  # times of the current round
        self._medians: dict[int, float] = {}  # of the last completed round
        self._since_tuned = 0
        self._rounds = 0

    @property
    def best(self) -> int | None:
        """The chunk size chosen by the last completed round (``fixed`` if set; None before)."""
        return self._best

    @property
    def tuning(self) -> bool:
        return self._tuning

    @property
    def rounds(self) -> int:
        """Completed tuning rounds."""
        return self._rounds

    @property
    def medians(self) -> dict[int, float]:
        """Median step time per candidate in the last completed round (for logging)."""
        return dict(self._medians)

    def current(self) -> int:
        """Chunk size to use for the next step."""
        if self.fixed is not None:
            return self.fixed
        if self._tuning:
            return self.candidates[self._trial]
        assert self._best is not None
        return self._best

    def record(self, step_time_s: float) -> None:
        """Report the wall-clock time of the step that used ``current()``."""
        if (
            isinstance(step_time_s, bool)
            or not isinstance(step_time_s, (int, float))
            or not math.isfinite(step_time_s)
            or step_time_s < 0
        ):
            raise ValueError(f"step_time_s must be a finite number >= 0, got {step_time_s!r}")
        t = float(step_time_s)
        self.history.append((self.current(), t))
        if self.fixed is not None:
            return
        if not self._tuning:
            self._since_tuned += 1
            if self.retune_every is not None and self._since_tuned >= self.retune_every:
                self._tuning, self._trial = True, 0
                self._round = [[] for _ in self.candidates]
            return
        times = self._round[self._trial]
        times.append(t)
        if len(times) < self.trial_steps:
            return
        self._trial += 1
        if self._trial < len(self.candidates):
            return
        warm = 1 if self.trial_steps >= 2 else 0
        self._medians = {
            c: statistics.median(ts[warm:]) for c, ts in zip(self.candidates, self._round)
        }
        self._best = min(self.candidates, key=lambda c: self._medians[c])  # first on ties
        self._tuning, self._trial, self._since_tuned = False, 0, 0
        self._rounds += 1

    def _config(self) -> dict[str, Any]:
        return {
            "candidates": list(self.candidates),
            "trial_steps": self.trial_steps,
            "retune_every": self.retune_every,
            "fixed": self.fixed,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "config": self._config(),
            "history": [[c, t] for c, t in self.history],
            "best": self._best,
            "tuning": self._tuning,
            "trial": self._trial,
            "round": [list(ts) for ts in self._round],
            "medians": [[c, m] for c, m in self._medians.items()],
            "since_tuned": self._since_tuned,
            "rounds": self._rounds,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d["config"] != self._config():
            raise _state_mismatch("ChunkSizeTuner config", d["config"], self._config())
        self.history = [(int(c), float(t)) for c, t in d["history"]]
        self._best = None if d["best"] is None else int(d["best"])
        self._tuning = bool(d["tuning"])
        self._trial = int(d["trial"])
        self._round = [[float(t) for t in ts] for ts in d["round"]]
        self._medians = {int(c): float(m) for c, m in d["medians"]}
        self._since_tuned = int(d["since_tuned"])
        self._rounds = int(d["rounds"])
