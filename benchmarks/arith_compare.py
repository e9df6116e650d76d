"""GRPO against PPO on the built-in ``arith`` task: one table and one picture from the runs of
``learning_curves.py`` (one output directory per algorithm).

    python benchmarks/arith_compare.py        # the five directories under benchmarks/arith

Writes ``table.md`` (per algorithm and mode, over seeds: accuracy over the first and the last 20
steps and over all steps, the step and the wall-clock second at which the 20-step mean first
reaches ``--threshold``, step time and wall-clock) and ``accuracy.png`` (accuracy against step and
against wall-clock seconds; each run's mean over the last ``--window`` steps, averaged over seeds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from oppo.config import MODES


def smooth(x: list[float], window: int) -> np.ndarray:
    """Mean of each full window of ``window`` steps (``len(x) - window + 1`` points; the point
    for step i averages steps i - window + 1 .. i)."""
    return np.convolve(np.asarray(x, dtype=float), np.ones(window) / window, mode="valid")


def load(dirs: list[Path]) -> dict[tuple[str, str], list[dict]]:
    """(algorithm, mode) -> the seeds' summaries; the algorithm is the directory's name."""
    cells: dict[tuple[str, str], list[dict]] = {}
    for d in dirs:
        for key, v in json.loads((d / "curves.json").read_text()).items():
            if not key.startswith("_"):
                cells.setdefault((d.name, v["mode"]), []).append(v)
    return cells


def reached(run: dict, threshold: float, window: int) -> tuple[int, float] | None:
    """The first step whose last-``window``-step mean accuracy is >= ``threshold``, and the
    wall-clock seconds at that step; None if the run never gets there."""
    for i, a in enumerate(smooth(run["accuracy"], window)):
        if a >= threshold:
            return i + window - 1, run["wallclock"][i + window - 1]
    return None


def table(cells: dict[tuple[str, str], list[dict]], threshold: float, window: int) -> str:
    def cell(vals: list[float]) -> str:
        return f"{statistics.mean(vals):.3f} ({min(vals):.3f}-{max(vals):.3f})"

    def to_threshold(runs: list[dict]) -> str:
        hits = [reached(r, threshold, window) for r in runs]
        got = [h for h in hits if h is not None]
        if not got:
            return "not reached"
        text = f"{statistics.mean(h[0] for h in got):.0f} / {statistics.mean(h[1] for h in got):.0f} s"
        return text if len(got) == len(runs) else f"{text} ({len(got)} of {len(runs)} seeds)"

    rows = ["| algorithm | mode | seeds | accuracy, first 20 steps | accuracy, last 20 steps (range) | "
            f"accuracy, all steps | steps / seconds to {threshold} | median step | wall-clock |",
            "|---|---|---|---|---|---|---|---|---|"]
    for (algo, mode), runs in cells.items():
        rows.append(
            f"| {algo} | {mode} | {len(runs)} | {statistics.mean(r['accuracy_first20'] for r in runs):.3f} | "
            f"{cell([r['accuracy_last20'] for r in runs])} | "
            f"{statistics.mean(statistics.mean(r['accuracy']) for r in runs):.3f} | {to_threshold(runs)} | "
            f"{statistics.mean(r['step_time_median_s'] for r in runs):.2f} s | "
            f"{statistics.mean(r['wallclock_s'] for r in runs):.0f} s |")
    return "\n".join(rows) + "\n"


def picture(cells: dict[tuple[str, str], list[dict]], path: Path, window: int) -> None:
    fig = Figure(figsize=(12, 4.5))
    FigureCanvasAgg(fig)
    by_step, by_time = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    styles = ["-", "--", ":", "-.", (0, (3, 1, 1, 1, 1, 1))]
    modes = [m for m in MODES if any(mode == m for _, mode in cells)]  # sequential: solid
    algos = sorted({a for a, _ in cells})
    colors = dict(zip(algos, ("tab:blue", "tab:red", "tab:green", "tab:purple")))
    for (algo, mode), runs in cells.items():
        n = min(len(r["accuracy"]) for r in runs)
        curves = np.stack([smooth(r["accuracy"][:n], window) for r in runs])
        times = np.stack([np.asarray(r["wallclock"][:n]) for r in runs])
        style = dict(color=colors[algo], linestyle=styles[modes.index(mode) % len(styles)], label=f"{algo} {mode}")
        by_step.plot(np.arange(window - 1, n), curves.mean(0), **style)
        by_time.plot(times.mean(0)[window - 1:], curves.mean(0), **style)
    by_step.set_xlabel("step")
    by_time.set_xlabel("wall-clock seconds (mean over seeds)")
    for ax in (by_step, by_time):
        ax.set_ylabel(f"accuracy (mean of the last {window} steps and of the seeds)")
        ax.grid(alpha=0.3)
    by_time.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.suptitle(f"arith: share of right answers, {', '.join(algos)}, in each overlap mode")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="benchmarks/arith/grpo,benchmarks/arith/ppo,benchmarks/arith/rloo,"
                                     "benchmarks/arith/reinforce_pp,benchmarks/arith/grpo_256")
    p.add_argument("--out", default="benchmarks/arith")
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--threshold", type=float, default=0.35,
                   help="Accuracy whose first crossing (of the --window-step mean) the table times.")
    p.add_argument("--plot", default="grpo,ppo,grpo_256",
                   help="Comma-separated algorithms (directory names) to draw; empty: all of --runs.")
    args = p.parse_args()
    cells = load([Path(d) for d in args.runs.split(",")])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table(cells, args.threshold, args.window))
    drawn = set(args.plot.split(",")) if args.plot else {a for a, _ in cells}
    if not drawn & {a for a, _ in cells}:
        raise SystemExit(f"--plot {args.plot!r} names none of the algorithms in --runs")
    picture({k: v for k, v in cells.items() if k[0] in drawn}, out / "accuracy.png", args.window)
    print((out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
