"""Pictures of one or more runs, for comparing modes side by side (``oppo bench``, ``oppo report``).

:func:`make_report` reads run directories (``metrics.jsonl``, and ``trace.json`` and
``lengths.jsonl`` where present) and writes one PNG per view whose data exists: reward, accuracy
and KL against step or time, a step's timeline, response lengths, overlap and lag. Runs sharing a
label are drawn as their mean with a min-max band; a mode or a stage has one colour in every
picture (:data:`MODE_COLORS`, :data:`STAGE_COLORS`). Drawn on Agg canvases without pyplot: no
display, no global matplotlib state. The pictures one by one: ``docs/metrics.md``, "Pictures".
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from oppo.metrics import METRICS_FILE, read_metrics
from oppo.trace import Span, bubble_ratio, load_trace, step_windows

__all__ = ["MODE_COLORS", "STAGE_COLORS", "make_report", "stage_color"]

TRACE_FILE = "trace.json"
LENGTHS_FILE = "lengths.jsonl"
_DPI = 110

MODE_COLORS = {"sequential": "#1f77b4", "intra": "#ff7f0e", "inter": "#2ca02c", "oppo": "#d62728",
               "pipeline": "#9467bd"}
"""One colour per overlap mode, in every picture (a label that starts with a mode name takes its colour)."""

STAGE_COLORS = {
    # the actor (the policy's lane): reds and oranges
    "generate": "#d62728", "prefill_prompt": "#9467bd", "decode": "#ff7f0e", "recompute_kv": "#ffbb78",
    "decode_inflight": "#f7b6d2",
    # the scorers: olive, slate, pink; the critic's update on the scorer worker: dark blue
    "score_reward": "#bcbd22", "score_reference": "#7f7f7f", "score_critic": "#e377c2",
    "train_critic": "#1f3a93", "load_critic": "#aec7e8",
    # the learner: greens and cyans
    "experience": "#2ca02c", "advantages": "#98df8a", "recompute_values": "#8c564b", "train": "#17becf",
    "weight_sync": "#c49c94",
    # the controller waiting (not work)
    "wait_scorers": "#d9d9d9", "wait_critic": "#bdbdbd", "wait_learner": "#969696",
}
"""One colour per stage, in every picture; other stages get a colour from their name."""

_WAITING = ("wait_",)
_LANE_ORDER = ("policy", "actor", "scorer", "reward", "reference", "critic", "learner", "controller")
_EXTRA = ["#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#5254a3", "#8ca252", "#bd9e39", "#ad494a",
          "#a55194"]


def stage_color(stage: str) -> str:
    """The stage's colour: fixed for oppo's stages, derived from the name (stable) for others."""
    if stage in STAGE_COLORS:
        return STAGE_COLORS[stage]
    h = sum((i + 1) * ord(c) for i, c in enumerate(stage))  # not hash(): that changes per process
    return _EXTRA[h % len(_EXTRA)]


@dataclass
class _Run:
    path: Path
    label: str
    metrics: list[dict]
    spans: list[Span] | None
    lengths: list[int] | None  # all response lengths of the run, every step


def read_run(path: Path, label: str) -> _Run:
    spans = None
    trace_path = path / TRACE_FILE
    if trace_path.exists():
        try:
            spans = load_trace(trace_path)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{trace_path}: not a readable Chrome trace ({e})") from e
    lengths = None
    lengths_path = path / LENGTHS_FILE
    if lengths_path.exists():
        lengths = [int(n) for rec in read_metrics(lengths_path) for n in rec.get("lengths", [])]
    return _Run(path, label, read_metrics(path / METRICS_FILE), spans, lengths)


def _series(run: _Run, key: str, x_key: str = "step") -> tuple[np.ndarray, np.ndarray]:
    """(x, y) over the records that have both keys with finite values, sorted by x."""
    pts = [
        (float(r[x_key]), float(r[key]))
        for r in run.metrics
        if r.get(key) is not None and r.get(x_key) is not None
    ]
    pts = [(x, y) for x, y in pts if np.isfinite(x) and np.isfinite(y)]
    pts.sort()
    if not pts:
        return np.empty(0), np.empty(0)
    arr = np.asarray(pts)
    return arr[:, 0], arr[:, 1]


def _time_series(run: _Run, key: str) -> tuple[np.ndarray, np.ndarray]:
    """``key`` against wall-clock seconds: ``time/wallclock``, else the running sum of ``time/step``."""
    x, y = _series(run, key, "time/wallclock")
    if len(x):
        return x, y
    clock, t, pts = 0.0, [], []
    for r in sorted(run.metrics, key=lambda r: r["step"]):
        dt = r.get("time/step")
        if dt is None:
            continue
        clock += float(dt)
        if r.get(key) is not None:
            t.append(clock)
            pts.append(float(r[key]))
    return np.asarray(t), np.asarray(pts)


def _groups(runs: list[_Run]) -> dict[str, list[_Run]]:
    groups: dict[str, list[_Run]] = {}
    for run in runs:
        groups.setdefault(run.label, []).append(run)
    return groups


def _band_stats(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Column-wise mean, min, max ignoring NaN (columns that are all NaN stay NaN)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns
        return np.nanmean(matrix, 0), np.nanmin(matrix, 0), np.nanmax(matrix, 0)


def _plot_group(ax, series: list[tuple[np.ndarray, np.ndarray]], *, interpolate: bool, **style) -> bool:
    """One line for a group of runs: the run itself, or the mean with a min-max band.

    ``interpolate=False`` aligns runs on identical x (steps); ``True`` resamples them on a
    common grid over the x range all of them cover (wall-clock seconds).
    """
    series = [(x, y) for x, y in series if len(x)]
    if not series:
        return False
    if len(series) == 1:
        ax.plot(*series[0], **style)
        return True
    if interpolate:
        lo = max(x[0] for x, _ in series)
        hi = min(x[-1] for x, _ in series)
        if hi <= lo:  # no common range: draw the runs one by one
            label = style.pop("label", None)
            for i, (x, y) in enumerate(series):
                ax.plot(x, y, label=label if i == 0 else None, **style)
            return True
        grid = np.linspace(lo, hi, 200)
        matrix = np.stack([np.interp(grid, x, y) for x, y in series])
    else:
        grid = np.unique(np.concatenate([x for x, _ in series]))
        matrix = np.full((len(series), len(grid)), np.nan)
        for i, (x, y) in enumerate(series):
            matrix[i, np.searchsorted(grid, x)] = y
    mean, lo_band, hi_band = _band_stats(matrix)
    (line,) = ax.plot(grid, mean, **style)
    ax.fill_between(grid, lo_band, hi_band, color=line.get_color(), alpha=0.2, linewidth=0)
    return True


def _new_figure(width: float, height: float, nrows: int = 1, sharex: bool = True):
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, 1, sharex=sharex, squeeze=False)[:, 0]
    return fig, list(axes)


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=_DPI)
    return path


def _colors(labels: Sequence[str]) -> dict[str, str]:
    """A mode's colour for labels naming a mode, other colours for the rest."""
    out: dict[str, str] = {}
    spare = [c for c in (f"C{i}" for i in range(10)) if c not in ("C0", "C1", "C2", "C3")]
    for label in labels:
        mode = next((m for m in MODE_COLORS if label == m or label.startswith((m + "_", m + "-", m + " ", m + ":"))), None)
        out[label] = MODE_COLORS[mode] if mode else spare[len([x for x in out.values() if x in spare]) % len(spare)]
    return out


def _widths(n: int) -> list[float]:
    """Line widths for n lines drawn in order: the first thickest, so coinciding lines all show."""
    return [1.5 + 1.3 * (n - 1 - i) for i in range(n)]


def _band_note(groups: dict[str, list[_Run]]) -> str:
    n = max(len(g) for g in groups.values())
    return f"  (line: mean over runs of a label, band: min-max; up to {n} runs)" if n > 1 else ""


def _line_figure(
    groups: dict[str, list[_Run]],
    path: Path,
    panels: list[tuple[str, list[tuple[str, str]]]],
    *,
    xlabel: str,
    title: str,
    by_time: bool = False,
) -> Path | None:
    """Generic 'metric against step/time' figure: one panel per (ylabel, [(key, linestyle)])."""
    colors = _colors(list(groups))
    widths = dict(zip(groups, _widths(len(groups))))
    fig, axes = _new_figure(9, 3.2 * len(panels) + 0.6, nrows=len(panels))
    drew_any = False
    for ax, (ylabel, keys) in zip(axes, panels):
        drew = False
        for label, runs in groups.items():
            for key, linestyle in keys:
                get = (lambda r, k=key: _time_series(r, k)) if by_time else (lambda r, k=key: _series(r, k))
                name = label if len(keys) == 1 else f"{label}: {key.split('/')[0]}"
                drew |= _plot_group(
                    ax,
                    [get(r) for r in runs],
                    interpolate=by_time,
                    color=colors[label],
                    linestyle=linestyle,
                    linewidth=widths[label],
                    label=name,
                )
        if drew:
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
            if all(k.startswith("overlap/") for k, _ in keys):  # counts: whole numbers
                ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        drew_any |= drew
    if not drew_any:
        return None
    axes[-1].set_xlabel(xlabel)
    if not by_time:
        axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    fig.suptitle(title + _band_note(groups), fontsize="medium")
    return _save(fig, path)


def _reward_panels(groups: dict[str, list[_Run]]) -> list[tuple[str, list[tuple[str, str]]]]:
    keys = [("reward/mean", "-")]
    if any(r.get("judge/mean") is not None for runs in groups.values() for run in runs for r in run.metrics):
        keys.append(("judge/mean", "--"))
    return [("reward / judge score" if len(keys) > 1 else "reward/mean", keys)]


def _lanes_in_order(spans: list[Span]) -> list[str]:
    """Rows top-down in pipeline order, the same in every run: oppo's lanes in a fixed order,
    then any others by their first span's start."""
    first: dict[str, float] = {}
    for s in spans:
        first[s.lane] = min(first.get(s.lane, s.start), s.start)
    rank = {lane: i for i, lane in enumerate(_LANE_ORDER)}
    return sorted(first, key=lambda lane: (rank.get(lane, len(rank)), first[lane], lane))


def _stages_in_order(stages: set[str]) -> list[str]:
    known = [st for st in STAGE_COLORS if st in stages]
    return known + sorted(stages - set(known))


def _plot_timeline(runs: list[_Run], path: Path) -> Path | None:
    fig = timeline_figure(runs)
    return None if fig is None else _save(fig, path)


def timeline_figure(runs: list[_Run]) -> Figure | None:
    traced = [(r, r.spans) for r in runs if r.spans]  # the runs with a trace, and its spans
    if not traced:
        return None
    stages = _stages_in_order({s.stage for _, spans in traced for s in spans})
    stage_colors = {st: stage_color(st) for st in stages}
    rows = [_lanes_in_order(spans) for _, spans in traced]
    fig = Figure(figsize=(10, sum(0.45 * len(r) + 1.1 for r in rows) + 0.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(
        len(traced), 1, sharex=True, squeeze=False, height_ratios=[len(r) + 1.5 for r in rows]
    )[:, 0]
    other_steps_drawn = False
    longest = 0.0
    for ax, (run, spans), lanes in zip(axes, traced, rows):
        windows = step_windows(s for s in spans if s.step >= 0) or step_windows(spans)
        steps = list(windows)
        step = steps[len(steps) // 2]  # the median step: past warm-up, not the ragged last one
        w0, w1 = windows[step]
        longest = max(longest, w1 - w0)
        # One broken_barh call per (lane, stage, own step?): chunked stages give many spans.
        bars: dict[tuple[str, str, bool], list[tuple[float, float]]] = {}
        for s in spans:
            if s.end <= w0 or s.start >= w1:
                continue
            a, b = max(s.start, w0), min(s.end, w1)
            bars.setdefault((s.lane, s.stage, s.step == step), []).append((a - w0, b - a))
        for (lane, stage, own), xranges in bars.items():
            other_steps_drawn |= not own
            ax.broken_barh(
                xranges,
                (lanes.index(lane) - 0.38, 0.76),
                gid=stage,  # tests read the stage of each bar back
                facecolors=stage_colors[stage],
                edgecolor="black" if own else "grey",
                linewidth=0.4,
                alpha=1.0 if own else 0.45,
                hatch=None if own else "///",
            )
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_ylim(len(lanes) - 0.5, -0.5)  # first lane on top
        ax.grid(axis="x", alpha=0.3)
        name = run.label if run.label == run.path.name else f"{run.label} ({run.path.name})"
        bubble = bubble_ratio(spans, (w0, w1))
        ax.set_title(
            f"{name}: step {step}, {w1 - w0:.3g} s, bubble ratio {bubble:.0%}",
            fontsize="medium",
            loc="left",
        )
    axes[-1].set_xlim(0, longest * 1.02)  # shared: every run's whole step, the longest included
    axes[-1].set_xlabel("seconds since the step's first span")
    handles = [
        Patch(facecolor=stage_colors[st], edgecolor="black", linewidth=0.4,
              label=f"{st} (waiting)" if st.startswith(_WAITING) else st)
        for st in stages
    ]
    if other_steps_drawn:
        handles.append(Patch(facecolor="white", edgecolor="grey", hatch="///", label="other step's work"))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 6), fontsize="small")
    fig.suptitle("One step per run: who was busy when", fontsize="medium")
    return fig


def _plot_length_hist(groups: dict[str, list[_Run]], path: Path) -> Path | None:
    data = {
        label: np.asarray([n for r in runs if r.lengths for n in r.lengths])
        for label, runs in groups.items()
    }
    data = {label: v for label, v in data.items() if v.size}
    if not data:
        return None
    colors = _colors(list(groups))
    everything = np.concatenate(list(data.values()))
    lo, hi = int(everything.min()), int(everything.max())
    n_bins = max(1, min(60, hi - lo + 1))
    bins = np.linspace(lo - 0.5, hi + 0.5, n_bins + 1)
    fig, (ax,) = _new_figure(8, 4.2)
    for label, v in data.items():
        ax.hist(
            v,
            bins=bins,
            weights=np.full(v.size, 1.0 / v.size),  # fractions: labels with more runs compare fairly
            histtype="step",
            linewidth=1.6,
            color=colors[label],
            label=f"{label}: n={v.size}, mean {v.mean():.1f}, p99 {np.percentile(v, 99):.0f}, max {v.max()}",
        )
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("fraction of responses")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title("Response lengths, all steps (the long tail sets a step's length)", fontsize="medium")
    return _save(fig, path)


def make_report(
    run_dirs: Sequence[str | Path] | str | Path,
    out_dir: str | Path,
    labels: Sequence[str] | None = None,
) -> list[Path]:
    """Write the comparison PNGs for ``run_dirs`` into ``out_dir``; return the files written.

    ``labels`` names each run (default: its directory name); runs that share a label are
    averaged with a min-max band. A picture whose data no run has is skipped. Prints nothing.

    Raises ``FileNotFoundError`` naming the directory if a run has no ``metrics.jsonl``.
    """
    dirs = [Path(run_dirs)] if isinstance(run_dirs, (str, Path)) else [Path(d) for d in run_dirs]
    if not dirs:
        raise ValueError("make_report needs at least one run directory")
    if labels is None:
        labels = [d.name for d in dirs]
    labels = [str(label) for label in labels]
    if len(labels) != len(dirs):
        raise ValueError(f"got {len(labels)} labels for {len(dirs)} run directories")
    for d in dirs:
        if not d.is_dir():
            raise FileNotFoundError(f"run directory {d} does not exist")
        if not (d / METRICS_FILE).is_file():
            raise FileNotFoundError(
                f"run directory {d} has no {METRICS_FILE}; is it an oppo run directory?"
            )

    runs = [read_run(d, label) for d, label in zip(dirs, labels)]
    groups = _groups(runs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    written: list[Path | None] = [
        _line_figure(
            groups,
            out_dir / "reward_vs_step.png",
            _reward_panels(groups),
            xlabel="step",
            title="Reward vs step",
        ),
        _line_figure(
            groups,
            out_dir / "reward_vs_time.png",
            _reward_panels(groups),
            xlabel="wall-clock seconds",
            title="Reward vs wall-clock",
            by_time=True,
        ),
        _line_figure(  # tasks with one right answer (arith) only
            groups,
            out_dir / "accuracy_vs_step.png",
            [("task/accuracy", [("task/accuracy", "-")])],
            xlabel="step",
            title="Accuracy vs step: share of responses with the right answer",
        ),
        _line_figure(
            groups,
            out_dir / "kl_vs_step.png",
            [("KL(policy || reference) per sequence", [("kl/mean", "-")])],
            xlabel="step",
            title="KL to the reference vs step: the per-token estimate (ppo.kl_estimator) summed per sequence,\n"
                  "the quantity ppo.kl_coef penalises (the k1 estimate of one batch can dip below 0)",
        ),
        _plot_timeline(runs, out_dir / "timeline.png"),
    ]
    hist = _plot_length_hist(groups, out_dir / "response_lengths.png")
    if hist is None:
        hist = _line_figure(
            groups,
            out_dir / "response_lengths.png",
            [("response length (tokens)", [("response_length/mean", "-"), ("response_length/max", "--")])],
            xlabel="step",
            title="Response length: mean (solid) and max (dashed)",
        )
    written.append(hist)
    written.append(
        _line_figure(
            groups,
            out_dir / "overlap.png",
            [
                (key, [(key, "-")])
                for key in ("overlap/delta", "overlap/token_lag_max", "overlap/seq_lag_max", "overlap/lag_max")
                if any(r.get(key) is not None for run in runs for r in run.metrics)
            ]
            or [("overlap/delta", [("overlap/delta", "-")])],
            xlabel="step",
            title="Inter-step overlap: Delta and the largest policy lag (per token, per sequence)",
        )
    )
    return [p for p in written if p is not None]
