"""Held-out validation of the planner (``oppo.plan``) on this machine.

1. FIT: train on the built-in task with its natural response lengths, B = 32, in ``sequential``
   and ``oppo`` mode; fit the stage costs from those two runs' traces (``calibrate.fit``: one cost
   set per CPU placement, "together" from sequential, "split" from oppo) and the controller's
   untraced time per step (``calibrate.fit_overhead``).
2. PREDICT, before anything else is measured: every held-out run below, from its settings alone.
   Lengths: forced runs use the forced log-normal sampler (exactly the lengths the run will draw);
   natural-length runs draw from the fit runs' measured lengths (``EmpiricalLengths``), as a user
   would predict a run not made yet. Written to ``predictions.json`` before the first held-out run.
3. MEASURE the held-out runs (each twice, separate processes, ``--steps`` timed steps after one
   warm-up step): other tails (forced long tail), other B (16, 64), other Delta, the modes not
   fitted (intra, inter, pipeline), GRPO with groups of 4, refill, and a Ray placement.
4. REPORT ``heldout.md`` / ``heldout.json``: per run the prediction, the measured median step
   time (the pooled timed steps of both repeats) and each repeat's median, their spread, the
   absolute-time error, the speed ratio against the same workload's sequential run (predicted vs
   measured) and its error; and a second prediction replayed with the run's own measured lengths
   (what the cost model and schedule get wrong, with the length model taken out).

What the planner cannot model, said here and in the report: a Ray placement is simulated as the
local split placement (the actor in the controller, every scorer on one other device): Ray's
per-call overhead and its learner rank are not modelled. ``pipeline`` is simulated with the update
beside decoding on a device of its own; on a 2-core CPU the learner thread and the decoding thread
share the cores, which the planner does not model.

Blind and recomputed predictions: ``predictions.json`` keeps the predictions as first made (before
the measurements; a changed spec is predicted anew); they are never remade when the planner
changes. Every invocation also predicts every run again with the current planner ("predicted
now"): after a fix to the planner those are made after the measurements, not blind, and the
report says so and shows both.

Resumable: every run writes into ``<cache>/<name>.tmp`` and renames it to ``<cache>/<name>`` when
done; a finished run is never redone (delete its directory to redo it). Each run is its own
process (``--run-one``), so a killed script loses at most the run in progress.

    OPPO_HOME=/tmp/oppo-home python benchmarks/plan/heldout.py            # the full validation
    OPPO_HOME=/tmp/oppo-home python benchmarks/plan/heldout.py --quick    # smoke: 4 runs, 3 steps
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# every run: fixed Delta and chunk size (the adaptive ones depend on rewards and timings, which a
# prediction made before the run cannot know); batch settings as `oppo bench --quick`
COMMON = ("overlap.chunk_size=16", "run.save_every=0")
TAIL_SIGMA = 1.5  # the forced long tail: log-normal, median max_new_tokens / 12, capped at max_new_tokens


@dataclass(frozen=True)
class Spec:
    """One run: a workload (runs of one workload share a sequential baseline) in one mode."""

    name: str
    workload: str
    mode: str
    batch: int = 32
    overrides: tuple[str, ...] = ()
    sigma: float | None = None  # forced log-normal lengths; None: the task's own (natural) lengths
    role: str = "heldout"  # "fit": its traces fit the costs; "heldout": predicted, then measured
    note: str = ""

    def config_overrides(self, steps: int) -> list[str]:
        mb = min(16, self.batch)
        return [f"overlap.mode={self.mode}", f"ppo.batch_size={self.batch}", *COMMON,
                f"ppo.minibatch_size={mb}", f"ppo.micro_batch_size={mb}", "overlap.delta=8",
                f"run.steps={steps}", *self.overrides]


def specs(quick: bool) -> list[Spec]:
    if quick:  # a smoke run: the code paths, not the figures (responses capped at 48 tokens, not 128)
        short = ("generation.max_new_tokens=48",)
        return [Spec("fit-natural-B16-sequential", "natural B=16", "sequential", 16, role="fit"),
                Spec("fit-natural-B16-oppo", "natural B=16", "oppo", 16, role="fit"),
                Spec("tail-B16-sequential", "long tail B=16", "sequential", 16, short, sigma=TAIL_SIGMA),
                Spec("tail-B16-pipeline", "long tail B=16", "pipeline", 16, short, sigma=TAIL_SIGMA)]
    nat, tail, grpo = "natural B=32", "long tail B=32", "GRPO G=4 B=32"
    ray = ("placement.name=ray", "learner.replicate.cpus=0.2", "placement.ray.scorer_cpus=0.2")
    return [
        Spec("fit-natural-B32-sequential", nat, "sequential", role="fit"),
        Spec("fit-natural-B32-oppo", nat, "oppo", role="fit"),
        # the fitted configuration in new runs, and the modes not fitted
        Spec("natural-B32-sequential", nat, "sequential", note="fit configuration, new runs"),
        Spec("natural-B32-oppo", nat, "oppo", note="fit configuration, new runs"),
        Spec("natural-B32-intra", nat, "intra"),
        Spec("natural-B32-inter", nat, "inter"),
        Spec("natural-B32-pipeline", nat, "pipeline"),
        # other Delta
        Spec("natural-B32-delta16-inter", nat, "inter", overrides=("overlap.delta=16",), note="Delta 16"),
        Spec("natural-B32-delta16-oppo", nat, "oppo", overrides=("overlap.delta=16",), note="Delta 16"),
        # other B
        Spec("natural-B16-sequential", "natural B=16", "sequential", 16),
        Spec("natural-B16-oppo", "natural B=16", "oppo", 16),
        Spec("natural-B64-sequential", "natural B=64", "sequential", 64),
        Spec("natural-B64-oppo", "natural B=64", "oppo", 64),
        # another tail (forced lengths)
        Spec("tail-B32-sequential", tail, "sequential", sigma=TAIL_SIGMA),
        Spec("tail-B32-inter", tail, "inter", sigma=TAIL_SIGMA),
        Spec("tail-B32-oppo", tail, "oppo", sigma=TAIL_SIGMA),
        Spec("tail-B32-oppo-refill", tail, "oppo", overrides=("overlap.refill=true",), sigma=TAIL_SIGMA,
             note="refill"),
        Spec("tail-B32-pipeline", tail, "pipeline", sigma=TAIL_SIGMA),
        # GRPO in groups of 4 (critic-free), Delta 2 groups
        *[Spec(f"grpo-G4-B32-{m}", grpo, m, overrides=("algo.name=grpo", "algo.group_size=4", "overlap.delta=2"))
          for m in ("sequential", "inter", "oppo")],
        # a Ray placement: the scorers in a Ray actor, the learner a Ray rank
        Spec("ray-natural-B32-oppo", nat, "oppo", overrides=ray,
             note="Ray placement, simulated as the local split placement"),
    ]


# ----------------------------------------------------------------------------- one run (a child process)


def run_one(spec: Spec, steps: int, out: Path) -> None:
    """Train ``spec`` for ``steps`` steps into ``out``: config.yaml, metrics.jsonl, lengths.jsonl
    (with each sequence's place in its group), trace.json, meta.json."""
    import yaml

    from oppo.bench import synthetic_sampler, timing_only
    from oppo.config import load_config, to_dict
    from oppo.trainer import Trainer

    cfg = load_config(None, spec.config_overrides(steps) + [f"run.out_dir={out}"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    t = Trainer.from_config(cfg, progress=False)
    try:
        if spec.sigma is not None:
            t.length_sampler = synthetic_sampler(spec.sigma, t.max_new_tokens, cfg.run.seed)
        with open(out / "metrics.jsonl", "w") as mf, open(out / "lengths.jsonl", "w") as lf:
            for step in range(steps):
                m = t.run_step()
                if spec.sigma is not None:
                    m = timing_only(m)
                mf.write(json.dumps({"step": step, **m}) + "\n")
                mf.flush()
                rs = t.last_result.exp.rollouts
                lf.write(json.dumps({"step": step, "lengths": [len(r.response_ids) for r in rs],
                                     "prompt_index": [r.prompt_index for r in rs],
                                     "member": [r.uid - r.group for r in rs]}) + "\n")
                print(f"    {spec.name} step {step}: {m['time/step']:.2f} s", file=sys.stderr, flush=True)
        t.tracer.save(out / "trace.json")
        meta = {"spec": asdict(spec), "steps": steps, "max_new_tokens": t.max_new_tokens,
                "group_size": cfg.group_size, "needs_critic": cfg.needs_critic, "sigma": spec.sigma,
                "machine": _machine(), "finished_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        (out / "meta.json").write_text(json.dumps(meta, indent=1))
    finally:
        t.close()


def _machine() -> str:
    from oppo.bench import machine

    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return f"{machine()}; load average {load:.1f} when the run ended"


class RunFailed(RuntimeError):
    pass


def ensure_run(spec: Spec, rep: int, steps: int, cache: Path, say) -> Path:
    """The run's directory, measured now unless a finished one is cached."""
    d = cache / f"{spec.name}-r{rep}"
    if (d / "meta.json").is_file():
        return d
    tmp = d.with_name(d.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    say(f"  run {d.name} ({steps} steps)")
    t0 = time.time()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    tmp.mkdir(parents=True)
    with open(tmp / "log.txt", "w") as log:  # the child's output, kept with the run (and when it fails)
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run-one", json.dumps(asdict(spec)),
                               "--steps", str(steps), "--run-dir", str(tmp)], env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RunFailed(f"{d.name} failed (exit {proc.returncode}); its output: {tmp / 'log.txt'}")
    tmp.rename(d)
    say(f"  run {d.name} done in {time.time() - t0:.0f} s")
    return d


# ----------------------------------------------------------------------------- predict and compare


def workload_of(spec: Spec, steps: int, max_new_tokens: int, fit_lengths: list[int]):
    """The a-priori workload of ``spec``: its settings, and its lengths as known before the run."""
    from oppo.config import load_config
    from oppo.plan.calibrate import PROMPT_PAD, PROMPT_TOKENS
    from oppo.plan.lengths import EmpiricalLengths, LogNormalLengths
    from oppo.plan.sim import Workload

    cfg = load_config(None, spec.config_overrides(steps))
    max_new_tokens = cfg.generation.max_new_tokens or max_new_tokens  # (else the task's, as the fit runs had)
    if spec.sigma is not None:
        lengths = LogNormalLengths(max(2, max_new_tokens // 12), spec.sigma, max_new_tokens, cfg.run.seed)
    else:
        lengths = EmpiricalLengths(tuple(fit_lengths), cfg.run.seed)
    o, p = cfg.overlap, cfg.ppo
    wl = Workload(batch=p.batch_size, lengths=lengths, prompt_tokens=PROMPT_TOKENS, prompt_pad=PROMPT_PAD,
                  delta=o.delta, max_lag=o.max_lag, chunk=o.chunk_size, minibatch=p.minibatch_size,
                  micro=p.micro_batch_size, epochs=p.epochs, group_size=cfg.group_size, refill=o.refill,
                  partial_groups=o.partial_groups)
    return wl, cfg.needs_critic


def _timed(run_dir: Path, warmup: int = 1) -> list[float]:
    ms = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [m["time/step"] for m in ms[warmup:]]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="Smoke run: 4 runs (B=16), 3 steps, one repeat.")
    p.add_argument("--steps", type=int, default=None, help="Timed steps per run, after one warm-up (default 10; "
                                                          "--quick 2).")
    p.add_argument("--repeats", type=int, default=None, help="Measurements of each held-out run (default 2; --quick 1).")
    p.add_argument("--cache", default=None, help="Run directories (default runs/plan-heldout[-quick]).")
    p.add_argument("--out", default=None, help="Report prefix (default benchmarks/plan/heldout[_quick]).")
    p.add_argument("--only", default="", help="Comma-separated run names to measure (the rest must be cached).")
    p.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.run_one:
        run_one(Spec(**{**json.loads(a.run_one), "overrides": tuple(json.loads(a.run_one)["overrides"])}), a.steps,
                Path(a.run_dir))
        return 0
    sys.path.insert(0, str(ROOT / "src"))
    from oppo.plan.calibrate import CpuProfile, fit, fit_overhead, load_run_dir, replay_workload

    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    timed = a.steps if a.steps is not None else (2 if a.quick else 10)
    steps = timed + 1  # one warm-up step, left out of every figure
    repeats = a.repeats if a.repeats is not None else (1 if a.quick else 2)
    cache = Path(a.cache or ROOT / ("runs/plan-heldout-quick" if a.quick else "runs/plan-heldout"))
    out = Path(a.out or HERE / ("heldout_quick" if a.quick else "heldout"))
    cache.mkdir(parents=True, exist_ok=True)
    all_specs = specs(a.quick)
    started = time.time()

    # 1. FIT
    say("fit runs:")
    fit_dirs = [ensure_run(s, 0, steps, cache, say) for s in all_specs if s.role == "fit"]
    fit_runs = [load_run_dir(d) for d in fit_dirs]
    costs = fit(fit_runs)
    profile = CpuProfile(costs)
    overhead = fit_overhead(profile, fit_runs)
    mnt = fit_runs[0].max_new_tokens or 128
    fit_lengths = sorted(n for r in fit_runs for n in r.table.values())

    # 2. PREDICT (before any held-out run is measured; kept if it was made by an earlier invocation)
    pred_path = cache / "predictions.json"
    fit_key = sorted(str(d) for d in fit_dirs)
    predictions = json.loads(pred_path.read_text()) if pred_path.is_file() else {}
    if predictions.get("fit_runs") != fit_key or predictions.get("steps") != steps:
        predictions = {"fit_runs": fit_key, "steps": steps, "made_at": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                     time.gmtime()), "runs": {}}
    for s in all_specs:
        # (a changed spec is predicted anew; compared as JSON reads it back: lists, not tuples, else
        # every invocation re-predicted every run and overwrote the blind predictions)
        if predictions["runs"].get(s.name, {}).get("spec") != json.loads(json.dumps(asdict(s))):
            wl, needs_critic = workload_of(s, steps, mnt, fit_lengths)
            res = profile.simulate(s.mode, wl, steps, warmup=1, needs_critic=needs_critic)
            predictions["runs"][s.name] = {"spec": asdict(s), "step_s": res.step_time_median,
                                           "lengths": wl.lengths.describe(),
                                           "made_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    pred_path.write_text(json.dumps(predictions, indent=1))
    say(f"predictions written to {pred_path}")
    # the same predictions by the planner as it is now (equal to the blind ones unless it changed since)
    now = {}
    for s in all_specs:
        wl, needs_critic = workload_of(s, steps, mnt, fit_lengths)
        now[s.name] = profile.simulate(s.mode, wl, steps, warmup=1, needs_critic=needs_critic).step_time_median

    # 3. MEASURE
    only = {x.strip() for x in a.only.split(",") if x.strip()}
    rows, failed = [], []
    for s in all_specs:
        reps = 1 if s.role == "fit" else repeats
        dirs = []
        for r in range(reps):
            d = cache / f"{s.name}-r{r}"
            if only and s.name not in only and not (d / "meta.json").is_file():
                continue
            try:
                dirs.append(ensure_run(s, r, steps, cache, say))
            except RunFailed as e:  # reported, not fatal: the other runs still count
                say(f"  {e}")
                failed.append(str(e))
        if not dirs:
            continue
        per_rep = [_timed(d) for d in dirs]
        pooled = [x for xs in per_rep for x in xs]
        # the same prediction given the run's own measured lengths (the cost model and schedule alone)
        replayed = []
        for d in dirs:
            run = load_run_dir(d)
            wl = replay_workload(run, check=False)
            replayed.append(profile.simulate(s.mode, wl, len(run.metrics), 1, run.needs_critic).step_time_median)
        meta = json.loads((dirs[0] / "meta.json").read_text())
        rows.append({"name": s.name, "workload": s.workload, "mode": s.mode, "role": s.role, "note": s.note,
                     "predicted_s": predictions["runs"][s.name]["step_s"],
                     "predicted_lengths": predictions["runs"][s.name]["lengths"],
                     "predicted_at": predictions["runs"][s.name].get("made_at", predictions["made_at"]),
                     "predicted_now_s": now[s.name],
                     "replayed_s": statistics.mean(replayed),
                     "measured_s": statistics.median(pooled), "repeat_medians_s": [statistics.median(x) for x in per_rep],
                     "timed_steps": [len(x) for x in per_rep], "machine": meta["machine"],
                     "measured_at": min(json.loads((d / "meta.json").read_text())["finished_at"] for d in dirs)})
    # 4. REPORT
    for r in rows:
        reps = r["repeat_medians_s"]
        r["spread"] = (max(reps) - min(reps)) / statistics.mean(reps) if len(reps) > 1 else None
        r["error"] = r["predicted_s"] / r["measured_s"] - 1
        r["error_now"] = r["predicted_now_s"] / r["measured_s"] - 1
        r["replayed_error"] = r["replayed_s"] / r["measured_s"] - 1
        # (the fit runs' ratios against the fit sequential run; held-out ones against a held-out one)
        base = next((b for b in rows if b["workload"] == r["workload"] and b["mode"] == "sequential"
                     and b["role"] == r["role"]), None) or next(
            (b for b in rows if b["workload"] == r["workload"] and b["mode"] == "sequential"), None)
        if base is not None and r["mode"] != "sequential":
            r["ratio_measured"] = base["measured_s"] / r["measured_s"]
            for key, col in (("", "predicted_s"), ("_now", "predicted_now_s"), ("_replayed", "replayed_s")):
                r[f"ratio_predicted{key}"] = base[col] / r[col]
                r[f"ratio_error{key}"] = r[f"ratio_predicted{key}"] / r["ratio_measured"] - 1
            r["baseline"] = base["name"]
    planner_changed = any(abs(r["predicted_now_s"] / r["predicted_s"] - 1) > 1e-6 for r in rows)
    result = {"command": "python benchmarks/plan/heldout.py " + " ".join(argv), "quick": a.quick,
              "timed_steps_per_run": timed, "repeats": repeats, "fit_runs": [str(d) for d in fit_dirs],
              "costs": {g: c.to_dict() for g, c in costs.items()}, "overhead_s": overhead,
              "predictions_made_at": predictions["made_at"], "planner_changed_since": planner_changed,
              "predicted_now_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rows": rows, "failed": failed,
              "seconds": time.time() - started}
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=1))
    Path(f"{out}.md").write_text(to_markdown(result))
    say(f"wrote {out}.md and {out}.json ({time.time() - started:.0f} s)")
    return 0


def pct(x) -> str:
    return "-" if x is None else f"{x * 100:+.0f}%"


def _summary(rows: list[dict], key: str) -> str:
    """Median and max |error| of the step time and of the speed ratio of prediction ``key`` ("", "_now",
    "_replayed")."""
    ek = "replayed_error" if key == "_replayed" else f"error{key}"
    e = [abs(r[ek]) for r in rows if ek in r]
    q = [abs(r[f"ratio_error{key}"]) for r in rows if f"ratio_error{key}" in r]
    out = f"step time {statistics.median(e):.0%} (max {max(e):.0%})" if e else "step time -"
    return out + (f"; speed ratio {statistics.median(q):.0%} (max {max(q):.0%})" if q else "")


def to_markdown(res: dict) -> str:
    rows = res["rows"]
    held = [r for r in rows if r["role"] == "heldout"]
    fitted = [r for r in rows if r["role"] == "fit"]
    changed = res.get("planner_changed_since", False)
    kinds = sorted({r["machine"].split("; load average")[0] for r in rows})
    loads = [float(r["machine"].split("load average ")[1].split()[0]) for r in rows if "load average " in r["machine"]]
    machines = [k + (f"; load average {min(loads):.1f}-{max(loads):.1f} at the ends of the runs" if loads else "")
                for k in kinds]
    lines = ["# The planner, validated held out" + (" (--quick smoke run: not figures to quote)" if res["quick"] else ""),
             "", f"Command: `{res['command']}`", "",
             f"Machine(s): {'; '.join(machines)}.", "",
             f"Costs fitted on {len(res['fit_runs'])} runs only (the rows marked *fit*: natural lengths, sequential "
             f"and oppo); every other row was predicted from its settings before it was measured "
             f"(*blind* predictions, made {res['predictions_made_at']}). {res['timed_steps_per_run']} timed steps per "
             f"run after one warm-up step; held-out runs measured {res['repeats']} time(s), each in its own process. "
             f"Untraced controller time per step, fitted on the fit runs: "
             + ", ".join(f"{g} {v * 1e3:.0f} ms" for g, v in res["overhead_s"].items()) + ". Fitted costs: "
             + "; ".join(f"{g}: " + ", ".join(f"{k}={v:.3g}" for k, v in c["coef"].items() if v)
                         for g, c in res["costs"].items()) + ".", ""]
    if changed:
        lines += [f"**The planner changed after the measurements.** The *blind* columns are the predictions made "
                  f"before them, by the planner as it was then, kept as they were; the *now* columns are the same "
                  f"predictions by the planner as it is now (made {res['predicted_now_at']}, after the measurements "
                  f"and after looking at them: **not blind**), and *given lengths* too is the planner of now.", ""]
    lines += ["Columns: *measured* the median of the pooled timed steps of the repeats, then each repeat's median and "
              "their spread ((max - min) / mean); *predicted* from the settings (natural lengths drawn from the fit "
              "runs' lengths; forced lengths exactly); *error* = predicted / measured - 1; *given lengths*: the "
              "planner replaying the run's own measured lengths (cost model and schedule alone); *speed ratio* = the "
              "same workload's sequential step time / this run's (a fit run's against the fit sequential run, a "
              "held-out run's against the held-out sequential run), measured, then predicted, with the error of the "
              "prediction.", ""]
    if changed:
        lines += ["| run | role | measured (s) | repeats (s) | spread | blind predicted (s) | error "
                  "| now predicted (s) | error | given lengths (s) | error | speed ratio measured | blind | error "
                  "| now | error | given lengths | error |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    else:
        lines += ["| run | role | measured (s) | repeats (s) | spread | predicted (s) | error | given lengths (s) "
                  "| error | speed ratio measured | predicted | error | given lengths | error |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(r, key):
        if "ratio_measured" not in r:
            return ["-", "-"]
        return [f"{r[f'ratio_predicted{key}']:.2f}x", pct(r[f"ratio_error{key}"])]

    for r in rows:
        label = r["name"] + (f" ({r['note']})" if r["note"] else "")
        cells = [label, "fit" if r["role"] == "fit" else "held out", f"{r['measured_s']:.2f}",
                 " / ".join(f"{x:.2f}" for x in r["repeat_medians_s"]), pct(r["spread"]),
                 f"{r['predicted_s']:.2f}", pct(r["error"])]
        if changed:
            cells += [f"{r['predicted_now_s']:.2f}", pct(r["error_now"])]
        cells += [f"{r['replayed_s']:.2f}", pct(r["replayed_error"]),
                  f"{r['ratio_measured']:.2f}x" if "ratio_measured" in r else "-", *ratio(r, "")]
        if changed:
            cells += ratio(r, "_now")
        cells += ratio(r, "_replayed")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Median |error| (max):", ""]
    modelled = [r for r in held if r["mode"] != "pipeline" and "ray" not in r["name"]]
    for label, sel in ((f"held out ({len(held)} runs)", held),
                       (f"held out, without the {len(held) - len(modelled)} runs of what is not modelled (below: "
                        f"pipeline, Ray)", modelled if len(modelled) < len(held) else []),
                       (f"in sample (the {len(fitted)} fit runs)", fitted)):
        if not sel:
            continue
        lines.append(f"- {label}: " + ("blind prediction: " if changed else "prediction: ") + _summary(sel, "")
                     + (f"; now (not blind): {_summary(sel, '_now')}" if changed else "")
                     + f"; given lengths: {_summary(sel, '_replayed')}.")
    spreads = [r["spread"] for r in held if r["spread"] is not None]
    if spreads:
        lines.append(f"- run-to-run spread of the held-out runs: median {statistics.median(spreads):.0%} "
                     f"(max {max(spreads):.0%}).")
    late = [r["name"] for r in held if r["measured_at"] < r["predicted_at"]]
    if late:  # (the timestamps are UTC strings of one format: they sort as times)
        lines += ["", f"**Not blind:** the predictions were (re)made after {len(late)} held-out run(s) had been measured "
                      f"({', '.join(late)}): their spec or the planner changed after the measurement."]
    if res.get("failed"):
        lines += ["", "Runs that failed (not in the table): " + "; ".join(res["failed"]) + "."]
    lines += ["", "Not modelled: the Ray placement is simulated as the local split placement (Ray's per-call "
                  "overhead and its learner rank are not in the model); pipeline's update is simulated on a device "
                  "of its own, while on a 2-core CPU the learner thread shares the cores with decoding.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
