"""The learner's forward shapes over a run, before and after variable-length attention (issue 50).

    python benchmarks/learner_shapes.py            # 20 minibatches of 32, lognormal lengths up to 512

No model runs: the micro-batches are cut (``learner.batch.micro_groups``) and laid out
(``LayoutRule.layout``) exactly as the learner does, for sequences of long-tailed lengths (prompt
and response together, lognormal, median ~100, capped at 512), under ``ppo.shape_buckets=on``.
It prints, per layout, the distinct (rows x width) shapes the learner's forwards take over the
run and the padded share of the positions they compute:

- ``mask``: today's packed path on SDPA (transformers' block-diagonal mask; rows chosen by the FLOP
  count, widths on the width ladder);
- ``varlen``: oppo's variable-length attention (one row per micro-batch, its width on the coarse
  token ladder ``forward.varlen_width``).

each with no token budget (micro-batches of ``micro_batch_size`` rows: the CPU default) and with
one (``--budget``, the whole minibatch one micro-batch unless it passes it: a GPU's default).
"""

from __future__ import annotations

import argparse
import random

from oppo.config import PPOConfig
from oppo.forward import LayoutRule
from oppo.learner.batch import MicroBatching, micro_groups, token_budget


def lengths(n: int, rng: random.Random, cap: int = 512) -> list[int]:
    return [max(2, min(cap, int(rng.lognormvariate(4.6, 0.8)))) for _ in range(n)]


def measure(plan: LayoutRule, cfg: PPOConfig, minibatches: list[list[int]]) -> tuple[int, float, list]:
    micro = MicroBatching.of(cfg)
    shapes: dict[tuple[int, int], int] = {}
    computed = real = 0
    for lens in minibatches:
        for group in micro_groups(None, list(range(len(lens))), micro, lens):
            n = [lens[i] for i in group]
            layout = plan.layout(n, token_budget(micro), micro.micro_batch_padding)
            shapes[(layout.rows, layout.width)] = shapes.get((layout.rows, layout.width), 0) + 1
            computed += layout.computed
            real += sum(n)
    return len(shapes), 1 - real / computed, sorted(shapes.items(), key=lambda kv: -kv[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minibatches", type=int, default=20)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048, help="the model width (the mask path's attention cost)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    mbs = [lengths(a.size, rng) for _ in range(a.minibatches)]
    print(f"{a.minibatches} minibatches of {a.size}; lengths median {sorted(sum(mbs, []))[a.size * a.minibatches // 2]},"
          f" max {max(max(m) for m in mbs)}; tokens per minibatch {min(map(sum, mbs))}..{max(map(sum, mbs))}")
    plans = {"mask": LayoutRule(True, 1.0 / (6 * a.hidden), buckets=True), "varlen": LayoutRule(True, buckets=True, varlen=True)}
    cfgs = {"no budget (micro_batch_size 8)": PPOConfig(minibatch_size=a.size, micro_batch_size=8, micro_batch_tokens=0),
            f"budget {a.budget}": PPOConfig(minibatch_size=a.size, micro_batch_size=a.size, micro_batch_tokens=a.budget)}
    print(f"{'layout':8} {'micro-batches':32} {'shapes':>6} {'padded':>7}  most used (rows, width): count")
    for cname, cfg in cfgs.items():
        for pname, plan in plans.items():
            n, pad, top = measure(plan, cfg, mbs)
            print(f"{pname:8} {cname:32} {n:6d} {pad:7.1%}  " + ", ".join(f"{s}: {c}" for s, c in top[:6]))


if __name__ == "__main__":
    main()
