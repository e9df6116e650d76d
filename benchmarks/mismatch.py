"""Issue 22: the sampler-vs-trainer mismatch and the carried tokens' weights on the built-in task.

    OPPO_HOME=<cache> python benchmarks/mismatch.py fp32 bf16 oppo_top_p

fp32 / bf16: sequential, default settings (B = 32), the ``mismatch/*`` metrics of 4 steps.
oppo_top_p: oppo mode with top_p 0.9, Delta 8, max_lag 1 and ``ppo.actor_lr=0`` (the weights never
change, so every carried token's importance weight should be 1). Prints one line per step.
"""

import sys

from oppo.config import load_config
from oppo.trainer import Trainer

KEYS = ("mismatch/", "overlap/is_weight", "overlap/offpolicy_token_frac", "overlap/token_lag_mean",
        "overlap/seq_lag_mean", "overlap/lag_mean", "ppo/sampler")
RUNS = {"fp32": ["overlap.mode=sequential"], "bf16": ["overlap.mode=sequential", "policy.dtype=bfloat16"],
        "oppo_top_p": ["overlap.mode=oppo", "generation.top_p=0.9", "overlap.delta=8", "overlap.max_lag=1",
                       "ppo.actor_lr=0"]}


def main(names: list[str], steps: int = 4) -> None:
    for name in names:
        cfg = load_config(None, ["placement.threads=2", "log.progress=false", f"run.out_dir=/tmp/oppo-mismatch-{name}",
                                 *RUNS[name]])
        t = Trainer.from_config(cfg, progress=False)
        try:
            for _ in range(steps):
                m = t.run_step()
                print(name, {k: round(v, 6) for k, v in m.items() if k.startswith(KEYS)}, flush=True)
        finally:
            t.close()


if __name__ == "__main__":
    main(sys.argv[1:])
