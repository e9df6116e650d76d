"""Fit the stage costs from oppo's own traces, and check the planner against measured speedups.

A measured run directory (``trace.json`` + ``metrics.jsonl``; lengths from ``oppo bench --tail``'s
sampler or from ``lengths.jsonl``) is replayed by the simulator, which gives every measured span
the sizes of its work; non-negative least squares turns them into seconds per unit
(``LinearCosts``). On the CPU two cost sets are fitted (``together``, ``split``: ``cpu_profile``).
:func:`validation` (``oppo plan --calibrate``) is an in-sample check; the held-out one,
``benchmarks/plan/heldout.py``, uses :func:`load_run_dir`, :func:`fit` and :func:`fit_overhead`.

Design notes: docs/planner.md, "Calibration"."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..config import upgrade_settings
from ..trace import Span, load_trace
from .costs import LinearCosts, Work, nnls
from .lengths import LogNormalLengths, TableLengths
from .sim import MODES, STREAMING, DeviceSplit, Lengths, Workload, simulate

__all__ = ["MeasuredRun", "load_run", "load_run_dir", "read_lengths", "fit_overhead", "load_tail_sweep",
           "replay_workload", "fit", "cpu_placement", "CpuProfile", "Comparison", "validate", "check_bench",
           "validation", "BUILTIN_LENGTHS"]


@dataclass
class MeasuredRun:
    """One mode's run directory from a bench: its metrics, spans and workload settings."""

    path: Path
    mode: str
    metrics: list[dict]
    spans: list[Span]
    settings: dict
    sigma: float | None = None
    table: dict | None = None  # measured lengths, (prompt_index, member) -> tokens (a run directory's lengths.jsonl)
    max_new_tokens: int | None = None
    group_size: int = 1
    needs_critic: bool = True

    @property
    def step_times(self) -> list[float]:
        return [m["time/step"] for m in self.metrics]


def load_run(path: str | Path, mode: str | None = None, settings: dict | None = None,
             sigma: float | None = None) -> MeasuredRun:
    path = Path(path)
    metrics = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return MeasuredRun(path, mode or path.name, metrics, load_trace(path / "trace.json"),
                       upgrade_settings(settings or {}), sigma)


def read_lengths(path: str | Path) -> dict[tuple[int, int], int]:
    """``lengths.jsonl`` (``oppo train`` or ``benchmarks/plan/heldout.py``) as ``{(prompt_index,
    member): tokens}``; without a ``member`` field, a group's members are the adjacent entries of
    one prompt index (a step trains whole groups, members adjacent)."""
    table: dict[tuple[int, int], int] = {}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        d = json.loads(line)
        members = d.get("member")
        if members is None:
            members, prev, m = [], None, 0
            for i in d["prompt_index"]:
                m = m + 1 if i == prev else 0
                members.append(m)
                prev = i
        for i, m, n in zip(d["prompt_index"], members, d["lengths"]):
            table[(int(i), int(m))] = int(n)
    return table


def load_run_dir(path: str | Path) -> MeasuredRun:
    """A run directory (``config.yaml``, ``metrics.jsonl``, ``trace.json``, ``lengths.jsonl``, and
    ``meta.json`` from ``benchmarks/plan/heldout.py``): replayable with its measured lengths."""
    import yaml

    path = Path(path)
    settings = yaml.safe_load((path / "config.yaml").read_text())
    meta = json.loads((path / "meta.json").read_text()) if (path / "meta.json").is_file() else {}
    run = load_run(path, settings["overlap"]["mode"], settings, meta.get("sigma"))
    run.table = read_lengths(path / "lengths.jsonl")
    run.max_new_tokens = meta.get("max_new_tokens")
    run.group_size = int(meta.get("group_size") or settings.get("algo", {}).get("group_size") or 1)
    run.needs_critic = bool(meta.get("needs_critic", True))
    return run


def _bench_settings(bench_dir: Path) -> dict:
    import yaml

    res = json.loads((bench_dir / "bench.json").read_text())
    return yaml.safe_load(res["settings"])


def load_tail_sweep(bench_dir: str | Path) -> list[MeasuredRun]:
    """Every ``tail/sigma_*/<mode>/`` run of an ``oppo bench`` output directory."""
    bench_dir = Path(bench_dir)
    settings = _bench_settings(bench_dir)
    runs = []
    for d in sorted((bench_dir / "tail").glob("sigma_*")):
        sigma = float(d.name.split("_", 1)[1])
        for mode in MODES:
            if (d / mode / "trace.json").is_file():
                runs.append(load_run(d / mode, mode, settings, sigma))
    if not runs:
        raise FileNotFoundError(f"no tail/sigma_*/<mode>/trace.json under {bench_dir} (run `oppo bench --tail ...`)")
    return runs


PROMPT_TOKENS, PROMPT_PAD = 11, 15  # the built-in task's prompts: 11.3 tokens on average, 8-15


def replay_workload(run: MeasuredRun, max_new_tokens: int = 128, check: bool = True) -> Workload:
    """The workload a run trained: its lengths (measured ones from a run directory, else the tail
    sweep's synthetic ones), batch sizes, Delta and chunk per step, groups and refill.

    ``check``: the replayed batches must have the measured mean and maximum length at every step
    (not for ``pipeline``, whose schedule depends on timing)."""
    ppo, ov = run.settings["ppo"], run.settings["overlap"]
    mnt = run.max_new_tokens or run.settings.get("generation", {}).get("max_new_tokens") or max_new_tokens
    lengths: Lengths
    if run.table is not None:
        lengths = TableLengths(run.table, mnt)
    elif run.sigma is not None:
        lengths = LogNormalLengths(max(2, mnt // 12), run.sigma, mnt, run.settings["run"]["seed"])
    else:
        raise ValueError(f"{run.path}: no lengths to replay (a run directory's lengths.jsonl, or an oppo bench --tail run)")
    wl = Workload(
        batch=ppo["batch_size"], lengths=lengths, prompt_tokens=PROMPT_TOKENS, prompt_pad=PROMPT_PAD,
        delta=[int(m.get("overlap/delta", 0)) for m in run.metrics] or 0, max_lag=ov["max_lag"],
        chunk=[int(m.get("overlap/chunk_size", 0)) or 16 for m in run.metrics], minibatch=ppo["minibatch_size"],
        micro=ppo["micro_batch_size"], epochs=ppo["epochs"], group_size=run.group_size,
        refill=bool(ov.get("refill", False)), partial_groups=ov.get("partial_groups", "carry"))
    if check and run.mode != "pipeline":
        sim = simulate(run.mode, wl, _UNIT, cpu_placement(run.mode, critic_on_worker(run.settings), run.needs_critic),
                       steps=len(run.metrics), warmup=0)
        for m, s in zip(run.metrics, sim.steps):
            if (abs(statistics.mean(s.lengths) - m["response_length/mean"]) > 1e-3
                    or max(s.lengths) != m["response_length/max"]):
                raise ValueError(f"{run.path}: step {s.step}: replayed batch (mean length "
                                 f"{statistics.mean(s.lengths):.3f}, max {max(s.lengths)}) differs from the measured "
                                 f"one ({m['response_length/mean']:.3f}, {m['response_length/max']:g}); "
                                 "is it a run of this oppo version with the bench's seed?")
    return wl


# any positive decode cost gives the same schedule on one device: the finish order depends on lengths only
_UNIT = LinearCosts({"decode.calls": 1e-3, "decode.rows": 1e-5}, "unit")


def critic_on_worker(settings: dict) -> bool:
    """``placement.local.critic_on_worker`` of a run's saved settings (upgraded: ``upgrade_settings``)."""
    return bool(((settings.get("placement") or {}).get("local") or {}).get("critic_on_worker", True))


def cpu_placement(mode: str, critic_on_worker: bool = True, needs_critic: bool = True) -> DeviceSplit:
    """Where oppo runs each stage on a CPU machine in ``mode`` (see the module docstring).
    ``needs_critic=False`` (GRPO, RLOO, REINFORCE++): no critic to score or train."""
    if not needs_critic:
        return DeviceSplit(1, 1 if mode in STREAMING else 0, scorer_roles=("reward", "reference"), critic="value_head")
    if mode in STREAMING:
        return DeviceSplit(1, 1, critic="scorer" if critic_on_worker else "actor")
    return DeviceSplit(1, 0, critic="actor")


def _group(mode: str) -> str:
    return "split" if mode in STREAMING else "together"


def _samples(run: MeasuredRun, warmup: int = 1) -> list[tuple[dict[str, float], float, str]]:
    """(features, measured seconds, label) for every measured span the replay can size."""
    wl = replay_workload(run)
    on_worker = critic_on_worker(run.settings)
    sim = simulate(run.mode, wl, _UNIT, cpu_placement(run.mode, on_worker, run.needs_critic),
                   steps=len(run.metrics), warmup=0, fine=True)
    simulated: dict[tuple[str, str, int], list[tuple[Work, ...]]] = {}
    for _dev, lane, stage, step, _s, _e, works in sim_log(sim):
        simulated.setdefault((lane, stage, step), []).append(works)
    measured: dict[tuple[str, str, int], list[Span]] = {}
    for s in run.spans:
        measured.setdefault((s.lane, s.stage, s.step), []).append(s)
    measured = {k: _innermost(v) for k, v in measured.items()}
    out: list[tuple[dict[str, float], float, str]] = []  # (features, seconds, kind of span)

    def add(works: Sequence[Work], seconds: float, label: str) -> None:
        f: dict[str, float] = {}
        for w in works:
            for k, v in LinearCosts.features(w).items():
                f[k] = f.get(k, 0.0) + v
        if f:
            out.append((f, seconds, label))

    for (lane, stage, step), spans in measured.items():
        if step < warmup or lane == "controller":
            continue
        if lane == "scorer" and stage.startswith("score_") and run.mode in STREAMING:
            role = stage[len("score_"):]  # the scorer worker's own batching is timing-dependent: use its token count
            for s in spans:
                add([Work("stream", role, 1, 0, s.args.get("tokens", 0))], s.duration, f"stream.{role}")
            continue
        if (lane, stage) == ("actor", "generate"):  # the sequential loop: prefill + decode in one span
            sim_works = [w for key in (("actor", "prefill_prompt", step), ("actor", "decode", step))
                         for ws in simulated.get(key, []) for w in ws]
            add(sim_works, sum(s.duration for s in spans), "generate")
            continue
        sim_spans = simulated.get((lane, stage, step), [])
        if not sim_spans:
            continue
        if stage == "decode" and len(spans) == len(sim_spans) + 1:
            # the runtime closes its last decode span after the loop (the close check): fold it in
            last = spans[-2]
            spans = spans[:-2] + [Span(last.lane, last.stage, last.step, last.start, spans[-1].end)]
        if len(sim_spans) == len(spans):  # one to one (decode segments between chunk hand-offs)
            for s, ws in zip(spans, sim_spans):
                add(ws, s.duration, stage)
        else:
            add([w for ws in sim_spans for w in ws], sum(s.duration for s in spans), stage)
    return out


def _innermost(spans: list[Span]) -> list[Span]:
    """The spans of one (lane, stage, step) less every span that encloses another of them.

    The runtime records some work twice, nested: with the critic trained beside the actor
    (``learner.critic.CriticBesideScorer``, every intra/oppo/pipeline run with a critic) the actor's
    update is a ``learner/train`` span inside ``stages.update``'s ``learner/train`` span, which
    also holds handing the critic its batch and waiting for it (``controller/wait_critic``).
    Summed, the two would count the actor's update twice (the fitted ``train.actor.tokens`` of the
    split placement 2x the real one). The inner span is the work the simulator sizes.
    """
    if len(spans) < 2:
        return spans
    eps = 1e-9
    return [s for s in spans
            if not any(o is not s and s.start - eps <= o.start and o.end <= s.end + eps
                       and (o.start, o.end) != (s.start, s.end) for o in spans)]


def sim_log(result) -> list:
    """The simulated spans with the work each did: (device, lane, stage, step, start, end, works)."""
    out = []
    for s in result.spans:
        works = tuple(Work(**w) for w in s.args.get("works", []))
        out.append(("", s.lane, s.stage, s.step, s.start, s.end, works))
    return out


def fit(runs: list[MeasuredRun], warmup: int = 1) -> dict[str, LinearCosts]:
    """Fit one ``LinearCosts`` per cost group (``together``, ``split``) from the runs' spans."""
    by_group: dict[str, list] = {}
    for run in runs:
        by_group.setdefault(_group(run.mode), []).extend(_samples(run, warmup))
    out = {}
    for group, samples in sorted(by_group.items()):
        names = sorted({k for f, _, _ in samples for k in f})
        A = np.array([[f.get(k, 0.0) for k in names] for f, _, _ in samples])
        b = np.array([sec for _, sec, _ in samples])
        scale = np.where(A.max(0) > 0, A.max(0), 1.0)  # columns of very different sizes: scale for stability
        x = nnls(A / scale, b) / scale
        costs = LinearCosts({k: float(v) for k, v in zip(names, x)}, f"fitted on CPU traces ({group})")
        pred = A @ x
        costs.fit_stats = {  # how well the linear model explains the spans, per kind of span
            label: {"spans": int(sum(1 for _, _, l in samples if l == label)),
                    "measured_s": float(sum(s for (_, s, l) in samples if l == label)),
                    "predicted_s": float(sum(p for p, (_, _, l) in zip(pred, samples) if l == label))}
            for label in sorted({l for _, _, l in samples})}
        out[group] = costs
    _apportion_updates(out, by_group)
    return out


def _tied_updates(samples) -> bool:
    """Whether every span that trains the actor trains the critic too, with the same sizes (the
    ``together`` placement: ``learner.update`` trains both in one span): the fit can then price
    their sum only."""
    tr = [f for f, _, _ in samples if any(k.startswith("train.actor.") for k in f)]
    return bool(tr) and all(f.get(k.replace("train.actor.", "train.critic."), None) == v
                            for f in tr for k, v in f.items() if k.startswith("train.actor."))


def _apportion_updates(costs: dict[str, LinearCosts], by_group: dict[str, list]) -> None:
    """Split a cost group's tied actor + critic update cost (:func:`_tied_updates`) between the two
    in the ratio another group measured apart (``split``: the actor's update in the controller,
    the critic's in the scorer process, one core each).

    Without this the least squares, given two identical columns, puts the pair's whole cost on one
    of them (``train.actor.tokens``, critic 0), and a critic-free run (GRPO, RLOO) is priced
    with the critic's update in its actor's: about 2x. Assumed: the two updates' cost ratio is
    the same on all cores as on one. Without a group that measured them apart nothing changes."""
    for group, samples in by_group.items():
        if not _tied_updates(samples):
            continue
        ref = next((costs[g].coef for g, ss in by_group.items() if g != group and not _tied_updates(ss)
                    and costs[g].coef.get("train.actor.tokens", 0.0) > 0
                    and costs[g].coef.get("train.critic.tokens", 0.0) > 0), None)
        if ref is None:
            continue
        share = ref["train.actor.tokens"] / (ref["train.actor.tokens"] + ref["train.critic.tokens"])
        coef = costs[group].coef
        for k in [k for k in coef if k.startswith("train.actor.")]:
            kc = k.replace("train.actor.", "train.critic.")
            both = coef[k] + coef.get(kc, 0.0)
            coef[k], coef[kc] = share * both, (1.0 - share) * both
        costs[group].label += f" (actor + critic update split {share:.2f} : {1 - share:.2f} as measured apart)"


@dataclass
class CpuProfile:
    """Costs and placement per mode for oppo on a CPU machine (one ``LinearCosts`` per group)."""

    costs: dict[str, LinearCosts]
    critic_on_worker: bool = True
    overhead_s: float = 0.001  # untraced controller time per step (measured: about 1 ms)
    overhead_by_group: dict[str, float] = field(default_factory=dict)  # fitted (fit_overhead), else overhead_s

    def costs_for(self, mode: str, needs_critic: bool = True) -> LinearCosts:
        c = self.costs[_group(mode)]
        alone = not needs_critic and "together" in self.costs  # (no together fit: split's, 1 core: an overestimate)
        if mode in STREAMING and (not self.critic_on_worker or alone):
            # the controller trains actor and critic on all cores after the barrier (together's update
            # costs); without a critic the actor trains alone on all cores (setup.CriticBesideScorer,
            # which gives the actor one core while the critic trains beside it, is not used)
            coef = {k: v for k, v in c.coef.items() if not k.startswith("train.")}
            coef.update({k: v for k, v in self.costs["together"].coef.items() if k.startswith("train.")})
            c = LinearCosts(coef, c.label + " + together's training")
        return c

    def placement_for(self, mode: str, needs_critic: bool = True) -> DeviceSplit:
        return cpu_placement(mode, self.critic_on_worker, needs_critic)

    def overhead_for(self, mode: str) -> float:
        return self.overhead_by_group.get(_group(mode), self.overhead_s)

    def simulate(self, mode: str, wl: Workload, steps: int, warmup: int = 1, needs_critic: bool = True):
        return simulate(mode, wl, self.costs_for(mode, needs_critic), self.placement_for(mode, needs_critic), steps,
                        warmup, overhead_s=self.overhead_for(mode))


def fit_overhead(profile: CpuProfile, runs: list[MeasuredRun], warmup: int = 1) -> dict[str, float]:
    """Per cost group, the median of (measured - simulated) step time over the runs' timed steps:
    the controller's untraced time (Python between stages, metrics, threads handing over). Sets
    ``profile.overhead_by_group`` and returns it; never below 0."""
    resid: dict[str, list[float]] = {}
    for run in runs:
        wl = replay_workload(run, check=False)
        res = simulate(run.mode, wl, profile.costs_for(run.mode, run.needs_critic),
                       profile.placement_for(run.mode, run.needs_critic),
                       len(run.metrics), warmup=0)
        for m, s in list(zip(run.metrics, res.steps))[warmup:]:
            resid.setdefault(_group(run.mode), []).append(m["time/step"] - s.time)
    profile.overhead_by_group = {g: max(0.0, statistics.median(v)) for g, v in resid.items()}
    return profile.overhead_by_group


@dataclass
class Comparison:
    label: str
    measured: dict[str, float]  # mode -> speedup
    predicted: dict[str, float]
    measured_s: dict[str, float] = field(default_factory=dict)  # mode -> median step time
    predicted_s: dict[str, float] = field(default_factory=dict)
    note: str = ""
    measured_mean: dict[str, float] = field(default_factory=dict)  # speedup of the mean step time (training time)
    predicted_mean: dict[str, float] = field(default_factory=dict)
    # set by validation / check_bench; outside to_dict, equality and repr
    held_out: dict[str, float] | None = field(default=None, compare=False, repr=False)  # mode -> speedup, sigma left out of the fit
    busy: dict[str, dict[str, dict[str, float]]] | None = field(default=None, compare=False, repr=False)  # mode -> measured/predicted -> lane -> fraction

    def error(self, mode: str) -> float:
        return self.predicted[mode] / self.measured[mode] - 1.0

    def to_dict(self) -> dict:
        return {"label": self.label, "note": self.note, "measured_speedup": self.measured,
                "predicted_speedup": self.predicted, "measured_step_s": self.measured_s,
                "predicted_step_s": self.predicted_s,
                "error": {m: self.error(m) for m in self.measured if m != "sequential"},
                "measured_speedup_of_mean_step": self.measured_mean,
                "predicted_speedup_of_mean_step": self.predicted_mean}


def validate(profile: CpuProfile, runs: list[MeasuredRun], label: str, warmup: int = 1) -> Comparison:
    """Replay the runs of one tail setting (all modes) with ``profile``; compare median-step speedups."""
    meas_s, pred_s, meas_m, pred_m = {}, {}, {}, {}
    for run in runs:
        wl = replay_workload(run)
        res = profile.simulate(run.mode, wl, len(run.metrics), warmup)
        meas_s[run.mode] = statistics.median(run.step_times[warmup:])
        pred_s[run.mode] = res.step_time_median
        meas_m[run.mode] = statistics.mean(run.step_times[warmup:])
        pred_m[run.mode] = res.step_time_mean

    def ratio(d):
        return {m: d["sequential"] / v for m, v in d.items()}

    return Comparison(label, ratio(meas_s), ratio(pred_s), meas_s, pred_s, measured_mean=ratio(meas_m),
                      predicted_mean=ratio(pred_m))


BUILTIN_LENGTHS = (8.0, 0.7)
"""The built-in task's response lengths, as a log-normal (median, sigma), capped at 128.

Its runs record per-step mean and maximum lengths only, not every sequence's, so the planner
assumes a distribution: median 8 and sigma 0.7 give a mean of 10 tokens and a typical maximum of
about 34 in a batch of 32, as the 41-step bench's response-length plot shows after its first
steps (means 8-10, maxima 20-55). This is an assumption, and the check against those benches
tests it together with the costs."""


def check_bench(profile: CpuProfile, bench_dir: str | Path, lengths: tuple[float, float] = BUILTIN_LENGTHS,
                max_new_tokens: int = 128, seed: int = 1) -> Comparison:
    """Predict a built-in-task bench (``bench.json``, no traces needed) with assumed lengths."""
    bench_dir = Path(bench_dir)
    res = json.loads((bench_dir / "bench.json").read_text())
    import yaml

    st = upgrade_settings(yaml.safe_load(res["settings"]))  # (benches saved before placement.* had them in overlap.*)
    ppo, ov, on_worker = st["ppo"], st["overlap"], critic_on_worker(st)
    trials = ov.get("trial_steps", ov.get("chunk_trial_steps", 2))  # (older benches' name)
    chunk = ([c for c in ov["chunk_candidates"] if c for _ in range(trials)] + [16]
             if not ov["chunk_size"] else ov["chunk_size"])  # the tuner's streamed trials, then (assumed) 16
    start = ov["delta_min"] if ov.get("delta_rule", "reward_slope") == "cost" else ov["delta_init"]
    delta = ov["delta"] if ov["delta"] >= 0 else start  # adaptive in the run; its start here
    wl = Workload(batch=ppo["batch_size"], lengths=LogNormalLengths(lengths[0], lengths[1], max_new_tokens, seed),
                  prompt_tokens=PROMPT_TOKENS, prompt_pad=PROMPT_PAD, delta=delta, max_lag=ov["max_lag"], chunk=chunk,
                  minibatch=ppo["minibatch_size"], micro=ppo["micro_batch_size"], epochs=ppo["epochs"])
    prof = CpuProfile(profile.costs, on_worker, profile.overhead_s)
    pred_s, meas_s, busy = {}, {}, {}
    for mode, v in res["modes"].items():
        sim = prof.simulate(mode, wl, res["steps"])
        pred_s[mode] = sim.step_time_median
        meas_s[mode] = v["step_time_median_s"]
        busy[mode] = {"measured": {lane: v["busy_fraction"].get(lane, 0.0) for lane in ("actor", "scorer", "learner")},
                      "predicted": {lane: sim.busy_fraction("lane").get(lane, 0.0)
                                    for lane in ("actor", "scorer", "learner")}}
    cmp = Comparison(f"built-in task, {bench_dir.name} ({res['steps']} steps)",
                     {m: meas_s["sequential"] / v for m, v in meas_s.items()},
                     {m: pred_s["sequential"] / v for m, v in pred_s.items()}, meas_s, pred_s,
                     note=f"lengths assumed log-normal median {lengths[0]:g} sigma {lengths[1]:g}; "
                          f"Delta fixed at {delta}; critic_on_worker={on_worker}")
    cmp.busy = busy
    return cmp


def validation(tail_dirs: list[str | Path], check_dirs: Sequence[str | Path] = (),
               lengths: tuple[float, float] = BUILTIN_LENGTHS) -> dict:
    """Fit on every tail run; compare per sigma (in-sample and with that sigma held out) and per check bench."""
    runs = [r for d in tail_dirs for r in load_tail_sweep(d)]
    costs = fit(runs)
    profile = CpuProfile(costs)
    sigmas = sorted({r.sigma for r in runs if r.sigma is not None})  # (load_tail_sweep sets every run's)
    comparisons = []
    for sigma in sigmas:
        mine = [r for r in runs if r.sigma == sigma]
        c = validate(profile, mine, f"tail sigma {sigma:g}")
        others = [r for r in runs if r.sigma != sigma]
        if others:
            held = validate(CpuProfile(fit(others)), mine, "held out")
            c.held_out = held.predicted
        comparisons.append(c)
    for d in check_dirs:
        comparisons.append(check_bench(profile, d, lengths))
    return {"costs": costs, "profile": profile, "comparisons": comparisons, "runs": len(runs)}
