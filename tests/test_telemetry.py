"""Tests for oppo.metrics (JSONL logger, TensorBoard, W&B guard, progress) and oppo.trace."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import threading
import time

import pytest

from oppo.metrics import MetricsLogger, ProgressBar, read_metrics
from oppo.trace import (
    Span,
    Tracer,
    bubble_ratio,
    busy_seconds,
    busy_stats,
    load_trace,
    overlap_seconds,
    step_windows,
)

# --------------------------------------------------------------------------------------------
# MetricsLogger
# --------------------------------------------------------------------------------------------


def test_jsonl_written_and_read_back(tmp_path):
    with MetricsLogger(tmp_path) as log:
        log.log(0, {"reward/mean": 0.5, "response_length/max": 12})
        log.log(1, {"reward/mean": 0.75, "time/step": 1.25})
        # flushed per line: readable before close
        assert len(read_metrics(tmp_path / "metrics.jsonl")) == 2
    records = read_metrics(tmp_path)  # a run dir works too
    assert records == [
        {"step": 0, "reward/mean": 0.5, "response_length/max": 12},
        {"step": 1, "reward/mean": 0.75, "time/step": 1.25},
    ]
    assert isinstance(records[0]["response_length/max"], int)


def test_non_finite_values_become_null(tmp_path):
    with MetricsLogger(tmp_path) as log:
        log.log(3, {"loss/value": float("nan"), "kl/mean": float("inf"), "ok": 1.0})
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    assert "NaN" not in line and "Infinity" not in line
    # strict parser: NaN / Infinity tokens are rejected
    record = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert record == {"step": 3, "loss/value": None, "kl/mean": None, "ok": 1.0}


def test_non_numeric_metric_is_a_clear_error(tmp_path):
    with MetricsLogger(tmp_path) as log, pytest.raises(TypeError, match="policy"):
        log.log(0, {"policy": "gpt2"})


def test_truncate_after_keeps_steps_up_to_it(tmp_path):
    with MetricsLogger(tmp_path) as log:
        for step in range(6):
            log.log(step, {"reward/mean": step / 10})
        log.truncate_after(2)
        log.log(3, {"reward/mean": -1.0})  # appends after the kept lines
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[-1]["reward/mean"] == -1.0
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # every line is still valid JSON
    assert not list(tmp_path.glob(".metrics.*"))  # no temp file left behind


def test_resume_drops_steps_from_the_first_logged_one(tmp_path):
    with MetricsLogger(tmp_path) as log:
        for step in range(5):
            log.log(step, {"reward/mean": float(step)})
    # a torn last line from a crash is tolerated and dropped
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "rew')
    with MetricsLogger(tmp_path, resume=True) as log:
        log.log(3, {"reward/mean": 30.0})
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(tmp_path)] == [
        (0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)
    ]


def test_without_resume_an_old_file_is_overwritten(tmp_path):
    with MetricsLogger(tmp_path) as log:
        log.log(0, {"a": 1})
    with MetricsLogger(tmp_path) as log:
        log.log(0, {"a": 2})
    assert read_metrics(tmp_path) == [{"step": 0, "a": 2}]


def test_tensorboard_writes_an_events_file(tmp_path):
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path, tensorboard=True) as log:
        log.log(0, {"reward/mean": 0.5, "loss/value": float("nan")})
        log.log(1, {"reward/mean": 0.6})
    events = list(tmp_path.glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    assert (tmp_path / "metrics.jsonl").exists()


def test_wandb_missing_is_a_clear_error_before_any_file(tmp_path):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed")
    run_dir = tmp_path / "run"
    with pytest.raises(ImportError) as info:
        MetricsLogger(run_dir, wandb=True)
    msg = str(info.value)
    assert "wandb" in msg and "pip install 'oppo[wandb]'" in msg
    assert not run_dir.exists()  # failed at construction, before writing anything


def test_progress_bar_without_tty_prints_compact_lines():
    out = io.StringIO()  # not a TTY
    bar = ProgressBar(total_steps=40, file=out)
    for step in range(40):
        bar.update(step, {"reward/mean": 0.1234, "kl/mean": 0.01, "time/step": 0.5})
    bar.close()
    lines = out.getvalue().splitlines()
    # default rule: first step, every ceil(40 / 20) = 2 steps, and the last step
    assert len(lines) == 1 + 20
    assert "reward 0.123" in lines[0] and "kl 0.0100" in lines[0] and "step_time 0.50s" in lines[0]
    assert lines[-1].startswith("[oppo] step 39 (40/40)")


def test_progress_line_shows_losses_clip_and_length_only_when_present():
    out = io.StringIO()
    bar = ProgressBar(total_steps=2, file=out)
    bar.update(0, {"reward/mean": 0.5, "kl/mean": -0.002, "loss/policy": -0.01234, "ppo/clipfrac": 0.0625,
                   "loss/value": 0.3456, "response_length/mean": 41.25, "time/step": 2.0})
    bar.update(1, {"reward/mean": 0.6, "loss/policy": 0.02, "ppo/clipfrac": 0.1})  # critic-free: no loss/value
    first, second = out.getvalue().splitlines()
    assert ("reward 0.500 | kl -0.0020 | ploss -0.0123 | clip 0.062 | vloss 0.3456 | len 41.2 | step_time 2.00s"
            in first)
    assert "ploss 0.0200 | clip 0.100 | elapsed" in second
    assert "vloss" not in second and "len" not in second and "kl" not in second
    assert len(first) < 160  # one short line


def test_progress_bar_every_zero_is_silent():
    out = io.StringIO()
    bar = ProgressBar(total_steps=3, enabled=False, every=0, file=out)
    for step in range(3):
        bar.update(step, {})
    bar.close()
    assert out.getvalue() == ""


# --------------------------------------------------------------------------------------------
# Tracer
# --------------------------------------------------------------------------------------------


def test_tracer_two_threads_saved_as_chrome_trace(tmp_path):
    tracer = Tracer()

    def work(lane: str, stage: str) -> None:
        for step in range(3):
            with tracer.span(lane, stage, step, batch=4) as args:
                time.sleep(0.002)
                args["tokens"] = 10 * step

    threads = [threading.Thread(target=work, args=a) for a in [("policy", "generate"), ("reward", "score")]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    spans = tracer.spans
    assert len(spans) == 6
    assert {(s.lane, s.stage) for s in spans} == {("policy", "generate"), ("reward", "score")}
    assert all(s.end > s.start for s in spans)

    path = tracer.save(tmp_path / "trace.json")
    data = json.loads(path.read_text())
    assert data["displayTimeUnit"] == "ms"
    events = data["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(names.values()) == ["policy", "reward"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 6
    for e in complete:
        assert {"name", "ts", "dur", "pid", "tid", "args"} <= e.keys()
        assert e["tid"] in names
        assert e["args"]["batch"] == 4 and "step" in e["args"]
        assert e["dur"] >= 2000 * 0.9  # slept 2 ms: microseconds, not seconds
        assert 0 <= e["ts"] < 60e6

    # round trip: seconds relative to the tracer's start
    loaded = load_trace(path)
    original = sorted(spans, key=lambda s: s.start)
    assert [(s.lane, s.stage, s.step) for s in loaded] == [(s.lane, s.stage, s.step) for s in original]
    for a, b in zip(loaded, original):
        assert a.start == pytest.approx(b.start - tracer.t0, abs=1e-6)
        assert a.duration == pytest.approx(b.duration, abs=1e-6)
    assert loaded[-1].args["tokens"] == 20


def test_disabled_tracer_records_nothing(tmp_path):
    tracer = Tracer(enabled=False)
    with tracer.span("policy", "generate", 0) as args:
        args["tokens"] = 1
    tracer.add("policy", "generate", 0, 0.0, 1.0)
    assert tracer.spans == []


def test_add_rejects_reversed_span():
    with pytest.raises(ValueError, match="ends before it starts"):
        Tracer().add("policy", "generate", 0, 2.0, 1.0)


def test_a_trace_row_is_a_lane(tmp_path):
    """``Span.lane`` (was ``Span.worker``: "worker" is the scorer worker's word alone); the file
    keeps the lane as a thread's name, so traces written before the rename read back the same."""
    tracer = Tracer()
    tracer.add(lane="scorer", stage="score_reward", step=0, start=1.0, end=2.0)
    with tracer.span(lane="actor", stage="decode", step=0):
        pass
    assert {s.lane for s in tracer.spans} == {"scorer", "actor"}
    with pytest.raises(AttributeError, match="Span.lane"):
        tracer.spans[0].worker
    text = tracer.save(tmp_path / "trace.json").read_text()
    assert '"lane"' not in text and '"worker"' not in text
    assert {s.lane for s in load_trace(tmp_path / "trace.json")} == {"scorer", "actor"}
    spans = [Span("actor", "decode", 0, 0.0, 2.0), Span("scorer", "score_reward", 0, 1.0, 3.0)]
    assert overlap_seconds(spans, lane_a="actor", lane_b="scorer") == pytest.approx(1.0)


# Hand-made spans over the window [0, 10] s:
#   policy: generate [0, 6], generate [4, 8]       -> union [0, 8]           = 8 s busy
#   reward: score    [1, 3], score    [5, 7]       -> 2 + 2                  = 4 s busy
#   learner: train   [8, 10]                                                 = 2 s busy
SPANS = [
    Span("policy", "generate", 0, 0.0, 6.0),
    Span("policy", "generate", 0, 4.0, 8.0),
    Span("reward", "score", 0, 1.0, 3.0),
    Span("reward", "score", 0, 5.0, 7.0),
    Span("learner", "train", 0, 8.0, 10.0),
]


def test_busy_stats_does_not_double_count_a_lanes_overlap():
    assert busy_seconds(SPANS) == pytest.approx({"policy": 8.0, "reward": 4.0, "learner": 2.0})
    # fractions of the whole trace [0, 10]
    assert busy_stats(SPANS) == pytest.approx({"policy": 0.8, "reward": 0.4, "learner": 0.2})
    # window [2, 6]: policy [2, 6] = 4 -> 1.0; reward [2, 3] + [5, 6] = 2 -> 0.5; learner 0
    assert busy_stats(SPANS, 2.0, 6.0) == pytest.approx({"policy": 1.0, "reward": 0.5, "learner": 0.0})


def test_step_windows():
    spans = SPANS + [Span("policy", "generate", 1, 9.0, 12.0), Span("learner", "train", 1, 12.0, 13.5)]
    assert step_windows(spans) == {0: (0.0, 10.0), 1: (9.0, 13.5)}


def test_bubble_ratio():
    # busiest lane in [0, 10] is policy with 8 s: bubble = 1 - 8 / 10 = 0.2
    assert bubble_ratio(SPANS, (0.0, 10.0)) == pytest.approx(0.2)
    # window [0, 16]: 1 - 8 / 16 = 0.5 (the idle tail counts)
    assert bubble_ratio(SPANS, (0.0, 16.0)) == pytest.approx(0.5)
    # a step with one lane busy throughout is at its ideal bound
    assert bubble_ratio([Span("policy", "generate", 0, 1.0, 3.0)]) == pytest.approx(0.0)
    assert bubble_ratio([], (0.0, 0.0)) == 0.0


def test_overlap_seconds():
    # policy union [0, 8]; reward [1, 3] and [5, 7] both inside it -> 2 + 2 = 4 s
    assert overlap_seconds(SPANS, "policy", "reward") == pytest.approx(4.0)
    # policy [0, 8] and learner [8, 10] only touch -> 0 s
    assert overlap_seconds(SPANS, "policy", "learner") == pytest.approx(0.0)
    # within [2, 6]: reward [2, 3] + [5, 6] -> 2 s
    assert overlap_seconds(SPANS, "reward", "policy", 2.0, 6.0) == pytest.approx(2.0)
    assert overlap_seconds(SPANS, "policy", "nobody") == 0.0
    assert math.isclose(overlap_seconds(SPANS, "policy", "policy"), 8.0)
