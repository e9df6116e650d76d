"""Decode overhead: what the trainer's generate stage costs per decode step, over its engine's own step.

    PYTHONPATH=src python benchmarks/decode_overhead.py --size small --batch 16 --steps 4 --modes sequential,oppo

A synthetic policy of ``--size`` (``oppo.bench.MODEL_SIZES``, random weights) and a tiny reward
model (also the critic) train for ``--steps`` steps per mode on forced long-tailed lengths (the
representative workload scaled to ``--max-new-tokens``). The rollout backend's ``admit`` and
one decode step (``decode``; ``step`` in engines before it, whose ``step`` also read every row's
tokens) are timed inside the run (wrapped, so the script measures older code the same way), and
per step the report gives:

- ``gen_ms_per_step``: time/generate / the decode steps taken;
- ``engine_ms_per_step``: the time inside the engine's ``step`` and ``admit`` / the decode steps;
- ``overhead``: their ratio, the loop's cost over its engine's (1.0: the loop adds nothing).

On CUDA the engine's calls are synchronised before and after so their time is the device's. The
first step (warm-up) is left out. Prints a markdown table and writes ``--out`` JSON if given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _timed(engine, sync):
    """Wrap the engine's decode step and ``admit`` to count decode steps and accumulate their time."""
    acc = {"steps": 0, "s": 0.0, "reads": 0}
    step = "decode" if hasattr(engine, "decode") else "step"
    for name in (step, "admit"):
        inner = getattr(engine, name)

        def wrapped(*a, _inner=inner, _name=name, **k):
            sync()
            t = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                sync()
                acc["s"] += time.perf_counter() - t
                if _name == step:
                    acc["steps"] += 1

        setattr(engine, name, wrapped)
    return acc


def run(args) -> list[dict]:
    from oppo.bench import WORKLOADS, write_synthetic_models
    from oppo.config import load_config
    from oppo.trainer import Trainer

    root = Path(args.models or tempfile.mkdtemp(prefix="oppo-decode-overhead-"))
    paths = write_synthetic_models(root, args.size, args.reward_size or args.size, device=args.device)
    workload = WORKLOADS["representative"].scaled(args.max_new_tokens)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    rows = []
    for mode in args.modes.split(","):
        cfg = load_config(None, [
            f"policy.path={paths['policy']}", f"reward.path={paths['reward']}", f"data.prompts={paths['prompts']}",
            f"run.out_dir={root / 'runs' / mode}", f"placement.threads={args.threads}", "log.progress=false",
            f"policy.device={args.device}", f"ppo.batch_size={args.batch}", f"ppo.minibatch_size={args.batch}",
            f"ppo.micro_batch_size={min(args.batch, 8)}", f"generation.max_new_tokens={args.max_new_tokens}",
            f"overlap.mode={mode}", *args.overrides])
        t = Trainer.from_config(cfg, progress=False)
        try:
            t.length_sampler = workload.sampler(cfg.run.seed)
            acc = _timed(t.roles.rollout, sync)
            per_step = []
            for i in range(args.steps):
                before = dict(acc)
                m = t.run_step()
                n = acc["steps"] - before["steps"]
                if i and n:
                    per_step.append((1e3 * m["time/generate"] / n, 1e3 * (acc["s"] - before["s"]) / n, n))
            reads = getattr(t.roles.rollout, "host_reads", None)  # the engine's own, whole run (newer engines)
            total = acc["steps"]
        finally:
            t.close()
        gen = statistics.median(p[0] for p in per_step)
        eng = statistics.median(p[1] for p in per_step)
        rows.append({"mode": mode, "gen_ms_per_step": gen, "engine_ms_per_step": eng, "overhead": gen / eng,
                     "decode_steps": [p[2] for p in per_step],
                     "host_reads_per_step": None if reads is None else reads / max(1, total)})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--reward-size", default=None, help="reward model (also the critic) size; default --size")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=4, help="steps per mode, the first untimed")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--modes", default="sequential,oppo")
    p.add_argument("--models", default=None, help="directory for the synthetic models (reused)")
    p.add_argument("--out", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    rows = run(args)
    print(f"| mode | generate ms / decode step | engine ms / decode step | overhead | engine reads / decode step |  "
          f"({args.size}, B={args.batch}, {args.device}, {args.threads} thread(s))")
    print("|---|---|---|---|---|")
    for r in rows:
        reads = "-" if r["host_reads_per_step"] is None else f"{r['host_reads_per_step']:.2f}"
        print(f"| {r['mode']} | {r['gen_ms_per_step']:.2f} | {r['engine_ms_per_step']:.2f} | {r['overhead']:.2f}x | "
              f"{reads} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
