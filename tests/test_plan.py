"""The planner (oppo.plan): hand-checkable schedules, the cost models, the length model, and the
calibration against the committed CPU benches. All fast (no models, no torch work)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from oppo.plan.costs import GPUS, Efficiency, LinearCosts, Roofline, Work, model_shape, nnls
from oppo.plan.lengths import FixedLengths, LogNormalLengths
from oppo.plan.sim import DeviceSplit, Workload, simulate

# a copy of an `oppo bench --quick` tail sweep (benchmarks/latest as committed at 1212ebf): `make bench`
# rewrites benchmarks/latest with the current workload, which this replay must not depend on
BENCH = Path(__file__).resolve().parent / "fixtures" / "bench_tail"

# one second per decode step, nothing else costs anything unless a test says so
UNIT = {"decode.calls": 1.0}


def step_times(mode, wl, coef, pl, steps):
    res = simulate(mode, wl, LinearCosts(coef), pl, steps=steps, warmup=0)
    return [round(s.time, 9) for s in res.steps]


class Table:
    """Lengths from a dict (prompt index -> tokens), 1 for any other index."""

    def __init__(self, d):
        self.d = d

    def __call__(self, i):
        return self.d.get(i, 1)


def test_two_stage_pipeline_by_hand():
    # B = 2 rows of 4 tokens; decode 1 s per step; the reward model's forward costs 0.5 s a call
    # streamed, 2 s one-shot; the PPO update 1 s (one micro-batch).
    # sequential: decode 0-4, score 4-6, train 6-7                 -> 7.0 s
    # intra, chunk 1: scorer prefills prompts 0-0.5, then scores each token's chunk as it
    #   arrives at 1, 2, 3, 4 (0.5 s each, so it keeps up); last done at 4.5; train 4.5-5.5 -> 5.5 s
    coef = {**UNIT, "stream.reward.calls": 0.5, "oneshot.reward.calls": 2.0, "train.actor.calls": 1.0}
    pl = DeviceSplit(1, 1, scorer_roles=("reward",), critic="value_head")
    for chunk in (1, 2, 4):
        wl = Workload(2, FixedLengths(4), minibatch=2, micro=2, chunk=chunk, delta=0)
        assert step_times("sequential", wl, coef, pl, 2) == [7.0, 7.0]
        assert step_times("intra", wl, coef, pl, 2) == [5.5, 5.5]


def test_scorer_slower_than_decode_queues_and_batches():
    # chunk 1, streamed forward 1.5 s per call, decode 1 s per step, 4 tokens:
    # prompts 0-1.5; chunks arrive at 1, 2, 3, 4 -> forwards 1.5-3 (chunk@1), 3-4.5 (chunks @2, @3
    # batched in one call), 4.5-6 (final chunk @4); train 1 s -> 7.0
    coef = {**UNIT, "stream.reward.calls": 1.5, "train.actor.calls": 1.0}
    pl = DeviceSplit(1, 1, scorer_roles=("reward",), critic="value_head")
    wl = Workload(2, FixedLengths(4), minibatch=2, micro=2, chunk=1, delta=0)
    res = simulate("intra", wl, LinearCosts(coef), pl, steps=1, warmup=0)
    assert res.steps[0].time == pytest.approx(7.0)
    scored = [(s.start, s.end) for s in res.spans if s.stage == "score_reward"]
    assert scored == [(1.5, 3.0), (3.0, 4.5), (4.5, 6.0)]


def test_zero_scorer_cost_makes_intra_equal_sequential():
    coef = {"decode.calls": 0.01, "decode.rows": 0.001, "train.actor.tokens": 1e-4, "train.critic.tokens": 1e-4,
            "prefill.tokens": 1e-4}
    pl = DeviceSplit(1, 1, critic="actor")  # same devices, same critic placement in both modes
    wl = Workload(8, LogNormalLengths(6, 1.0, 64), minibatch=4, micro=2, chunk=3, delta=0)
    assert step_times("intra", wl, coef, pl, 5) == pytest.approx(step_times("sequential", wl, coef, pl, 5))


def test_equal_lengths_give_inter_no_gain():
    # every sequence ends at the same decode step: closing at B finished carries only finished
    # ones, each step decodes B new rows for L steps, exactly as the sequential loop
    coef = {**UNIT, "oneshot.reward.tokens": 1e-3, "train.actor.tokens": 1e-3}
    pl = DeviceSplit(1, 0, scorer_roles=("reward",), critic="value_head")
    wl = Workload(4, FixedLengths(5), minibatch=4, micro=4, delta=2, max_lag=1)
    seq = step_times("sequential", wl, coef, pl, 6)
    inter = step_times("inter", wl, coef, pl, 6)
    assert inter == pytest.approx(seq)


def test_inter_carries_the_long_sequence_by_hand():
    # B = 2, Delta = 1, max_lag = 1, decode 1 s per step, nothing else costs.
    # Lengths: prompt 0 -> 4 tokens, every other prompt 1 token.
    # sequential: step 0 = prompts {0, 1}: 4 s; then {2, 3}, {4, 5}: 1 s each.
    # inter: step 0 admits {0, 1, 2}; 1 and 2 finish at 1 s -> close, 0 carried with 1 token;
    #   step 1 admits {3}; 0 is due (lag 1), needs 3 more steps -> 3 s; trains {0, 3};
    #   step 2 admits {4, 5} -> 1 s.
    pl = DeviceSplit(1, 0, scorer_roles=(), critic="value_head")
    wl = Workload(2, Table({0: 4}), minibatch=2, micro=2, delta=1, max_lag=1)
    assert step_times("sequential", wl, UNIT, pl, 3) == [4.0, 1.0, 1.0]
    assert step_times("inter", wl, UNIT, pl, 3) == [1.0, 3.0, 1.0]
    res = simulate("inter", wl, LinearCosts(UNIT), pl, steps=3, warmup=0)
    assert res.steps[1].lags == [1, 0] and res.steps[1].offpolicy_tokens == 1  # one token sampled by pi_0


def test_data_parallel_actors_split_rows_and_wait_for_the_slowest():
    # 4 rows on 2 actor devices (2 each); lengths 1, 1, 1, 6 by prompt index: the device holding
    # the 6-token row decodes 6 s, the other 1 s; the sequential step waits for both.
    pl = DeviceSplit(2, 0, scorer_roles=(), critic="value_head")
    wl = Workload(4, Table({3: 6}), minibatch=4, micro=4, delta=0)
    res = simulate("sequential", wl, LinearCosts(UNIT), pl, steps=1, warmup=0)
    assert res.steps[0].time == pytest.approx(6.0)
    busy = res.steps[0].device_busy
    assert sorted(busy.values()) == pytest.approx([1.0, 6.0])


def test_lognormal_lengths_replay_the_bench_sampler():
    from oppo.bench import synthetic_sampler

    bench = synthetic_sampler(1.5, 128, 0)
    mine = LogNormalLengths(128 // 12, 1.5, 128, seed=0)
    assert [mine(i) for i in range(500)] == [bench(i) for i in range(500)]
    assert LogNormalLengths(10, 0.0, 128).sample(5) == [10] * 5


def test_nnls_recovers_nonnegative_coefficients():
    A = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    assert nnls(A, A @ np.array([2.0, 0.5])) == pytest.approx([2.0, 0.5])
    # least squares would give a negative intercept (-1); NNLS clamps it at 0 and refits the slope
    x = nnls(A, np.array([-1.0, 0.0, 1.0, 2.0]))
    assert x[0] == 0.0 and x[1] == pytest.approx(8 / 14)


def test_linear_costs_features_and_time():
    c = LinearCosts({"decode.calls": 2.0, "decode.rows": 0.5, "train.actor.tokens": 0.01})
    assert c.time(Work("decode", "policy", calls=3, rows=10)) == pytest.approx(3 * 2.0 + 10 * 0.5)
    assert c.time(Work("train", "actor", calls=2, tokens=100)) == pytest.approx(1.0)
    assert c.time(Work("train", "critic", calls=2, tokens=100)) == 0.0  # no coefficient, no cost
    assert list(c.decode_steps(np.array([1, 4]), np.array([0, 0]))) == [2.5, 4.0]


def test_roofline_decode_and_forward_by_hand():
    m = model_shape(7)  # 7.6e9 parameters, bf16
    r = Roofline(GPUS["h100"], {"policy": m}, Efficiency(decode_bw=0.5, decode_step_s=0.01, forward=0.5,
                                                        forward_call_s=0.0))
    # one row, empty cache: read 15.2 GB at 3.35 TB/s * 0.5 -> 9.07 ms, plus 10 ms
    assert r.decode_steps(np.array([1]), np.array([0]))[0] == pytest.approx(15.2e9 / 1.675e12 + 0.01)
    # 100k tokens, no attention: 2 * 7.6e9 * 1e5 FLOP at 989e12 * 0.5 -> 3.07 s (compute-bound)
    assert r.time(Work("oneshot", "policy", 1, 100, 1e5, 0)) == pytest.approx(2 * 7.6e9 * 1e5 / 494.5e12)


def test_bad_inputs_say_what_to_do():
    with pytest.raises(ValueError, match="unknown op"):
        Work("dance")
    with pytest.raises(ValueError, match="critic must be"):
        DeviceSplit(critic="nowhere")
    from oppo.plan.project import parse_placement

    assert parse_placement("7+1", 8) == (7, 1)
    with pytest.raises(ValueError, match="make them agree"):
        parse_placement("7+1", 16)


@pytest.mark.skipif(not (BENCH / "tail").is_dir(), reason="needs the committed tail sweep (tests/fixtures/bench_tail)")
def test_calibration_replays_the_measured_runs_and_predicts_within_15_percent():
    from oppo.plan.calibrate import load_tail_sweep, validation

    runs = load_tail_sweep(BENCH)
    assert len(runs) == 12  # 3 sigmas x 4 modes; replay_workload (called by the fit) checks every batch
    v = validation([BENCH])
    for c in v["comparisons"]:
        for mode in ("intra", "inter", "oppo"):
            assert abs(c.error(mode)) < 0.15, (c.label, mode, c.measured[mode], c.predicted[mode])


def test_cli_prints_a_projection(capsys):
    from oppo.plan.cli import main

    assert main(["--sigma", "1.0", "--steps", "4"]) == 0
    text = capsys.readouterr().out
    assert "| oppo |" in text and "spec sheet" in text


def test_projection_shows_the_long_tail_gain():
    from oppo.plan.project import paper_setting, project, summarize

    s = summarize(project(paper_setting("h100", sigma=1.0), steps=6, warmup=1))
    assert s["sequential"]["speedup"] == pytest.approx(1.0)
    assert s["oppo"]["speedup"] > s["inter"]["speedup"] > 1.1
    assert math.isclose(s["intra"]["offpolicy_token_frac"], 0.0)


# ------------------------------------------------------------------ pipeline, groups, refill


def test_pipeline_step_is_max_of_decode_and_train_plus_sync_by_hand():
    # B = 2 rows of 4 tokens, Delta 0, decode 1 s per step, the update 3 s, the weight sync 0.5 s,
    # no scorer work. The update runs beside decoding (the learner thread).
    # step 0: decode 0-4, close at 4; update 4-7; meanwhile step 1's two rows are admitted at 4
    #   and decode steps begun before 7 run: 4-5, 5-6, 6-7 (3 tokens each); sync 7-7.5 -> 7.5 s
    # step 1: 1 token left: 7.5-8.5; update 8.5-11.5 while step 2's rows decode 3 tokens; sync -> 12
    #   -> 4.5 s = max(decode 4, train 3) + sync 0.5
    # last step (no next one is begun): 1 + 3 + 0.5 = 4.5 s
    pl = DeviceSplit(1, 1, scorer_roles=(), critic="value_head")
    coef = {**UNIT, "train.actor.calls": 3.0, "sync.calls": 0.5}
    wl = Workload(2, FixedLengths(4), minibatch=2, micro=2, delta=0, max_lag=1)
    assert step_times("pipeline", wl, coef, pl, 4) == [7.5, 4.5, 4.5, 4.5]
    # sequential: decode 4 + train 3 + sync 0.5
    assert step_times("sequential", wl, coef, pl, 2) == [7.5, 7.5]
    res = simulate("pipeline", wl, LinearCosts(coef), pl, steps=3, warmup=0)
    s1 = res.steps[1]
    assert s1.lags == [0, 0] and s1.offpolicy_tokens == 6  # 3 tokens each sampled by pi_0, trained at step 1
    inflight = [(s.start, s.end) for s in res.spans if s.stage == "decode_inflight" and s.step == 0]
    assert inflight == [(4.0, 7.0)]
    # an update longer than decoding: all 4 tokens decode during the update (4-8 < 4-10), the
    # next step closes at once -> step = train 6 + sync 0.5
    coef6 = {**coef, "train.actor.calls": 6.0}
    assert step_times("pipeline", wl, coef6, pl, 4) == [10.5, 6.5, 6.5, 6.5]


def test_groups_close_on_whole_groups_carry_or_wait_by_hand():
    # B = 4 in groups of G = 2, Delta 1 group, max_lag 1, decode 1 s per step, nothing else costs.
    # Lengths by (prompt, member): prompt 0 -> (1, 5), prompt 1 -> (1, 1), prompt 2 -> (2, 2); others 1.
    # sequential: groups of prompts 0 and 1, waits for the 5-token member -> 5 s; then prompts
    #   2 and 3 -> 2 s.
    # carry: admits 3 groups; at 1 s group 1 is complete, at 2 s group 2: close with 2 groups,
    #   group 0 carried whole (member 0 finished, member 1 with 2 of 5 tokens). Step 1: group 0 is
    #   due; the new groups finish at 1 s, group 0's member at 3 s -> 3 s.
    # wait: at 2 s group 0 is partly finished and still running -> the step waits for it: 5 s.
    lens = {(0, 0): 1, (0, 1): 5, (1, 0): 1, (1, 1): 1, (2, 0): 2, (2, 1): 2}
    lengths = lambda i, m=0: lens.get((i, m), 1)  # noqa: E731
    pl = DeviceSplit(1, 0, scorer_roles=(), critic="value_head")
    wl = Workload(4, lengths, minibatch=4, micro=4, delta=1, max_lag=1, group_size=2)
    assert step_times("sequential", wl, UNIT, pl, 2) == [5.0, 2.0]
    assert step_times("inter", wl, UNIT, pl, 2) == [2.0, 3.0]
    assert step_times("inter", replace(wl, partial_groups="wait"), UNIT, pl, 1) == [5.0]
    res = simulate("inter", wl, LinearCosts(UNIT), pl, steps=2, warmup=0)
    assert res.steps[0].lengths == [1, 1, 2, 2]  # groups 1 and 2, members adjacent
    assert sorted(res.steps[1].lengths) == [1, 1, 1, 5] and sorted(res.steps[1].lags) == [0, 0, 1, 1]


def test_refill_admits_at_each_finish_by_hand():
    # B = 2, Delta 0, max_lag 1, decode 1 s per step. Lengths: prompt 0 -> 3, every other 1.
    # inter without refill: prompts 0 and 1 admitted; waits for 2 finished -> 3 s.
    # with refill: prompt 1 finishes at 1 s, prompt 2 is admitted in its slot and finishes at 2 s:
    #   close at 2 s (prompt 3 admitted at that finish, carried); step 1: prompt 0 (1 token left)
    #   and prompt 3 finish after 1 s, both due (admitted in step 0) -> 1 s.
    pl = DeviceSplit(1, 0, scorer_roles=(), critic="value_head")
    wl = Workload(2, Table({0: 3}), minibatch=2, micro=2, delta=0, max_lag=1)
    assert step_times("inter", wl, UNIT, pl, 1) == [3.0]
    wr = replace(wl, refill=True)
    assert step_times("inter", wr, UNIT, pl, 2) == [2.0, 1.0]
    res = simulate("inter", wr, LinearCosts(UNIT), pl, steps=2, warmup=0)
    assert res.steps[1].lags == [1, 1] and res.steps[1].offpolicy_tokens == 2
    # refill is an inter-step setting: sequential ignores it
    assert step_times("sequential", wr, UNIT, pl, 1) == [3.0]


def test_lognormal_lengths_replay_the_bench_sampler_for_group_members():
    from oppo.bench import synthetic_sampler

    bench = synthetic_sampler(1.0, 128, 3)
    mine = LogNormalLengths(128 // 12, 1.0, 128, seed=3)
    assert [mine(i, m) for i in range(50) for m in range(4)] == [bench(i, m) for i in range(50) for m in range(4)]


@pytest.mark.skipif(not (BENCH / "tail").is_dir(), reason="needs the committed tail sweep (tests/fixtures/bench_tail)")
def test_inter_breakdown_accounts_for_the_whole_difference():
    from oppo.plan.calibrate import load_tail_sweep
    from oppo.plan.inter import breakdown

    runs = load_tail_sweep(BENCH)
    seq = next(r for r in runs if r.sigma == 1.5 and r.mode == "sequential")
    inter = next(r for r in runs if r.sigma == 1.5 and r.mode == "inter")
    bd = breakdown(seq, inter)
    assert sum(bd["parts"].values()) == pytest.approx(bd["step_difference"])
    s, i = bd["sequential"], bd["inter"]
    # the sequential loop decodes until its batch's longest response; it never waits for due rows
    assert s["decode_steps"] == pytest.approx(s["batch_max_length"]) and s["due_wait_steps"] == 0
    # inter keeps B + Delta in flight and closes on B finished: fewer decode steps, more rows in each
    assert i["decode_steps"] < s["decode_steps"] and i["rows_per_decode_step"] > s["rows_per_decode_step"]
    assert 0 < i["due_wait_steps"] < i["decode_steps"]


def test_gpu_like_decode_keeps_the_step_cost_at_b_and_prices_extra_rows_low():
    from oppo.plan.inter import gpu_like

    c = LinearCosts({"decode.calls": 2e-3, "decode.rows": 1e-4, "decode.attn": 0.0, "train.actor.tokens": 1e-4})
    g = gpu_like(c, 32, rows_share=0.02, other_scale=0.5)
    at_b = 2e-3 + 32 * 1e-4  # 5.2 ms for 32 rows on the CPU costs
    assert g.decode_steps(np.array([32]), np.array([0]))[0] == pytest.approx(at_b)
    assert g.decode_steps(np.array([33]), np.array([0]))[0] == pytest.approx(at_b * (1 + 0.02 / 32))
    assert g.coef["train.actor.tokens"] == pytest.approx(0.5e-4)


def test_read_lengths_gives_group_members_their_place(tmp_path):
    from oppo.plan.calibrate import read_lengths

    p = tmp_path / "lengths.jsonl"
    # oppo train's format (no member field): a group's members are adjacent entries of one prompt
    p.write_text('{"step": 0, "lengths": [3, 5, 7, 2], "prompt_index": [4, 4, 9, 9]}\n'
                 '{"step": 1, "lengths": [6], "prompt_index": [1], "member": [0]}\n')
    assert read_lengths(p) == {(4, 0): 3, (4, 1): 5, (9, 0): 7, (9, 1): 2, (1, 0): 6}


def _measured_from_sim(mode, coef, lengths, steps=4, batch=8, needs_critic=True):
    """A MeasuredRun whose spans and metrics are a simulation with known costs ``coef``, as the
    runtime would record them (streamed scorer spans carry their token count)."""
    from oppo.plan.calibrate import MeasuredRun, cpu_placement
    from oppo.plan.lengths import TableLengths
    from oppo.trace import Span

    wl = Workload(batch, TableLengths(lengths, 64), prompt_tokens=11, prompt_pad=15,  # as replay_workload
                  delta=2, chunk=4, minibatch=4, micro=4)
    res = simulate(mode, wl, LinearCosts(coef), cpu_placement(mode, True, needs_critic), steps=steps, warmup=0,
                   fine=True)
    spans = [Span(s.lane, s.stage, s.step, s.start, s.end,
                  {"tokens": s.args["works"][0]["tokens"]} if s.stage.startswith("score_") else {})
             for s in res.spans]
    metrics = [{"time/step": s.time, "response_length/mean": float(np.mean(s.lengths)),
                "response_length/max": float(max(s.lengths)), "overlap/delta": 2, "overlap/chunk_size": 4}
               for s in res.steps]
    settings = {"ppo": {"batch_size": batch, "minibatch_size": 4, "micro_batch_size": 4, "epochs": 1},
                "overlap": {"max_lag": 1}, "placement": {"critic_on_worker": True}, "run": {"seed": 0}}
    return MeasuredRun(Path(mode), mode, metrics, spans, settings, table=lengths, max_new_tokens=64,
                       needs_critic=needs_critic)


SPLIT_TRUE = {"decode.calls": 0.01, "decode.rows": 0.001, "prefill.calls": 0.02, "book.calls": 0.002,
              "oneshot.policy.tokens": 1e-4, "oneshot.critic.tokens": 1e-4, "stream.reward.calls": 0.005,
              "stream.reference.calls": 0.005, "stream.critic.calls": 0.005, "stream.reward.tokens": 5e-5,
              "stream.reference.tokens": 5e-5, "stream.critic.tokens": 5e-5, "train.actor.tokens": 2e-4,
              "train.critic.tokens": 1.5e-4}
FIT_LENGTHS = {(i, 0): 3 + (i * 7) % 19 for i in range(200)}


def test_fit_counts_a_nested_span_of_one_stage_once():
    # With the critic trained beside the actor the runtime records the actor's update as a
    # learner/train span inside stages.update's learner/train span (setup.CriticBesideScorer).
    # Summing both fitted the split placement's train.actor.tokens at 2x the real cost.
    from oppo.plan.calibrate import fit
    from oppo.trace import Span

    run = _measured_from_sim("oppo", SPLIT_TRUE, FIT_LENGTHS)
    outer = [Span(s.lane, s.stage, s.step, s.start - 1e-3, s.end + 1e-3)
             for s in run.spans if (s.lane, s.stage) == ("learner", "train")]
    assert outer
    for spans in (run.spans, run.spans + outer):
        run.spans = spans
        c = fit([run])["split"].coef
        assert c["train.actor.tokens"] == pytest.approx(2e-4, rel=0.02)
        assert c["train.critic.tokens"] == pytest.approx(1.5e-4, rel=0.02)


def test_fit_splits_a_tied_actor_and_critic_update_as_measured_apart():
    # sequential trains actor and critic in one span with the same sizes: the fit can price their
    # sum only, and put all of it on the actor, so a critic-free run (GRPO) paid for a critic.
    # The split placement measures them apart (here 2 : 1.5), which apportions the sum.
    from oppo.plan.calibrate import CpuProfile, fit

    together = {"decode.calls": 0.01, "decode.rows": 0.001, "book.calls": 0.002, "oneshot.reward.tokens": 3e-5,
                "oneshot.reference.tokens": 3e-5, "oneshot.critic.tokens": 3e-5, "train.actor.tokens": 1e-4,
                "train.critic.tokens": 0.75e-4}
    costs = fit([_measured_from_sim("sequential", together, FIT_LENGTHS),
                 _measured_from_sim("oppo", SPLIT_TRUE, FIT_LENGTHS)])
    c = costs["together"].coef
    assert c["train.actor.tokens"] == pytest.approx(1e-4, rel=0.02)
    assert c["train.critic.tokens"] == pytest.approx(0.75e-4, rel=0.02)
    # without a critic the split placement's actor trains alone on all cores: together's cost
    prof = CpuProfile(costs)
    assert prof.costs_for("oppo", needs_critic=False).coef["train.actor.tokens"] == pytest.approx(1e-4, rel=0.02)
    assert prof.costs_for("oppo").coef["train.actor.tokens"] == pytest.approx(2e-4, rel=0.02)
