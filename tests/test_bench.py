"""`oppo bench` and `oppo report` on tiny models: the files users read are written and hold
the figures the issue asks for."""

import json

import pytest

from oppo.bench import summarize
from oppo.cli import main
from oppo.trace import Span


@pytest.mark.slow
def test_bench_writes_json_markdown_and_pictures(tiny_models, tiny_prompts, tmp_path):
    out = tmp_path / "b"
    rc = main(["bench", "--steps", "2", "--out", str(out), "--tail", "0.5", "--tail-steps", "2",
               f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
               f"data.prompts={tiny_prompts}", "ppo.batch_size=4", "ppo.minibatch_size=4",
               "ppo.micro_batch_size=4", "generation.max_new_tokens=12", "overlap.delta_max=2"])
    assert rc == 0
    res = json.loads((out / "bench.json").read_text())
    assert res["machine"]
    assert set(res["modes"]) == {"sequential", "intra", "inter", "oppo"}
    for mode, v in res["modes"].items():
        assert v["step_time_median_s"] > 0
        assert {"actor", "scorer", "learner"} <= set(v["busy_fraction"])
        assert all(0.0 <= f <= 1.0 + 1e-9 for f in v["busy_fraction"].values())
    assert res["speedup"]["sequential"] == pytest.approx(1.0)
    assert len(res["tail_sweep"]) == 1 and "oppo" in res["tail_sweep"][0]["speedup"]
    assert "| oppo |" in (out / "bench.md").read_text()
    for png in ("reward_vs_step.png", "timeline.png", "response_lengths.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc = main(["report", str(out / "runs" / "oppo"), "--out", str(tmp_path / "rep")])
    assert rc == 0 and (tmp_path / "rep" / "reward_vs_step.png").is_file()


def test_summarize_busy_fraction_and_speedup():
    # two modes, one measured step each (warmup=0). sequential: actor 0-2, scorer 2-3, learner 3-4
    # -> window 4 s, busy 2/4, 1/4, 1/4, busiest 2 s -> bubble 1 - 2/4 = 0.5.
    # oppo: actor 0-2, scorer 0.5-2.5 (overlapping), learner 2.5-3 -> window 3 s.
    def rec(spans, end):
        return {"metrics": [{"time/step": end, "perf/tokens_per_s": 10.0, "reward/mean": 0.5,
                             "response_length/mean": 5.0, "perf/cpu_util": 0.5}],
                "windows": {0: (0.0, end)}, "spans": spans}
    seq = rec([Span("actor", "generate", 0, 0, 2), Span("scorer", "score", 0, 2, 3),
               Span("learner", "train", 0, 3, 4)], 4.0)
    opp = rec([Span("actor", "decode", 0, 0, 2), Span("scorer", "score", 0, 0.5, 2.5),
               Span("learner", "train", 0, 2.5, 3)], 3.0)
    s = summarize({"sequential": seq, "oppo": opp}, warmup=0)
    assert s["modes"]["sequential"]["busy_fraction"] == pytest.approx({"actor": 0.5, "scorer": 0.25, "learner": 0.25})
    assert s["modes"]["sequential"]["bubble_ratio"] == pytest.approx(0.5)
    assert s["speedup"]["oppo"] == pytest.approx(4.0 / 3.0)
    # busiest worker: sequential 2/4 = 0.5; oppo max(2/3, 2/3) -> ratio (2/3)/0.5
    assert s["busiest_busy_ratio"]["oppo"] == pytest.approx((2 / 3) / 0.5)
    assert s["modes"]["oppo"]["time_to_target_s"] == pytest.approx(3.0)
