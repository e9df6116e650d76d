"""Runs the modes of a bench side by side: one Trainer per mode from the same config, their steps
interleaved (step 0 of every mode, then step 1, ...) so that machine noise hits all modes alike;
forced-length runs keep their timings and drop their learning metrics (``docs/bench.md``)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..config import MODES, with_overrides
from ..metrics import MetricsLogger
from .probe import backend_step_probe
from .workloads import LengthWorkload, synthetic_sampler


QUICK = ["ppo.batch_size=32", "ppo.minibatch_size=16", "ppo.micro_batch_size=16"]
LOCAL_BASELINE = "sequential:placement.name=local"
"""The second baseline of a bench under a Ray placement: the best single-process sequential run."""


def split_mode(spec: str) -> tuple[str, list[str]]:
    """``"pipeline:overlap.stale_kv=recompute"`` -> ``("pipeline", ["overlap.stale_kv=recompute"])``."""
    mode, *over = [x.strip() for x in spec.split(":")]
    if mode not in MODES:
        raise ValueError(f"--modes: unknown mode {mode!r} in {spec!r}; choose from {', '.join(MODES)}, optionally "
                         f"with settings after colons (e.g. pipeline:overlap.stale_kv=recompute).")
    return mode, over


def mode_overrides(spec: str) -> list[str]:
    """The settings a mode spec sets: its overlap mode and its own settings."""
    mode, over = split_mode(spec)
    return [f"overlap.mode={mode}", *over]


def slug(spec: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "+" for c in spec.replace(":", "+"))


LEARNING_PREFIXES = ("reward/", "judge/", "task/", "kl/", "loss/", "ppo/", "value/", "grad_norm/")
"""Metrics that describe learning, left out of forced-length (timing-only) runs (``docs/bench.md``)."""

CHECKED = ("loss/policy", "loss/value", "grad_norm/")
"""Kept in timing-only runs all the same: not measures of learning there, but the numbers that show a
run stayed finite (the guard, ``guard.py``, runs in these runs too; ``docs/bench.md``)."""


def timing_only(metrics: dict) -> dict:
    """A forced-length step's metrics: the learning ones (:data:`LEARNING_PREFIXES`) left out but
    for the losses and gradient norms (:data:`CHECKED`), and ``bench/timing_only`` = 1 (``docs/bench.md``)."""
    return {**{k: v for k, v in metrics.items() if k.startswith(CHECKED) or not k.startswith(LEARNING_PREFIXES)},
            "bench/timing_only": 1}


def run_modes(base, modes: list[str], steps: int, out: Path, tail_sigma: float | None = None,
              progress=print, lengths: LengthWorkload | None = None,
              deadline: float | None = None, one_at_a_time: bool = False, on_step=None) -> dict[str, dict]:
    """Run every mode for ``steps`` steps; return per-mode raw records.

    By default the modes are interleaved (step 0 of every mode, then step 1, ...) with every
    mode's Trainer resident, so that machine noise hits them alike. ``one_at_a_time``: each mode
    is built, stepped, closed and freed (``gc.collect``, ``torch.cuda.empty_cache``) before the
    next is built, so one mode's models are resident at a time: what a large model on one GPU
    needs (five 1B trainers do not fit 80 GB). Each mode then runs its steps back to back, as a
    real run does; machine noise is no longer shared, which on a dedicated GPU costs less than on
    a shared CPU (rebuilding every trainer for each round of interleaving would cost a model load
    per mode and step). On CUDA each record then holds ``peak_cuda_mib``: the peak memory
    allocated on each device from the trainer's build to its close (``torch.cuda.max_memory_allocated``,
    reset before the build).

    ``lengths`` forces response lengths (a :class:`LengthWorkload`; ``tail_sigma`` is the sweep's
    shorthand for one); the rollout backend is the config's (``generation.backend``). ``deadline``
    (a ``time.time()``): stop after the round of steps that would end past it, once every mode
    has at least two steps (one warm-up, one timed); one mode at a time, each mode gets an equal
    share of the time left when it starts. ``on_step(mode, step, metrics, trainer)``, if given,
    sees each step's metrics as the trainer returned them (before :func:`timing_only`); what it
    raises stops the run (the trainers are closed). Forced lengths make the runs timing-only:
    their learning metrics are left out of the records and metrics files (:func:`timing_only`).
    """
    import gc

    from ..trainer import Trainer

    trainers, loggers, records = {}, {}, {}
    cuda = torch.cuda.is_available()

    def build(mode: str):
        # run.steps: a pipeline run begins no step beyond the bench's; no checkpoints in a bench
        cfg = with_overrides(base, [*mode_overrides(mode), f"run.out_dir={out / slug(mode)}",
                                    f"run.steps={steps}", "run.save_every=0"])
        Path(cfg.run.out_dir).mkdir(parents=True, exist_ok=True)
        t = Trainer.from_config(cfg, progress=False)
        trainers[mode] = t
        if tail_sigma is not None:
            t.length_sampler = synthetic_sampler(tail_sigma, t.max_new_tokens, cfg.run.seed)
        elif lengths is not None:
            t.length_sampler = lengths.sampler(cfg.run.seed)
        loggers[mode] = MetricsLogger(cfg.run.out_dir)
        records[mode] = {"metrics": [], "sampler": t.length_sampler, "lengths": [], "backend": t.roles.backend}

    def run_step(mode: str, step: int) -> None:
        t = trainers[mode]
        m = t.run_step()
        if on_step is not None:
            on_step(mode, step, m, t)
        if t.length_sampler is not None:
            m = timing_only(m)
        loggers[mode].log(step, m)
        records[mode]["metrics"].append(m)
        assert t.last_result is not None  # run_step set it
        records[mode]["lengths"].append([int(n) for n in t.last_result.exp.mask.sum(1).tolist()])

    def finish(mode: str) -> None:
        t = trainers[mode]
        probe = backend_step_probe(t, t.cfg.ppo.batch_size)
        if probe is not None:
            records[mode]["backend_step_ms"] = 1e3 * probe
            records[mode]["backend_probe_rows"] = t.cfg.ppo.batch_size
        stats = getattr(t.roles.rollout, "capture_stats", None)  # the static backend's decode graphs
        if callable(stats):
            records[mode]["decode_captures"] = stats()
        t.tracer.save(Path(t.cfg.run.out_dir) / "trace.json")
        records[mode]["windows"] = dict(t.step_windows)
        records[mode]["spans"] = t.tracer.spans

    def close(mode: str) -> None:
        t = trainers.pop(mode, None)
        if t is not None:
            t.close()
        if mode in loggers:
            loggers.pop(mode).close()

    if one_at_a_time:
        for i, mode in enumerate(modes):
            if cuda and torch.cuda.is_initialized():  # (before any CUDA work the peaks are 0, and the reset raises)
                for d in range(torch.cuda.device_count()):
                    torch.cuda.reset_peak_memory_stats(d)
            share = None if deadline is None else time.time() + (deadline - time.time()) / (len(modes) - i)
            try:
                build(mode)
                for step in range(steps):
                    t_step = time.time()
                    run_step(mode, step)
                    progress(f"  {mode} step {step + 1}/{steps}: {records[mode]['metrics'][-1]['time/step']:.2f}s")
                    if share is not None and step >= 1 and time.time() + (time.time() - t_step) > share:
                        progress(f"  {mode}: stopping after {step + 1} steps: the next would end past its share "
                                 f"of the time budget")
                        break
                finish(mode)
            finally:
                close(mode)
                gc.collect()  # the trainer's models, optimizer state, KV slots and CUDA graphs
                if cuda:
                    metrics = records.get(mode, {}).get("metrics", [])
                    if mode in records:
                        records[mode]["peak_cuda_mib"] = {
                            f"cuda:{d}": max([torch.cuda.max_memory_allocated(d) / 2**20]
                                             + [m.get(f"memory/cuda{d}_peak_mb", 0.0) for m in metrics])
                            for d in range(torch.cuda.device_count())}  # (the trainer resets the peak each step)
                    torch.cuda.empty_cache()
        return records
    try:
        for mode in modes:  # a mode, or a mode with settings of its own (split_mode)
            build(mode)
        for step in range(steps):
            t_round = time.time()
            for mode in modes:
                run_step(mode, step)
            progress(f"  step {step + 1}/{steps}: " + "  ".join(
                f"{mode} {records[mode]['metrics'][-1]['time/step']:.2f}s" for mode in modes))
            if deadline is not None and step >= 1 and time.time() + (time.time() - t_round) > deadline:
                progress(f"  stopping after {step + 1} steps: the next round would end past the time budget")
                break
        for mode in modes:
            finish(mode)
    finally:
        for mode in modes:
            close(mode)
    return records
