"""Where inter-step overlap's time goes, and where it pays.

:func:`breakdown` splits the difference of the mean step times of a ``sequential`` and an ``inter``
run of one workload into its causes (decode steps, cost per decode step, one-shot scoring,
experience, training, weight sync, untraced), counts from the planner's replay and seconds from
the traces. :func:`regime` simulates where the inter-step overlap alone pays.

Design notes (each cause): docs/planner.md, "Where inter-step overlap's time goes"."""

from __future__ import annotations

import statistics
from dataclasses import replace

from .calibrate import CpuProfile, MeasuredRun, cpu_placement, critic_on_worker, replay_workload
from .costs import LinearCosts
from .lengths import LogNormalLengths
from .sim import Workload, simulate

__all__ = ["breakdown", "breakdown_markdown", "regime", "regime_markdown", "gpu_like"]

_STEPS = LinearCosts({"decode.calls": 1.0}, "one second per decode step")  # the replay counts decode steps


def _stage_seconds(run: MeasuredRun, warmup: int) -> dict[str, float]:
    """Mean seconds per timed step of each kind of work, from the run's spans."""
    steps = list(range(warmup, len(run.metrics)))
    tot: dict[str, float] = {}
    for s in run.spans:
        if s.step not in steps:
            continue
        if s.lane == "actor" and s.stage in ("generate", "decode", "prefill_prompt"):
            key = "decode"  # (the sequential loop's one generate span holds its prefill and decoding)
        elif s.lane == "scorer" and s.stage.startswith("score_"):
            key = "score"
        elif s.stage in ("experience", "recompute_values"):
            key = "experience"
        elif s.stage in ("train", "advantages", "train_critic"):
            key = "train"
        elif s.stage == "weight_sync":
            key = "sync"
        else:
            continue
        tot[key] = tot.get(key, 0.0) + s.duration
    n = max(1, len(steps))
    out = {k: tot.get(k, 0.0) / n for k in ("decode", "score", "experience", "train", "sync")}
    out["step"] = statistics.mean(m["time/step"] for m in run.metrics[warmup:])
    out["untraced"] = out["step"] - sum(out[k] for k in ("decode", "score", "experience", "train", "sync"))
    return out


def _schedule(run: MeasuredRun, warmup: int) -> dict[str, float]:
    """Mean counts per timed step from the replay: decode steps, rows per decode step, decode
    steps after B were finished (waiting for due carried rows), carried and stale rows."""
    wl = replay_workload(run)
    pl = cpu_placement(run.mode, critic_on_worker(run.settings), run.needs_critic)
    res = simulate(run.mode, wl, _STEPS, pl, len(run.metrics), warmup=0)
    timed = res.steps[warmup:]
    calls: dict[int, int] = {}  # step -> decode calls
    rows: dict[int, int] = {}  # step -> rows decoded
    for s in res.spans:
        if s.stage == "decode" and s.step >= warmup:
            for w in s.args.get("works", []):
                calls[s.step] = calls.get(s.step, 0) + w["calls"]
                rows[s.step] = rows.get(s.step, 0) + w["rows"]
    n = max(1, len(timed))
    return {"decode_steps": sum(calls.values()) / n,
            "rows_per_decode_step": sum(rows.values()) / max(1, sum(calls.values())),
            "due_wait_steps": sum(s.close - s.full for s in timed) / n,
            "carried": statistics.mean(s.carried for s in timed),
            "stale_rows": statistics.mean(sum(1 for lag in s.lags if lag > 0) for s in timed),
            "batch_max_length": statistics.mean(max(s.lengths) for s in timed)}


def breakdown(seq: MeasuredRun, inter: MeasuredRun, warmup: int = 1) -> dict:
    """The difference of the mean step time, inter - sequential, split into its causes (module
    docstring). Positive seconds: inter spends more."""
    a, b = _stage_seconds(seq, warmup), _stage_seconds(inter, warmup)
    sa, sb = _schedule(seq, warmup), _schedule(inter, warmup)
    ca = a["decode"] / max(1e-9, sa["decode_steps"])  # measured seconds per decode step
    cb = b["decode"] / max(1e-9, sb["decode_steps"])
    parts = {
        "fewer decode steps (the tail is not waited for)": (sb["decode_steps"] - sb["due_wait_steps"]
                                                            - sa["decode_steps"]) * ca,
        "decode steps waiting for due carried sequences (max_lag)": sb["due_wait_steps"] * ca,
        "cost per decode step (B + Delta rows instead of B)": sb["decode_steps"] * (cb - ca),
        "one-shot scoring after the close": b["score"] - a["score"],
        "experience (incl. old log-probs of carried rows)": b["experience"] - a["experience"],
        "training": b["train"] - a["train"],
        "weight sync": b["sync"] - a["sync"],
        "untraced (controller)": b["untraced"] - a["untraced"],
    }
    return {"sequential": {**a, **sa, "s_per_decode_step": ca}, "inter": {**b, **sb, "s_per_decode_step": cb},
            "parts": parts, "step_difference": b["step"] - a["step"], "speedup": a["step"] / b["step"],
            "runs": [str(seq.path), str(inter.path)]}


def breakdown_markdown(label: str, bd: dict) -> str:
    s, i = bd["sequential"], bd["inter"]
    rows = [("mean step time (s)", "step", "{:.3f}"), ("decode incl. prefill (s)", "decode", "{:.3f}"),
            ("decode steps per step", "decode_steps", "{:.1f}"),
            ("  of which after B finished: waiting for due rows", "due_wait_steps", "{:.1f}"),
            ("rows per decode step", "rows_per_decode_step", "{:.1f}"),
            ("seconds per decode step (ms)", "s_per_decode_step", "ms"),
            ("longest response in the batch (tokens)", "batch_max_length", "{:.0f}"),
            ("rows carried into the next step", "carried", "{:.1f}"), ("stale rows trained", "stale_rows", "{:.1f}"),
            ("one-shot scoring (s)", "score", "{:.3f}"), ("experience (s)", "experience", "{:.3f}"),
            ("training (s)", "train", "{:.3f}"), ("weight sync (s)", "sync", "{:.3f}"),
            ("untraced (s)", "untraced", "{:.3f}")]

    def f(fmt, v):
        return f"{v * 1e3:.2f}" if fmt == "ms" else fmt.format(v)

    lines = [f"**{label}**: inter {bd['speedup']:.2f}x sequential (mean step time)", "",
             "| per timed step | sequential | inter |", "|---|---|---|"]
    lines += [f"| {name} | {f(fmt, s[k])} | {f(fmt, i[k])} |" for name, k, fmt in rows]
    lines += ["", "| where inter's step time goes, against sequential | seconds per step |", "|---|---|"]
    lines += [f"| {k} | {v:+.3f} |" for k, v in bd["parts"].items()]
    lines.append(f"| **total (inter - sequential)** | **{bd['step_difference']:+.3f}** |")
    return "\n".join(lines)


def gpu_like(costs: LinearCosts, batch: int, rows_share: float = 0.02, other_scale: float = 1.0) -> LinearCosts:
    """``costs`` with a GPU-like decode: a decode step of ``batch`` rows costs what it costs in
    ``costs`` (at a typical context), but each extra row adds only ``rows_share`` of that;
    every other cost is scaled by ``other_scale`` (below 1: decoding dominates the step)."""
    c = dict(costs.coef)
    step = c.get("decode.calls", 0.0) + c.get("decode.rows", 0.0) * batch + c.get("decode.attn", 0.0) * batch * 20
    per_row = rows_share * step / batch
    c["decode.calls"] = step - per_row * batch
    c["decode.rows"] = per_row
    c["decode.attn"] = 0.0
    for k in list(c):
        if not k.startswith("decode."):
            c[k] *= other_scale
    return LinearCosts(c, f"{costs.label}, GPU-like decode (an extra row {rows_share:.0%} of a step), "
                          f"other stages x{other_scale:g}")


def regime(profile: CpuProfile, sigmas=(0.5, 0.75, 1.0, 1.5, 2.0), batch: int = 32, delta: int = 8,
           max_lag: int = 1, steps: int = 40, cap: int = 128, median: float = 10.0) -> list[dict]:
    """Inter's speedup over sequential (mean step time) per tail sigma under three cost regimes
    (log-normal lengths of ``median`` capped at ``cap``: the tail sweep's, and at sigma 0.75 the
    representative workload's shape as ``oppo bench --quick`` scales it)."""
    base = profile.costs["together"]
    regimes = [("CPU, fitted costs", base),
               ("GPU-like decode (batch size nearly free)", gpu_like(base, batch)),
               ("GPU-like decode, decoding dominant (other stages x0.25)", gpu_like(base, batch, other_scale=0.25))]
    pl = cpu_placement("inter")
    rows = []
    for sigma in sigmas:
        wl = Workload(batch, LogNormalLengths(median, sigma, cap, seed=1), delta=delta, max_lag=max_lag, chunk=16,
                      minibatch=16, micro=16)
        row = {"sigma": sigma}
        for name, c in regimes:
            seq = simulate("sequential", wl, c, pl, steps, warmup=2, keep_spans=False)
            inter = simulate("inter", wl, c, pl, steps, warmup=2, keep_spans=False)
            inter2 = simulate("inter", replace(wl, max_lag=2, delta=min(batch, 2 * delta)), c, pl, steps, warmup=2,
                              keep_spans=False)
            row[name] = {"inter": seq.step_time_mean / inter.step_time_mean,
                         "inter_lag2": seq.step_time_mean / inter2.step_time_mean,
                         "decode_share": statistics.mean((s.close - s.start) / s.time for s in seq.timed)}
        rows.append(row)
    return rows


def regime_markdown(rows: list[dict], batch: int, delta: int) -> str:
    names = [k for k in rows[0] if k != "sigma"]
    lines = ["| tail sigma | " + " | ".join(f"{n}: inter / inter (max_lag 2, Delta {2 * delta}) "
                                            f"[decode share of the sequential step]" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for r in rows:
        cells = [f"{r[n]['inter']:.2f}x / {r[n]['inter_lag2']:.2f}x [{r[n]['decode_share']:.0%}]" for n in names]
        lines.append(f"| {r['sigma']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
