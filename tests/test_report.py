"""Tests for oppo.report: the PNGs are written from fake run directories."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from oppo.metrics import MetricsLogger
from oppo.report import make_report
from oppo.trace import Tracer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_PNGS = {"reward_vs_step.png", "reward_vs_time.png", "accuracy_vs_step.png", "kl_vs_step.png", "timeline.png",
            "response_lengths.png", "overlap.png"}


def _fake_run(run_dir, seed: int, step_time: float, overlapped: bool, n_steps: int = 6) -> None:
    rng = random.Random(seed)
    clock = 0.0
    with MetricsLogger(run_dir) as log:
        for step in range(n_steps):
            clock += step_time
            metrics = {
                "reward/mean": 0.1 * step + rng.uniform(-0.05, 0.05),
                "judge/mean": 0.08 * step,
                "task/accuracy": 0.05 * step,
                "kl/mean": 0.01 * step,
                "response_length/mean": 20 + step,
                "response_length/max": 40 + 2 * step,
                "time/step": step_time,
                "time/wallclock": clock,
            }
            if overlapped:
                metrics |= {"overlap/delta": min(step, 3), "overlap/lag_max": step % 2, "loss/value": float("nan")}
            log.log(step, metrics)
    with open(run_dir / "lengths.jsonl", "w") as f:
        for step in range(n_steps):
            f.write(json.dumps({"step": step, "lengths": [rng.randint(4, 64) for _ in range(8)]}) + "\n")
    tracer = Tracer()
    t = tracer.t0
    for step in range(n_steps):
        gen = 0.6 * step_time
        tracer.add("policy", "generate", step, t, t + gen)
        tracer.add("reward", "score", step, t + 0.2 * gen, t + gen + 0.05)
        tracer.add("critic", "ref_values", step, t + gen, t + gen + 0.1)
        tracer.add("learner", "train", step, t + gen + 0.1, t + step_time)
        if overlapped and step + 1 < n_steps:  # next step's generation starts during training
            tracer.add("policy", "generate", step + 1, t + gen + 0.1, t + step_time)
        t += step_time
    tracer.save(run_dir / "trace.json")


@pytest.fixture
def runs(tmp_path):
    dirs = [tmp_path / "seq", tmp_path / "oppo_s0", tmp_path / "oppo_s1"]
    _fake_run(dirs[0], seed=0, step_time=1.0, overlapped=False)
    _fake_run(dirs[1], seed=1, step_time=0.6, overlapped=True)
    _fake_run(dirs[2], seed=2, step_time=0.7, overlapped=True)
    return dirs


def _assert_png(path):
    assert path.exists() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_make_report_writes_every_picture(runs, tmp_path, capsys):
    out = tmp_path / "report"
    written = make_report(runs, out, labels=["sequential", "oppo", "oppo"])
    assert {p.name for p in written} == ALL_PNGS
    for p in written:
        assert p.parent == out
        _assert_png(p)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_missing_data_skips_pictures(tmp_path):
    run = tmp_path / "bare"
    with MetricsLogger(run) as log:
        for step in range(3):
            log.log(step, {"reward/mean": 0.1 * step, "response_length/mean": 10, "response_length/max": 12})
    written = make_report(run, tmp_path / "out")  # a single Path works too
    # no trace, no lengths.jsonl, no wall-clock or step time, no overlap metrics
    assert {p.name for p in written} == {"reward_vs_step.png", "response_lengths.png"}
    for p in written:
        _assert_png(p)


def test_reward_vs_time_falls_back_to_summed_step_time(tmp_path):
    run = tmp_path / "r"
    with MetricsLogger(run) as log:
        for step in range(3):
            log.log(step, {"reward/mean": 0.1 * step, "time/step": 0.5})
    assert "reward_vs_time.png" in {p.name for p in make_report([run], tmp_path / "out")}


def test_missing_metrics_is_a_clear_error(runs, tmp_path):
    broken = tmp_path / "empty_run"
    broken.mkdir()
    with pytest.raises(FileNotFoundError, match="empty_run.*metrics.jsonl"):
        make_report([runs[0], broken], tmp_path / "out")
    shutil.rmtree(broken)
    with pytest.raises(FileNotFoundError, match="empty_run"):
        make_report([broken], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # validated before writing anything


def test_labels_must_match_runs(runs, tmp_path):
    with pytest.raises(ValueError, match="2 labels for 3"):
        make_report(runs, tmp_path / "out", labels=["a", "b"])


# --------------------------------------------------------------------------- what a user sees

def _timeline(run_dirs, labels=None):
    from oppo.report import read_run, timeline_figure

    return timeline_figure([read_run(d, label) for d, label in zip(run_dirs, labels or [d.name for d in run_dirs])])


def test_timeline_shows_every_runs_whole_step(tmp_path):
    """The shortest run first, the longest last: the shared time axis still holds the longest step."""
    short, long_ = tmp_path / "fast", tmp_path / "slow"
    _fake_run(short, seed=0, step_time=0.3, overlapped=True)
    _fake_run(long_, seed=1, step_time=2.0, overlapped=False)
    fig = _timeline([short, long_])
    rightmost = [max(p.vertices[:, 0].max() for coll in ax.collections for p in coll.get_paths())
                 for ax in fig.axes[:2]]
    assert rightmost[1] > 1.9 > rightmost[0]  # the slow run's step is about 2 s, the fast one's 0.3 s
    for ax in fig.axes[:2]:
        assert ax.get_xlim()[0] == 0 and ax.get_xlim()[1] >= max(rightmost)


def test_stage_colours_and_rows_are_the_same_in_every_picture(runs, tmp_path):
    """One colour per stage whatever other stages a picture holds; rows in the same order."""
    from matplotlib.colors import to_rgba

    from oppo.report import stage_color

    other = tmp_path / "other"
    _fake_run(other, seed=3, step_time=0.5, overlapped=False)
    spans = json.loads((other / "trace.json").read_text())
    for e in spans["traceEvents"]:  # a picture with stages the others lack
        if e.get("name") == "ref_values":
            e["name"] = "advantages"
    (other / "trace.json").write_text(json.dumps(spans))
    seen: dict[str, tuple] = {}
    for dirs in ([runs[0], runs[1]], [other, runs[2]]):
        fig = _timeline(dirs)
        for ax in fig.axes[:2]:
            rows = [t.get_text() for t in ax.get_yticklabels()]
            assert rows == ["policy", "reward", "critic", "learner"], rows
            for coll in ax.collections:
                stage = coll.get_gid()
                color = tuple(coll.get_facecolor()[0][:3])
                assert color == to_rgba(stage_color(stage))[:3], stage
                assert seen.setdefault(stage, color) == color, stage
    assert len(seen) >= 4
    assert len({stage_color(s) for s in ("train", "train_critic", "advantages", "decode", "wait_critic",
                                         "experience", "wait_scorers")}) == 7  # no two oppo stages share one


def test_kl_picture(runs, tmp_path):
    written = make_report(runs, tmp_path / "out")
    assert "kl_vs_step.png" in {p.name for p in written}
