"""A discrete-event simulation of oppo's PPO steps, per mode and placement.

It replays what ``control.sequential_step`` and ``control.overlapped_step`` do, with every stage's
duration taken from a cost model (``costs.py``) instead of a clock, and lets oppo's own pure
scheduler (``oppo.scheduler``) decide admission and closing, so the simulated steps follow the
runtime's rules rather than a copy of them. A :class:`DeviceSplit` says which devices do what; each
step yields its time, every device's and lane's busy seconds and ``oppo.trace.Span`` records.
What each stage models and what is left out: ``docs/planner.md``, "What the simulation models".
"""

from __future__ import annotations

import heapq
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Protocol, Sequence

import numpy as np

from .. import modes as _modes
from ..scheduler import DeltaController, Scheduler, SeqTicket
from ..trace import Span
from .costs import CostModel, Work

# every mode's behaviour is read from the one table (oppo.modes); pipeline is left out of the
# default comparison on purpose (the OPPO paper compares four modes; pipeline is simulated on request)
MODES = tuple(m.name for m in _modes.TABLE if not m.in_flight)
"""The modes compared by default (projections, calibration): the OPPO paper's four."""
ALL_MODES = _modes.NAMES
STREAMING = tuple(m.name for m in _modes.TABLE if m.streams)
CARRYING = tuple(m.name for m in _modes.TABLE if m.carries)
IN_FLIGHT = tuple(m.name for m in _modes.TABLE if m.in_flight)


class Lengths(Protocol):
    """A response's length in tokens (EOS included): prompt position, place in its group."""

    def __call__(self, index: int, member: int = 0) -> int: ...


@dataclass(frozen=True)
class Workload:
    """What is trained: batch size, lengths, and the overlap and PPO settings that set the schedule.

    ``lengths(prompt_index)`` gives a response's length in tokens (EOS included); with groups
    (``group_size`` G > 1) ``lengths(prompt_index, member)`` gives each of the G answers' own.
    ``chunk`` and ``delta`` may be one value or one per step (the last repeats), e.g. a measured
    run's ``overlap/chunk_size`` per step. ``delta`` counts groups, as ``overlap.delta`` does.
    """

    batch: int
    lengths: Lengths
    prompt_tokens: int = 11
    prompt_pad: int | None = None  # width of the left-padded prompts in a one-shot batch (default: prompt_tokens)
    delta: int | Sequence[int] = 8
    max_lag: int = 1
    chunk: int | Sequence[int] = 16
    minibatch: int = 16
    micro: int = 8
    epochs: int = 1
    seed: int = 0
    group_size: int = 1  # G (GRPO/RLOO): lengths(prompt_index, member) then gives each member's length
    refill: bool = False  # overlap.refill: admit a replacement as soon as a sequence finishes
    partial_groups: str = "carry"  # overlap.partial_groups: "carry" or "wait" (see oppo.scheduler)

    def chunk_at(self, step: int) -> int:
        return _at(self.chunk, step)

    def delta_at(self, step: int) -> int:
        return _at(self.delta, step)

    @property
    def pad(self) -> int:
        return self.prompt_pad if self.prompt_pad is not None else self.prompt_tokens


def _at(v, step: int) -> int:
    if isinstance(v, (int, np.integer)):
        return int(v)
    v = list(v)
    return int(v[min(step, len(v) - 1)])


@dataclass(frozen=True)
class DeviceSplit:
    """Which devices run what.

    actor_devices: devices that decode (data-parallel, each its own rows) and train the actor.
    scorer_devices: devices that hold ``scorer_roles``; 0 = those models share the actor devices
        and run in turn with everything else (oppo's controller on CPU in sequential/inter).
    scorer_roles: models scored on the scorer devices; streamed chunk by chunk in intra/oppo.
    actor_roles: models run one-shot on the actor devices after each close in every mode (e.g.
        the reference and a value-head forward in the paper's TRL setup).
    critic: where the critic's update runs: ``"scorer"`` (beside the actor's, on the scorer
        devices), ``"actor"`` (after the actor's, on the actor devices) or ``"value_head"`` (part
        of the actor's update: no separate critic).
    """

    actor_devices: int = 1
    scorer_devices: int = 1
    scorer_roles: tuple[str, ...] = ("reward", "reference", "critic")
    actor_roles: tuple[str, ...] = ()
    critic: str = "scorer"

    def __post_init__(self) -> None:
        if self.actor_devices < 1 or self.scorer_devices < 0:
            raise ValueError(f"a placement needs >= 1 actor device and >= 0 scorer devices; got {self}")
        if self.critic not in ("scorer", "actor", "value_head"):
            raise ValueError(f"critic must be 'scorer', 'actor' or 'value_head', not {self.critic!r}")

    @property
    def shared(self) -> bool:
        return self.scorer_devices == 0

    @property
    def devices(self) -> int:
        return self.actor_devices + self.scorer_devices

    def label(self) -> str:
        return f"{self.actor_devices}" if self.shared else f"{self.actor_devices}+{self.scorer_devices}"


@dataclass
class SimulatedStep:
    step: int
    start: float
    end: float
    close: float  # when the batch was complete (decoding stopped)
    lengths: list[int]  # the trained batch's response lengths
    lags: list[int]
    offpolicy_tokens: int
    tokens: int
    carried: int
    device_busy: dict[str, float]
    lane_busy: dict[str, float]  # per trace lane (actor, scorer, learner): one device of each group
    full: float = 0.0  # when B sequences were first finished (before the close: waiting for due ones)

    @property
    def time(self) -> float:
        return self.end - self.start


@dataclass
class RunResult:
    mode: str
    placement: DeviceSplit
    steps: list[SimulatedStep]
    spans: list[Span]
    warmup: int = 1

    @property
    def timed(self) -> list[SimulatedStep]:
        return self.steps[self.warmup:] or self.steps

    @property
    def step_time_median(self) -> float:
        return statistics.median(s.time for s in self.timed)

    @property
    def step_time_mean(self) -> float:
        return statistics.mean(s.time for s in self.timed)

    def busy_fraction(self, by: str = "device") -> dict[str, float]:
        """Busy seconds over wall seconds of the timed steps, per device (``by="device"``) or per
        trace lane (``by="lane"``; any other value, such as the older ``"worker"``, means lanes too)."""
        total = sum(s.time for s in self.timed)
        keys = sorted({k for s in self.timed for k in (s.device_busy if by == "device" else s.lane_busy)})
        return {k: sum((s.device_busy if by == "device" else s.lane_busy).get(k, 0.0) for s in self.timed) / total
                for k in keys}

    def utilization(self) -> dict[str, float]:
        """Mean busy fraction of the actor devices, of the scorer devices, and of all devices."""
        bf = self.busy_fraction("device")
        a = [v for k, v in bf.items() if k.startswith("actor")]
        s = [v for k, v in bf.items() if k.startswith("scorer")]
        out = {"actor_devices": statistics.mean(a) if a else 0.0}
        if s:
            out["scorer_devices"] = statistics.mean(s)
        out["all_devices"] = statistics.mean(a + s)
        return out

    def tokens_per_s(self) -> float:
        return sum(s.tokens for s in self.timed) / sum(s.time for s in self.timed)


# --------------------------------------------------------------------------- internals


@dataclass
class _Row:
    uid: int
    index: int
    length: int
    version: int
    device: int
    done: int = 0  # tokens sampled so far
    emitted: int = 0  # tokens handed to the scorers
    prior: int = 0  # tokens sampled before the current step
    finished: bool = False


class _DeltaSchedule(DeltaController):
    """Delta per step from a list (e.g. a measured run's ``overlap/delta``) instead of the reward slope."""

    def __init__(self, values: Sequence[int]):
        values = [int(v) for v in values]
        super().__init__(values[0], min(values), max(values), 1)
        self._values, self._k = values, 0

    def after_step(self, mean_reward: float) -> int:
        self._k += 1
        self._delta = self._values[min(self._k, len(self._values) - 1)]
        return self._delta


class _Device:
    """One device (or one CPU thread): does one thing at a time."""

    def __init__(self, name: str):
        self.name = name
        self.free = 0.0

    def run(self, sim: "_Sim", ready: float, seconds: float, lane: str, stage: str, step: int,
            works: Sequence[Work] = ()) -> float:
        start = max(ready, self.free)
        self.free = start + max(0.0, seconds)
        sim.record(self, lane, stage, step, start, self.free, works)
        return self.free


def _group_run(sim: "_Sim", devs: list[_Device], ready: float, seconds: float, lane: str, stage: str,
               step: int, works: Sequence[Work] = ()) -> float:
    """A data-parallel piece of work on every device of a group, starting together."""
    start = max([ready] + [d.free for d in devs])
    for d in devs:
        d.free = start
        d.run(sim, start, seconds, lane, stage, step, works)
    return start + max(0.0, seconds)


def _split(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


class _Sim:
    def __init__(self, mode: str, wl: Workload, costs: CostModel, pl: DeviceSplit, fine: bool, steps: int):
        if mode not in ALL_MODES:
            raise ValueError(f"unknown mode {mode!r}; one of {', '.join(ALL_MODES)}")
        self.mode, self.wl, self.costs, self.pl, self.fine, self.steps = mode, wl, costs, pl, fine, steps
        m = _modes.get(mode)
        self.streams, self.carries, self.in_flight = m.streams, m.carries, m.in_flight
        lag = wl.max_lag if self.carries else 0
        if self.carries and lag < 1:
            raise ValueError(f"{mode} carries sequences: max_lag must be >= 1 (got {lag})")
        delta = (wl.delta if isinstance(wl.delta, (int, np.integer)) else _DeltaSchedule(wl.delta)) if self.carries else 0
        self.sched = Scheduler(wl.batch, lag, int(delta) if isinstance(delta, (int, np.integer)) else delta,
                               refill=wl.refill and self.carries, group_size=wl.group_size,
                               partial_groups=wl.partial_groups)
        self.actors = [_Device(f"actor{i}") for i in range(pl.actor_devices)]
        self.scorers = self.actors if pl.shared else [_Device(f"scorer{i}") for i in range(pl.scorer_devices)]
        # pipeline: the update runs beside decoding (oppo's learner thread; PipelineRL's trainer
        # GPUs), modelled as devices of its own that do not slow the actor's decoding
        self.learners = [_Device(f"learner{i}") for i in range(pl.actor_devices)] if self.in_flight else self.actors
        self.rows: dict[int, _Row] = {}
        self.clock = 0.0
        self.log_start = 0
        self.next_begun = False  # pipeline: the next step's prompts were admitted while the learner trained
        self.stage_log: list[tuple[str, str, str, int, float, float, tuple[Work, ...]]] = []

    def record(self, dev: _Device, lane: str, stage: str, step: int, start: float, end: float,
               works: Sequence[Work]) -> None:
        if end > start or works:
            self.stage_log.append((dev.name, lane, stage, step, start, end, tuple(works)))

    def _length(self, t) -> int:
        if self.wl.group_size > 1:  # each member of a group draws its own length, as oppo bench forces them
            return max(1, int(self.wl.lengths(t.prompt_index, t.uid - t.group)))
        return max(1, int(self.wl.lengths(t.prompt_index)))

    # ---------------------------------------------------------------- one step

    def step(self, k: int) -> SimulatedStep:
        t0 = self.clock
        for d in self.actors + self.scorers + self.learners:
            d.free = max(d.free, t0)  # (pipeline: a scorer may still drain chunks of the in-flight decode)
        chunk = self.wl.chunk_at(k)
        for r in self.rows.values():
            r.prior = r.done  # tokens sampled by older policy versions, if trained at this step
        self.log_start = len(self.stage_log)
        self.full_at: float | None = None
        queues: list[list[tuple[float, int, int, int, bool]]] = [[] for _ in self.scorers]
        if not self.next_begun:
            self._admit(k, self.sched.begin_step().seqs, t0, queues, first=True)
        self.next_begun = False
        # 2. decode until the scheduler closes the step
        close_t, close = self._decode(k, chunk, queues)
        batch = [self.rows[u] for u in sorted(close.uids)]
        # 3. score
        t_scored = self._close(k, close_t, batch, queues)
        lengths = [r.length for r in batch]
        off_tokens = sum(r.prior for r in batch)  # sampled before this step: by an older version
        for u in close.uids:
            del self.rows[u]
        self.sched.end_step(0.0)
        # 4-6. learn; pipeline: meanwhile admit the next step and decode until the update is done
        learned = self._learn(k, t_scored, lengths, self.learners)
        ready = learned
        if self.in_flight and k + 1 < self.steps:  # (the runtime begins no step beyond the run's last)
            q_next: list[list[tuple[float, int, int, int, bool]]] = [[] for _ in self.scorers]
            self._admit(k, self.sched.begin_step().seqs, t_scored, q_next)
            self.next_begun = True
            stopped = self._decode(k, chunk, q_next, deadline=learned)
            for j, q in enumerate(q_next):  # the scorers take those chunks as they come, after their own update
                self._score_queue(k, j, q)
            ready = max(learned, stopped)
        # the weight sync: the rollout backend samples with the new weights from here on
        sync = Work("sync", "policy", 1)
        end = _group_run(self, self.actors, ready, self.costs.time(sync), "learner", "weight_sync", k, [sync])
        self.clock = end
        dev_busy, lane_busy = self._busy(t0, end)
        return SimulatedStep(k, t0, end, close_t, lengths, list(close.lags), off_tokens, sum(lengths),
                          sum(1 for r in self.rows.values() if not r.finished), dev_busy, lane_busy,
                          self.full_at if self.full_at is not None else close_t)

    def _admit(self, k: int, tickets, t: float, queues, first: bool = False) -> list[_Row]:
        """Stage 1: new rows go to the least-loaded actor device, which prefills their prompts at
        ``t``; streaming scorers prefill them too (at a step's start as their own span, mid-step as
        a queued message, like ``scorer.admit`` between chunks)."""
        wl, costs, pl = self.wl, self.costs, self.pl
        if not tickets:
            return []
        load = [0] * len(self.actors)  # running rows per actor device
        for r in self.rows.values():
            if not r.finished:
                load[r.device] += 1
        heap = [(n, i) for i, n in enumerate(load)]
        heapq.heapify(heap)
        new = []
        for tk in tickets:
            n, device = heapq.heappop(heap)
            heapq.heappush(heap, (n + 1, device))
            row = _Row(tk.uid, tk.prompt_index, self._length(tk), tk.start_version, device)
            self.rows[row.uid] = row
            new.append(row)
        per_actor = [0] * len(self.actors)
        per_scorer = [0] * len(self.scorers)
        for r in new:
            per_actor[r.device] += 1
            per_scorer[r.uid % len(self.scorers)] += 1
        for dev, n in zip(self.actors, per_actor):
            if n:
                w = Work("prefill", "policy", 1, n, n * wl.pad, n * wl.prompt_tokens ** 2 / 2)
                dev.run(self, t, costs.time(w), "actor", "prefill_prompt", k, [w])
        if self.streams:
            if first:
                for dev, n in zip(self.scorers, per_scorer):
                    if n:
                        works = [Work("stream", role, 1, n, n * wl.prompt_tokens, n * wl.prompt_tokens ** 2 / 2)
                                 for role in pl.scorer_roles]
                        dev.run(self, t, sum(costs.time(w) for w in works), "scorer", "prefill_prompt", k, works)
            else:
                for r in new:
                    queues[r.uid % len(self.scorers)].append((t, r.uid, wl.prompt_tokens, 0, False))
        return new

    def _timeline(self, rows: list[_Row], start: float):
        """The lock-step decode of ``rows`` on one device from ``start``, if nothing joins: the end
        of every decode step, the rows running in it and the context they hold."""
        rem = np.array([r.length - r.done for r in rows])
        base = np.array([self.wl.prompt_tokens + r.done for r in rows], float)
        order = np.argsort(rem, kind="stable")
        rem_s, base_s = rem[order], base[order]
        S = int(rem_s[-1])
        s = np.arange(1, S + 1)
        first = np.searchsorted(rem_s, s, side="left")  # rows with rem >= s are still running
        active = len(rem_s) - first
        suffix = np.concatenate([np.cumsum(base_s[::-1])[::-1], [0.0]])
        attn = suffix[first] + active * (s - 1)  # context each running row holds at step s
        ends = start + np.cumsum(self.costs.decode_steps(active, attn))
        return ends, active, attn, rem

    def _decode(self, k: int, chunk: int, queues, deadline: float | None = None):
        """Decode every running row per actor device; feed finishes to the scheduler in time order.

        Until the scheduler closes the step (returns ``(close time, CloseStep)``), or with a
        ``deadline`` (pipeline: the update's end) until the first decode-step boundary at or past
        it on each device, as the runtime checks ``update.done()`` between decode steps (returns
        when decoding stopped). A refill admits new rows at the finish that freed their slots:
        the timelines are rebuilt from there.
        """
        while True:
            per_dev: dict[int, list[_Row]] = {}
            for r in self.rows.values():
                if not r.finished:
                    per_dev.setdefault(r.device, []).append(r)
            if not per_dev:  # (pipeline: the batch may have finished while the learner trained)
                now = max(d.free for d in self.actors)
                if deadline is not None:
                    return now
                self.full_at = now if self.full_at is None else self.full_at
                close = self.sched.try_close()
                if close is None:
                    raise RuntimeError("internal error: the step cannot close but nothing is decoding")
                return now, close
            timelines: dict[int, tuple] = {}
            events: list[tuple[float, int, int]] = []  # (finish time, device, uid)
            for i, rows in per_dev.items():
                start = self.actors[i].free
                ends, active, attn, rem = self._timeline(rows, start)
                n = len(ends)
                if deadline is not None:  # steps begun before the deadline run to their end
                    n = 0 if start >= deadline else min(n, 1 + int(np.searchsorted(ends, deadline, side="left")))
                timelines[i] = (start, ends, active, attn, n)
                for r, left in zip(rows, rem):
                    if left <= n:
                        events.append((float(ends[left - 1]), i, r.uid))
            events.sort()
            pool = sum(1 for r in self.rows.values() if r.finished)  # finished, untrained (carried)
            if deadline is None and pool >= self.wl.batch and self.full_at is None:
                self.full_at = max(d.free for d in self.actors)
            j = 0
            rebuilt = False
            while j < len(events):
                t = events[j][0]
                admitted: list[SeqTicket] = []
                while j < len(events) and events[j][0] == t:
                    adm = self.sched.on_finished(events[j][2])
                    if adm is not None:
                        admitted.extend(adm.seqs)
                    pool += 1
                    j += 1
                if deadline is None and pool >= self.wl.batch and self.full_at is None:
                    self.full_at = t
                close = None
                # try_close cannot succeed before B are finished (it costs O(B) per call at scale)
                if deadline is None and pool >= self.wl.batch:
                    close = self.sched.try_close()
                if close is not None or admitted:
                    self._advance(k, chunk, queues, per_dev, timelines, t)
                    self._admit(k, admitted, t, queues)
                    if close is not None:
                        return t, close
                    rebuilt = True
                    break
            if rebuilt:
                continue
            if deadline is None:
                raise RuntimeError("internal error: the step cannot close but nothing is decoding")
            self._advance(k, chunk, queues, per_dev, timelines, None)
            return max(self.actors[i].free for i in per_dev)

    def _advance(self, k: int, chunk: int, queues, per_dev, timelines, t: float | None) -> None:
        """Advance every running row to time ``t`` (None: to its device's deadline horizon);
        stream its chunks; record the decode spans."""
        wl = self.wl
        stage = "decode_inflight" if self.next_begun else "decode"
        for i, rows in per_dev.items():
            start, ends, active, attn, horizon = timelines[i]
            n = horizon if t is None else min(horizon, int(np.searchsorted(ends, t + 1e-12, side="right")))
            if n == 0:
                continue
            cuts = {n}
            for r in rows:
                m = min(r.length - r.done, n)
                if self.streams:
                    q = queues[r.uid % len(self.scorers)]
                    s = r.emitted - r.done + chunk  # local step at which chunk tokens are on hand
                    while s < min(r.length - r.done, n + 1):
                        if s >= 1:
                            q.append((float(ends[s - 1]), r.uid, r.done + s - r.emitted, wl.prompt_tokens + r.emitted,
                                      False))
                            r.emitted = r.done + s
                            cuts.add(s)
                        s += chunk
                    if r.length - r.done <= n:  # finished in this stretch: its final chunk
                        s = r.length - r.done
                        q.append((float(ends[s - 1]), r.uid, r.length - r.emitted, wl.prompt_tokens + r.emitted, True))
                        r.emitted = r.length
                        cuts.add(s)
                else:
                    if r.length - r.done <= n:
                        cuts.add(r.length - r.done)
                r.done += m
                r.finished = r.done >= r.length
            dev = self.actors[i]
            segments = sorted(c for c in cuts if c <= n) if (self.fine and self.streams) else [n]
            prev = 0
            for c in segments:
                if c <= prev:
                    continue
                w = Work("decode", "policy", c - prev, float(active[prev:c].sum()), 0.0, float(attn[prev:c].sum()))
                t_start = start if prev == 0 else float(ends[prev - 1])
                dev.free = t_start
                dev.run(self, t_start, float(ends[c - 1]) - t_start, "actor", stage, k, [w])
                prev = c

    def _score_queue(self, k: int, j: int, items: list) -> float:
        """A streaming scorer device drains its queue: each round, everything on hand in one forward per role."""
        dev, roles, costs = self.scorers[j], self.pl.scorer_roles, self.costs
        items.sort()
        i = 0
        while i < len(items):
            start = max(dev.free, items[i][0])
            pending: dict[int, list] = {}
            while i < len(items) and items[i][0] <= start:
                _, uid, ntok, ctx, _final = items[i]
                if uid in pending:
                    pending[uid][0] += ntok
                else:
                    pending[uid] = [ntok, ctx]
                i += 1
            rows = len(pending)
            tokens = sum(p[0] for p in pending.values())
            attn = sum(p[0] * (p[1] + p[0] / 2) for p in pending.values())
            for role in roles:
                w = Work("stream", role, 1, rows, tokens, attn)
                dev.run(self, start, costs.time(w), "scorer", f"score_{role}", k, [w])
                start = dev.free
        return dev.free

    def _close(self, k: int, t_close: float, batch: list[_Row], queues) -> float:
        """Stage 3: the closed batch's own work and its scores; returns when the batch is scored."""
        wl, pl, costs = self.wl, self.pl, self.costs
        B = len(batch)
        A = len(self.actors)
        stale = [r for r in batch if r.version < k or r.prior]  # sampled in part by older weights
        for d in self.actors:
            d.free = max(d.free, t_close)

        def oneshot(role: str, rows: list[_Row], devs: list[_Device], lane: str, stage: str, ready: float) -> float:
            if not rows:
                return ready
            parts = _split(len(rows), len(devs))
            width = wl.pad + max(r.length for r in rows)  # one padded batch, as score_full pads it
            n = parts[0]
            w = Work("oneshot", role, 1, n, n * width, n * width ** 2 / 2)
            return _group_run(self, devs, ready, costs.time(w), lane, stage, k, [w])

        # the controller's own work: experience tensors, the off-policy correction of carried rows
        t = _group_run(self, self.actors, t_close, costs.time(Work("book", "", 1, B / A)), "learner", "experience", k,
                       [Work("book", "", 1, B / A)])
        if "policy" not in pl.actor_roles:  # else the full policy forward below gives the proximal log-probs
            t = oneshot("policy", stale, self.actors, "learner", "experience", t)
        for role in pl.actor_roles:
            t = oneshot(role, batch, self.actors, "learner", f"forward_{role}", t)
        if self.streams:
            if stale and "critic" in pl.scorer_roles and pl.critic != "value_head":
                t = oneshot("critic", stale, self.actors, "learner", "recompute_values", t)  # stale_values=recompute
            done = [self._score_queue(k, j, q) for j, q in enumerate(queues)]
            return max([t] + done)  # the barrier: the scorers finish what was sent
        t_s = t
        for role in pl.scorer_roles:
            t_s = oneshot(role, batch, self.scorers, "scorer", f"score_{role}", t_s if pl.shared else t_close)
        return max(t, t_s)

    def _learn(self, k: int, t: float, lens: list[int], devs: list[_Device]) -> float:
        """Stages 4-6 on ``devs``: advantages, then the actor's PPO update, and the critic's beside
        it (on the scorer devices), after it, or not at all (a value head). Returns its end."""
        pl, costs = self.pl, self.costs
        A = len(devs)
        book = Work("book", "", 1, len(lens) / A)
        t = _group_run(self, devs, t, costs.time(book), "learner", "advantages", k, [book])
        works = [self._train_work("actor", lens, A, k)]
        if pl.critic == "scorer" and not pl.shared:
            cw = self._train_work("critic", lens, len(self.scorers), k)
            end_c = _group_run(self, self.scorers, t, costs.time(cw), "scorer", "train_critic", k, [cw])
        else:
            end_c = t
            if pl.critic != "value_head":  # after the actor's, in the same span (as learner.update records it)
                works.append(self._train_work("critic", lens, A, k))
        end_a = _group_run(self, devs, t, sum(costs.time(w) for w in works), "learner", "train", k, works)
        return max(end_a, end_c)

    def _train_work(self, role: str, lens: list[int], dp: int, k: int) -> Work:
        """One PPO update over the batch: random minibatches, micro-batches padded to their longest row."""
        wl = self.wl
        rng = np.random.default_rng(wl.seed * 7919 + k)
        calls, tokens, attn, opt = 0, 0.0, 0.0, 0
        lens_a = np.array(lens)
        for _ in range(wl.epochs):
            perm = rng.permutation(len(lens))
            for m0 in range(0, len(lens), wl.minibatch):
                mb = perm[m0:m0 + wl.minibatch]
                opt += 1
                for u0 in range(0, len(mb), wl.micro):
                    rows = lens_a[mb[u0:u0 + wl.micro]]
                    width = wl.pad + int(rows.max())
                    calls += 1
                    tokens += len(rows) * width
                    attn += len(rows) * width ** 2 / 2
        return Work("train", role, math.ceil(calls / dp), 0, tokens / dp, attn / dp, opt, dp)

    def _busy(self, t0: float, t1: float) -> tuple[dict[str, float], dict[str, float]]:
        dev: dict[str, float] = {d.name: 0.0 for d in self.actors + self.scorers}
        lanes: dict[str, float] = {}
        seen_lane: dict[str, list[tuple[float, float]]] = {}
        for name, lane, stage, step, s, e, _ in self.stage_log[self.log_start:]:
            a, b = max(s, t0), min(e, t1)
            if b <= a:
                continue
            dev[name] = dev.get(name, 0.0) + (b - a)
            if name in ("actor0", "scorer0"):  # per-lane figures: one device of each group, like a bench trace
                seen_lane.setdefault(lane, []).append((a, b))
        for lane, iv in seen_lane.items():
            lanes[lane] = _union_len(iv)
        return dev, lanes


def _union_len(iv: list[tuple[float, float]]) -> float:
    total, cur = 0.0, None
    for a, b in sorted(iv):
        if cur is None or a > cur[1]:
            if cur:
                total += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    if cur:
        total += cur[1] - cur[0]
    return total


def simulate(mode: str, workload: Workload, costs: CostModel, placement: DeviceSplit, steps: int = 8,
             warmup: int = 1, fine: bool = False, overhead_s: float = 0.0, keep_spans: bool = True) -> RunResult:
    """Simulate ``steps`` PPO steps of ``mode``; the first ``warmup`` are left out of the summaries.

    ``fine=True`` splits the decode spans at every chunk hand-off, as the runtime records them
    (for calibration). ``overhead_s`` is added to every step (the controller's untraced time).
    ``keep_spans=False`` skips building the spans (large clusters: the summaries need none).
    """
    sim = _Sim(mode, workload, costs, placement, fine, steps)
    out = []
    for k in range(steps):
        r = sim.step(k)
        if overhead_s:
            r.end += overhead_s
            sim.clock = r.end
        out.append(r)
    spans = [] if not keep_spans else [Span(lane if len(sim.actors) == 1 else f"{lane}:{dev}", stage, step, s, e,
                  {"works": [w.__dict__ for w in works]} if works else {})
             for dev, lane, stage, step, s, e, works in sim.stage_log]
    return RunResult(mode, placement, out, spans, warmup)
