"""Measure overlap.stale_kv and overlap.stale_values (keep vs recompute) side by side.

    python benchmarks/stale_state.py --steps 40 --out benchmarks/stale_state.json

Four `oppo`-mode trainers on the built-in task (same seed, data and models), one per
combination, stepped interleaved; Delta is fixed at 4 and max_lag at 2 so that sequences are
carried every step. Reports the median step time, the mean reward of the last 10 steps, the
share of off-policy tokens and the importance-weight statistics.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from oppo.config import load_config
from oppo.trainer import Trainer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default="benchmarks/stale_state.json")
    args = p.parse_args()
    combos = [(kv, v) for kv in ("keep", "recompute") for v in ("keep", "recompute")]
    trainers = {}
    for kv, v in combos:
        cfg = load_config(None, ["overlap.mode=oppo", "overlap.delta=4", "overlap.max_lag=2",
                                 f"overlap.stale_kv={kv}", f"overlap.stale_values={v}", "overlap.chunk_size=32",
                                 f"run.out_dir=/tmp/stale_{kv}_{v}", "log.trace=false"])
        trainers[(kv, v)] = Trainer.from_config(cfg, progress=False)
    hist = {c: [] for c in combos}
    for step in range(args.steps):
        for c, t in trainers.items():
            hist[c].append(t.run_step())
        print(f"step {step + 1}/{args.steps}", file=sys.stderr, flush=True)
    out = {}
    for (kv, v), ms in hist.items():
        last = ms[-10:]
        out[f"stale_kv={kv},stale_values={v}"] = {
            "step_time_median_s": statistics.median(m["time/step"] for m in ms[1:]),
            "reward_last10": statistics.mean(m["reward/mean"] for m in last),
            "judge_last10": statistics.mean(m["judge/mean"] for m in last),
            "value_explained_var_mean": statistics.mean(m["value/explained_var"] for m in ms[5:]),
            "offpolicy_token_frac_mean": statistics.mean(m["overlap/offpolicy_token_frac"] for m in ms),
            "is_weight_mean": statistics.mean(m["overlap/is_weight_mean"] for m in ms),
            "trained_length_mean": statistics.mean(m["response_length/mean"] for m in ms),
        }
    for t in trainers.values():
        t.close()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for k, v in out.items():
        print(k, {a: round(b, 3) for a, b in v.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
