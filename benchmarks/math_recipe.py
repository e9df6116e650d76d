"""The GSM8K recipes' reward set-up at the built-in task's scale: PPO and GRPO on ``arith``, trained
on ``math_accuracy`` (math-verify) plus a format term through ``reward.terms``, in place of the
task's own reward; held-out accuracy before and after a fixed number of steps, over seeds.

    python benchmarks/math_recipe.py --seeds 0,1,2 --steps 60 --out benchmarks/math_recipe

Each (algorithm, seed) is one ``oppo train`` run (sequential, the arith preset's sizes). Accuracy
is the task's own (``oppo.task.arith:accuracy``: the first number of the response is right), on
the task's held-out prompts (``eval_prompts.jsonl``), one near-greedy answer each (temperature
0.01), of the prepared SFT policy ("before") and of each run's final policy ("after"); the training
batches' ``task/accuracy`` over the first and the last 10 steps is reported beside it. Writes
``results.json`` and ``table.md`` under ``--out`` (run directories under ``--out/runs``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from oppo.rewards import math_accuracy
from oppo.task.arith import accuracy, answer_of

WINDOW = 10


def arith_math_accuracy(prompts: list[str], responses: list[str], **_) -> list[float]:
    """math_accuracy with the gold answer computed from the arith prompt (the task has no answer
    column; with one, ``math_accuracy`` reads it directly)."""
    return math_accuracy(prompts, responses, answer=[str(answer_of(p)) for p in prompts])


TERMS = [{"function": "math_recipe:arith_math_accuracy", "name": "math_accuracy", "weight": 1.0},
         {"function": "format_reward", "name": "ends_with_period", "weight": 0.2,
          "kwargs": {"pattern": r"\.\s*\Z"}}]


def held_out_accuracy(policy_dir: Path, task_dir: Path, seed: int = 0) -> float:
    from transformers import AutoTokenizer, LlamaForCausalLM

    from oppo.task import models as M

    tok = AutoTokenizer.from_pretrained(task_dir / "policy")
    prompts = [json.loads(line)["prompt"] for line in (task_dir / "eval_prompts.jsonl").read_text().splitlines()]
    model = LlamaForCausalLM.from_pretrained(policy_dir).eval()
    samples = M.sample(model, [tok(p)["input_ids"] for p in prompts], max_new_tokens=16, batch_size=128,
                       seed=seed, temperature=0.01)
    texts = [tok.decode(s.ids, skip_special_tokens=True) for s in samples]
    return statistics.mean(accuracy(prompts, texts))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--algos", default="ppo,grpo")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default="benchmarks/math_recipe")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))  # (math_recipe:arith_math_accuracy is importable)
    from oppo.config import load_config
    from oppo.metrics import read_metrics
    from oppo.run import train
    from oppo.task import prepare

    out = Path(args.out)
    task_dir = prepare(task="arith", progress=False).policy_path.parent
    before = held_out_accuracy(task_dir / "policy", task_dir)
    results: dict = {"before": before, "steps": args.steps, "runs": {}}
    for algo in args.algos.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            run_dir = out / "runs" / f"{algo}_seed{seed}"
            cfg = load_config(overrides=["data.task=arith", f"algo.name={algo}", f"run.seed={seed}",
                                         f"run.steps={args.steps}", "overlap.mode=sequential", "log.progress=false",
                                         "run.samples=0", f"run.out_dir={run_dir}", f"reward.terms={json.dumps(TERMS)}",
                                         *args.overrides])
            t = time.perf_counter()
            train(cfg, progress=False)
            wall = time.perf_counter() - t
            m = read_metrics(run_dir)
            final = sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "policy"
            acc = [r["task/accuracy"] for r in m]
            results["runs"][f"{algo}/{seed}"] = {
                "algo": algo, "seed": seed, "wall_s": round(wall, 1), "after": held_out_accuracy(final, task_dir),
                "batch_first": statistics.mean(acc[:WINDOW]), "batch_last": statistics.mean(acc[-WINDOW:]),
                "math_accuracy_first": statistics.mean(r["reward/math_accuracy/mean"] for r in m[:WINDOW]),
                "math_accuracy_last": statistics.mean(r["reward/math_accuracy/mean"] for r in m[-WINDOW:]),
            }
            print(algo, seed, results["runs"][f"{algo}/{seed}"], flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "table.md").write_text(table(results))
    print(table(results))
    return 0


def table(results: dict) -> str:
    rows = ["| algorithm | seeds | held-out accuracy before | after (per seed) | batch accuracy, first / last "
            f"{WINDOW} steps | math_accuracy term, first / last {WINDOW} | wall-clock per run |",
            "|---|---|---|---|---|---|---|"]
    by_algo: dict[str, list[dict]] = {}
    for r in results["runs"].values():
        by_algo.setdefault(r["algo"], []).append(r)
    for algo, runs in by_algo.items():
        mean = lambda k: statistics.mean(r[k] for r in runs)  # noqa: E731
        seeds = ", ".join(f"{r['after']:.3f}" for r in runs)
        rows.append(f"| {algo} | {len(runs)} | {results['before']:.3f} | {mean('after'):.3f} ({seeds}) | "
                    f"{mean('batch_first'):.3f} / {mean('batch_last'):.3f} | {mean('math_accuracy_first'):.3f} / "
                    f"{mean('math_accuracy_last'):.3f} | {mean('wall_s'):.0f} s |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
