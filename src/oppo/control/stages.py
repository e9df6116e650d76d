"""The stages of one PPO step as functions of a :class:`Run`.

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

from .. import modes
from ..algo.stage import compute_advantages
from ..config import Config
from ..learner.batch import Experience, attach_scores, build_experience
from ..learner.offpolicy import staleness_stats
from ..scheduler import ChunkSizeTuner, DeltaController, Scheduler
from ..plan.online import OnlinePlanner
from ..tuner import OverlapTuner, TunedDelta, delta_ladder
from ..api.roles import Roles
from ..api.decode import decode_and_stream
from ..api.records import Chunk, Rollout, ScoredOutputs, Scores


@dataclass(frozen=True)
class OverlapPolicy:
    """What the overlapped loop does, from ``overlap.mode``'s row of the mode table
    (:data:`oppo.modes.TABLE`) and two stale-state settings: ``streams`` chunks to the scorers
    while decoding; ``carries`` unfinished sequences into the next step; trains ``in_flight``
    while the engine decodes the next step."""

    streams: bool
    carries: bool
    in_flight: bool
    recompute_kv: bool  # overlap.stale_kv=recompute
    recompute_values: bool  # overlap.stale_values=recompute

    @classmethod
    def of(cls, cfg: Config) -> "OverlapPolicy":
        mode = modes.get(cfg.overlap.mode)
        return cls(mode.streams, mode.carries, mode.in_flight, cfg.overlap.stale_kv == "recompute",
                   cfg.overlap.stale_values == "recompute")


@dataclass
class StepResult:
    """What a step hands to metrics: the trained batch and its stats."""

    exp: Experience
    stats: dict[str, float]
    texts: list[tuple[str, str]]


class Run:
    """The controller's state over the roles: the scheduler, the overlap controller (Delta and the
    chunk size: ``tuner.OverlapTuner``, or the reward-slope rule with a ``ChunkSizeTuner``), the
    sequences admitted and not yet trained, which of them stream to the scorers, and (pipeline) the
    learner thread."""

    def __init__(self, roles: Roles):
        cfg = roles.cfg
        self.roles, self.cfg, self.policy = roles, cfg, OverlapPolicy.of(cfg)
        self.threads, self.tracer = roles.placement.threads, roles.tracer
        o, carries, B, G = cfg.overlap, cfg.carries, cfg.ppo.batch_size, cfg.group_size
        dmax = min(o.delta_max, B // G)  # derived once: the adaptive bounds never exceed B (groups: B / G)
        dmin = min(o.delta_min, dmax)
        adaptive = carries and o.delta < 0
        self.tuner: OverlapTuner | ChunkSizeTuner
        self.planner: OnlinePlanner | None = None
        self.trained_lengths: list[int] = []  # the last step's trained response lengths (the planner's)
        delta: int | DeltaController | TunedDelta
        if adaptive and o.delta_rule == "reward_slope":  # the OPPO paper's rules
            delta = DeltaController(min(max(o.delta_init, dmin), dmax), dmin, dmax, o.delta_window,
                                    o.delta_proportional)
            self.tuner = ChunkSizeTuner(tuple(c for c in o.chunk_candidates if c), o.trial_steps, o.retune_every,
                                        fixed=o.chunk_size or None)
        else:
            deltas = delta_ladder(dmin, dmax) if adaptive else ((o.delta if carries else 0),)
            chunks = ((o.chunk_size,) if o.chunk_size else tuple(o.chunk_candidates)) if self.policy.streams else (0,)
            self.tuner = OverlapTuner(deltas, chunks, trial_steps=o.trial_steps, retune_every=o.retune_every,
                                      margin=o.tune_margin, max_stale_share=o.max_stale_share,
                                      in_flight=self.policy.in_flight, steps=cfg.run.steps)
            delta = TunedDelta(self.tuner) if len(deltas) > 1 else deltas[0]
            if len(deltas) > 1 and G == 1:  # the planner predicts Delta from the run's own steps (plan/online.py)
                self.planner = OnlinePlanner(B, o.max_lag)
                self.tuner.predictor = self.planner.predict
        self.scheduler = Scheduler(B, o.max_lag if carries else 0, delta, refill=o.refill and carries, group_size=G,
                                   partial_groups=o.partial_groups)
        self.streaming = False  # this step's chunks stream to the scorers (the controller may score one-shot)
        self.streamed: set[int] = set()  # uids the scorers hold a prefix of (admitted to them)
        self.scored_whole: set[int] = set()  # streamed uids whose final chunk the scorers got
        self.rollouts: dict[int, Rollout] = {}  # admitted, not yet trained
        self.length_sampler = None  # benchmarks: (prompt_index, member of its group) -> forced response length
        self.learner_thread = (ThreadPoolExecutor(1, thread_name_prefix="oppo-learner") if self.policy.in_flight
                               else None)
        self.next_begun = False  # pipeline: the next step's prompts were admitted while the learner trained
        self.skipped_updates: float = 0  # ppo.nonfinite=skip: optimizer steps skipped since this process started

    def chunk(self) -> int | None:
        """Tokens per streamed chunk for the next step; None: nothing streams (one-shot scoring)."""
        if not self.policy.streams:
            return None
        c = self.tuner.current() if isinstance(self.tuner, ChunkSizeTuner) else self.tuner.current().chunk
        return c or None

    def record(self, seconds: float, tokens: float, stale_share: float, metrics: dict | None = None) -> None:
        """A step ran with the controller's setting: its time, trained tokens and off-policy share
        (and its ``metrics``, whose stage times the planner learns from)."""
        if isinstance(self.tuner, ChunkSizeTuner):
            self.tuner.record(seconds)
            return
        if self.planner is not None and metrics is not None:
            self.planner.observe(self.tuner.current(), seconds, self.trained_lengths,
                                 metrics.get("perf/decode_steps", 0.0), metrics.get("time/generate", 0.0))
        self.tuner.record(seconds, tokens, stale_share)

    def take_decisions(self) -> list[str]:
        """The overlap controller's decisions since the last call, one line each with its reason."""
        return self.tuner.take_decisions() if isinstance(self.tuner, OverlapTuner) else []

    def forget_streams(self, uids) -> None:
        self.streamed.difference_update(uids)
        self.scored_whole.difference_update(uids)

    def between_steps(self) -> None:
        """Bring the run to a state a checkpoint saves: a pipeline run's next step, begun while
        the learner trained, is un-begun (its sequences stay admitted, for the drain)."""
        if self.next_begun:
            self.scheduler.suspend()
            self.next_begun = False

    def untrained(self) -> dict[int, Rollout]:
        """The sequences admitted and not yet trained, by uid, in admission order; a decoding one as
        the rollout backend holds it now (its progress lives in the backend's record, not in ours)."""
        decoding = {r.uid: r for r in self.roles.rollout.in_flight() or []}
        return {u: decoding.get(u, r) for u, r in self.rollouts.items()}

    def save_in_flight(self) -> dict:
        """What a checkpoint saves of the sequences admitted and not yet trained (carried ones, a
        finished group member waiting for its siblings, a pipeline run's begun step), between
        steps. ``{"how": "saved", "sequences": [Rollout.state_dict()...]}``: each one's prompt,
        tokens so far and every token's version and log-probs, in admission order (the scheduler's
        tickets are in its own state). Where the rollout backend cannot hand its rows out, they
        are drained instead (:meth:`drain`): ``{"how": "drained", "count": n, "sequences": []}``."""
        self.between_steps()
        rows = self.roles.rollout.in_flight()
        if rows is None:
            return {"how": "drained", "count": self.drain(), "sequences": []}
        self.rollouts.update((r.uid, r) for r in rows)  # their progress, as the backend holds it
        return {"how": "saved", "count": len(self.rollouts),
                "sequences": [r.state_dict() for r in self.rollouts.values()]}

    def restore_in_flight(self, sequences: list[dict], step: int) -> None:
        """Admit saved sequences (:meth:`save_in_flight`) again, their scheduler tickets restored
        already. The running ones go back into the rollout backend with their partial responses:
        it prefills prompt + response so far under its current weights (as ``stale_kv=recompute``
        does, so their next tokens carry the current version) and decodes on where each stopped.
        Saved tokens keep their versions and behaviour log-probs, so the off-policy correction
        and the staleness metrics see them as before. Streaming scorers prefill each prompt and
        get the response so far as the sequence's first chunk (``emitted`` is reset: the engine
        sends it with its next chunk); a finished one gets it as its final chunk."""
        rows = [Rollout.from_state_dict(d) for d in sequences]
        if not rows:
            return
        rollout, scorer = self.roles.rollout, self.roles.scorer
        for r in rows:
            r.emitted = 0
            r.scored_version = rollout.version  # the scorers score it afresh, with the weights they hold now
            self.rollouts[r.uid] = r
        running = [r for r in rows if not r.finished]
        with self.tracer.span("actor", "prefill_prompt", step):
            rollout.admit(running)
        done = [r for r in rows if r.finished]
        if self.policy.streams and running:
            scorer.admit([r.uid for r in running], [r.prompt_ids for r in running], step)
            self.streamed.update(r.uid for r in running)
        if self.policy.streams and done:
            scorer.admit_finished([r.uid for r in done], [r.prompt_ids for r in done], [r.response_ids for r in done],
                                  step)
            for r in done:
                r.emitted = len(r.response_ids)
            self.streamed.update(r.uid for r in done)
            self.scored_whole.update(r.uid for r in done)

    def reload_in_flight(self, saved: dict, step: int) -> None:
        """After a checkpoint saved the sequences in flight, the live run continues as a run
        resumed from it would: every untrained sequence leaves the rollout backend and the
        scorers and is restored from the saved state (:meth:`restore_in_flight`). Costs one
        prefill of the carried rows per checkpoint, and makes the live and the resumed run take
        the same path (``checkpoint.py``)."""
        uids = set(self.rollouts)
        if not uids:
            return
        self.roles.rollout.abort(uids)
        self.roles.scorer.forget(uids)
        self.roles.scorer.barrier()
        self.rollouts.clear()
        self.forget_streams(uids)
        self.restore_in_flight(saved["sequences"], step)

    def drain(self) -> int:
        """Abort every sequence in flight and requeue its prompt (before a checkpoint, where the
        backend cannot hand them out); returns how many."""
        self.between_steps()
        drained = self.scheduler.drain_for_checkpoint()
        if drained:
            uids = {t.uid for t in drained}
            self.roles.rollout.abort(uids)
            self.roles.scorer.forget(uids)
            self.roles.scorer.barrier()
            for u in uids:
                self.rollouts.pop(u, None)
            self.forget_streams(uids)
        return len(drained)

    def close(self) -> None:
        if self.learner_thread is not None:
            self.learner_thread.shutdown(wait=True)


# ====================================================================== stage 1: take prompts


def start(run: Run, tickets) -> list[Rollout]:
    """Stage 1: turn admitted tickets into rollouts (prompt text and ids from the data stream)."""
    new = []
    for t in tickets:
        text, ids = run.roles.prompt_set.at(t.prompt_index)
        r = Rollout(t.uid, t.prompt_index, text, list(ids), t.start_version, group=t.group)
        if run.length_sampler is not None:
            r.target_length = run.length_sampler(t.prompt_index, t.uid - t.group)  # (its place in its group)
        run.rollouts[t.uid] = r
        new.append(r)
    return new


def admit(run: Run, tickets, step: int) -> None:
    """Stage 1 for sequences that start while others decode: into the rollout backend and, when
    chunks stream, the scorers."""
    new = start(run, tickets)
    if not new:
        return
    rollout = run.roles.rollout
    for r in new:
        r.scored_version = rollout.version
    with run.tracer.span("actor", "prefill_prompt", step):
        rollout.admit(new)
    if run.streaming:
        run.roles.scorer.admit([r.uid for r in new], [r.prompt_ids for r in new], step)
        run.streamed.update(r.uid for r in new)


def finish(run: Run, uids) -> None:
    for u in uids:
        run.rollouts.pop(u, None)
    run.forget_streams(uids)


# ====================================================================== stage 2: generate


def decode_until_close(run: Run, step: int, chunk: int | None):
    """Decode (streaming chunks to the scorers) until the scheduler closes the step."""
    close, t_span = None, time.perf_counter()
    while close is None:
        if run.roles.rollout.active == 0:  # (pipeline: the batch may have finished while the learner trained)
            close = run.scheduler.try_close()
            if close is None:
                raise RuntimeError("internal error: the step cannot close but nothing is decoding")
            break
        t_span = decode_once(run, step, chunk, t_span)
        close = run.scheduler.try_close()
    run.tracer.add("actor", "decode", step, t_span, time.perf_counter())
    return close


def decode_once(run: Run, step: int, chunk: int | None, t_span: float, stage: str = "decode") -> float:
    """Advance the rollout backend once (``api.decode.decode_and_stream``): finished sequences go to
    the scheduler (refills are admitted), chunks to the scorers. Returns the start of the open trace
    span."""
    sink = _ControllerSink(run, step, stage, t_span)
    decode_and_stream(run.roles.rollout, chunk, sink)
    return sink.t_span


class _ControllerSink:
    """The controller's :class:`~oppo.api.decode.DecodeSink`: a finished sequence to the scheduler, the
    chunks of streamed sequences to the scorers (one trace span per stretch between two feeds)."""

    def __init__(self, run: Run, step: int, stage: str, t_span: float):
        self.run, self.step, self.stage, self.t_span = run, step, stage, t_span

    def advancing(self) -> None:
        pass

    def finished(self, rollout: Rollout) -> None:
        run = self.run
        run.rollouts[rollout.uid] = rollout  # the backend's record (it never changes ours)
        refill = run.scheduler.on_finished(rollout.uid)
        if refill is not None:
            admit(run, refill.seqs, self.step)

    def chunks(self, chunks: list[Chunk]) -> None:
        run = self.run
        mine = [c for c in chunks if c.uid in run.streamed]  # (admitted while scoring one-shot: not)
        run.scored_whole.update(c.uid for c in mine if c.final)
        if mine:
            now = time.perf_counter()
            run.tracer.add("actor", self.stage, self.step, self.t_span, now)
            run.roles.scorer.feed(mine, self.step)
            self.t_span = now


def texts(run: Run, batch: list[Rollout]) -> list[str]:
    """Each response decoded once per step (reward function, judge and samples share it)."""
    return run.roles.tokenizer.batch_decode([r.response_ids for r in batch], skip_special_tokens=True)


def experience(run: Run, batch: list[Rollout], step: int) -> Experience:
    """The batch as tensors, with the off-policy correction of carried tokens (needs no scores)."""
    with run.tracer.span("learner", "experience", step):
        return run.roles.learner.old_logprobs(build_experience(batch, run.roles.pad_id, run.roles.device), step)


# ====================================================================== stage 3: score


def score(run: Run, batch: list[Rollout], txt: list[str], step: int) -> Scores:
    """Stage 3, one-shot: reward score, reference log-probs, critic values of whole sequences."""
    with run.tracer.span("scorer", "score_reward", step):
        scores = reward_scores(run, batch, txt, step) if run.roles.reward_fn else None
    out = score_models(run, batch, step)
    if run.roles.composite is not None:
        return composite_scores(run, batch, txt, out, step)
    return Scores(scores if scores is not None else _scores(out["reward"]), out["reference"], out.get("critic"))


def score_models(run: Run, batch: list[Rollout], step: int) -> dict[str, list[ScoredOutputs]]:
    """The scoring models' one-shot outputs for whole sequences, by role (the reward model's
    unless a reward function scores; the critic's where there is one)."""
    roles, tracer = run.roles, run.tracer
    prompts, responses = [r.prompt_ids for r in batch], [r.response_ids for r in batch]
    out = {}
    for role in reward_roles(roles):
        with tracer.span("scorer", "score_reward", step):
            out[role] = roles.scorer.score_full(role, prompts, responses)
    with tracer.span("scorer", "score_reference", step):
        out["reference"] = roles.scorer.score_full("reference", prompts, responses)
    if roles.critic is not None:
        with tracer.span("scorer", "score_critic", step):
            out["critic"] = roles.scorer.score_full("critic", prompts, responses)
    return out


def reward_scores(run: Run, batch: list[Rollout], txt: list[str], step: int) -> list[float]:
    fn = run.roles.reward_fn
    assert fn is not None  # called only where the run has a reward function
    indices = [r.prompt_index for r in batch]  # data positions: the records' other inputs (columns) by position
    return fn([r.prompt for r in batch], txt, step=step, indices=indices, context=run.roles.prompt_set.context(indices))


def reward_roles(roles: Roles) -> tuple[str, ...]:
    """The scorer roles of the reward models the trained reward reads: ``reward``, none under a
    reward function, every reward model term's under ``reward.terms``."""
    if roles.composite is not None:
        return roles.composite.model_roles
    return () if roles.reward_fn else ("reward",)


def composite_scores(run: Run, batch: list[Rollout], txt: list[str], out: dict[str, list[ScoredOutputs]],
                     step: int, values: list | None = None) -> Scores:
    """Stage 3's record under ``reward.terms``: their weighted sum, each term's mean in ``terms``."""
    comp = run.roles.composite
    assert comp is not None  # called only where the run has reward.terms
    with run.tracer.span("scorer", "score_reward", step):
        indices = [r.prompt_index for r in batch]
        scores, terms = comp([r.prompt for r in batch], txt, {role: _scores(out[role]) for role in comp.model_roles},
                             step=step, indices=indices, context=run.roles.prompt_set.context(indices))
    return Scores(scores, out["reference"], values if values is not None else out.get("critic"), terms)


def _scores(outputs: list[ScoredOutputs]) -> list[float]:
    """The reward role's scores: it sets ``score`` on every output."""
    return [cast(float, o.score) for o in outputs]


def close_batch(run: Run, close, step: int) -> tuple[list[Rollout], list[str], Experience, Scores]:
    """The closed step's batch, its texts, experience and scores. Streamed: the scorers finish
    the last chunks while this thread does the batch's own work."""
    roles, scorer = run.roles, run.roles.scorer
    uids = sorted(close.uids)  # admission order, as the sequential loop trains them
    batch = [run.rollouts[u] for u in uids]
    if not run.policy.streams:
        txt = texts(run, batch)
        return batch, txt, experience(run, batch, step), score(run, batch, txt, step)
    # Rows the scorers did not get whole (admitted, or finished, while the controller scored
    # one-shot) are scored one-shot below; a prefix the scorers hold of one is dropped.
    whole = [i for i, r in enumerate(batch) if r.uid in run.scored_whole]
    rest = [i for i, r in enumerate(batch) if r.uid not in run.scored_whole]
    partial = {batch[i].uid for i in rest} & run.streamed
    if partial:
        scorer.forget(partial)
        run.forget_streams(partial)
    # While the scorers finish the last chunks, this process does the batch's own work on its
    # core: texts, the off-policy correction, and the values of carried prefixes (reading the
    # critic alongside the scorer is safe: nothing writes it until the update).
    run.threads.use(run.threads.decode)
    txt = texts(run, batch)
    exp = experience(run, batch, step)
    # the critic changed since their prefix was scored
    stale = [i for i in whole if (sv := batch[i].scored_version) is not None and sv < step]
    fresh = []
    if stale and roles.critic is not None and run.policy.recompute_values:
        with run.tracer.span("learner", "recompute_values", step):
            fresh = scorer.score_full("critic", [batch[i].prompt_ids for i in stale],
                                      [batch[i].response_ids for i in stale])
    run.threads.use(run.threads.full)
    with run.tracer.span("controller", "wait_scorers", step):  # waiting: not actor work
        scorer.barrier()  # also: no scorer work may touch the critic while it trains
    streamed = scorer.take([batch[i].uid for i in whole]) if whole else {}
    one_shot = score_models(run, [batch[i] for i in rest], step) if rest else {}
    out: dict[str, list] = {}
    for role in set(streamed) | set(one_shot):  # back into the batch's order
        merged: list = [None] * len(batch)
        for idx, got in ((whole, streamed.get(role)), (rest, one_shot.get(role))):
            for i, o in zip(idx, got or []):
                merged[i] = o
        out[role] = merged
    values = out.get("critic")
    if fresh:
        assert values is not None  # fresh values only with a critic, and then the scorers stream its values
        for i, v in zip(stale, fresh):
            values[i] = v
    if roles.composite is not None:
        return batch, txt, exp, composite_scores(run, batch, txt, out, step, values)
    scores = reward_scores(run, batch, txt, step) if roles.reward_fn else _scores(out["reward"])
    return batch, txt, exp, Scores(scores, out["reference"], values)


# ====================================================================== stages 4-6: learn


def update(run: Run, exp: Experience, txt: list[str], scores: Scores, step: int) -> StepResult:
    """Stages 4-6: KL-shaped rewards, advantages, PPO epochs. Changes the trained weights only
    (the pipeline's learner thread runs it while the engine decodes with the weights it has).
    Non-finite numbers stop the run here (``guard.py``), before the weight sync; with
    ``ppo.nonfinite=skip`` the skipped optimizer steps are counted (``guard/skipped_updates``)."""
    batch = exp.rollouts
    with run.tracer.span("learner", "advantages", step):
        exp = compute_advantages(attach_scores(exp, scores), run.cfg.ppo, run.roles.algorithm, step)
    if exp.trainable:
        with run.tracer.span("learner", "train", step):
            stats = run.roles.learner.update(exp, step)
    else:  # non-finite advantages under ppo.nonfinite=skip (warned): every optimizer step of the update skipped
        n = len(run.roles.learner.minibatches(exp.mask.shape[0], step))
        stats = {"guard/skipped/actor": n, **({"guard/skipped/critic": n} if run.roles.critic is not None else {})}
    if run.cfg.ppo.nonfinite == "skip":
        stats["guard/skipped_updates"] = sum(v for k, v in stats.items() if k.startswith("guard/skipped/"))
        run.skipped_updates += stats["guard/skipped_updates"]
        stats["guard/skipped_updates_total"] = run.skipped_updates
    stats.update(exp.stats or {})
    stats.update(scores.terms)  # reward.terms: each term's mean
    return StepResult(exp, stats, [(r.prompt, t) for r, t in zip(batch, txt)])


def sync_weights(run: Run, stats: dict[str, float], step: int) -> None:
    """The weight sync after step ``step``'s update: the rollout backend samples as version
    ``step + 1`` from here on, the critic's scorer reads the new critic; adds the seconds to
    ``time/weight_sync``. With ``stale_kv=recompute`` the carried rows' KV is rebuilt."""
    with run.tracer.span("learner", "weight_sync", step):
        dt = run.roles.sync(step + 1)
    stats["time/weight_sync"] = stats.get("time/weight_sync", 0.0) + dt
    refresh_kv(run, step + 1)


def new_weights(run: Run, version: int) -> None:
    """The rollout backend samples as ``version`` (a run's or a resume's first step)."""
    run.roles.rollout.set_version(version)
    refresh_kv(run, version)


def refresh_kv(run: Run, version: int) -> None:
    if run.policy.carries and run.policy.recompute_kv and run.roles.rollout.active:
        with run.tracer.span("actor", "recompute_kv", version):
            run.roles.rollout.recompute()


def overlap_stats(run: Run, close, exp: Experience, chunk: int | None) -> dict[str, float]:
    trained = set(close.uids)
    run.trained_lengths = [len(r.response_ids) for r in exp.rollouts]
    # the carried rows' progress is the backend's (one read of its records); none carried: no call
    untrained = run.untrained() if set(run.rollouts) - trained else {}
    return {
        "overlap/delta": run.scheduler.delta, "overlap/carried": len(run.scheduler.in_flight),
        "overlap/waiting_members": run.scheduler.waiting_members,
        **staleness_stats(exp, close.step, close.lags),  # token and sequence lags, IS weights
        "overlap/chunk_size": chunk or 0, "overlap/streaming": float(run.streaming),
        **(run.tuner.metrics() if isinstance(run.tuner, OverlapTuner) and run.tuner.tunes else {}),
        "overlap/in_flight_length_mean": mean_or_nan([len(r.response_ids) for u, r in untrained.items()
                                                if u not in trained] or [0]),
    }


def mean_or_nan(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")
