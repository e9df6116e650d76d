"""What a run prints as it starts: the CPU threads, the models it loads, whether it trains
on-policy, and the samples of its first and last steps."""

from __future__ import annotations

import os
import sys

from .. import modes
from ..config import Config, OverlapConfig, PlacementConfig, PPOConfig


def print_samples(title: str, texts, scores, n: int) -> None:
    """The first ``n`` (prompt, response) pairs with their scores, on stderr."""
    if n <= 0:
        return
    print(f"\n{title}", file=sys.stderr)
    for (prompt, response), s in list(zip(texts, scores))[:n]:
        print(f"  [{s:+.3f}] {prompt} ||| {response}", file=sys.stderr)



def policy_line(overlap: OverlapConfig, ppo: PPOConfig) -> str:
    """One line for the run's start: whether it trains on-policy tokens only (no sequence outlives
    the weights that began it) or may train off-policy ones (carried across an update, or sampled
    while the learner trained), and the settings that give TRL's PPOTrainer behaviour (from the
    ``overlap`` and ``ppo`` sections)."""
    o, B = overlap, ppo.batch_size
    mode = modes.get(o.mode)
    trl = (f"for TRL's PPOTrainer (on-policy, its defaults): overlap.mode=sequential ppo.epochs=4 "
           f"ppo.minibatch_size={B} generation.temperature=0.7 (docs/from-trl.md)")
    extra = o.delta if o.delta >= 0 else o.delta_max  # adaptive Delta goes up to delta_max
    if mode.in_flight:
        why = (f"overlap.mode={o.mode} loads new weights while sequences decode and carries up to Delta unfinished "
               f"ones into the next step (overlap.max_lag={o.max_lag})")
    elif mode.carries and extra > 0 and o.max_lag > 0:
        delta = (f"overlap.delta={o.delta}" if o.delta >= 0 else
                 f"adaptive Delta up to overlap.delta_max={o.delta_max}, starting at overlap.delta_min={o.delta_min}"
                 + (f" and kept only where carrying measurably shortens the step, adding at most "
                    f"overlap.max_stale_share={o.max_stale_share:g} of off-policy tokens" if o.delta_rule == "cost"
                    else " (overlap.delta_rule=reward_slope)"))
        why = (f"overlap.mode={o.mode} keeps extra sequences in flight ({delta}) and carries unfinished ones into "
               f"the next step (overlap.max_lag={o.max_lag})")
    else:
        how = ("stage after stage" if o.mode == "sequential" else "with no extra sequences in flight" if mode.carries
               else "scoring while decoding, carrying nothing")
        return (f"on-policy: overlap.mode={o.mode} ({how}) trains every step on tokens the step's own policy "
                f"sampled; {trl}")
    return (f"may train off-policy tokens: {why}, their PPO ratios importance-weighted by the behaviour "
            f"log-probs (ppo.is_truncate={ppo.is_truncate}); {trl}")


def loading_line(cfg: Config) -> str:
    """One line before the models load (minutes for large ones, with nothing else printed): which
    models, from where, so that a slow or wrong load is seen before it ends."""
    if cfg.uses_builtin_task:
        from ..task import get_task

        task = f"the {cfg.data.task} task's"
        policy = f"{task} SFT policy"
        builtin_fn = get_task(cfg.data.task).reward_function
    else:
        task, policy, builtin_fn = "", str(cfg.policy.path), None
    fn = cfg.reward.function or (None if cfg.reward.path else builtin_fn)
    reward = f"function {fn}" if fn else cfg.reward.path or f"{task} reward model"
    first_rm = cfg.reward.path
    if cfg.reward.terms:  # (validated) the weighted sum, each term by what it reads
        from ..rewards import parse_terms

        terms = parse_terms(cfg.reward.terms)
        reward = " + ".join(f"{t.weight:g} x {t.path or t.function}" for t in terms)
        fn, first_rm = None, next((t.path for t in terms if t.path), None)
    parts = [f"policy {policy}", f"reward {reward}",
             f"reference {cfg.reference.path or 'a frozen copy of the policy'}"]
    if cfg.algo_spec.needs_critic:  # initialised as resolve_paths says: the reward model's, else the policy's
        critic = cfg.critic.path or first_rm or (f"{task} reward model" if cfg.uses_builtin_task and not fn
                                                 and not cfg.reward.terms else policy)
        parts.append(f"critic from {critic}")
    if cfg.reward.judge:
        parts.append(f"judge {cfg.reward.judge}")
    return "loading models: " + ", ".join(parts) + " ..."


def machine_threads() -> tuple[int, int, int | None, float | None]:
    """This process's torch thread count, the machine's cores, the cores this process may run on
    (None where the OS does not say) and the load other work puts on them (None where the OS does not
    say): the 1-minute load average, but no more than the tasks runnable now besides this one
    (:func:`others_runnable`). The average alone lags a minute: right after ``make demo``'s
    ``pip install`` (or any burst that has just ended) it stood above 2 on an idle 2-core machine and the
    README's first command warned "oversubscribed" (issue 53)."""
    import torch

    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on macOS / Windows
        usable = None
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    try:
        with open("/proc/loadavg") as f:
            now = others_runnable(f.read())
    except OSError:  # (not Linux)
        now = None
    if load is not None and now is not None:
        load = min(load, float(now))
    return torch.get_num_threads(), os.cpu_count() or 1, usable, load


def others_runnable(loadavg: str) -> int | None:
    """The tasks runnable now but this process's reading thread, from ``/proc/loadavg``'s text (its
    fourth field, ``runnable/total``, counts the reader itself); None if it does not parse."""
    try:
        return max(0, int(loadavg.split()[3].split("/")[0]) - 1)
    except (IndexError, ValueError):
        return None


def threads_lines(placement: PlacementConfig, streams: bool, torch_threads: int, cores: int, usable: int | None,
                  load: float | None) -> list[str]:
    """The start-up lines on CPU threads: the count torch uses and where it comes from (the
    ``placement`` section; ``streams``: the mode scores while decoding, ``Config.streams``), and,
    when the machine is already busier than the cores this run may use, a warning with the fix:
    there torch's threads wait on each other and steps can be many times slower (``docs/guide.md``)."""
    pl = placement
    full = pl.threads or torch_threads
    source = f"placement.threads={pl.threads}" if pl.threads else "placement.threads=0: torch's default"
    cpus = f"{usable} usable of {cores} cores" if usable is not None and usable != cores else f"{cores} cores"
    line = f"threads: torch {full} ({source}); {cpus}"
    if streams:
        line += (f"; while decoding, actor {pl.actor_threads} and scorer {pl.scorer_threads} "
                 f"(placement.actor_threads, placement.scorer_threads)")
    if load is not None:
        line += f"; load average {load:.1f}"
    lines = [line]
    avail = usable if usable is not None else cores
    if load is not None and load > avail:
        fix = ("set placement.threads=1 (or fewer threads than the idle cores)" if full > 1 else
               "this run already uses one thread: free some cores")
        lines.append(f"oppo: warning: the machine is oversubscribed (load average {load:.1f} over {avail} usable "
                     f"cores before this run starts): torch's threads will wait on each other and steps can be many "
                     f"times slower; {fix}")
    return lines

