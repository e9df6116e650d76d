"""The table of a learning benchmark (issue 51): per overlap mode, over seeds, how far the reward and
the judge rose against the seeds' spread, whether the mode's curve stays inside sequential's band,
how fast it runs against sequential, and when it first reaches sequential's final reward.

Pure functions over plain numbers (no torch, nothing of oppo), so that each is checked on
hand-made numbers (tests/test_learning_table.py); ``benchmarks/learning_curves.py`` feeds them the
runs' per-step series and writes ``table.md``.

A run here is a mapping with ``mode``, ``seed`` and the per-step lists ``reward``, ``judge`` (None
entries where a step logged none) and ``wallclock`` (``time/wallclock``: seconds of training at the
end of each step, model loading left out), and ``step_time_median_s``: the entries of
``curves.json``.
"""

from __future__ import annotations

import math
import statistics
from typing import Mapping, Sequence

HEAD = 5
"""Steps averaged for a run's first and last value (the first-5 and last-5 means)."""
WINDOW = 5
"""Steps per window of the band check."""
SMOOTH = 3
"""Steps of the trailing moving mean a run is read through for the time to a target."""


def head_tail(xs: Sequence[float], n: int = HEAD) -> tuple[float, float]:
    """The mean of the first ``n`` and of the last ``n`` values (all of them where there are fewer)."""
    if not xs:
        raise ValueError("head_tail: no values")
    return statistics.fmean(xs[:n]), statistics.fmean(xs[-n:])


def rise(series: Sequence[Sequence[float]], n: int = HEAD) -> dict:
    """Over the seeds' ``series`` (one list per seed): ``first`` and ``last``, the means over seeds
    of each seed's first-``n`` and last-``n`` mean; ``rise`` = last - first; ``spread`` = max - min
    over seeds of the first-``n`` means (how far apart the seeds start); ``ratio`` = rise / spread
    (inf where the spread is 0 and the rise is not: one seed, or seeds that start alike; nan where
    both are 0)."""
    if not series:
        raise ValueError("rise: no runs")
    firsts, lasts = zip(*(head_tail(s, n) for s in series))
    first, last = statistics.fmean(firsts), statistics.fmean(lasts)
    spread = max(firsts) - min(firsts)
    up = last - first
    ratio = up / spread if spread > 0 else (math.nan if up == 0 else math.copysign(math.inf, up))
    return {"first": first, "last": last, "rise": up, "spread": spread, "ratio": ratio, "seeds": len(series)}


def windows(steps: int, size: int = WINDOW) -> list[tuple[int, int]]:
    """The step windows ``[start, end)`` of ``size`` steps over ``steps`` steps; the last one shorter
    where ``size`` does not divide ``steps``."""
    if size < 1:
        raise ValueError(f"windows: size must be >= 1, got {size}")
    return [(s, min(s + size, steps)) for s in range(0, steps, size)]


def window_means(xs: Sequence[float], size: int = WINDOW) -> list[float]:
    """The mean of ``xs`` over each window of :func:`windows`."""
    return [statistics.fmean(xs[a:b]) for a, b in windows(len(xs), size)]


def band_check(mode: Sequence[Sequence[float]], base: Sequence[Sequence[float]], size: int = WINDOW) -> dict:
    """Whether the mode's curve stays inside the base's (sequential's) band, window by window.

    Each run's values are averaged over each window of ``size`` steps (:func:`window_means`; runs
    cut to the shortest). In a window, the mode's value is the mean over its seeds of their window
    means, the band is [min, max] over the base's seeds of theirs, and the window is inside when
    min <= value <= max. Returns ``inside`` (count), ``total``, ``outside`` (the ``(start, end)``
    of each window outside, ``end`` exclusive) and per window ``value``, ``low``, ``high``."""
    if not mode or not base:
        raise ValueError("band_check: no runs")
    steps = min(len(s) for s in [*mode, *base])
    wins = windows(steps, size)
    mine = [window_means(s[:steps], size) for s in mode]
    theirs = [window_means(s[:steps], size) for s in base]
    value = [statistics.fmean(r[i] for r in mine) for i in range(len(wins))]
    low = [min(r[i] for r in theirs) for i in range(len(wins))]
    high = [max(r[i] for r in theirs) for i in range(len(wins))]
    outside = [w for w, v, lo, hi in zip(wins, value, low, high) if not lo <= v <= hi]
    return {"inside": len(wins) - len(outside), "total": len(wins), "outside": outside,
            "value": value, "low": low, "high": high}


def moving_mean(xs: Sequence[float], k: int = SMOOTH) -> list[float]:
    """The trailing mean of ``k`` values at each step from the ``k``-th on: entry ``i`` is the mean
    of ``xs[i : i + k]``, read as the value at step ``i + k - 1`` (``len(xs) - k + 1`` entries; none
    where there are fewer than ``k`` values)."""
    if k < 1:
        raise ValueError(f"moving_mean: k must be >= 1, got {k}")
    return [statistics.fmean(xs[i:i + k]) for i in range(len(xs) - k + 1)]


def time_to_reach(values: Sequence[float], times: Sequence[float], target: float, k: int = SMOOTH) -> float | None:
    """The time (``times[step]``, the wall-clock at the end of that step) of the first step at
    which the trailing ``k``-step mean of ``values`` is at least ``target``; None if it never is."""
    for i, m in enumerate(moving_mean(values, k)):
        if m >= target:
            return times[i + k - 1]
    return None


def reach_summary(times: Sequence[float | None]) -> dict:
    """Per mode, over its seeds' :func:`time_to_reach`: ``mean`` over the seeds that reached the
    target (None if none did), ``reached`` and ``seeds`` (counts)."""
    got = [t for t in times if t is not None]
    return {"mean": statistics.fmean(got) if got else None, "reached": len(got), "seeds": len(times)}


def speed(base_walls: Sequence[float], mode_walls: Sequence[float]) -> float:
    """The mode's speed against the base (sequential) over the same steps: the base's mean total
    wall-clock over the mode's (above 1: the mode is faster)."""
    return statistics.fmean(base_walls) / statistics.fmean(mode_walls)


# ------------------------------------------------------------------------------ the table itself


def _series(runs: Sequence[Mapping], key: str) -> list[list[float]] | None:
    """Each run's ``key`` series, the steps without a value dropped; None where a run has none."""
    out = [[float(v) for v in r.get(key) or [] if v is not None] for r in runs]
    return out if all(out) else None


def _wall(run: Mapping) -> float:
    """A run's total wall-clock: its last step's ``time/wallclock`` (``wallclock_s`` in a
    ``curves.json`` written before the per-step series were kept)."""
    return run["wallclock"][-1] if run.get("wallclock") else run["wallclock_s"]


def mode_rows(runs: Sequence[Mapping], base_mode: str = "sequential", head: int = HEAD, window: int = WINDOW,
              smooth: int = SMOOTH) -> dict:
    """The table's numbers per mode (in the order the modes first appear in ``runs``), and the
    target: the base mode's final reward, the mean over its seeds of their last-``head`` means. The
    band, speed and time-to-target entries are None where ``runs`` holds no base mode (the time to
    target also where a run kept no per-step ``wallclock``)."""
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    by_mode = {m: sorted((r for r in runs if r["mode"] == m), key=lambda r: r.get("seed", 0)) for m in modes}
    base = by_mode.get(base_mode)
    target = rise([r["reward"] for r in base], head)["last"] if base else None
    rows = {}
    for m, rs in by_mode.items():
        row: dict = {"seeds": [r.get("seed") for r in rs], "steps": min(len(r["reward"]) for r in rs),
                     "reward": rise([r["reward"] for r in rs], head)}
        judge = _series(rs, "judge")
        row["judge"] = rise(judge, head) if judge else None
        row["step_time_median_s"] = statistics.fmean(r["step_time_median_s"] for r in rs)
        row["wallclock_s"] = statistics.fmean(_wall(r) for r in rs)
        row["band"] = band_check([r["reward"] for r in rs], [r["reward"] for r in base], window) if base else None
        row["judge_band"] = None
        if base and judge and _series(base, "judge"):
            row["judge_band"] = band_check(judge, _series(base, "judge") or [], window)
        row["speed"] = speed([_wall(r) for r in base], [_wall(r) for r in rs]) if base else None
        row["same_steps"] = bool(base) and {len(r["reward"]) for r in rs} == {len(r["reward"]) for r in base}
        timed = target is not None and all(r.get("wallclock") for r in rs)
        row["reach"] = (reach_summary([time_to_reach(r["reward"], r["wallclock"], target, smooth) for r in rs])
                        if timed else None)
        rows[m] = row
    return {"base": base_mode if base else None, "target": target, "head": head, "window": window,
            "smooth": smooth, "modes": rows}


def _f(x: float | None, spec: str = ".3f") -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if math.isnan(x):
        return "n/a"
    return format(x, spec)


def _rise_cell(r: Mapping | None) -> tuple[str, str]:
    if r is None:
        return "-", "-"
    return (f"{_f(r['first'])} -> {_f(r['last'])} ({r['rise']:+.3f})",
            f"{_f(r['rise'])} / {_f(r['spread'])} = {_f(r['ratio'], '.1f')}x")


def _band_cell(b: Mapping | None) -> str:
    if b is None:
        return "-"
    out = f"{b['inside']}/{b['total']}"
    if b["outside"]:
        out += " (out: " + ", ".join(f"{a}-{e - 1}" for a, e in b["outside"]) + ")"
    return out


def _reach_cell(r: Mapping | None) -> str:
    if r is None:
        return "-"
    if r["mean"] is None:
        return f"not reached (0/{r['seeds']} seeds)"
    cell = f"{r['mean']:.1f} s"
    return cell if r["reached"] == r["seeds"] else f"{cell} ({r['reached']}/{r['seeds']} seeds; the rest not reached)"


def markdown(table: Mapping, title: str = "Learning benchmark", machine: str = "", command: str = "") -> str:
    """``table`` (:func:`mode_rows`) as a markdown page: one table, a row per mode, then what each
    column means."""
    h, w, k = table["head"], table["window"], table["smooth"]
    base = table["base"] or "sequential"
    lines = [f"# {title}", ""]
    if machine:
        lines += [f"Machine: {machine}", ""]
    if command:
        lines += ["Command:", "", f"    {command}", ""]
    lines += [f"| mode | seeds | steps | reward first-{h} -> last-{h} (rise) | reward rise / first-{h} spread "
              f"| judge first-{h} -> last-{h} (rise) | judge rise / spread | reward windows in {base}'s band "
              f"| judge windows in {base}'s band | median step (s) | wall-clock (s) | speed vs {base} "
              f"| time to {base}'s final reward |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, row in table["modes"].items():
        rew, rew_ratio = _rise_cell(row["reward"])
        jud, jud_ratio = _rise_cell(row["judge"])
        spd = "-" if row["speed"] is None else f"{row['speed']:.2f}x" + ("" if row["same_steps"] else " (steps differ)")
        lines.append(f"| {mode} | {len(row['seeds'])} | {row['steps']} | {rew} | {rew_ratio} | {jud} | {jud_ratio} "
                     f"| {_band_cell(row['band'])} | {_band_cell(row['judge_band'])} | {row['step_time_median_s']:.2f} "
                     f"| {row['wallclock_s']:.1f} | {spd} | {_reach_cell(row['reach'])} |")
    target = "-" if table["target"] is None else f"{table['target']:.3f}"
    lines += ["",
              f"- first-{h} / last-{h}: each seed's mean reward (judge) over its first / last {h} steps, then the "
              f"mean over seeds; rise = last - first.",
              f"- spread: max - min over seeds of the first-{h} means (how far apart the seeds start); the measure "
              f"asks rise / spread > 2.",
              f"- windows in {base}'s band: steps cut in windows of {w} (steps a-b, both counted); in each, the "
              f"mode's mean over seeds of its window means against [min, max] over {base}'s seeds of theirs. "
              f"{base} against itself is always inside.",
              f"- median step: each run's median `time/step` (its first step left out), mean over seeds; wall-clock: "
              f"each run's `time/wallclock` at its last step (training time, model loading left out), mean over "
              f"seeds; speed vs {base}: {base}'s mean wall-clock over the mode's (above 1: faster).",
              f"- time to {base}'s final reward: the target is {base}'s final reward, the mean over its seeds of "
              f"their last-{h} means ({target}); per seed, the wall-clock at the first step whose trailing "
              f"{k}-step mean reward reaches it; the mean over the seeds that reached it."]
    return "\n".join(lines) + "\n"
