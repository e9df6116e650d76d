"""The overlap controller (``oppo.tuner``) driven through simulated cost curves, and the trainer
switching between streamed and one-shot scoring."""

from __future__ import annotations

import math
import random

import pytest

from oppo.tuner import OverlapTuner, Setting, delta_ladder

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


def test_state_dict_resumes_the_same_decisions():
    a = OverlapTuner(delta_ladder(0, 16), CHUNKS, trial_steps=2, retune_every=8)
    drive(a, long_tail, 13, noise=0.03)
    b = OverlapTuner(delta_ladder(0, 16), CHUNKS, trial_steps=2, retune_every=8)
    b.load_state_dict(a.state_dict())
    ua, ub = drive(a, long_tail, 40, noise=0.03, seed=7), drive(b, long_tail, 40, noise=0.03, seed=7)
    assert ua == ub
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

    t = Trainer(cfg, progress=False)
    try:
        out = []
        for _ in range(n):
            m = t.run_step()
            out.append((t.last_result.exp.ids.tolist(), m))
        return out, t.run.tuner
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
