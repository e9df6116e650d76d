"""A step's metrics: what the trained batch says (reward, KL, lengths, the learner's stats), the
time each stage took, memory, and the task's own measures."""

from __future__ import annotations

import resource

import torch

from ..algo.losses import explained_variance
from ..api.records import RolloutStats
from ..perf import peak_flops, spec_peak_flops
from .stages import Loop, StepResult, mean_or_nan, mean_reward


def step_metrics(loop: Loop, result: StepResult, times: dict[str, float], dt: float, wallclock: float
                 ) -> dict[str, float]:
    exp, roles = result.exp, loop.roles
    assert exp.scores is not None and exp.kl is not None  # a trained batch was scored and shaped
    lengths = exp.mask.sum(1)
    kl_seq = (exp.kl * exp.mask).sum(1)
    m = {
        "reward/mean": mean_reward(exp.scores), "reward/std": exp.scores.std().item() if len(exp.scores) > 1 else 0.0,
        "kl/mean": kl_seq.mean().item(),
        "response_length/mean": lengths.mean().item(), "response_length/max": lengths.max().item(),
        "response_length/eos_frac": mean_or_nan([float(r.ended_with_eos) for r in exp.rollouts]),
        "time/step": dt, "time/wallclock": wallclock,
        "perf/tokens_per_s": lengths.sum().item() / dt,
        "data/prompts_truncated": roles.prompt_set.truncated, "data/prompts_skipped": roles.prompt_set.skipped,
        **times,
    }
    if exp.values is not None and exp.returns is not None:
        m["value/explained_var"] = explained_variance(exp.values, exp.returns, exp.mask).item()
    m.update({k: v for k, v in result.stats.items() if not k.startswith("_")})
    rollout = roles.rollout.take_stats()  # once per step: the backend's counters restart
    m.update(utilisation(loop, result, times, rollout))
    m.update(memory(loop, rollout))
    prompts, responses = [p for p, _ in result.texts], [r for _, r in result.texts]
    context = roles.prompt_set.context([r.prompt_index for r in exp.rollouts])  # (the records' columns)
    if roles.judge_fn is not None:
        m["judge/mean"] = mean_or_nan(roles.judge_fn(prompts, responses, context=context))
    if roles.accuracy_fn is not None:
        m["task/accuracy"] = mean_or_nan(roles.accuracy_fn(prompts, responses, context=context))
    return m


def utilisation(loop: Loop, result: StepResult, times: dict[str, float], rollout: RolloutStats) -> dict[str, float]:
    """How hard the stages drive the hardware (``oppo.perf``): each stage's model FLOPs utilisation
    against the device's measured peak (``perf/peak_tflops``, compute dtype, once per process) and,
    where the device is known, against its spec peak (``perf/peak_spec_tflops``: ``*_mfu_spec``):

    - ``perf/generate_mfu``: the actor's forward over the trained sequences' tokens / time/generate,
      plus time/inflight_decode in pipeline mode;
    - ``perf/train_mfu``: every forward the train window holds / time/train: forward and backward
      of actor and critic, every epoch, and the actor's old-log-prob forward (``Learner.old_logprobs``)
      where it runs inside time/train (the sequential loop times it there, ``time/old_logprobs``; the
      overlapped loops run it in close_batch, inside time/score). At one epoch (the default) it is
      a quarter of the actor's FLOPs in the window; left out, sequential and overlapped train MFU
      were not comparable (issue 46).

    And the decode loop's time per decode step (``perf/decode_step_ms``: that generate time / the
    decode steps the backend took, where it counts them). Exact for ``sequential``; in the
    overlapped modes a step's stages also hold other steps' work (carried rows, the update beside
    decoding), so read their figures as rates, not utilisations."""
    roles, exp = loop.roles, result.exp
    out: dict[str, float] = {}
    generate = times.get("time/generate", 0.0) + times.get("time/inflight_decode", 0.0)  # (pipeline: both)
    done = rollout.decode_steps  # (counted by oppo's backends)
    if done is not None:
        out["perf/decode_steps"] = float(done)
        if done and generate:
            out["perf/decode_step_ms"] = 1e3 * generate / done
    if roles.actor_flops is None:
        return out
    lengths = exp.valid.sum(1).tolist()
    peak = peak_flops(str(roles.device), roles.compute_dtype, torch.get_num_threads())
    out["perf/peak_tflops"] = peak / 1e12
    spec = spec_peak_flops(str(roles.device), roles.compute_dtype)
    if spec is not None:
        out["perf/peak_spec_tflops"] = spec / 1e12
    actor = roles.actor_flops(lengths)
    epochs = roles.settings.ppo.epochs
    train = 3 * epochs * actor
    if roles.critic_flops is not None:
        train += 3 * epochs * roles.critic_flops(lengths)
    if "time/old_logprobs" in times:  # the recompute ran inside time/train
        train += roles.actor_flops(recomputed_lengths(exp, roles.recompute_old))
    if generate:
        out["perf/generate_mfu"] = actor / generate / peak
        if spec is not None:
            out["perf/generate_mfu_spec"] = actor / generate / spec
    if times.get("time/train"):
        out["perf/train_tflops"] = train / times["time/train"] / 1e12
        out["perf/train_mfu"] = train / times["time/train"] / peak
        if spec is not None:
            out["perf/train_mfu_spec"] = train / times["time/train"] / spec
    return out


def recomputed_lengths(exp, recompute_all: bool) -> list[int]:
    """The lengths (prompt + response tokens) of the rows whose old log-probs the learner's forward
    recomputed (``Learner.old_logprobs``): every row with a response token under ``recompute_all``,
    else the rows holding an off-policy token (sampled by a version older than the batch's newest)."""
    mask = exp.mask > 0  # [B, T]
    if recompute_all:
        rows = mask.any(1)
    else:
        newest = exp.versions[mask].max() if mask.any() else 0
        rows = ((exp.versions < newest) & mask).any(1)
    return exp.valid[rows].sum(1).tolist()


def memory(loop: Loop, rollout: RolloutStats) -> dict[str, float]:
    """Memory of this step (MiB): the actor's KV-cache peak, the streaming scorers' (peak so
    far), on GPU each device's peak allocation during the step (reset after reading), and the
    process's peak resident memory (all roles of this process; the scorer process apart)."""
    mb = 1024 * 1024
    out = {"memory/actor_kv_peak_mb": rollout.kv_peak_bytes / mb}
    if loop.policy.streams:
        for role, peak in loop.roles.scorer.peak_cache_bytes.items():
            out[f"memory/{role}_kv_peak_mb"] = peak / mb
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            out[f"memory/cuda{i}_peak_mb"] = torch.cuda.max_memory_allocated(i) / mb
            torch.cuda.reset_peak_memory_stats(i)
    out["memory/host_rss_peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return out
