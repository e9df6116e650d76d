"""``oppo bench``'s command line: parse, check every mode's settings before anything loads, run the
main workload, the stage profile's second row and the tail sweep, write bench.json, bench.md and
the pictures."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..config import MODES, load_config, with_overrides
from .runner import LOCAL_BASELINE, QUICK, mode_overrides, run_modes, slug, split_mode
from .summaries import jsonable, machine, settings_yaml, stage_profile, summarize, to_markdown
from .workloads import WORKLOADS, pct


DESCRIPTION = "The same workload in every mode, side by side, in one invocation (docs/bench.md)."


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="oppo bench", description=DESCRIPTION)
    p.add_argument("--quick", action="store_true", help="A small budget: under 10 minutes on 2 CPU cores.")
    p.add_argument("--out", default="benchmarks/latest", help="Output directory (bench.json, bench.md, PNGs).")
    p.add_argument("--modes", default=",".join(MODES), help="Comma-separated modes.")
    p.add_argument("--steps", type=int, default=None, help="Steps per mode, the first untimed (default 21; --quick 11).")
    p.add_argument("--tail", default=None,
                   help="Comma-separated log-normal sigmas for the synthetic-length sweep (e.g. 0.25,0.75,1.25).")
    p.add_argument("--tail-steps", type=int, default=4, help="Steps per mode at each sigma of the sweep.")
    p.add_argument("--tail-modes", default=",".join(MODES), help="Modes compared in the tail sweep.")
    p.add_argument("--workload", default="representative", choices=sorted(WORKLOADS) + ["natural"],
                   help="The main run's response lengths: representative (the default) = long-tailed, "
                        "like real RLHF (sets generation.max_new_tokens to its maximum, or to what fits "
                        "the models' positions after the longest prompt, unless given); natural = the task's own (the tiny models' short responses, training-bound).")
    p.add_argument("--target", type=float, default=None, help="Target reward for time-to-target.")
    p.add_argument("--config", default=None, help="YAML settings shared by every mode.")
    p.add_argument("overrides", nargs="*", help="section.key=value settings shared by every mode.")
    args = p.parse_args(argv)
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if args.quick and args.tail is None:
        args.tail = "0.5,1.0,1.5"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        split_mode(m)  # an unknown mode fails here, before anything loads
    workload = WORKLOADS.get(args.workload)  # None: natural
    shared = (QUICK if args.quick else []) + list(args.overrides) + ["log.progress=false", "run.samples=0"]
    natural = load_config(args.config, shared)  # the task's own lengths: the second profile row, the tail sweep
    preset = []
    if workload and natural.generation.max_new_tokens is None:  # (one given is the user's: the run checks it)
        room = new_token_room(natural)
        if room is not None and 1 <= room < workload.max_new_tokens:
            say(f"oppo bench: --workload {args.workload} clips its lengths at generation.max_new_tokens={room}, "
                f"not {workload.max_new_tokens}: the models' positions less the longest prompt")
            workload = workload.scaled(room)
        preset = [f"generation.max_new_tokens={workload.max_new_tokens}"]
    base = load_config(args.config, preset + shared)
    for m in modes:  # each mode's own settings are valid, before anything loads
        with_overrides(base, mode_overrides(m))
    if base.placement.name == "ray" and LOCAL_BASELINE not in modes and "sequential" in modes:
        modes.append(LOCAL_BASELINE)
    if workload:
        if base.generation.max_new_tokens is None:  # (an override cleared the preset)
            raise ValueError(f"--workload {args.workload} scales its lengths to generation.max_new_tokens: give it "
                             "a number, not an empty value (or use --workload natural)")
        if base.generation.max_new_tokens != workload.max_new_tokens:  # (given by the user)
            workload = workload.scaled(base.generation.max_new_tokens)
    steps = args.steps or (11 if args.quick else 21)  # the first step is a warm-up, not timed
    base = with_overrides(base, [f"run.steps={steps}"])  # the controller plans its trials against the run's length
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    say(f"oppo bench: {', '.join(modes)} x {steps} steps, interleaved -> {out}")
    records = run_modes(base, modes, steps, out / "runs", progress=say, lengths=workload)
    result = summarize(records, target=args.target)
    label = f"built-in task '{base.data.task}'" if base.uses_builtin_task else "user models"
    if workload:
        label += f", {workload.name} lengths"
        result["workload_lengths"] = {"name": workload.name, "description": workload.description,
                                      **workload.stats(base.run.seed)}
    result.update(machine=machine(), command="oppo bench " + " ".join(argv), steps=steps, workload=label,
                  settings=settings_yaml(base), stage_profile=[stage_profile(records, label)])
    if workload is not None:  # the second row: the task's own lengths, sequential only, a few steps
        say("stage profile, second row: the task's own response lengths (sequential)")
        rec = run_modes(natural, ["sequential"], min(steps, 5), out / "natural", progress=say)
        own = (f"built-in task '{base.data.task}'" if base.uses_builtin_task else "user models") + ", its own lengths"
        result["stage_profile"].append(stage_profile(rec, own))
    if args.tail:
        tail_modes = [m.strip() for m in args.tail_modes.split(",")]
        sweep = []
        for sigma in (float(s) for s in args.tail.split(",")):
            say(f"tail sweep: sigma={sigma}")
            rec = run_modes(natural, tail_modes, args.tail_steps, out / "tail" / f"sigma_{sigma}", sigma,
                            progress=say)
            s = summarize(rec)
            sampler = rec[tail_modes[0]]["sampler"]
            sampler_lens = [sampler(i) for i in range(2000)]  # the distribution the runs drew from
            sweep.append({"sigma": sigma, "speedup": s["speedup"], "length_p50": pct(sampler_lens, 0.5),
                          "length_p99": pct(sampler_lens, 0.99),
                          "step_time_median_s": {m: v["step_time_median_s"] for m, v in s["modes"].items()}})
        result["tail_sweep"], result["tail_modes"] = sweep, tail_modes
    result["seconds"] = time.time() - started
    (out / "bench.json").write_text(json.dumps(jsonable(result), indent=1))
    (out / "bench.md").write_text(to_markdown(result))
    from ..report import make_report

    make_report([out / "runs" / slug(m) for m in modes], out, labels=modes)
    say((out / "bench.md").read_text())
    return 0


def new_token_room(cfg) -> int | None:
    """The most new tokens that fit after the run's longest prompt in every model it reads
    (the models' positions, ``models.context_length``, less the longest prompt as the run
    tokenises and cuts it): what a forced-length workload may reach without the prompt-length
    check refusing the run (``models.context_problem``, the same sources). None when no model
    names its positions. Resolves the paths as the run does (the built-in task is prepared here
    if it is not yet) and reads configs, the tokenizer and the prompts, no weights."""
    from ..data import build_prompt_set, read_records
    from ..marker import is_marker
    from ..models import context_length, load_model_config, load_tokenizer
    from ..setup.build import prepared_task
    from ..setup.resolve import resolve_paths

    paths = resolve_paths(cfg, prepared_task(cfg))
    limits = []
    for role, path in (("policy", paths.policy), ("reference", paths.reference), ("critic", paths.critic),
                       ("reward", paths.reward)):
        if path is None or is_marker(path):
            continue
        found = context_length(load_model_config(path, role, trust_remote_code=cfg.policy.trust_remote_code))
        if found:
            limits.append(found[0])
    if not limits:
        return None
    d = cfg.data
    prompts = build_prompt_set(read_records(paths.prompts, d.field, d.split).texts, load_tokenizer(paths.policy), d,
                               cfg.run.seed)
    return min(limits) - max(len(ids) for ids in prompts.ids)
