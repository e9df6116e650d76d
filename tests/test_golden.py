"""Golden metrics: what oppo computed before the controller was restructured (issue 19).

``tests/golden/metrics.json`` was recorded on main before the restructuring (commit
12c625c), by ``python tests/test_golden.py --record``: a few seeded steps of every mode on the
tiny models, with a fixed chunk size. These tests run the same configurations and compare the
sampled tokens exactly and the metrics to recording tolerance, so a change that moves code
without meaning to change what oppo computes is checked against what it computed before.

``pipeline`` is not bitwise reproducible after its first step (how far decoding gets while the
learner trains depends on timing), so only its first step is compared.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "golden" / "metrics.json"
KEYS = ("reward/mean", "kl/mean", "loss/policy", "loss/value", "ppo/clipfrac", "response_length/mean",
        "overlap/carried", "overlap/seq_lag_mean", "overlap/offpolicy_token_frac", "overlap/is_weight_mean")
RENAMED = {"overlap/lag_mean": "overlap/seq_lag_mean"}
"""Metrics renamed since the recording (old name: new name); issue 22 made lag per token."""
BASE = ["placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=2", "ppo.micro_batch_size=1",
        "generation.max_new_tokens=16", "overlap.chunk_size=4", "log.progress=false"]
CASES = {
    "sequential": (["overlap.mode=sequential"], 3),
    "intra": (["overlap.mode=intra"], 3),
    "intra_thread": (["overlap.mode=intra", "placement.local.scorer_process=false"], 3),
    "inter": (["overlap.mode=inter", "overlap.delta=2", "overlap.max_lag=1"], 4),
    "oppo": (["overlap.mode=oppo", "overlap.delta=2", "overlap.max_lag=1"], 4),
    "oppo_recompute": (["overlap.mode=oppo", "overlap.delta=2", "overlap.max_lag=2", "overlap.stale_kv=recompute",
                        "overlap.stale_values=recompute"], 4),
    # recorded when every algorithm's Config got ppo.kl_coef=0.05 (GRPO's own default is 0.04 since)
    "grpo_oppo": (["algo.name=grpo", "ppo.kl_coef=0.05", "overlap.mode=oppo", "overlap.delta=1", "overlap.max_lag=1"],
                  3),
    "pipeline": (["overlap.mode=pipeline", "overlap.delta=2", "overlap.max_lag=1"], 1),
}


def run_case(models: dict, prompts: Path, out: Path, name: str) -> list[dict]:
    from oppo.config import load_config
    from oppo.trainer import Trainer

    extra, steps = CASES[name]
    cfg = load_config(None, [f"policy.path={models['policy']}", f"reward.path={models['reward']}",
                             f"data.prompts={prompts}", f"run.out_dir={out}", *BASE, *extra])
    t = Trainer.from_config(cfg, progress=False)
    rows = []
    try:
        for _ in range(steps):
            m = t.run_step()
            exp = t.last_result.exp
            rows.append({"ids": exp.ids.tolist(), "metrics": {k: m[k] for k in KEYS if k in m}})
    finally:
        t.close()
    return rows


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(tiny_models, tiny_prompts, tmp_path, name):
    want = json.loads(GOLDEN.read_text())[name]
    got = run_case(tiny_models, tiny_prompts, tmp_path, name)
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        w["metrics"] = {RENAMED.get(k, k): v for k, v in w["metrics"].items()}
        assert g["ids"] == w["ids"], f"{name} step {step}: other tokens were sampled"
        assert set(g["metrics"]) == set(w["metrics"]), f"{name} step {step}"
        for k, v in w["metrics"].items():
            assert g["metrics"][k] == pytest.approx(v, abs=1e-4, rel=1e-3), f"{name} step {step}: {k}"


if __name__ == "__main__" and "--record" in sys.argv:
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import TINY_PROMPTS, make_models

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "tiny").mkdir()
        models = make_models(root / "tiny")
        prompts = root / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TINY_PROMPTS))
        out = {name: run_case(models, prompts, root / name, name) for name in sorted(CASES)}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(out, indent=1))
    print(f"wrote {GOLDEN}")
