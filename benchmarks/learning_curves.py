"""Reward and judge curves of `oppo train` over several seeds and modes, and their table.

    python benchmarks/learning_curves.py --seeds 0,1,2 --modes sequential,oppo --out benchmarks/curves
    python benchmarks/learning_curves.py --seeds 0,1,2 --modes sequential,oppo,pipeline --out benchmarks/real_model \
        --recipe sentiment policy.path=/path/to/model

Each (mode, seed) is one full `oppo train` run with the default settings (the built-in task), or a
recipe's (``--recipe``), plus any overrides; the script writes the run directories, `curves.json`
(per-step reward/judge per run, the first/last-5-step means, the per-mode summary and the table's
numbers), the report pictures (reward and judge against step and wall-clock, mean over seeds with
a min-max band) and `table.md` (``learning_table.py``: per mode the rise against the seeds'
spread, the windows inside sequential's band, the speed against sequential and the time to
sequential's final reward), which it also prints.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (learning_table beside this file)

import learning_table  # noqa: E402

from oppo.config import load_config
from oppo.metrics import read_metrics
from oppo.report import make_report
from oppo.run import train


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--modes", default="sequential,oppo")
    p.add_argument("--out", default="benchmarks/curves")
    p.add_argument("--merge", default=None,
                   help="Comma-separated output directories of earlier invocations (e.g. seeds run in two "
                        "batches): train nothing, write their runs' combined summary and pictures to --out.")
    p.add_argument("--recipe", default=None,
                   help="Start every run from this shipped recipe (`oppo recipes` lists them), as "
                        "`oppo train --recipe NAME`; the overrides apply on top.")
    p.add_argument("--machine", default="",
                   help="What machine this is, for table.md (the versions of torch and transformers and the "
                        "device are added).")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    out = Path(args.out)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    runs, labels, summary = [], [], {}
    if args.merge:
        out.mkdir(parents=True, exist_ok=True)
        for d in (Path(x) for x in args.merge.split(",")):
            for key, v in json.loads((d / "curves.json").read_text()).items():
                if not key.startswith("_"):
                    summary[key] = v
                    runs.append(d / key)
                    labels.append(v["mode"])
        order = sorted(range(len(runs)), key=lambda i: (labels[i], summary_key(runs[i])))
        runs, labels = [runs[i] for i in order], [labels[i] for i in order]
        return finish(out, runs, labels, summary, args.machine, command)
    for mode in args.modes.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            run_dir = out / f"{mode}_seed{seed}"
            cfg = load_config(None, [*args.overrides, f"overlap.mode={mode}", f"run.seed={seed}",
                                     f"run.out_dir={run_dir}", "log.progress=false", "run.samples=0"],
                              recipe=args.recipe)
            print(f"{mode} seed {seed} -> {run_dir}", file=sys.stderr, flush=True)
            load_before = load_average()
            train(cfg, progress=False)
            load = [load_before, load_average()]
            ms = read_metrics(run_dir)
            first, last = ms[:5], ms[-5:]
            summary[f"{mode}_seed{seed}"] = {
                "mode": mode, "seed": seed, "steps": len(ms),
                "reward_first5": statistics.mean(m["reward/mean"] for m in first),
                "reward_last5": statistics.mean(m["reward/mean"] for m in last),
                "judge_first5": statistics.mean(m["judge/mean"] for m in first if "judge/mean" in m) if "judge/mean" in ms[0] else None,
                "judge_last5": statistics.mean(m["judge/mean"] for m in last if "judge/mean" in m) if "judge/mean" in ms[0] else None,
                "kl_last5": statistics.mean(m["kl/mean"] for m in last),
                "step_time_median_s": statistics.median(m["time/step"] for m in ms[1:] or ms),
                "wallclock_s": ms[-1]["time/wallclock"],
                "reward": [m["reward/mean"] for m in ms],
                "wallclock": [m["time/wallclock"] for m in ms],
                "judge": [m.get("judge/mean") for m in ms],
                "response_length_mean": [m["response_length/mean"] for m in ms],
                "load_average_1m": load,  # the machine's, as the run started and ended (a shared box's)
            }
            if "task/accuracy" in ms[0]:  # tasks with one right answer (arith)
                acc = [m["task/accuracy"] for m in ms]
                summary[f"{mode}_seed{seed}"].update(
                    accuracy=acc, accuracy_first20=statistics.mean(acc[:20]),
                    accuracy_last20=statistics.mean(acc[-20:]))
            runs.append(run_dir)
            labels.append(mode)
    return finish(out, runs, labels, summary, args.machine, command)


def summary_key(run_dir: Path) -> int:
    return int(run_dir.name.rsplit("seed", 1)[1])


def finish(out: Path, runs: list[Path], labels: list[str], summary: dict, machine: str = "",
           command: str = "") -> int:
    summary["_by_mode"] = by_mode(summary)
    table = learning_table.mode_rows([v for k, v in summary.items() if not k.startswith("_")])
    summary["_table"] = table
    (out / "curves.json").write_text(json.dumps(summary, indent=1))
    loads = [x for k, v in summary.items() if not k.startswith("_") for x in v.get("load_average_1m") or []
             if x is not None]
    if loads:
        load = f"1-minute load average {min(loads):.1f}-{max(loads):.1f} at the runs' starts and ends"
        machine = f"{machine}; {load}" if machine else load
    page = learning_table.markdown(table, f"Learning benchmark: {out}", machine_line(machine), command)
    (out / "table.md").write_text(page)
    for path in make_report(runs, out, labels=labels):
        print(path)
    for mode, agg in summary["_by_mode"].items():
        print(mode, json.dumps(agg))
    for k, v in summary.items():
        if k.startswith("_"):
            continue
        print(f"{k}: reward {v['reward_first5']:.3f} -> {v['reward_last5']:.3f}, judge {v['judge_first5']} -> "
              f"{v['judge_last5']}, kl {v['kl_last5']:.3f}, step {v['step_time_median_s']:.2f}s")
    print(page)
    print(out / "table.md")
    return 0


def load_average() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def machine_line(described: str) -> str:
    """``described`` (``--machine``), then the device, the torch and transformers versions."""
    import torch
    import transformers

    device = (f"GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
              else f"CPU only, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} "
                   f"cores visible ({platform.processor() or platform.machine()})")
    return "; ".join(x for x in (described, device, f"torch {torch.__version__}",
                                 f"transformers {transformers.__version__}", f"Python {platform.python_version()}") if x)


def by_mode(summary: dict) -> dict:
    """Across seeds, per mode: mean, min and max of the last-5-step reward and judge, of the
    mean reward over all steps (the area under the curve, which compares whole curves), and
    where the task has one right answer, of the last-20-step and all-step accuracy."""
    out = {}
    for mode in sorted({v["mode"] for v in summary.values()}):
        runs = [v for v in summary.values() if v["mode"] == mode]
        agg = {}
        for key, values in (("reward_last5", [r["reward_last5"] for r in runs]),
                            ("judge_last5", [r["judge_last5"] for r in runs if r["judge_last5"] is not None]),
                            ("reward_auc", [statistics.mean(r["reward"]) for r in runs]),
                            ("accuracy_last20", [r["accuracy_last20"] for r in runs if "accuracy" in r]),
                            ("accuracy_auc", [statistics.mean(r["accuracy"]) for r in runs if "accuracy" in r])):
            if values:
                agg[key] = {"mean": statistics.mean(values), "min": min(values), "max": max(values),
                            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}
        out[mode] = agg
    base = out.get("sequential")
    for mode, agg in out.items():
        if base is None or mode == "sequential":
            continue
        for key, a in agg.items():  # Welch's t of this mode's seeds against sequential's
            b = base.get(key)
            if b and a["n"] > 1 and b["n"] > 1:
                se = (a["std"] ** 2 / a["n"] + b["std"] ** 2 / b["n"]) ** 0.5
                a["diff_vs_sequential"] = a["mean"] - b["mean"]
                a["welch_t_vs_sequential"] = (a["mean"] - b["mean"]) / se if se > 0 else 0.0
    return out


if __name__ == "__main__":
    sys.exit(main())
