"""One overlapped loop for every mode but ``sequential``, driven by an :class:`OverlapPolicy`:
``intra`` streams chunks to the scorers while decoding, ``inter`` carries (B + Delta in flight,
the step closes when B have finished), ``oppo`` does both, and ``pipeline`` also runs the update in
the learner thread while this thread decodes the next step's prompts, loading the new weights
between two decode steps (not bitwise reproducible). With Delta = 0 and max_lag = 0 every mode
trains exactly the batches of ``sequential``.

Design notes (what each mode does, pipeline's versions and checkpoints): docs/overlap.md, "One loop
for every overlapped mode"."""

from __future__ import annotations

import time

from . import stages as s


def overlapped_step(run: s.Run, step: int) -> tuple[s.StepResult, dict[str, float]]:
    """The stages of ``sequential_step``, overlapped as ``run.policy`` says (module docstring)."""
    pol, sched, rollout, tracer = run.policy, run.scheduler, run.roles.rollout, run.tracer
    times: dict[str, float] = {}
    t_gen = time.perf_counter()
    run.threads.use(run.threads.decode)  # the actor decodes on its own core(s); the scorers have theirs
    if rollout.version != step:  # a run's or a resume's first step (otherwise loaded at the last one's end)
        s.new_weights(run, step)
    chunk = run.chunk()  # None: nothing streams this step (the mode, or the controller's one-shot setting)
    run.streams.streaming = chunk is not None
    if not run.streams.next_begun:
        s.admit(run, sched.begin_step().seqs, step)
    run.streams.next_begun = False
    # 1-2. admit and decode until the scheduler closes the step
    close = s.decode_until_close(run, step, chunk)
    times["time/generate"] = time.perf_counter() - t_gen
    run.threads.use(run.threads.full)
    # 3. the closed batch's scores (the last chunks, or one-shot)
    t = time.perf_counter()
    batch, texts, exp, scores = s.close_batch(run, close, step)
    times["time/score"] = time.perf_counter() - t
    t = time.perf_counter()
    stats = s.overlap_stats(run, close, exp, chunk)  # before the next step is admitted
    # 4-6. the update: here, or in the learner thread while the next step decodes
    if pol.in_flight:
        assert run.learner_thread is not None  # Run starts it for an in-flight policy
        update = run.learner_thread.submit(s.update, run, exp, texts, scores, step)
    else:
        result = s.update(run, exp, texts, scores, step)
    s.end_step(run, scores)  # (pipeline: before the next step begins, while the learner trains)
    if pol.in_flight:
        stats.update(_decode_while_training(run, step, chunk, update))
        times["time/inflight_decode"] = time.perf_counter() - t
        with tracer.span("controller", "wait_learner", step):
            result = update.result()
        stats["pipeline/rows_at_load"] = rollout.active
    s.sync_weights(run, result.stats, step)
    times["time/train"] = time.perf_counter() - t
    result.stats.update(stats)
    s.finish(run, close.uids)
    return result, times


def _decode_while_training(run: s.Run, step: int, chunk: int | None, update) -> dict[str, float]:
    """Pipeline: admit the next step's sequences (sampled by this step's weights) and decode them
    until the update is done."""
    nxt, decoded, rollout = step + 1, 0, run.roles.rollout
    if nxt < run.steps:
        s.admit(run, run.scheduler.begin_step().seqs, step)
        run.streams.next_begun = True
        t_span = time.perf_counter()
        while not update.done() and rollout.active:
            decoded += rollout.active
            t_span = s.decode_once(run, step, chunk, t_span, stage="decode_inflight")
        run.tracer.add("actor", "decode_inflight", step, t_span, time.perf_counter())
    return {"pipeline/inflight_tokens": decoded}
