"""``oppo plan``: fit stage costs from oppo's traces, check the planner against measured
speedups, and project the PPO step of a GPU cluster per mode (see ``oppo.plan``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from .costs import GPUS, Efficiency
from .project import paper_setting, parse_placement, project, scale_sweep, sensitivity, summarize
from . import summary

DEFAULT_SCALE = "8,16,32,64,128,256,512,1024"


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: give comma-separated numbers, not {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="oppo plan", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A discrete-event planner of the PPO step per mode and placement: fit stage costs from "
                    "`oppo bench` traces and check the measured speedups (--calibrate), and project a GPU "
                    "cluster from a roofline of a named GPU (spec-sheet figures times stated efficiencies).",
        epilog="Examples:\n"
               "  oppo plan                                   # the OPPO paper's setting on 8 H200s, printed\n"
               "  oppo plan --calibrate benchmarks/latest --check benchmarks/modes41 --out benchmarks/plan\n"
               "  oppo plan --gpu h100 --model-b 7 --gpus 8 --placement 7+1 --batch 112 --sigma 1.0\n"
               "  oppo plan --scale 8,64,256,1024 --sigma 0.5,1.0,1.5 --out runs/plan\n")
    c = p.add_argument_group("calibration and validation (CPU benches)")
    c.add_argument("--calibrate", action="append", default=[], metavar="BENCH_DIR",
                   help="An `oppo bench --tail ...` output: fit the stage costs from its tail/sigma_*/<mode>/ "
                        "traces and compare predicted with measured speedups (repeatable).")
    c.add_argument("--check", action="append", default=[], metavar="BENCH_DIR",
                   help="A built-in-task bench (its bench.json): predict it with the fitted costs and the "
                        "--builtin-lengths assumption (repeatable; needs --calibrate).")
    c.add_argument("--builtin-lengths", default="8,0.7", metavar="MEDIAN,SIGMA",
                   help="Assumed log-normal response lengths of the built-in task (default 8,0.7).")
    g = p.add_argument_group("projection (roofline of a named GPU)")
    g.add_argument("--gpu", default="h200", choices=sorted(GPUS), help="GPU (default h200, as in the paper).")
    g.add_argument("--model-b", type=float, default=7.0, help="Actor size in billions (Qwen2.5 shapes; default 7).")
    g.add_argument("--reward-b", type=float, default=7.0, help="Reward model size in billions (default 7).")
    g.add_argument("--gpus", type=int, default=8, help="GPUs in all (default 8).")
    g.add_argument("--placement", default="7+1",
                   help="ACTOR+SCORER GPUs (default 7+1: the reward model on its own GPU); one number = shared.")
    g.add_argument("--batch", type=int, default=112, help="B, sequences per PPO step (default 112).")
    g.add_argument("--sigma", default="0.5,1.0,1.5", help="Tail heaviness: log-normal sigmas (default 0.5,1.0,1.5).")
    g.add_argument("--max-new-tokens", type=int, default=1024, help="Response length cap (default 1024).")
    g.add_argument("--median", type=float, default=None, help="Median response length (default cap / 8).")
    g.add_argument("--prompt-tokens", type=int, default=256, help="Prompt length (default 256).")
    g.add_argument("--delta", type=int, default=8, help="Delta, extra sequences in flight (default 8).")
    g.add_argument("--max-lag", type=int, default=1, help="max_lag (default 1).")
    g.add_argument("--chunk", type=int, default=256, help="Streaming chunk size in tokens (default 256).")
    g.add_argument("--epochs", type=int, default=1, help="PPO epochs per step (default 1).")
    g.add_argument("--minibatches", type=int, default=4, help="Minibatches (optimizer steps) per epoch (default 4).")
    g.add_argument("--decode-step-ms", type=float, default=20.0,
                   help="Fixed cost of one decode step besides reading the weights (default 20: eager PyTorch).")
    g.add_argument("--mfu", type=float, default=0.35, help="Training efficiency, fraction of peak (default 0.35).")
    g.add_argument("--scale", default="", metavar="GPUS",
                   help=f"Weak-scaling sweep over these GPU counts (e.g. {DEFAULT_SCALE}), 7+1 per node, "
                        "16 sequences per actor GPU, Delta = B/14.")
    g.add_argument("--sensitivity", action="store_true", help="Re-project with one assumption changed at a time.")
    g.add_argument("--steps", type=int, default=60,
                   help="Simulated steps per mode, the first 2 untimed (default 60; a sweep's large clusters run "
                        "fewer: about 60 x 112 / B, at least 12, as their steps hold many more sequences).")
    p.add_argument("--out", default=None, help="Write plan.json, plan.md and the pictures here.")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    started = time.time()
    out: dict = {"command": "oppo plan " + " ".join(argv)}
    md = ["# oppo plan", "", f"Command: `{out['command']}`", ""]
    comparisons = []
    if args.check and not args.calibrate:
        raise ValueError("--check needs --calibrate (the costs come from a tail sweep's traces)")
    if args.calibrate:
        from .calibrate import validation

        med, sig = _floats(args.builtin_lengths, "--builtin-lengths")
        say(f"oppo plan: fitting stage costs from {', '.join(args.calibrate)}")
        v = validation(args.calibrate, args.check, (med, sig))
        comparisons = v["comparisons"]
        out["calibration"] = {g: {**c.to_dict(), "fit": c.fit_stats} for g, c in v["costs"].items()}
        out["validation"] = [{**c.to_dict(), "held_out": getattr(c, "held_out", None),
                              "busy": getattr(c, "busy", None)} for c in comparisons]
        md += ["## Validation: planner vs measured speedups (CPU)", "",
               f"Stage costs fitted on {v['runs']} measured runs (every tail-sweep mode and sigma; first step "
               "left out). Speedup = sequential's median step time / the mode's, as `oppo bench` reports it; "
               "the last columns use the mean of the timed steps instead (the run's wall-clock per step; the "
               "built-in benches' bench.json keeps medians only).", "",
               summary.validation_markdown(comparisons), "", summary.step_time_markdown(comparisons), ""]
    actor, scorer = parse_placement(args.placement, args.gpus)
    eff = replace(Efficiency(), decode_step_s=args.decode_step_ms / 1e3, train_mfu=args.mfu)
    base = dict(gpu=args.gpu, actor_b=args.model_b, reward_b=args.reward_b, actor_gpus=actor, scorer_gpus=scorer,
                batch=args.batch, max_new_tokens=args.max_new_tokens, median=args.median,
                prompt_tokens=args.prompt_tokens, delta=args.delta, max_lag=args.max_lag, chunk=args.chunk,
                epochs=args.epochs, minibatches=args.minibatches, eff=eff)
    sigmas = _floats(args.sigma, "--sigma")
    out["projection"] = []
    md += ["## Projection", ""]
    for sigma in sigmas:
        st = paper_setting(sigma=sigma, **base)
        summ = summarize(project(st, steps=args.steps))
        out["projection"].append({"setting": st.label, "sigma": sigma, "modes": summ})
        md += [f"**{st.label}**", "", summary.projection_markdown(summ), ""]
    costs_desc = paper_setting(**base).costs.describe()
    md += [f"Costs: {costs_desc}.", ""]
    out["costs"] = costs_desc
    if args.sensitivity:
        s_mid = sigmas[len(sigmas) // 2]
        say(f"sensitivity at sigma {s_mid:g}")
        rows = sensitivity(base, s_mid, args.steps)
        out["sensitivity"] = {"sigma": s_mid, "rows": rows}
        md += [f"### One assumption changed at a time (sigma {s_mid:g})", "",
               "| variant | sequential step (s) | intra | inter | oppo | busy-time gain (oppo / sequential) |",
               "|---|---|---|---|---|---|"]
        md += [f"| {r['variant']} | {r['sequential_step_s']:.1f} | {r['intra_speedup']:.2f}x | "
               f"{r['inter_speedup']:.2f}x | {r['oppo_speedup']:.2f}x | {r['utilization_gain']:.2f}x |" for r in rows]
        md.append("")
    scale_rows, sigma_rows = [], []
    if args.scale:
        gpus_list = [int(x) for x in _floats(args.scale, "--scale")]
        say(f"weak scaling over {gpus_list} GPUs, sigmas {sigmas}")
        scale_kw = {k: v for k, v in base.items() if k not in ("actor_gpus", "scorer_gpus", "batch", "delta")}
        scale_rows = scale_sweep(args.gpu, gpus_list, sigmas, steps=args.steps, progress=say,
                                 node=(actor, scorer) if scorer else (actor, 0),
                                 per_gpu_batch=max(1, args.batch // actor), delta_frac=args.delta / args.batch,
                                 **{k: v for k, v in scale_kw.items() if k != "gpu"})
        out["scale"] = scale_rows
        md += ["## Weak scaling: projected speedup (intra / inter / oppo)", "",
               summary.scale_markdown(scale_rows), ""]
        grid = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75]
        tuned = {**base, "delta": max(1, args.batch // 4), "max_lag": 2}
        for s in grid:
            summ = summarize(project(paper_setting(sigma=s, **base), steps=args.steps))
            t = summarize(project(paper_setting(sigma=s, **tuned), ("sequential", "oppo"), steps=args.steps))
            sigma_rows.append({"sigma": s, **{f"{m}_speedup": v["speedup"] for m, v in summ.items()},
                               "oppo_tuned_speedup": t["oppo"]["speedup"],
                               "tuned_label": f"oppo, Delta {tuned['delta']}, max_lag 2"})
        out["sigma_sweep"] = sigma_rows
    out["seconds"] = time.time() - started
    text = "\n".join(md)
    print(text)
    if args.out:
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "plan.json").write_text(json.dumps(out, indent=1, default=_json_default))
        (d / "plan.md").write_text(text)
        if comparisons:
            summary.plot_validation(comparisons, d / "validation.png")
        if scale_rows:
            summary.plot_projection(scale_rows, sigma_rows, d / "projection.png",
                                   f"Projection (roofline, assumptions in plan.md): {args.model_b:g}B actor, "
                                   f"{args.reward_b:g}B reward model, {GPUS[args.gpu].name}")
        say(f"wrote {d}/plan.json, plan.md" + (", validation.png" if comparisons else "")
            + (", projection.png" if scale_rows else ""))
    return 0


def _json_default(x):
    if hasattr(x, "__dataclass_fields__"):
        return asdict(x)
    if hasattr(x, "item"):
        return x.item()
    return str(x)
