"""The overlap controller (``oppo.scheduler.tuner``) driven through simulated cost curves, and the trainer
switching between streamed and one-shot scoring."""

from __future__ import annotations

import math
import random

import pytest

from oppo.scheduler.tuner import OverlapTuner, Prediction, Setting, delta_ladder

CHUNKS = (16, 0, 8, 32)


def drive(tuner: OverlapTuner, cost, steps: int, noise: float = 0.0, seed: int = 0, stale=None):
    """Run ``steps`` steps: each costs ``cost(setting, step)`` seconds per token (times a uniform
    noise of +-``noise``), 100 tokens; ``stale(setting)`` is the off-policy share. Returns the
    settings used, step by step."""
    rng = random.Random(seed)
    used = []
    for k in range(steps):
        s = tuner.current()
        used.append(s)
        c = cost(s, k) * (1 + rng.uniform(-noise, noise))
        tuner.record(100 * c, 100, stale(s) if stale else (0.4 if s.delta else 0.0) * min(1, s.delta / 4))
    return used


def long_tail(s: Setting, k: int = 0) -> float:
    """Carrying pays up to Delta 8 (the tail hidden), a little worse at 16 (more rows per decode
    step); streaming in chunks of 8-16 beats one-shot by 20%."""
    by_delta = {0: 1.0, 2: 0.85, 4: 0.75, 8: 0.62, 16: 0.66}[s.delta]
    by_chunk = {0: 1.2, 8: 1.0, 16: 0.98, 32: 1.05}[s.chunk]
    return by_delta * by_chunk


def test_ladder():
    assert delta_ladder(0, 16) == (0, 4, 8, 16)
    assert delta_ladder(0, 4) == (0, 1, 2, 4)
    assert delta_ladder(3, 3) == (3,)
    assert delta_ladder(5, 16) == (5, 8, 16)


def test_converges_to_the_best_setting():
    t = OverlapTuner(delta_ladder(0, 16), CHUNKS, trial_steps=2, retune_every=30)
    used = drive(t, long_tail, 100, noise=0.02)
    best = min(((d, c) for d in (0, 4, 8, 16) for c in CHUNKS), key=lambda dc: long_tail(Setting(*dc)))
    assert (t.incumbent.delta, t.incumbent.chunk) == best == (8, 16)
    # exploring costs a bounded share of the run: after the first round the best setting holds
    first_hold = next(i for i, s in enumerate(used) if t.rounds and i > 20 and s == t.incumbent)
    assert sum(s == t.incumbent for s in used[first_hold:]) / len(used[first_hold:]) > 0.7
    assert any("Delta 4 -> " in d or "-> Delta 8" in d for d in t.take_decisions())


def test_no_tail_keeps_delta_at_zero_and_nothing_stale():
    """Equal lengths at the cap: extra rows only make each decode step dearer."""
    t = OverlapTuner(delta_ladder(0, 16), CHUNKS, trial_steps=2, retune_every=20)
    used = drive(t, lambda s, k: (1 + 0.03 * s.delta) * (1.0 if s.chunk else 0.9), 80, noise=0.02)
    assert t.incumbent == Setting(0, 0)  # one-shot scoring was cheaper here, and no Delta
    held = [s for s in used[30:] if s == t.incumbent]
    assert len(held) / len(used[30:]) > 0.7


def test_backs_off_when_carrying_stops_paying():
    def cost(s: Setting, k: int) -> float:  # from step 50 the tail is gone: carrying costs
        return long_tail(s) if k < 50 else 1.0 + 0.04 * s.delta

    t = OverlapTuner(delta_ladder(0, 16), (16,), trial_steps=2, retune_every=10)
    used = drive(t, cost, 50, noise=0.02)
    assert t.incumbent.delta == 8
    drive(t, lambda s, k: cost(s, 50 + k), 60, noise=0.02)
    assert t.incumbent.delta == 0
    assert any("-> Delta 0" in d for d in t.take_decisions())
    assert sum(s.delta == 8 for s in used[-20:]) >= 10  # the first half ended mostly holding Delta 8


def test_noise_does_not_make_it_oscillate():
    """A flat cost with +-4% noise per step: the starting setting is never left for good."""
    for seed in range(5):
        t = OverlapTuner(delta_ladder(0, 16), CHUNKS, trial_steps=2, retune_every=10, margin=0.05)
        drive(t, lambda s, k: 1.0, 120, noise=0.04, seed=seed)
        changes = [d for d in t.take_decisions() if " -> " in d]
        assert len(changes) <= 1, changes  # a lucky trial may move it once; never back and forth


def test_one_noisy_step_in_a_hold_is_not_a_drift():
    t = OverlapTuner((0, 4), (16,), trial_steps=2, retune_every=None)
    drive(t, lambda s, k: 1.0 if s.delta == 0 else 1.2, 12)
    assert t.phase == "hold" and t.incumbent.delta == 0
    t.record(300, 100)  # one step three times as slow
    assert t.phase == "hold"


def test_stale_budget_caps_delta():
    t = OverlapTuner(delta_ladder(0, 16), (16,), trial_steps=2, max_stale_share=0.3)
    drive(t, long_tail, 30, stale=lambda s: 0.1 * s.delta)  # Delta 4 would train 40% off-policy
    assert t.incumbent.delta == 0
    assert any("off-policy tokens" in d and "kept Delta 0" in d for d in t.take_decisions())


def test_fixed_settings_never_move():
    t = OverlapTuner((2,), (4,))
    drive(t, lambda s, k: 1.0 + k, 10)
    assert t.current() == Setting(2, 4) and not t.tunes and t.take_decisions() == []


def _drive_list(tuner: OverlapTuner, noise: list[float], cost=long_tail):
    """Run one step per entry of ``noise`` (its relative error); returns the settings used."""
    used = []
    for e in noise:
        s = tuner.current()
        used.append(s)
        tuner.record(100 * cost(s) * (1 + e), 100, 0.4 * min(1, s.delta / 4))
    return used


def _without_step(lines: list[str]) -> list[str]:
    return [d.split(": ", 1)[1] for d in lines]


def test_a_resume_mid_trial_takes_the_same_decisions_after_a_warm_up_step():
    """Checkpointed in the middle of a trial and resumed: the resumed run's first step is a warm-up
    (here three times as slow: a re-prefill) that is not measured; after it the resumed run
    measures what the uninterrupted one measures and decides the same, one step later."""
    rng = random.Random(3)
    noise = [rng.gauss(0, 0.05) for _ in range(120)]
    a = OverlapTuner(delta_ladder(0, 16), CHUNKS, trial_steps=2, retune_every=8)
    _drive_list(a, noise[:6])
    assert a.trial is not None and a._costs, "the checkpoint is taken mid-trial"
    b = OverlapTuner(delta_ladder(0, 16), CHUNKS, trial_steps=2, retune_every=8)
    b.load_state_dict(a.state_dict())
    a.take_decisions()
    ua = _drive_list(a, noise[6:])
    warm = b.current()
    b.record(300 * long_tail(warm), 100)  # the resumed run's first step: one-off costs
    assert b.current() == warm  # the warm-up measured nothing and moved nothing
    ub = _drive_list(b, noise[6:-1])
    assert ub == ua[:-1]
    da, db = _without_step(a.take_decisions()), _without_step(b.take_decisions())
    assert len(db) >= 4 and db == da[:len(db)] and len(da) - len(db) <= 1
    assert a.incumbent == b.incumbent or len(da) > len(db)
    other = OverlapTuner(delta_ladder(0, 8), CHUNKS)
    with pytest.raises(ValueError, match="same overlap settings"):
        other.load_state_dict(a.state_dict())


def test_bad_arguments():
    with pytest.raises(ValueError, match="ascending"):
        OverlapTuner((4, 0), (16,))
    with pytest.raises(ValueError, match="distinct"):
        OverlapTuner((0,), (16, 16))
    with pytest.raises(ValueError, match="finite"):
        OverlapTuner((0, 4), (16,)).record(math.nan, 1)


# ---------------------------------------------------------------- the trainer, one-shot and streamed


def _cfg(tiny_models, tiny_prompts, tmp_path, *extra):
    from oppo.config import load_config

    return load_config(None, [f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
                              f"data.prompts={tiny_prompts}", f"run.out_dir={tmp_path}", "placement.threads=1",
                              "ppo.batch_size=4", "ppo.minibatch_size=2", "ppo.micro_batch_size=2",
                              "generation.max_new_tokens=12", "log.progress=false", "placement.local.scorer_process=false", *extra])


def _steps(cfg, n):
    from oppo.trainer import Trainer

    t = Trainer.from_config(cfg, progress=False)
    try:
        out = []
        for _ in range(n):
            m = t.run_step()
            out.append((t.last_result.exp.ids.tolist(), m))
        return out, t.loop.tuner
    finally:
        t.close()


def test_one_shot_scoring_equals_streamed(tiny_models, tiny_prompts, tmp_path):
    """intra with the controller's one-shot setting (chunk 0) trains what streaming trains."""
    streamed, _ = _steps(_cfg(tiny_models, tiny_prompts, tmp_path / "a", "overlap.mode=intra",
                              "overlap.chunk_size=4"), 2)
    one_shot, _ = _steps(_cfg(tiny_models, tiny_prompts, tmp_path / "b", "overlap.mode=intra",
                              "overlap.chunk_candidates=[0]"), 2)
    for (ids_a, a), (ids_b, b) in zip(streamed, one_shot):
        assert ids_a == ids_b
        assert b["overlap/streaming"] == 0.0 and a["overlap/streaming"] == 1.0
        for k in ("reward/mean", "kl/mean", "loss/policy", "loss/value"):
            assert a[k] == pytest.approx(b[k], abs=1e-4, rel=1e-3), k


def test_switching_between_streamed_and_one_shot_with_carried_rows(tiny_models, tiny_prompts, tmp_path):
    """Trials switch streaming on and off every step while rows are carried across the switches:
    every trained row is scored (whole by the scorers, or one-shot) and the numbers stay finite."""
    cfg = _cfg(tiny_models, tiny_prompts, tmp_path, "overlap.mode=oppo", "overlap.delta=2",
               "overlap.chunk_candidates=[4,0]", "overlap.trial_steps=1", "overlap.retune_every=1",
               "overlap.tune_margin=0")
    rows, tuner = _steps(cfg, 6)
    modes = [m["overlap/streaming"] for _, m in rows]
    assert 0.0 in modes and 1.0 in modes
    assert max(m["overlap/carried"] for _, m in rows) > 0
    for _, m in rows:
        assert all(math.isfinite(m[k]) for k in ("reward/mean", "kl/mean", "loss/policy", "loss/value"))
    assert tuner.step == 6


def test_a_machine_that_slows_down_does_not_buy_stale_tokens():
    """Flat true cost, but the machine gets 1.5% slower every step (a shared machine filling up):
    each challenger tried later looks dearer, each incumbent measured earlier cheaper; and when it
    speeds up instead, a Delta tried later looks cheaper: the confirmation measures the incumbent
    again, so no Delta is kept."""
    for rate in (-0.015, 0.015):
        t = OverlapTuner(delta_ladder(0, 16), (16,), trial_steps=2, retune_every=6)
        drive(t, lambda s, k: (1 + rate) ** k, 40)
        assert t.incumbent.delta == 0, (rate, t.take_decisions())


def test_an_up_move_is_confirmed_before_it_is_kept():
    t = OverlapTuner((0, 4), (16,), trial_steps=2, retune_every=None)
    used = drive(t, lambda s, k: 1.0 if s.delta == 0 else 0.8, 14)
    assert t.incumbent.delta == 4
    # measure Delta 0 (warm-up + 2), Delta 4 (warm-up + 2), Delta 0 again (warm-up + 2), then hold at 4
    assert [s.delta for s in used[:10]] == [0, 0, 0, 4, 4, 4, 0, 0, 0, 4]
    assert any("before and" in d and "-> Delta 4" in d for d in t.take_decisions())


# ---------------------------------------------------------------- noise, prediction, short runs (issue 43)


def test_ten_percent_noise_settles_on_the_best_setting():
    """The issue's noise table as a test: 200 seeds x 400 steps, Gaussian noise of 10% on every
    step's cost, the default settings. At most 20% of steps run under a trial setting, and the
    final setting is the best in at least 90% of seeds. The curve's other settings are all at least
    twice the margin dearer than the best (``SEPARATED``): a setting within the margin is, by the
    controller's definition, no different. (Before issue 43: 27% trial steps, 44% final = best on
    the closer ``LONG_TAIL`` curve; ``benchmarks/controller_workloads/noise.md``.)"""
    from oppo.bench.controller_sim import SEPARATED, simulate, summarize

    s = summarize([simulate(SEPARATED, 0.10, seed, 400) for seed in range(200)])
    assert s["trial_share"] <= 0.20, s
    assert s["final_best"] >= 0.90, s
    assert s["overhead"] < 0.10, s  # exploring and its mistakes cost less than 10% over the best fixed setting


def _planner_drive(t: OverlapTuner, planner, lengths_of, cost, steps: int, noise: float = 0.02, seed: int = 0):
    """Steps of B = 16 rows: ``lengths_of(rng)`` the trained lengths, ``cost(setting)`` the seconds per
    token; 60% of a step in the decode loop, one decode step per token of the longest row."""
    rng = random.Random(seed)
    used = []
    for _ in range(steps):
        s = t.current()
        used.append(s)
        lengths = lengths_of(rng)
        secs = cost(s) * sum(lengths) * (1 + rng.gauss(0, noise))
        planner.observe(s, secs, lengths, max(lengths), 0.6 * secs)
        t.record(secs, sum(lengths), 0.3 * min(1, s.delta / 4))
    return used


def test_no_tail_the_planner_rules_out_every_delta_trial():
    """Every response at the cap: carrying cannot close a step earlier, so the planner predicts no
    saving for any Delta and the controller runs no Delta trial (at most 2 trial steps in all)."""
    from oppo.plan.online import OnlinePlanner

    t = OverlapTuner(delta_ladder(0, 16), (16,), retune_every=20, steps=100)
    planner = OnlinePlanner(16)
    t.predictor = planner.predict
    used = _planner_drive(t, planner, lambda rng: [64] * 16, lambda s: 1 + 0.03 * s.delta, 100)
    assert t.trial_steps_run <= 2 and all(s.delta == 0 for s in used)
    lines = t.take_decisions()
    assert any("not trying Delta 4" in d and "saves less than 5%" in d for d in lines), lines


def test_long_tail_the_planner_predicts_carrying_pays_and_the_controller_confirms_it():
    from oppo.plan.online import OnlinePlanner, replay_carry

    lengths = [min(128, max(1, int(random.Random(i).lognormvariate(3.3, 1.0)))) for i in range(256)]
    d0, _, _, stale0 = replay_carry(lengths, 16, 0)
    d4, _, _, stale4 = replay_carry(lengths, 16, 4)
    assert stale0 == 0 and 0 < stale4 < 1 and d4 < 0.8 * d0  # Delta 4 closes steps well before the tail
    assert replay_carry([64] * 64, 16, 4)[0] == replay_carry([64] * 64, 16, 0)[0] == 64  # no tail: no saving

    def cost(s: Setting) -> float:  # the true cost follows the decode steps the tail costs
        return {0: 1.0, 4: 0.8, 8: 0.72, 16: 0.7}[s.delta]

    t = OverlapTuner(delta_ladder(0, 16), (16,), retune_every=30, max_stale_share=0.9, steps=200)
    planner = OnlinePlanner(16)
    t.predictor = planner.predict
    rng_l = random.Random(5)
    _planner_drive(t, planner, lambda rng: [rng_l.choice(lengths) for _ in range(16)], cost, 60)
    lines = t.take_decisions()
    assert t.incumbent.delta >= 4, lines
    moved = [d for d in lines if "-> Delta 4" in d]
    assert moved and "predicted" in moved[0] and "before and" in moved[0]  # predicted, measured, confirmed


def test_predicted_losers_are_not_tried_and_the_rest_most_promising_first():
    pred = {16: 1.0, 0: None, 8: 1.1, 32: 0.8}  # chunk 32 predicted best, chunk 8 a loser, one-shot unknown

    t = OverlapTuner((0,), CHUNKS, trial_steps=2, retune_every=None)
    t.predictor = lambda s: None if pred[s.chunk] is None else Prediction(pred[s.chunk])
    seen = []
    for _ in range(12):
        s = t.current()
        seen.append(s.chunk)
        if t.trial is not None and s.chunk == 32:
            m = t.metrics()
            assert m["overlap/tuner_predicted_ms_per_token"] == pytest.approx(800, rel=0.05)
        t.record(100 * {16: 1.0, 0: 1.3, 8: 1.0, 32: 1.0}[s.chunk], 100)
    assert 8 not in seen and seen.index(32) < seen.index(0)
    lines = t.take_decisions()
    assert any("not trying Delta 0, chunk 8: predicted" in d for d in lines), lines
    assert any("chunk 32 saves less than 5%" in d and "predicted 800.000" in d for d in lines), lines
    assert "overlap/tuner_predicted_gain" in t.metrics() or "overlap/tuner_measured_gain" in t.metrics()


def test_a_run_too_short_to_repay_a_trial_does_not_run_it_and_says_so_once():
    t = OverlapTuner(delta_ladder(0, 16), CHUNKS, steps=6)
    used = drive(t, long_tail, 6)
    assert t.trial_steps_run == 0 and set(used) == {Setting(0, 16)}
    lines = t.take_decisions()
    assert sum("too few steps left" in d for d in lines) == 1, lines
    long_run = OverlapTuner(delta_ladder(0, 16), CHUNKS, steps=400)
    drive(long_run, long_tail, 40)
    assert long_run.trial_steps_run > 0


def test_every_kind_of_move_is_confirmed_by_measuring_the_incumbent_again():
    t = OverlapTuner((0,), (16, 8), trial_steps=2, retune_every=None)
    used = drive(t, lambda s, k: 1.0 if s.chunk == 16 else 0.8, 10)
    # warm-up + 2 of chunk 16, 2 of chunk 8, chunk 16 again (the confirmation), then chunk 8 holds
    assert [s.chunk for s in used[:8]] == [16, 16, 16, 8, 8, 16, 16, 8]
    assert any("-> Delta 0, chunk 8" in d and "before and" in d for d in t.take_decisions())


def test_the_drift_limit_follows_the_measured_spread():
    """A flat cost under 10% noise is not a drift (the old fixed 10% limit restarted rounds on it);
    a 15% rise under 1% noise is one."""
    for seed in range(10):
        t = OverlapTuner((0, 4), (16,), retune_every=None)
        drive(t, lambda s, k: 1.0 if s.delta == 0 else 1.5, 300, noise=0.17, seed=seed)  # uniform +-17%: sd ~10%
        assert sum("rose to" in d for d in t.take_decisions()) <= 1
        assert 0.06 < t.sigma < 0.14
    t = OverlapTuner((0, 4), (16,), retune_every=None)
    drive(t, lambda s, k: (1.0 if k < 40 else 1.15) * (1.0 if s.delta == 0 else 1.5), 60, noise=0.01)
    assert any("rose to" in d for d in t.take_decisions())


def test_metrics_with_no_value_yet_are_absent():
    t = OverlapTuner(delta_ladder(0, 16), CHUNKS)
    m = t.metrics()
    assert not any(k in m for k in ("overlap/tuner_cost_ms_per_token", "overlap/tuner_noise",
                                    "overlap/tuner_predicted_ms_per_token", "overlap/tuner_measured_gain"))
    drive(t, long_tail, 12, noise=0.02)
    m = t.metrics()
    assert all(math.isfinite(v) for v in m.values()) and "overlap/tuner_noise" in m and "overlap/tuner_measured_gain" in m


def test_the_trainer_feeds_the_planner_and_a_short_run_does_not_explore(tiny_models, tiny_prompts, tmp_path):
    """The default controller in a trainer: the planner learns from every step's stage timings and
    lengths, and a 4-step run (run.steps) is too short to repay a trial: no step runs one."""
    cfg = _cfg(tiny_models, tiny_prompts, tmp_path, "overlap.mode=oppo", "run.steps=4")
    rows, tuner = _steps(cfg, 4)
    assert tuner.predictor is not None and tuner.trial_steps_run == 0
    planner = tuner.predictor.__self__
    assert len(planner.lengths) >= 3 and all(c > 0 for cs in planner.decode.values() for c in cs)  # every measured step observed
    assert all(m["overlap/tuner_trial"] == 0.0 for _, m in rows)
    assert sum("too few steps left" in d for d in tuner.take_decisions()) == 1


# ---------------------------------------------------------------- the controller behind one Protocol


@pytest.mark.parametrize("extra, kind", [(("overlap.delta_rule=reward_slope",), "ChunkSizeTuner"), ((), "OverlapTuner")])
def test_every_overlap_controller_is_driven_one_way(extra, kind):
    """``control.controller.build_controller`` gives the reward-slope rule's chunk tuner or the cost
    controller; the loop drives either through the same calls (``OverlapController``), none asked
    which it holds."""
    from oppo.config import load_config
    from oppo.control.controller import build_controller
    from oppo.scheduler import StepTiming

    cfg = load_config(None, ["policy.path=p", "reward.path=r", "data.prompts=d", "overlap.mode=oppo", "overlap.delta=-1",
                             "overlap.delta_min=0", "overlap.delta_max=8", "overlap.chunk_candidates=[4,8]",
                             "ppo.batch_size=8", "ppo.minibatch_size=8", "ppo.micro_batch_size=8", *extra])
    controller, delta = build_controller(cfg.overlap, cfg.ppo.batch_size, cfg.group_size, cfg.run.steps,
                                         streams=True, in_flight=False)
    assert type(controller).__name__ == kind
    assert controller.chunk_size() == 4 and hasattr(delta, "after_step")  # Delta moves: a rule, not a number
    for k in range(6):
        controller.observe(StepTiming(1.0 + 0.1 * k, 100.0, 0.1, (10,) * 8, 10.0, 0.5))
    assert all(isinstance(line, str) for line in controller.take_decisions())
    assert isinstance(controller.step_metrics(), dict)
    again, _ = build_controller(cfg.overlap, cfg.ppo.batch_size, cfg.group_size, cfg.run.steps,
                                streams=True, in_flight=False)
    again.load_state_dict(controller.state_dict())
    assert again.chunk_size() == controller.chunk_size()


def test_a_prior_wrong_in_the_blocking_direction_does_not_veto_the_larger_delta():
    """Issue 51: a GPU's decode costs per call, not per row; the planner's half-per-row prior then
    predicts Delta 4 saves about half of what it truly saves (under the 5% margin). Before the fix
    it ruled Delta 4 out, so no second row count ever ran and the prior was never corrected. Now a
    model not fitted from the run's own measures vetoes nothing that a split the measures allow
    would let pass: Delta 4 is tried, the trial fits the decode model, and Delta 4 is kept; the fitted
    model then spares the next round a trial of Delta 0, which it predicts to cost over the margin more."""
    from oppo.plan.online import OnlinePlanner, replay_carry

    pool = [min(512, max(1, int(random.Random(i).lognormvariate(math.log(64), 1.0)))) for i in range(1024)]
    a, b, r = 1e-3, 1e-5, 0.95e-3  # s per decode step, per row in it, per trained token outside decoding
    truth = {d: replay_carry(pool, 16, d, steps=200, warmup=8) for d in delta_ladder(0, 16)}

    def per_token(d: int) -> tuple[float, float]:  # (decode, all) seconds per trained token at Delta d
        steps, rows, tok, _ = truth[d]
        return (a * steps + b * rows) / tok, (a * steps + b * rows) / tok + r

    true_gain = 1 - per_token(4)[1] / per_token(0)[1]
    t = OverlapTuner(delta_ladder(0, 16), (16,), retune_every=30, steps=200)
    planner = OnlinePlanner(16)
    t.predictor = planner.predict
    rng = random.Random(1)
    for k in range(60):
        s = t.current()
        lengths = rng.sample(pool, 16)
        f = 1 + rng.gauss(0, 0.02)
        dec, whole = per_token(s.delta)
        steps, _, tok, stale = truth[s.delta]
        planner.observe(s, whole * sum(lengths) * f, lengths, steps * sum(lengths) / tok, dec * sum(lengths) * f)
        t.record(whole * sum(lengths) * f, sum(lengths), stale)
        if k == 2:  # measured Delta 0 only: the prior, wrong in the blocking direction
            p0, p4 = planner.predict(Setting(0, 16)), planner.predict(Setting(4, 16))
            assert p0 is not None and p4 is not None and not p4.fitted and not planner.fitted
            assert 1 - p4.cost / p0.cost < 0.05 < true_gain - 0.02, (p4.cost / p0.cost, true_gain)
    lines = t.take_decisions()
    assert not any("not trying Delta 4" in x for x in lines), lines
    moved = [x for x in lines if "-> Delta 4" in x]
    assert t.incumbent.delta == 4 and moved and "fitted" in moved[0], lines
    # the next round: the fitted model predicts Delta 0 to cost more than the margin more; no down trial
    assert any("not trying Delta 0" in x and "costs more than 5% more" in x and "fitted" in x for x in lines), lines
    assert planner.fitted  # ... from two row counts, and it now predicts what Delta 4 truly saves
    p0, p4 = planner.predict(Setting(0, 16)), planner.predict(Setting(4, 16))
    assert p0 is not None and p4 is not None and p4.fitted
    assert 1 - p4.cost / p0.cost == pytest.approx(true_gain, abs=0.02)
