"""``ppo.shape_buckets=on`` in every overlap mode on the CPU: the bucketed road a GPU takes by
default (auto is on for CUDA, off here), driven in CI. Two steps each on the tiny models: every
metric finite, and the modes with no deferral equal ``sequential`` step for step (the invariant of
``tests/test_modes.py``, which runs buckets off) -- streamed into the bucketed scorer slots, where
sequential scores one-shot."""

from __future__ import annotations

import math

import pytest

from oppo import modes
from test_modes import assert_same_run, run_steps, tiny_cfg

BUCKETS = ("ppo.shape_buckets=on", "placement.local.scorer_process=false")  # (scorers on a thread: no child's imports)
STEPS = 2


@pytest.fixture(scope="module")
def sequential_bucketed(tiny_models, tiny_prompts, tmp_path_factory):
    return run_steps(tiny_cfg(tiny_models, tiny_prompts, tmp_path_factory.mktemp("seq_buckets"),
                              "overlap.mode=sequential", *BUCKETS), n=STEPS)


@pytest.mark.parametrize("mode", modes.NAMES)
def test_every_mode_with_buckets_on(sequential_bucketed, tiny_models, tiny_prompts, tmp_path, monkeypatch, mode):
    from oppo.scoring.slots import SlotKV

    fed = []
    feed = SlotKV.feed
    monkeypatch.setattr(SlotKV, "feed", lambda self, *a: (fed.append(1), feed(self, *a))[1])
    # no deferral (Delta = 0, max_lag = 0) where the mode defers; pipeline loads weights mid-flight
    run = sequential_bucketed if mode == "sequential" else run_steps(tiny_cfg(
        tiny_models, tiny_prompts, tmp_path, f"overlap.mode={mode}", "overlap.delta=0", "overlap.max_lag=0",
        *BUCKETS), n=STEPS)
    assert len(run) == STEPS
    for step, r in enumerate(run):
        bad = {k: v for k, v in r["m"].items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"{mode}, step {step}: non-finite {bad}"
        for name in ("scores", "ref", "values"):
            assert r[name].isfinite().all(), (mode, step, name)
    # the streaming modes' chunks go through the bucketed slots (the others score one-shot, in bucketed rows)
    assert bool(fed) == modes.get(mode).streams, mode
    if mode in ("intra", "inter", "oppo"):
        assert_same_run(sequential_bucketed, run)
