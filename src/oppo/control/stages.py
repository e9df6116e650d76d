"""The stages of one PPO step as functions of a :class:`Loop` (the controller's state over the roles).

``sequential.py`` calls them in their numbered order; ``overlapped.py`` calls the same ones in
another order (streaming chunks while decoding, carrying unfinished sequences, training while
decoding). Each stage returns a new record: the sampled :class:`~oppo.api.records.Rollout` batch, its
:class:`~oppo.api.records.Scores`, the :class:`~oppo.learner.batch.Experience` the learner consumes, and the
:class:`StepResult`.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

import torch

from .. import modes
from ..algo.stage import AdvantageSettings, compute_advantages
from ..config import OverlapConfig
from ..learner.batch import Experience, attach_scores, build_experience
from ..learner.offpolicy import staleness_stats
from ..scheduler import Scheduler, StepTiming
from ..api.roles import RoleHandles
from ..api.decode import decode_and_stream
from ..api.records import Chunk, Rollout, ScoredOutputs, Scores
from ..scheduler import OverlapController
from .controller import build_controller
from .inflight import InFlight
from .streams import Streams


@dataclass(frozen=True)
class OverlapPolicy:
    """What the overlapped loop does, from ``overlap.mode``'s row of the mode table
    (:data:`oppo.modes.TABLE`) and two stale-state settings: ``streams`` chunks to the scorers
    while decoding; ``carries`` unfinished sequences into the next step; trains ``in_flight``
    while the rollout backend decodes the next step."""

    streams: bool
    carries: bool
    in_flight: bool
    recompute_kv: bool  # overlap.stale_kv=recompute
    recompute_values: bool  # overlap.stale_values=recompute

    @classmethod
    def of(cls, overlap: OverlapConfig) -> "OverlapPolicy":
        """The policy the ``overlap`` section sets."""
        mode = modes.get(overlap.mode)
        return cls(mode.streams, mode.carries, mode.in_flight, overlap.stale_kv == "recompute",
                   overlap.stale_values == "recompute")


@dataclass
class StepResult:
    """What a step hands to metrics: the trained batch and its stats."""

    exp: Experience
    stats: dict[str, float]
    texts: list[tuple[str, str]]


class Loop:
    """The controller's state over the roles, one part per job: the scheduler's tickets; the
    overlap controller that sets Delta and the chunk size (``controller.py``); the rows in
    flight and which of them stream to the scorers (``streams.py``); their checkpoint save,
    restore and drain (``inflight.py``); and (pipeline) the learner thread. It reads the settings it
    needs from the roles' step settings once, here: ``policy`` (``overlap.*``), ``steps``
    (``run.steps``) and ``advantage`` (what the advantage stage reads of ``ppo.*``)."""

    def __init__(self, roles: RoleHandles):
        s = roles.settings
        self.roles, self.policy = roles, OverlapPolicy.of(s.overlap)
        self.steps, self.advantage = s.steps, AdvantageSettings.of(s.ppo)
        self.threads, self.tracer = roles.placement.threads, roles.tracer
        self.controller, delta = build_controller(s.overlap, s.ppo.batch_size, s.group_size, s.steps,
                                                  self.policy.streams, self.policy.in_flight)
        o = s.overlap
        self.scheduler = Scheduler(s.ppo.batch_size, o.max_lag if s.carries else 0, delta,
                                   refill=o.refill and s.carries, group_size=s.group_size,
                                   partial_groups=o.partial_groups)
        self.streams = Streams()
        self.inflight = InFlight(roles, self.scheduler, self.streams, self.policy.streams)
        self.trained_lengths: list[int] = []  # the last step's trained response lengths (the planner's)
        self.length_sampler = None  # benchmarks: (prompt_index, member of its group) -> forced response length
        self.learner_thread = (ThreadPoolExecutor(1, thread_name_prefix="oppo-learner") if self.policy.in_flight
                               else None)
        self.skipped_updates: float = 0  # ppo.nonfinite=skip: optimizer steps skipped since this process started

    @property
    def tuner(self) -> OverlapController:
        """The overlap controller (the name a checkpoint saves its state under)."""
        return self.controller

    @property
    def rollouts(self) -> dict[int, Rollout]:
        """The rows admitted and not yet trained, by uid (``Streams.rollouts``)."""
        return self.streams.rollouts

    @property
    def next_begun(self) -> bool:
        """Pipeline: the next step's prompts were admitted while the learner trained."""
        return self.streams.next_begun

    def chunk(self) -> int | None:
        """Tokens per streamed chunk for the next step; None: nothing streams (one-shot scoring)."""
        return (self.controller.chunk_size() or None) if self.policy.streams else None

    def record(self, seconds: float, tokens: float, stale_share: float, metrics: dict | None = None) -> None:
        """A step ran with the controller's setting: its time, trained tokens and off-policy share
        (and its ``metrics``, whose stage times the planner learns from)."""
        m = metrics or {}
        self.controller.observe(StepTiming(seconds, tokens, stale_share, tuple(self.trained_lengths),
                                           m.get("perf/decode_steps", 0.0), m.get("time/generate", 0.0)))

    def take_decisions(self) -> list[str]:
        """The overlap controller's decisions since the last call, one line each with its reason."""
        return self.controller.take_decisions()

    def untrained(self) -> dict[int, Rollout]:
        """The sequences admitted and not yet trained, by uid, in admission order (``Streams.untrained``)."""
        return self.streams.untrained(self.roles.rollout.in_flight() or [])

    # the sequences in flight across a checkpoint (inflight.py), as the trainer calls them

    def save_in_flight(self) -> dict:
        return self.inflight.save()

    def restore_in_flight(self, sequences: list[dict], step: int) -> None:
        self.inflight.restore(sequences, step)

    def reload_in_flight(self, saved: dict, step: int) -> None:
        self.inflight.reload(saved, step)

    def drain(self) -> int:
        return self.inflight.drain()

    def close(self) -> None:
        if self.learner_thread is not None:
            self.learner_thread.shutdown(wait=True)


# ====================================================================== stage 1: take prompts


def start(loop: Loop, tickets) -> list[Rollout]:
    """Stage 1: turn admitted tickets into rollouts (prompt text and ids from the data stream)."""
    new = []
    for t in tickets:
        text, ids = loop.roles.prompt_set.at(t.prompt_index)
        r = Rollout(t.uid, t.prompt_index, text, list(ids), t.start_version, group=t.group)
        if loop.length_sampler is not None:
            r.target_length = loop.length_sampler(t.prompt_index, t.uid - t.group)  # (its place in its group)
        new.append(r)
    loop.streams.add(new)
    return new


def admit(loop: Loop, tickets, step: int) -> None:
    """Stage 1 for sequences that start while others decode: into the rollout backend and, when
    chunks stream, the scorers."""
    new = start(loop, tickets)
    if not new:
        return
    rollout = loop.roles.rollout
    for r in new:
        r.scored_version = rollout.version
    with loop.tracer.span("actor", "prefill_prompt", step):
        rollout.admit(new)
    if loop.streams.streaming:
        loop.roles.scorer.admit([r.uid for r in new], [r.prompt_ids for r in new], step)
        loop.streams.stream(new)


def finish(loop: Loop, uids) -> None:
    """The trained rows leave flight."""
    loop.streams.forget(uids)


# ====================================================================== stage 2: generate


def decode_until_close(loop: Loop, step: int, chunk: int | None):
    """Decode (streaming chunks to the scorers) until the scheduler closes the step."""
    close, t_span = None, time.perf_counter()
    while close is None:
        if loop.roles.rollout.active == 0:  # (pipeline: the batch may have finished while the learner trained)
            close = loop.scheduler.try_close()
            if close is None:
                raise RuntimeError("internal error: the step cannot close but nothing is decoding")
            break
        t_span = decode_once(loop, step, chunk, t_span)
        close = loop.scheduler.try_close()
    loop.tracer.add("actor", "decode", step, t_span, time.perf_counter())
    return close


def decode_once(loop: Loop, step: int, chunk: int | None, t_span: float, stage: str = "decode") -> float:
    """Advance the rollout backend once (``api.decode.decode_and_stream``): finished sequences go to
    the scheduler (refills are admitted), chunks to the scorers. Returns the start of the open trace
    span."""
    sink = _ControllerSink(loop, step, stage, t_span)
    decode_and_stream(loop.roles.rollout, chunk, sink)
    return sink.t_span


class _ControllerSink:
    """The controller's :class:`~oppo.api.decode.DecodeSink`: a finished sequence to the scheduler, the
    chunks of streamed sequences to the scorers (one trace span per stretch between two feeds)."""

    def __init__(self, loop: Loop, step: int, stage: str, t_span: float):
        self.loop, self.step, self.stage, self.t_span = loop, step, stage, t_span

    def advancing(self) -> None:
        pass

    def finished(self, rollout: Rollout) -> None:
        loop = self.loop
        loop.streams.add([rollout])  # the backend's record (it never changes ours)
        refill = loop.scheduler.on_finished(rollout.uid)
        if refill is not None:
            admit(loop, refill.seqs, self.step)

    def chunks(self, chunks: list[Chunk]) -> None:
        loop = self.loop
        mine = loop.streams.fed(chunks)
        if mine:
            now = time.perf_counter()
            loop.tracer.add("actor", self.stage, self.step, self.t_span, now)
            loop.roles.scorer.feed(mine, self.step)
            self.t_span = now


def texts(loop: Loop, batch: list[Rollout]) -> list[str]:
    """Each response decoded once per step (reward function, judge and samples share it)."""
    return loop.roles.tokenizer.batch_decode([r.response_ids for r in batch], skip_special_tokens=True)


def experience(loop: Loop, batch: list[Rollout], step: int) -> Experience:
    """The batch as tensors, with the off-policy correction of carried tokens (needs no scores)."""
    with loop.tracer.span("learner", "experience", step):
        return loop.roles.learner.old_logprobs(build_experience(batch, loop.roles.pad_id, loop.roles.device), step)


# ====================================================================== stage 3: score


def score(loop: Loop, batch: list[Rollout], txt: list[str], step: int) -> Scores:
    """Stage 3, one-shot: the scoring models' outputs of whole sequences, and the reward."""
    return reward_scores(loop, batch, txt, score_models(loop, batch, step), step)


def score_models(loop: Loop, batch: list[Rollout], step: int) -> dict[str, list[ScoredOutputs]]:
    """The scoring models' one-shot outputs for whole sequences, by role: each reward model term's,
    the reference's, and the critic's where there is one."""
    roles, tracer = loop.roles, loop.tracer
    prompts, responses = [r.prompt_ids for r in batch], [r.response_ids for r in batch]
    out = {}
    for role in roles.reward.model_roles:
        with tracer.span("scorer", "score_reward", step):
            out[role] = roles.scorer.score_full(role, prompts, responses)
    with tracer.span("scorer", "score_reference", step):
        out["reference"] = roles.scorer.score_full("reference", prompts, responses)
    if roles.has_critic:
        with tracer.span("scorer", "score_critic", step):
            out["critic"] = roles.scorer.score_full("critic", prompts, responses)
    return out


def reward_scores(loop: Loop, batch: list[Rollout], txt: list[str], out: dict[str, list[ScoredOutputs]],
                  step: int) -> Scores:
    """Stage 3's record, given the scoring models' outputs ``out`` by role: the trained reward
    (``roles.reward``: its terms' weighted sum, a one-term reward's own scores) with each term's
    mean in ``terms`` (``reward.terms``), the reference log-probs and the critic's values."""
    reward = loop.roles.reward
    with loop.tracer.span("scorer", "score_reward", step):
        indices = [r.prompt_index for r in batch]  # data positions: the records' other inputs (columns) by position
        scores, terms = reward([r.prompt for r in batch], txt, {role: _scores(out[role]) for role in reward.model_roles},
                               step=step, indices=indices, context=loop.roles.prompt_set.context(indices))
    return Scores(scores, out["reference"], out.get("critic"), terms)


def _scores(outputs: list[ScoredOutputs]) -> list[float]:
    """A reward role's scores: it sets ``score`` on every output."""
    return [cast(float, o.score) for o in outputs]


def close_batch(loop: Loop, close, step: int) -> tuple[list[Rollout], list[str], Experience, Scores]:
    """The closed step's batch, its texts, experience and scores. Streamed: the scorers finish
    the last chunks while this thread does the batch's own work."""
    scorer = loop.roles.scorer
    batch = [loop.streams.rollouts[u] for u in sorted(close.uids)]  # admission order, as the sequential loop trains
    if not loop.policy.streams:
        txt = texts(loop, batch)
        return batch, txt, experience(loop, batch, step), score(loop, batch, txt, step)
    # Rows the scorers did not get whole (admitted, or finished, while the controller scored
    # one-shot) are scored one-shot below; a prefix the scorers hold of one is dropped.
    whole, rest, partial = loop.streams.split(batch)
    if partial:
        scorer.forget(partial)
        loop.streams.unstream(partial)
    # While the scorers finish the last chunks, this process does the batch's own work on its
    # core: texts, the off-policy correction, and the values of carried prefixes (reading the
    # critic alongside the scorer is safe: nothing writes it until the update).
    loop.threads.use(loop.threads.decode)
    txt = texts(loop, batch)
    exp = experience(loop, batch, step)
    fresh = fresh_values(loop, batch, whole, step)
    loop.threads.use(loop.threads.full)
    with loop.tracer.span("controller", "wait_scorers", step):  # waiting: not actor work
        scorer.barrier()  # also: no scorer work may touch the critic while it trains
    streamed = scorer.take([batch[i].uid for i in whole]) if whole else {}
    one_shot = score_models(loop, [batch[i] for i in rest], step) if rest else {}
    out = {role: _merged(len(batch), (whole, streamed.get(role)), (rest, one_shot.get(role)))
           for role in set(streamed) | set(one_shot)}
    for i, v in fresh.items():
        out["critic"][i] = v
    return batch, txt, exp, reward_scores(loop, batch, txt, out, step)


def fresh_values(loop: Loop, batch: list[Rollout], whole: list[int], step: int) -> dict[int, ScoredOutputs]:
    """``overlap.stale_values=recompute``: the critic's values of the streamed rows whose prefix was
    scored before the critic's last update, by position in ``batch``, recomputed one-shot."""
    stale = [i for i in whole if (sv := batch[i].scored_version) is not None and sv < step]
    if not (stale and loop.roles.has_critic and loop.policy.recompute_values):
        return {}
    with loop.tracer.span("learner", "recompute_values", step):
        fresh = loop.roles.scorer.score_full("critic", [batch[i].prompt_ids for i in stale],
                                            [batch[i].response_ids for i in stale])
    return dict(zip(stale, fresh))


def _merged(n: int, *parts: tuple[list[int], list | None]) -> list:
    """One role's outputs back in the batch's order, from ``(positions, outputs)`` parts."""
    merged: list = [None] * n
    for idx, got in parts:
        for i, o in zip(idx, got or []):
            merged[i] = o
    return merged


# ====================================================================== stages 4-6: learn


def update(loop: Loop, exp: Experience, txt: list[str], scores: Scores, step: int) -> StepResult:
    """Stages 4-6: KL-shaped rewards, advantages, PPO epochs. Changes the trained weights only
    (the pipeline's learner thread runs it while the rollout backend decodes with the weights it has).
    Non-finite numbers stop the run here (``guard.py``), before the weight sync; with
    ``ppo.nonfinite=skip`` the skipped optimizer steps are counted (``guard/skipped_updates``)."""
    batch = exp.rollouts
    with loop.tracer.span("learner", "advantages", step):
        exp = compute_advantages(attach_scores(exp, scores), loop.advantage, loop.roles.algorithm, step)
    if exp.trainable:
        with loop.tracer.span("learner", "train", step):
            stats = loop.roles.learner.update(exp, step)
    else:  # non-finite advantages under ppo.nonfinite=skip (warned): every optimizer step of the update skipped
        n = len(loop.roles.learner.minibatches(exp.mask.shape[0], step))
        stats = {"guard/skipped/actor": n, **({"guard/skipped/critic": n} if loop.roles.has_critic else {})}
    if loop.advantage.nonfinite == "skip":
        stats["guard/skipped_updates"] = sum(v for k, v in stats.items() if k.startswith("guard/skipped/"))
        loop.skipped_updates += stats["guard/skipped_updates"]
        stats["guard/skipped_updates_total"] = loop.skipped_updates
    stats.update(exp.stats or {})
    stats.update(scores.terms)  # reward.terms: each term's mean
    return StepResult(exp, stats, [(r.prompt, t) for r, t in zip(batch, txt)])


def sync_weights(loop: Loop, stats: dict[str, float], step: int) -> None:
    """The weight sync after step ``step``'s update: the rollout backend samples as version
    ``step + 1`` from here on, the critic's scorer reads the new critic; adds the seconds to
    ``time/weight_sync``. With ``stale_kv=recompute`` the carried rows' KV is rebuilt."""
    with loop.tracer.span("learner", "weight_sync", step):
        dt = loop.roles.sync(step + 1)
    stats["time/weight_sync"] = stats.get("time/weight_sync", 0.0) + dt
    refresh_kv(loop, step + 1)


def new_weights(loop: Loop, version: int) -> None:
    """The rollout backend samples as ``version`` (a run's or a resume's first step)."""
    loop.roles.rollout.set_version(version)
    refresh_kv(loop, version)


def refresh_kv(loop: Loop, version: int) -> None:
    if loop.policy.carries and loop.policy.recompute_kv and loop.roles.rollout.active:
        with loop.tracer.span("actor", "recompute_kv", version):
            loop.roles.rollout.recompute()


def overlap_stats(loop: Loop, close, exp: Experience, chunk: int | None) -> dict[str, float]:
    trained = set(close.uids)
    loop.trained_lengths = [len(r.response_ids) for r in exp.rollouts]
    # the carried rows' progress is the backend's (one read of its records); none carried: no call
    untrained = loop.untrained() if set(loop.streams.rollouts) - trained else {}
    return {
        "overlap/delta": loop.scheduler.delta, "overlap/carried": len(loop.scheduler.in_flight),
        "overlap/waiting_members": loop.scheduler.waiting_members,
        **staleness_stats(exp, close.step, close.lags),  # token and sequence lags, IS weights
        "overlap/chunk_size": chunk or 0, "overlap/streaming": float(loop.streams.streaming),
        **loop.controller.step_metrics(),
        "overlap/in_flight_length_mean": mean_or_nan([len(r.response_ids) for u, r in untrained.items()
                                                if u not in trained] or [0]),
    }


def end_step(loop: Loop, scores: Scores) -> None:
    """The scheduler's step ends (its version moves on; a reward-slope Delta reads the step's
    mean reward): after the update, or (pipeline) once it is handed to the learner thread, before
    the next step begins."""
    loop.scheduler.end_step(mean_reward(scores.scores))


def mean_reward(scores) -> float:
    """The step's mean reward: ``reward/mean`` and what the scheduler's Delta rule reads, the one
    definition (a float32 mean, as the learner holds the scores)."""
    return torch.as_tensor(scores, dtype=torch.float32).mean().item()


def mean_or_nan(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")
