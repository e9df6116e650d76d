"""``oppo bench``: the same workload in every mode, side by side, in one invocation.

Every mode gets its own Trainer built from the same config (same data, seed, models, batch);
steps are interleaved (step 0 of every mode, then step 1 of every mode, ...) so that machine
noise hits all modes alike. Timings skip the first (warm-up) step. Reported per mode: median
and spread of step time, speedup over ``sequential``, tokens per second, each worker's busy
fraction, bubble ratio against the ideal bound (the busiest worker's busy time), mean reward at
the last step and time to a target reward. ``--tail`` adds a synthetic workload whose response
lengths are drawn from a log-normal of the given sigma (heavier tail for larger sigma), to
measure speedup against tail heaviness. No mode is tuned differently from the others; the
settings table in bench.md says what all of them ran with.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from .config import MODES, load_config, to_dict
from .metrics import MetricsLogger
from .trace import busy_seconds

QUICK = ["ppo.batch_size=32", "ppo.minibatch_size=16", "ppo.micro_batch_size=16"]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    desc = f"{os.cpu_count()} CPU cores ({cpu}), torch {torch.__version__}"
    if torch.cuda.is_available():
        desc += f", GPU {torch.cuda.get_device_name(0)}"
    return desc


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _length_sampler(sigma: float, median: float, max_len: int, seed: int):
    def sample(prompt_index: int) -> int:
        rng = random.Random(seed * 1_000_003 + prompt_index)
        return max(1, min(max_len, int(round(median * math.exp(rng.gauss(0.0, sigma))))))
    return sample


def run_modes(base, modes: list[str], steps: int, out: Path, tail_sigma: float | None = None,
              progress=print) -> dict[str, dict]:
    """Run every mode for ``steps`` steps, interleaved; return per-mode raw records."""
    from .trainer import Trainer

    trainers, loggers, records = {}, {}, {}
    for mode in modes:
        cfg = copy.deepcopy(base)
        cfg.overlap.mode = mode
        cfg.run.out_dir = str(out / mode)
        Path(cfg.run.out_dir).mkdir(parents=True, exist_ok=True)
        t = Trainer(cfg, progress=False)
        if tail_sigma is not None:
            t.length_sampler = _synthetic_sampler(tail_sigma, t.max_new_tokens, cfg.run.seed)
        trainers[mode] = t
        loggers[mode] = MetricsLogger(cfg.run.out_dir)
        records[mode] = {"metrics": [], "sampler": t.length_sampler}
    try:
        for step in range(steps):
            for mode in modes:
                m = trainers[mode].run_step()
                loggers[mode].log(step, m)
                records[mode]["metrics"].append(m)
            progress(f"  step {step + 1}/{steps}: " + "  ".join(
                f"{mode} {records[mode]['metrics'][-1]['time/step']:.2f}s" for mode in modes))
        for mode, t in trainers.items():
            t.tracer.save(out / mode / "trace.json")
            records[mode]["windows"] = dict(t.step_windows)
            records[mode]["spans"] = t.tracer.spans
    finally:
        for mode in modes:
            trainers[mode].close()
            loggers[mode].close()
    return records


def summarize(records: dict[str, dict], warmup: int = 1, target: float | None = None) -> dict:
    """Per-mode figures from raw records (see the module docstring)."""
    seq = records.get("sequential")
    if target is None and seq is not None:
        last = [m["reward/mean"] for m in seq["metrics"][-3:]]
        target = sum(last) / len(last)
    out = {}
    for mode, rec in records.items():
        ms = rec["metrics"]
        times = [m["time/step"] for m in ms[warmup:]] or [m["time/step"] for m in ms]
        steps = sorted(rec["windows"])[warmup:] or sorted(rec["windows"])
        total = sum(rec["windows"][s][1] - rec["windows"][s][0] for s in steps)
        busy: dict[str, float] = {}
        busiest_sum = 0.0
        for s in steps:
            t0, t1 = rec["windows"][s]
            b = busy_seconds(rec["spans"], t0, t1)
            for w, v in b.items():
                busy[w] = busy.get(w, 0.0) + v
            busiest_sum += max(b.values(), default=0.0)
        wall, reached = 0.0, None
        rewards = [m["reward/mean"] for m in ms]
        for i, m in enumerate(ms):
            wall += m["time/step"]
            avg = sum(rewards[max(0, i - 2): i + 1]) / len(rewards[max(0, i - 2): i + 1])
            if reached is None and target is not None and avg >= target:
                reached = wall
        out[mode] = {
            "steps": len(ms),
            "step_time_median_s": statistics.median(times),
            "step_time_p25_s": _pct(times, 0.25), "step_time_p75_s": _pct(times, 0.75),
            "tokens_per_s": statistics.median([m["perf/tokens_per_s"] for m in ms[warmup:]] or [0.0]),
            "busy_fraction": {w: v / total for w, v in sorted(busy.items())} if total else {},
            "bubble_ratio": 1.0 - busiest_sum / total if total else float("nan"),
            "reward_last": rewards[-1],
            "judge_last": ms[-1].get("judge/mean"),
            "time_to_target_s": reached,
            "response_length_mean": statistics.mean(m["response_length/mean"] for m in ms),
            "cpu_util": statistics.median([m["perf/cpu_util"] for m in ms[warmup:]] or [0.0]),
        }
    if "sequential" in out:
        base = out["sequential"]["step_time_median_s"]
        speed = {m: base / v["step_time_median_s"] for m, v in out.items()}
        seq_busiest = max(out["sequential"]["busy_fraction"].values(), default=float("nan"))
        util = {m: max(v["busy_fraction"].values(), default=float("nan")) / seq_busiest for m, v in out.items()}
    else:
        speed, util = {}, {}
    return {"modes": out, "speedup": speed, "busiest_busy_ratio": util, "target_reward": target}


def to_markdown(result: dict) -> str:
    lines = ["# oppo bench", "", f"Machine: {result['machine']}", "",
             f"Command: `{result['command']}`", "",
             f"Workload: {result['workload']}; {result['steps']} steps per mode, interleaved; "
             f"timings skip the first step.", "",
             "| mode | step time median (s) | p25-p75 (s) | speedup | tokens/s | busy fraction (actor / scorer / learner) "
             "| busiest vs sequential | bubble ratio | CPU use | reward (last) | time to target (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, v in result["modes"].items():
        bf = v["busy_fraction"]
        busy = " / ".join(f"{bf.get(w, 0.0):.2f}" for w in ("actor", "scorer", "learner"))
        ttt = f"{v['time_to_target_s']:.1f}" if v["time_to_target_s"] is not None else "not reached"
        lines.append(f"| {mode} | {v['step_time_median_s']:.2f} | {v['step_time_p25_s']:.2f}-{v['step_time_p75_s']:.2f} "
                     f"| {result['speedup'].get(mode, float('nan')):.2f}x | {v['tokens_per_s']:.0f} | {busy} "
                     f"| {result['busiest_busy_ratio'].get(mode, float('nan')):.2f}x | {v['bubble_ratio']:.2f} "
                     f"| {v['cpu_util']:.0%} "
                     f"| {v['reward_last']:.3f} | {ttt} |")
    lines += ["", f"Target reward: {result['target_reward']:.3f} (sequential's mean over its last 3 steps unless "
              f"--target was given); time to target uses a 3-step moving average. CPU use: process CPU time "
             f"over wall time times cores (how much of the machine the mode kept busy; OpenMP spin-waits count as busy, "
             f"and a scorer worker in its own process is not counted).", ""]
    if result.get("tail_sweep"):
        lines += ["## Speedup against tail heaviness (synthetic lengths, log-normal sigma)", "",
                  "| sigma | length p50 | length p99 | " + " | ".join(f"{m} speedup" for m in result["tail_modes"]) + " |",
                  "|---|---|---|" + "---|" * len(result["tail_modes"])]
        for row in result["tail_sweep"]:
            lines.append(f"| {row['sigma']} | {row['length_p50']:.0f} | {row['length_p99']:.0f} | "
                         + " | ".join(f"{row['speedup'].get(m, float('nan')):.2f}x" for m in result["tail_modes"]) + " |")
        lines.append("")
    lines += ["## Settings (all modes)", "", "```yaml", result["settings"], "```", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="oppo bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="A small budget: under 10 minutes on 2 CPU cores.")
    p.add_argument("--out", default="benchmarks/latest", help="Output directory (bench.json, bench.md, PNGs).")
    p.add_argument("--modes", default=",".join(MODES), help="Comma-separated modes.")
    p.add_argument("--steps", type=int, default=None, help="Steps per mode, the first untimed (default 21; --quick 11).")
    p.add_argument("--tail", default=None,
                   help="Comma-separated log-normal sigmas for the synthetic-length sweep (e.g. 0.25,0.75,1.25).")
    p.add_argument("--tail-steps", type=int, default=4, help="Steps per mode at each sigma of the sweep.")
    p.add_argument("--tail-modes", default=",".join(MODES), help="Modes compared in the tail sweep.")
    p.add_argument("--target", type=float, default=None, help="Target reward for time-to-target.")
    p.add_argument("--config", default=None, help="YAML settings shared by every mode.")
    p.add_argument("overrides", nargs="*", help="section.key=value settings shared by every mode.")
    args = p.parse_args(argv)
    if args.quick and args.tail is None:
        args.tail = "0.5,1.0,1.5"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"--modes: unknown mode(s) {bad}; choose from {', '.join(MODES)}.")
    overrides = (QUICK if args.quick else []) + list(args.overrides) + ["log.progress=false", "run.samples=0"]
    base = load_config(args.config, overrides)
    steps = args.steps or (11 if args.quick else 21)  # the first step is a warm-up, not timed
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    started = time.time()
    say(f"oppo bench: {', '.join(modes)} x {steps} steps, interleaved -> {out}")
    records = run_modes(base, modes, steps, out / "runs", progress=say)
    result = summarize(records, target=args.target)
    result.update(machine=machine(), command="oppo bench " + " ".join(argv), steps=steps,
                  workload=f"built-in task '{base.data.task}'" if base.uses_builtin_task else "user models",
                  settings=_settings_yaml(base))
    if args.tail:
        tail_modes = [m.strip() for m in args.tail_modes.split(",")]
        sweep = []
        for sigma in (float(s) for s in args.tail.split(",")):
            say(f"tail sweep: sigma={sigma}")
            rec = run_modes(base, tail_modes, args.tail_steps, out / "tail" / f"sigma_{sigma}", sigma, progress=say)
            s = summarize(rec)
            sampler = rec[tail_modes[0]]["sampler"]
            sampler_lens = [sampler(i) for i in range(2000)]  # the distribution the runs drew from
            sweep.append({"sigma": sigma, "speedup": s["speedup"], "length_p50": _pct(sampler_lens, 0.5),
                          "length_p99": _pct(sampler_lens, 0.99),
                          "step_time_median_s": {m: v["step_time_median_s"] for m, v in s["modes"].items()}})
        result["tail_sweep"], result["tail_modes"] = sweep, tail_modes
    result["seconds"] = time.time() - started
    (out / "bench.json").write_text(json.dumps(_jsonable(result), indent=1))
    (out / "bench.md").write_text(to_markdown(result))
    from .report import make_report

    make_report([out / "runs" / m for m in modes], out, labels=modes)
    say((out / "bench.md").read_text())
    return 0


def _synthetic_sampler(sigma: float, max_new_tokens: int, seed: int):
    """Log-normal response lengths with median max_new_tokens / 12, clipped to max_new_tokens."""
    return _length_sampler(sigma, max(2, max_new_tokens // 12), max_new_tokens, seed)


def _settings_yaml(cfg) -> str:
    import yaml

    d = to_dict(cfg)
    d.pop("log", None)
    d["overlap"].pop("mode", None)
    return yaml.safe_dump(d, sort_keys=False).strip()


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
