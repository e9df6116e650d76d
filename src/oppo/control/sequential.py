"""The reference loop (``overlap.mode=sequential``): the numbered stages of one PPO step
(``stages.py``), one after another. Every other mode must match it: with no deferral the overlapped
loop trains exactly these batches (tested step for step)."""

from __future__ import annotations

import time

from . import stages as s


def sequential_step(loop: s.Loop, step: int) -> tuple[s.StepResult, dict[str, float]]:
    """One PPO step, stage after stage."""
    rollout, tracer = loop.roles.rollout, loop.tracer
    times: dict[str, float] = {}
    # 1. take B prompts
    batch = s.start(loop, loop.scheduler.begin_step().seqs)
    # 2. generate: sample responses from pi_k with their behaviour log-probs and version
    t = time.perf_counter()
    rollout.set_version(step)
    with tracer.span("actor", "generate", step):
        rollout.admit(batch)
        done = {r.uid: r for r in rollout.generate_all()}  # the backend's records
    batch = [done[r.uid] for r in batch]
    loop.streams.add(batch)
    times["time/generate"] = time.perf_counter() - t
    for r in batch:
        loop.scheduler.on_finished(r.uid)
    close = loop.scheduler.try_close()
    assert close is not None  # the whole batch has finished
    # 3. score: reward at the last token, reference log-probs, critic values
    t = time.perf_counter()
    texts = s.texts(loop, batch)
    scores = s.score(loop, batch, texts, step)
    times["time/score"] = time.perf_counter() - t
    # 4-6. rewards, advantages, PPO epochs; then the weight sync
    t = time.perf_counter()
    exp = s.experience(loop, batch, step)  # the old-log-prob recompute: inside time/train (perf/train_mfu counts it)
    times["time/old_logprobs"] = time.perf_counter() - t
    result = s.update(loop, exp, texts, scores, step)
    s.end_step(loop, scores)
    s.sync_weights(loop, result.stats, step)
    times["time/train"] = time.perf_counter() - t
    s.finish(loop, close.uids)
    return result, times
