"""What a bench's runs add up to: per-mode step times, speedups, busy fractions, bubble ratios,
stage profiles and hardware figures (``bench.json``), and their Markdown tables (``bench.md``)."""

from __future__ import annotations

import math
import os
import platform
import statistics
import time

import torch

from ..config import to_dict
from ..trace import busy_seconds
from .runner import LOCAL_BASELINE
from .workloads import pct


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


HARDWARE = {"generate_mfu": "perf/generate_mfu", "train_mfu": "perf/train_mfu", "train_tflops": "perf/train_tflops",
            "train_padded_frac": "perf/train_padded_frac", "decode_step_ms": "perf/decode_step_ms",
            "peak_tflops": "perf/peak_tflops"}
"""bench.json's per-mode ``hardware`` figures: the median over timed steps of these step metrics."""


def _hardware(rec: dict, ms: list[dict]) -> dict:
    """How hard a mode drove the hardware (``control.step_metrics.utilisation``), with the decode
    overhead: the generate stage's time per decode step over the backend's own (probe) step."""
    out = {}
    for name, key in HARDWARE.items():
        vals = [m[key] for m in ms if key in m]
        if vals:
            out[name] = statistics.median(vals)
    if "backend_step_ms" in rec:
        out["backend_step_ms"] = rec["backend_step_ms"]
        out["backend_probe_rows"] = rec["backend_probe_rows"]
        if "decode_step_ms" in out:
            out["decode_overhead"] = out["decode_step_ms"] / rec["backend_step_ms"]
    if "decode_captures" in rec:  # graphs (or compiled variants) made on a bucket's first step: in some timed step
        out["decode_captures"] = rec["decode_captures"]["captures"]
        out["decode_capture_s"] = rec["decode_captures"]["seconds"]
    return out


def hardware_markdown(modes: dict) -> list[str]:
    """The hardware-use table of ``bench.md`` (modes with ``hardware`` figures)."""
    rows = {m: v["hardware"] for m, v in modes.items() if v.get("hardware")}
    if not rows:
        return []
    peak = next((h["peak_tflops"] for h in rows.values() if "peak_tflops" in h), float("nan"))

    def f(h, k, fmt):
        return format(h[k], fmt) if k in h else "-"

    lines = ["## Hardware use", "",
             f"Model FLOPs utilisation against this device's measured peak ({peak:.3g} TFLOP/s: a matmul in the "
             f"compute dtype, same run). Exact for sequential; in overlapped modes a stage also holds other steps' "
             f"work. Decode overhead: the generate stage's time per decode step over the backend's own step (a probe "
             f"of the same backend alone, every row decoding: it errs low). Padded: the share of the learner's "
             f"computed positions that are padding. Decode graphs: the static backend's captures over the run (each "
             f"on its bucket's first step, inside that step) and their seconds.", "",
             "| mode | generate MFU | train MFU | train TFLOP/s | padded | decode ms/step | backend ms/step (probe) "
             "| decode overhead | decode graphs (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for m, h in rows.items():
        graphs = f"{h['decode_captures']} ({h['decode_capture_s']:.1f} s)" if "decode_captures" in h else "-"
        lines.append(f"| {m} | {f(h, 'generate_mfu', '.2%')} | {f(h, 'train_mfu', '.2%')} | "
                     f"{f(h, 'train_tflops', '.3g')} | {f(h, 'train_padded_frac', '.1%')} | "
                     f"{f(h, 'decode_step_ms', '.2f')} | {f(h, 'backend_step_ms', '.2f')} | "
                     f"{f(h, 'decode_overhead', '.2f')}{'x' if 'decode_overhead' in h else ''} | {graphs} |")
    return lines + [""]


def summarize(records: dict[str, dict], warmup: int = 1, target: float | None = None) -> dict:
    """Per-mode figures from raw records (``docs/bench.md``)."""
    seq = records.get("sequential")
    if target is None and seq is not None and all("reward/mean" in m for m in seq["metrics"]):
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
        timing = any(m.get("bench/timing_only") for m in ms)  # forced lengths: no learning metrics
        rewards = [m["reward/mean"] for m in ms] if not timing else []
        for i, m in enumerate(ms if not timing else []):
            wall += m["time/step"]
            avg = sum(rewards[max(0, i - 2): i + 1]) / len(rewards[max(0, i - 2): i + 1])
            if reached is None and target is not None and avg >= target:
                reached = wall
        out[mode] = {
            "steps": len(ms),
            "step_time_median_s": statistics.median(times),
            "step_time_p25_s": pct(times, 0.25), "step_time_p75_s": pct(times, 0.75),
            "tokens_per_s": statistics.median([m["perf/tokens_per_s"] for m in ms[warmup:]] or [0.0]),
            "busy_fraction": {w: v / total for w, v in sorted(busy.items())} if total else {},
            "bubble_ratio": 1.0 - busiest_sum / total if total else float("nan"),
            "timing_only": timing,
            "reward_last": rewards[-1] if rewards else None,
            "judge_last": ms[-1].get("judge/mean"),
            "time_to_target_s": reached,
            "response_length_mean": statistics.mean(m["response_length/mean"] for m in ms),
            "cpu_util": statistics.median([m["perf/cpu_util"] for m in ms[warmup:]] or [0.0]),
            "backend": rec.get("backend"),  # which rollout backend ran (generation.backend=auto resolved)
            "hardware": _hardware(rec, ms[warmup:] or ms),
            **({"peak_cuda_mib": rec["peak_cuda_mib"]} if "peak_cuda_mib" in rec else {}),  # (one mode at a time)
        }
    if "sequential" in out:
        base = out["sequential"]["step_time_median_s"]
        speed = {m: base / v["step_time_median_s"] for m, v in out.items()}
        seq_busiest = max(out["sequential"]["busy_fraction"].values(), default=float("nan"))
        util = {m: max(v["busy_fraction"].values(), default=float("nan")) / seq_busiest for m, v in out.items()}
    else:
        speed, util = {}, {}
    res = {"modes": out, "speedup": speed, "busiest_busy_ratio": util, "target_reward": target}
    if LOCAL_BASELINE in out:
        base = out[LOCAL_BASELINE]["step_time_median_s"]
        res["speedup_vs_local"] = {m: base / v["step_time_median_s"] for m, v in out.items()}
    return res


def stage_profile(records: dict[str, dict], workload: str, warmup: int = 1, mode: str = "sequential") -> dict:
    """Where the sequential step's time goes (median seconds and share of the step for generate,
    score and train) and the response lengths it trained on (p50, p99, max over every trained
    sequence). ``mode`` falls back to the first mode run when ``sequential`` was not."""
    if mode not in records:
        mode = next(iter(records))
    ms = records[mode]["metrics"]
    ms = ms[warmup:] or ms
    med = {k: statistics.median(m.get(f"time/{k}", 0.0) for m in ms) for k in ("generate", "score", "train", "step")}
    lens = [n for step in records[mode].get("lengths", [])[warmup:] or records[mode].get("lengths", []) for n in step]
    p50 = pct(lens, 0.5) if lens else float("nan")
    p99 = pct(lens, 0.99) if lens else float("nan")
    shares = {k: med[k] / med["step"] if med["step"] else float("nan") for k in ("generate", "score", "train")}
    return {"workload": workload, "mode": mode, "step_s": med["step"],
            **{f"{k}_s": med[k] for k in ("generate", "score", "train")},
            **{f"{k}_share": v for k, v in shares.items()},
            "largest": max(shares, key=lambda k: shares[k]),
            "length_p50": p50, "length_p99": p99, "length_max": max(lens) if lens else None,
            "p99_over_p50": p99 / p50 if lens and p50 else float("nan"), "sequences": len(lens)}


def stage_profile_markdown(rows: list[dict]) -> list[str]:
    """The stage-profile table: one row per workload, the headline first."""
    if not rows:
        return []
    lines = ["## Stage profile (where the sequential step's time goes)", "",
             "| workload | step (s) | generate | score | train | largest | response length p50 / p99 / max "
             "| p99/p50 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mx = r["length_max"] if r["length_max"] is not None else float("nan")
        lines.append(f"| {r['workload']} | {r['step_s']:.2f} | {r['generate_s']:.2f} s ({r['generate_share']:.0%}) "
                     f"| {r['score_s']:.2f} s ({r['score_share']:.0%}) | {r['train_s']:.2f} s ({r['train_share']:.0%}) "
                     f"| {r['largest']} | {r['length_p50']:.0f} / {r['length_p99']:.0f} / {mx:.0f} "
                     f"| {r['p99_over_p50']:.1f} |")
    head = rows[0]
    lines += ["", f"Measured on `{head['mode']}` (stages one after another; the first step excluded). Headline "
              f"workload: {head['largest']} is the largest share of the step ({head[head['largest'] + '_share']:.0%})"
              + (", as in real RLHF, where decoding the longest response bounds the step." if head["largest"] == "generate"
                 else "; real RLHF runs are generation-bound, so read these speedups as this regime's, not theirs.")
              + " Lengths are those of the sequences trained (forced where the workload says so).", ""]
    return lines


def to_markdown(result: dict) -> str:
    lines = ["# oppo bench", "", f"Machine: {result['machine']}", "",
             f"Command: `{result['command']}`", "",
             f"Workload: {result['workload']}; {result['steps']} steps per mode, "
             f"{result.get('schedule', 'interleaved')}; timings skip the first step.", "",
             "| mode | step time median (s) | p25-p75 (s) | speedup | tokens/s | busy fraction (actor / scorer / learner) "
             "| busiest vs sequential | bubble ratio | CPU use | reward (last) | time to target (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    local = result.get("speedup_vs_local")
    if local:
        lines[-2] = lines[-2].replace(" | speedup |", " | speedup | vs 1 process |")
        lines[-1] += "---|"
    for mode, v in result["modes"].items():
        bf = v["busy_fraction"]
        busy = " / ".join(f"{bf.get(w, 0.0):.2f}" for w in ("actor", "scorer", "learner"))
        if any(w.startswith("learner") and w != "learner" for w in bf):  # Ray learner ranks
            busy += " (ranks " + " / ".join(f"{bf[w]:.2f}" for w in sorted(bf) if w.startswith("learner")
                                            and w != "learner") + ")"
        ttt = f"{v['time_to_target_s']:.1f}" if v["time_to_target_s"] is not None else "not reached"
        reward = f"{v['reward_last']:.3f}" if v.get("reward_last") is not None else "-"
        if v.get("timing_only"):
            ttt = "- (timing only)"
        lines.append(f"| {mode} | {v['step_time_median_s']:.2f} | {v['step_time_p25_s']:.2f}-{v['step_time_p75_s']:.2f} "
                     f"| {result['speedup'].get(mode, float('nan')):.2f}x "
                     + (f"| {local.get(mode, float('nan')):.2f}x " if local else "")
                     + f"| {v['tokens_per_s']:.0f} | {busy} "
                     f"| {result['busiest_busy_ratio'].get(mode, float('nan')):.2f}x | {v['bubble_ratio']:.2f} "
                     f"| {v['cpu_util']:.0%} "
                     f"| {reward} | {ttt} |")
    cpu = ("CPU use: process CPU time over wall time times cores (how much of the machine the mode kept busy; "
           "OpenMP spin-waits count as busy, and a scorer worker in its own process is not counted).")
    if any(v.get("timing_only") for v in result["modes"].values()):
        lines += ["", "Timing only: the response lengths were forced (EOS banned before each target length and "
                  "forced at it), so the responses are not samples of the policy and no reward or KL of these "
                  "runs is reported (the k1 KL estimate of such runs went negative; their losses and gradient "
                  "norms stay in metrics.jsonl, as a check that the numbers stayed finite). `oppo bench --workload "
                  "natural` compares learning across modes. " + cpu, ""]
    else:
        target = result["target_reward"]
        lines += ["", (f"Target reward: {target:.3f}" if target is not None else "No target reward")
                  + " (sequential's mean over its last 3 steps unless --target was given); time to target uses a "
                  "3-step moving average. " + cpu, ""]
    peaks = {mode: v["peak_cuda_mib"] for mode, v in result["modes"].items() if v.get("peak_cuda_mib")}
    if peaks:
        lines += ["Peak GPU memory allocated per mode, from the trainer's build to its close "
                  "(`torch.cuda.max_memory_allocated`, reset between modes): " + "; ".join(
                      f"{mode} " + ", ".join(f"{mib / 1024:.1f} GiB" + (f" ({d})" if len(p) > 1 else "")
                                             for d, mib in p.items()) for mode, p in peaks.items()) + ".", ""]
    if result.get("workload_lengths"):
        w = result["workload_lengths"]
        lines += [f"Forced lengths ({w['name']}): {w['description']}; the distribution drawn from has p50 "
                  f"{w['p50']:.0f}, p99 {w['p99']:.0f}, max {w['max']:.0f} (p99/p50 {w['p99_over_p50']:.1f}).", ""]
    lines += hardware_markdown(result["modes"])
    lines += stage_profile_markdown(result.get("stage_profile", []))
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


def settings_yaml(cfg) -> str:
    import yaml

    d = to_dict(cfg)
    d.pop("log", None)
    d["overlap"].pop("mode", None)
    return yaml.safe_dump(d, sort_keys=False).strip()


def jsonable(x):
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
