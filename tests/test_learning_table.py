"""The learning benchmark of issue 51: the table's arithmetic (benchmarks/learning_table.py) on
hand-made numbers, the sentiment recipe's reward and judge (oppo.rewards.sentiment), and the
recipe's short form: two steps end to end on the built-in task's tiny policy, the reward checked
against VADER on the step's own replies and the judge against AFINN."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import time
from pathlib import Path

import pytest

import oppo
from oppo import recipes
from oppo.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _load_table():
    spec = importlib.util.spec_from_file_location("learning_table", ROOT / "benchmarks" / "learning_table.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


T = _load_table()


# ------------------------------------------------------------------------------ the pure functions


def test_head_tail_means():
    # first 5 of 1..10: (1+2+3+4+5)/5 = 3; last 5: (6+..+10)/5 = 8
    assert T.head_tail(list(range(1, 11))) == (3.0, 8.0)
    # fewer values than n: both are the mean of all, (1+2+3)/3 = 2
    assert T.head_tail([1.0, 2.0, 3.0], 5) == (2.0, 2.0)
    with pytest.raises(ValueError):
        T.head_tail([])


def test_rise_against_the_seeds_spread():
    seeds = [[0.0] * 5 + [1.0] * 5,   # first-5 mean 0.0, last-5 mean 1.0
             [0.2] * 5 + [1.2] * 5,   # 0.2, 1.2
             [0.1] * 5 + [0.8] * 5]   # 0.1, 0.8
    r = T.rise(seeds)
    # first = (0 + 0.2 + 0.1) / 3 = 0.1; last = (1 + 1.2 + 0.8) / 3 = 1.0; rise = 0.9
    # spread = max - min of the first-5 means = 0.2 - 0.0 = 0.2; ratio = 0.9 / 0.2 = 4.5
    assert r["first"] == pytest.approx(0.1) and r["last"] == pytest.approx(1.0)
    assert r["rise"] == pytest.approx(0.9) and r["spread"] == pytest.approx(0.2)
    assert r["ratio"] == pytest.approx(4.5) and r["seeds"] == 3
    # one seed: no spread, the ratio is infinite (a rise) or undefined (none)
    assert T.rise([[0.0] * 5 + [1.0] * 5])["ratio"] == math.inf
    assert math.isnan(T.rise([[1.0] * 10])["ratio"])


def test_windows_and_their_means():
    # 12 steps in windows of 5: steps 0-4, 5-9 and a short last one, 10-11
    assert T.windows(12, 5) == [(0, 5), (5, 10), (10, 12)]
    assert T.windows(10, 5) == [(0, 5), (5, 10)]
    # 1..7 in windows of 3: (1+2+3)/3 = 2, (4+5+6)/3 = 5, 7
    assert T.window_means([1, 2, 3, 4, 5, 6, 7], 3) == [2.0, 5.0, 7.0]
    with pytest.raises(ValueError):
        T.windows(5, 0)


def test_band_check_window_by_window():
    base = [[1, 1, 3, 3], [3, 3, 5, 5]]  # window means (size 2): [1, 3] and [3, 5]
    # the band: window 0 [min 1, max 3], window 1 [3, 5]
    mode = [[2, 2, 6, 6], [4, 4, 6, 6]]  # window means [2, 6] and [4, 6]
    # the mode's means over seeds: window 0 (2+4)/2 = 3, inside [1, 3] (the edge counts);
    # window 1 (6+6)/2 = 6, above 5: outside, steps 2-3
    b = T.band_check(mode, base, 2)
    assert (b["inside"], b["total"], b["outside"]) == (1, 2, [(2, 4)])
    assert b["value"] == [3.0, 6.0] and b["low"] == [1.0, 3.0] and b["high"] == [3.0, 5.0]
    # sequential against its own band: its mean is always between its min and max
    assert T.band_check(base, base, 2)["inside"] == 2
    # runs of different lengths are cut to the shortest: 3 steps, windows 0-1 and 2
    assert T.band_check([[2, 2, 6, 6, 9]], base, 2)["total"] == 2


def test_time_to_reach_reads_a_moving_mean():
    # trailing means of 3: (1+2+3)/3 = 2 at step 2, (2+3+4)/3 = 3 at step 3
    assert T.moving_mean([1, 2, 3, 4], 3) == [2.0, 3.0]
    assert T.moving_mean([1, 2], 3) == []
    values, times = [0, 1, 2, 3, 4], [10, 20, 30, 40, 50]
    # means [1 (steps 0-2), 2 (1-3), 3 (2-4)]: the first >= 2 ends at step 3, at 40 s
    assert T.time_to_reach(values, times, 2.0, 3) == 40
    assert T.time_to_reach(values, times, 5.0, 3) is None  # never
    # a single lucky step does not count: 9 alone is above 3.5, its 3-step means are all 3
    assert T.time_to_reach([0, 0, 9, 0, 0], times, 3.5, 3) is None
    assert T.time_to_reach([0, 0, 9, 0, 0], times, 3.5, 1) == 30
    # over seeds: the mean over those that reached it, (10 + 20) / 2 = 15, and how many did
    assert T.reach_summary([10.0, None, 20.0]) == {"mean": 15.0, "reached": 2, "seeds": 3}
    assert T.reach_summary([None, None])["mean"] is None


def test_speed_is_sequentials_wallclock_over_the_modes():
    # sequential's mean (100 + 120) / 2 = 110 s, the mode's (80 + 70) / 2 = 75 s: 110 / 75 = 1.4667x
    assert T.speed([100, 120], [80, 70]) == pytest.approx(110 / 75)


def _runs():
    """Two modes x two seeds, 6 steps. Worked out with head 2, window 3, smoothing 2 below."""
    def run(mode, seed, reward, wall, step):
        return {"mode": mode, "seed": seed, "reward": reward, "judge": [x / 2 for x in reward],
                "wallclock": wall, "step_time_median_s": step}
    return [run("sequential", 0, [0, 0, 1, 1, 2, 2], [1, 2, 3, 4, 5, 6], 1.0),
            run("sequential", 1, [1, 1, 1, 2, 2, 2], [2, 4, 6, 8, 10, 12], 2.0),
            run("oppo", 0, [0, 1, 1, 3, 3, 4], [1, 1.5, 2, 2.5, 3, 3.5], 0.5),
            run("oppo", 1, [0, 0, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6], 1.0)]


def test_mode_rows_on_hand_made_runs():
    t = T.mode_rows(_runs(), head=2, window=3, smooth=2)
    # target: sequential's last-2 means 2 and 2 -> 2.0
    assert t["base"] == "sequential" and t["target"] == pytest.approx(2.0)
    assert list(t["modes"]) == ["sequential", "oppo"]  # in the order the runs name them
    seq, op = t["modes"]["sequential"], t["modes"]["oppo"]
    # sequential: first-2 means 0 and 1 -> first 0.5, spread 1; last 2.0; rise 1.5; ratio 1.5
    assert (seq["reward"]["first"], seq["reward"]["spread"], seq["reward"]["ratio"]) == pytest.approx((0.5, 1, 1.5))
    # oppo: first-2 means 0.5 and 0 -> 0.25, spread 0.5; last-2 means 3.5 and 1 -> 2.25; rise 2; ratio 4
    assert (op["reward"]["first"], op["reward"]["last"]) == pytest.approx((0.25, 2.25))
    assert (op["reward"]["rise"], op["reward"]["spread"], op["reward"]["ratio"]) == pytest.approx((2.0, 0.5, 4.0))
    # the judge is half the reward: half the rise, the same ratio
    assert (op["judge"]["rise"], op["judge"]["ratio"]) == pytest.approx((1.0, 4.0))
    # band (windows of 3): sequential's window means [1/3, 5/3] and [1, 2] -> [1/3, 1], [5/3, 2];
    # oppo's [2/3, 10/3] and [1/3, 1] -> means 0.5 (inside) and 13/6 = 2.17 (above 2: steps 3-5 out)
    assert (op["band"]["inside"], op["band"]["total"], op["band"]["outside"]) == (1, 2, [(3, 6)])
    assert seq["band"]["inside"] == 2
    # wall-clock: sequential (6 + 12) / 2 = 9 s, oppo (3.5 + 6) / 2 = 4.75 s; speed 9 / 4.75 = 1.89x
    assert op["wallclock_s"] == pytest.approx(4.75) and op["speed"] == pytest.approx(9 / 4.75)
    assert seq["speed"] == pytest.approx(1.0) and op["same_steps"]
    assert (seq["step_time_median_s"], op["step_time_median_s"]) == pytest.approx((1.5, 0.75))
    # time to 2.0 on the 2-step moving mean: oppo seed 0's means 0.5, 1, 2, ... reach it at step 3
    # (2.5 s); seed 1's (0, 0.5, 1, 1, 1) never do
    assert op["reach"] == {"mean": 2.5, "reached": 1, "seeds": 2}
    # sequential seed 0: means 0, 0.5, 1, 1.5, 2 -> step 5 (6 s); seed 1: 1, 1, 1.5, 2 -> step 4 (10 s)
    assert seq["reach"] == {"mean": 8.0, "reached": 2, "seeds": 2}


def test_markdown_is_one_table_with_a_row_per_mode():
    t = T.mode_rows(_runs(), head=2, window=3, smooth=2)
    page = T.markdown(t, "hand-made", machine="a test box", command="python x.py")
    rows = [l for l in page.splitlines() if l.startswith("| ")]
    assert len(rows) == 3  # the header and one row a mode
    seq, op = rows[1], rows[2]
    assert op.startswith("| oppo | 2 | 6 | 0.250 -> 2.250 (+2.000) | 2.000 / 0.500 = 4.0x |")
    assert "| 1/2 (out: 3-5) |" in op and "| 1.89x |" in op
    assert "| 2.5 s (1/2 seeds; the rest not reached) |" in op
    assert "| 2/2 |" in seq and "| 8.0 s |" in seq and "| 1.00x |" in seq
    assert "Machine: a test box" in page and "python x.py" in page
    assert "(2.000)" in page  # the target, in the notes


def test_a_table_without_sequential_or_per_step_times():
    """An older curves.json (total wall-clock only, no per-step series) and a run without a judge:
    the columns that need them show '-'."""
    runs = [{"mode": "oppo", "seed": s, "reward": [0, 1, 2, 3, 4, 5], "judge": [None] * 6,
             "wallclock_s": 10.0 + s, "step_time_median_s": 1.0} for s in (0, 1)]
    t = T.mode_rows(runs, head=2)
    row = t["modes"]["oppo"]
    assert t["base"] is None and t["target"] is None
    assert row["judge"] is None and row["band"] is None and row["speed"] is None and row["reach"] is None
    assert row["wallclock_s"] == pytest.approx(10.5)
    line = [l for l in T.markdown(t).splitlines() if l.startswith("| oppo")][0]
    assert "| - | - |" in line  # no judge
    assert "4.000 / 0.000 = infx" in line  # the seeds start alike: no spread, an infinite ratio


# ------------------------------------------------------------------------------ reward and judge


def test_vader_and_afinn_adapters():
    from afinn import Afinn
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    from oppo.rewards import afinn_sentiment, vader_sentiment

    texts = ["I loved it, the staff were wonderful.", "It was cold and the food was awful.",
             "the room was on the third floor ."]
    want = [SentimentIntensityAnalyzer().polarity_scores(t)["compound"] for t in texts]
    assert vader_sentiment([""] * 3, texts) == want
    assert want[0] > 0.5 and want[1] < -0.3 and want[2] == 0.0
    # an empty reply: -1 by default (VADER says 0), or the given score
    assert vader_sentiment(["", ""], ["", " ... "]) == [-1.0, -1.0]
    assert vader_sentiment([""], [""], empty=0.0) == [0.0]
    # AFINN-165: good +3, bad -3, great +3; summed over the word count
    assert afinn_sentiment([""] * 3, ["good bad good", "The hotel was great .", ""]) == [
        (3 - 3 + 3) / 3, 3 / 4, 0.0]
    assert Afinn().score("good bad good") == 3.0
    assert vader_sentiment([], []) == [] and afinn_sentiment([], []) == []


def test_a_bad_setting_of_the_sentiment_terms_stops_the_config():
    with pytest.raises(ConfigError, match="empty must be a number"):
        oppo.config.validate(oppo.load_config(
            recipe="sentiment", overrides=["reward.terms=[{function: vader_sentiment, kwargs: {empty: low}}]"]))


# ------------------------------------------------------------------------------ the recipe


def test_the_recipe_ships_its_prompts_and_names_its_reward_and_judge():
    cfg = oppo.load_config(recipe="sentiment")
    prompts = Path(cfg.data.prompts)
    assert prompts == recipes.DIR / "sentiment_prompts.jsonl" and prompts.is_file()
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    texts = [r["prompt"] for r in rows]
    assert len(texts) >= 200 and len(set(texts)) == len(texts)
    assert cfg.reward.judge == "oppo.rewards:afinn_sentiment"
    assert [t["function"] for t in cfg.reward.terms] == ["vader_sentiment"]
    assert cfg.policy.path and cfg.data.chat_template
    # the user's own file of that name is not replaced: only a bare name shipped beside the recipe is
    assert oppo.load_config(recipe="sentiment", overrides=["data.prompts=mine.jsonl"]).data.prompts == "mine.jsonl"
    assert recipes.shipped_path("gsm8k_train.jsonl") == "gsm8k_train.jsonl"  # (none shipped: the user's path)


def test_the_recipes_hub_model_offline_is_refused_with_the_fix(monkeypatch):
    import oppo.models.hub
    from test_preflight import input_problems

    monkeypatch.setattr(oppo.models.hub, "hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setattr(oppo.models.hub, "in_hub_cache", lambda name: False)
    cfg = oppo.load_config(recipe="sentiment")
    found = [p for p in input_problems(cfg) if p.startswith("policy.path=")]
    assert len(found) == 1 and "policy.path=/local/dir" in found[0] and "hf download" in found[0]


def test_sentiment_recipe_two_steps_on_the_builtin_policy(builtin_home, tmp_path):
    """The short form of the real-model benchmark: the recipe's own settings (its reward, judge,
    prompts, sampling and PPO settings), on the built-in task's tiny policy instead of the instruct
    model, for 2 steps of 8 replies. Every trained score is VADER's on the step's own reply, and
    the judge is AFINN's mean over them."""
    from oppo.rewards import afinn_sentiment, vader_sentiment

    overrides = [f"policy.path={builtin_home.prepared.policy_path}",
                 "data.chat_template=false",  # (the tiny tokenizer has no chat template)
                 "ppo.batch_size=8", "ppo.minibatch_size=8", "ppo.micro_batch_size=8", "ppo.epochs=1",
                 "generation.max_new_tokens=16", "placement.threads=1", "overlap.mode=sequential",
                 "run.steps=2", "run.samples=0", "log.progress=false", f"run.out_dir={tmp_path / 'run'}"]
    cfg = oppo.load_config(overrides=overrides, recipe="sentiment")
    recipe = oppo.load_config(recipe="sentiment")
    for key in ("generation.temperature", "ppo.kl_coef", "ppo.actor_lr", "reward.judge", "data.prompts"):
        section, leaf = key.split(".")
        assert getattr(getattr(cfg, section), leaf) == getattr(getattr(recipe, section), leaf), key
    t0 = time.perf_counter()
    trainer = oppo.Trainer.from_config(cfg, progress=False)
    try:
        seen = []
        for _ in range(2):
            metrics = trainer.run_step()
            res = trainer.last_result
            assert res is not None and res.exp.scores is not None
            prompts, responses = (list(x) for x in zip(*res.texts))
            vader = vader_sentiment(prompts, responses)
            assert res.exp.scores.tolist() == pytest.approx(vader, abs=1e-5)
            assert metrics["reward/mean"] == pytest.approx(statistics.fmean(vader), abs=1e-5)
            assert metrics["reward/vader_sentiment/mean"] == pytest.approx(statistics.fmean(vader), abs=1e-5)
            assert metrics["judge/mean"] == pytest.approx(statistics.fmean(afinn_sentiment(prompts, responses)),
                                                          abs=1e-5)
            assert all(math.isfinite(metrics[k]) for k in ("loss/policy", "kl/mean"))
            seen += vader
    finally:
        trainer.close()
    print(f"sentiment recipe on the built-in policy: 2 steps in {time.perf_counter() - t0:.1f}s")
    assert trainer.step == 2
    assert any(v != 0.0 for v in seen)  # the task's replies carry sentiment words VADER reads
