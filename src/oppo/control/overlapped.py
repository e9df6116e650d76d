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


def overlapped_step(loop: s.Loop, step: int) -> tuple[s.StepResult, dict[str, float]]:
    """The stages of ``sequential_step``, overlapped as ``run.policy`` says (module docstring)."""
    pol, sched, rollout, tracer = loop.policy, loop.scheduler, loop.roles.rollout, loop.tracer
    times: dict[str, float] = {}
    t_gen = time.perf_counter()
    loop.threads.use(loop.threads.decode)  # the actor decodes on its own core(s); the scorers have theirs
    if rollout.version != step:  # a run's or a resume's first step (otherwise loaded at the last one's end)
        s.new_weights(loop, step)
    chunk = loop.chunk()  # None: nothing streams this step (the mode, or the controller's one-shot setting)
    loop.streams.streaming = chunk is not None
    if not loop.streams.next_begun:
        s.admit(loop, sched.begin_step().seqs, step)
    loop.streams.next_begun = False
    # 1-2. admit and decode until the scheduler closes the step
    close = s.decode_until_close(loop, step, chunk)
    times["time/generate"] = time.perf_counter() - t_gen
    loop.threads.use(loop.threads.full)
    # 3. the closed batch's scores (the last chunks, or one-shot)
    t = time.perf_counter()
    batch, texts, exp, scores = s.close_batch(loop, close, step)
    times["time/score"] = time.perf_counter() - t
    t = time.perf_counter()
    stats = s.overlap_stats(loop, close, exp, chunk)  # before the next step is admitted
    # 4-6. the update: here, or in the learner thread while the next step decodes
    if pol.in_flight:
        assert loop.learner_thread is not None  # Loop starts it for an in-flight policy
        update = loop.learner_thread.submit(s.update, loop, exp, texts, scores, step)
    else:
        result = s.update(loop, exp, texts, scores, step)
    s.end_step(loop, scores)  # (pipeline: before the next step begins, while the learner trains)
    if pol.in_flight:
        stats.update(_decode_while_training(loop, step, chunk, update))
        times["time/inflight_decode"] = time.perf_counter() - t
        with tracer.span("controller", "wait_learner", step):
            result = update.result()
        stats["pipeline/rows_at_load"] = rollout.active
    s.sync_weights(loop, result.stats, step)
    times["time/train"] = time.perf_counter() - t
    result.stats.update(stats)
    s.finish(loop, close.uids)
    return result, times


def _decode_while_training(loop: s.Loop, step: int, chunk: int | None, update) -> dict[str, float]:
    """Pipeline: admit the next step's sequences (sampled by this step's weights) and decode them
    until the update is done."""
    nxt, decoded, rollout = step + 1, 0, loop.roles.rollout
    if nxt < loop.steps:
        s.admit(loop, loop.scheduler.begin_step().seqs, step)
        loop.streams.next_begun = True
        t_span = time.perf_counter()
        while not update.done() and rollout.active:
            decoded += rollout.active
            t_span = s.decode_once(loop, step, chunk, t_span, stage="decode_inflight")
        loop.tracer.add("actor", "decode_inflight", step, t_span, time.perf_counter())
    return {"pipeline/inflight_tokens": decoded}
