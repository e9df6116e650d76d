"""Reward and judge curves of `oppo train` on the built-in task over several seeds and modes.

    python benchmarks/learning_curves.py --seeds 0,1,2 --modes sequential,oppo --out benchmarks/curves

Each (mode, seed) is one full `oppo train` run with the default settings (plus any overrides);
the script writes the run directories, `curves.json` (per-step reward/judge per run and the
first/last-5-step means), and the report pictures (mean over seeds with a min-max band).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

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
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    out = Path(args.out)
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
        return finish(out, runs, labels, summary)
    for mode in args.modes.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            run_dir = out / f"{mode}_seed{seed}"
            cfg = load_config(None, [*args.overrides, f"overlap.mode={mode}", f"run.seed={seed}",
                                     f"run.out_dir={run_dir}", "log.progress=false", "run.samples=0"])
            print(f"{mode} seed {seed} -> {run_dir}", file=sys.stderr, flush=True)
            train(cfg, progress=False)
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
            }
            if "task/accuracy" in ms[0]:  # tasks with one right answer (arith)
                acc = [m["task/accuracy"] for m in ms]
                summary[f"{mode}_seed{seed}"].update(
                    accuracy=acc, accuracy_first20=statistics.mean(acc[:20]),
                    accuracy_last20=statistics.mean(acc[-20:]))
            runs.append(run_dir)
            labels.append(mode)
    return finish(out, runs, labels, summary)


def summary_key(run_dir: Path) -> int:
    return int(run_dir.name.rsplit("seed", 1)[1])


def finish(out: Path, runs: list[Path], labels: list[str], summary: dict) -> int:
    summary["_by_mode"] = by_mode(summary)
    (out / "curves.json").write_text(json.dumps(summary, indent=1))
    for path in make_report(runs, out, labels=labels):
        print(path)
    for mode, agg in summary["_by_mode"].items():
        print(mode, json.dumps(agg))
    for k, v in summary.items():
        if k.startswith("_"):
            continue
        print(f"{k}: reward {v['reward_first5']:.3f} -> {v['reward_last5']:.3f}, judge {v['judge_first5']} -> "
              f"{v['judge_last5']}, kl {v['kl_last5']:.3f}, step {v['step_time_median_s']:.2f}s")
    return 0


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
