"""The inter-step overlap's state machine: which prompts to admit, when a step closes, which
sequences it trains, what is carried.

Phases (a call in the wrong phase raises ``RuntimeError``)::

    IDLE --begin_step()--> OPEN --try_close() gives a CloseStep--> UPDATING --end_step(r)--> IDLE

``begin_step`` tops the admitted-but-untrained sequences up to B + Delta (groups of G count as
one). A step closes once B sequences (B / G whole groups) are finished and no *due* one (one more
carry would push its lag past ``max_lag``) still runs; the batch is the finished ones with the
smallest (start_version, finish order), so every trained sequence has ``0 <= lag <= max_lag``.
Incomplete groups are carried whole. ``docs/scheduler.md`` has the rules in full (refill, data
positions, checkpoints, groups) and the reasons for them.
"""

from __future__ import annotations

from typing import Any

from .delta import DeltaController, DeltaRule
from .records import PARTIAL_GROUPS, STATE_FORMAT, Admit, CloseStep, Phase, SeqTicket, check_int, state_mismatch


class Scheduler:
    """Admission, step closing and staleness for inter-step overlap (module docstring;
    ``docs/scheduler.md``).

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
            are carried either way). See "Groups" in ``docs/scheduler.md``; not part of the
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
        check_int("batch_size", batch_size, 1, "a PPO step needs at least one sequence")
        check_int("max_lag", max_lag, 0, "use 0 for fully on-policy training")
        check_int("start_position", start_position, 0, "data positions start at 0")
        check_int("group_size", group_size, 1, "use 1 for one sequence per prompt")
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
            check_int("delta", delta, 0, "use 0 for no extra sequences in flight")
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
        backend is also filled to ``B + Delta`` running, within the ``2B`` untrained cap.
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
                "drained for a checkpoint); the rollout backend must abort drained sequences"
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
            self._controller.after_step(mean_reward)
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
        admission order; the caller must abort them in the rollout backend (their partial or complete
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
            "format": STATE_FORMAT,
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
        the running ones with their partial work (``control.stages.Loop.restore_in_flight``).
        Otherwise, or when the state predates finish orders, they are put on the requeue, after
        the saved requeue, one position per group. A checkpoint without ``group_size`` (older)
        has group size 1.
        """
        self._require(Phase.IDLE, "load_state_dict")
        if self._tickets or self._step or self._next_uid:
            raise RuntimeError("load_state_dict needs a freshly constructed Scheduler")
        check_state_format(d)
        saved = dict(d["config"])
        saved.setdefault("group_size", 1)  # written before groups existed
        mine = self._config()
        saved_start = saved.pop("start_position")
        mine.pop("start_position")
        if saved != mine:
            raise state_mismatch("Scheduler config", saved, mine)
        if (d["delta_controller"] is None) != (self._controller is None):
            raise state_mismatch("delta kind", saved["delta"], mine["delta"])
        if self._controller is not None:
            self._controller.load_state_dict(d["delta_controller"])
        self.start_position = saved_start
        self._step = check_int("step", d["step"], 0, "the checkpoint is corrupt")
        self._next_uid = check_int("next_uid", d["next_uid"], 0, "the checkpoint is corrupt")
        self._next_position = check_int(
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
        self._finish_counter = check_int("finish_counter", d["finish_counter"], 0, "the checkpoint is corrupt")

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


def check_state_format(d: dict[str, Any]) -> None:
    """Raise :class:`~oppo.checkpoint.formats.FormatError`, with what to do, unless
    :meth:`Scheduler.load_state_dict` reads ``d``'s format: a resume checks it before any model
    loads (``run.resume``), and the scheduler again as it loads."""
    from ..checkpoint.formats import upgraded

    version = d.get("format")
    upgraded("the checkpoint's scheduler state", {}, version if isinstance(version, int) else 0, STATE_FORMAT, {})
