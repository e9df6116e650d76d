"""One command for the GPU bench: sequential, intra, inter and oppo side by side, in bf16.

    python benchmarks/gpu_bench.py --out benchmarks/gpu

On a bare GPU machine (PyTorch and Transformers installed, no internet) it builds a ~340M
Llama-style policy and a ~100M reward model (also the critic) from config with random weights,
a synthetic word-level tokenizer and prompt set, and runs every mode on the representative
workload (``oppo.bench.WORKLOADS["representative"]``: long-tailed forced response lengths,
p99/p50 ~ 5.7, up to 512 tokens, so the step is generation-bound as in real RLHF whatever the
random weights would sample). Steps stop before the time budget (default 20 minutes, model
building included). It writes ``bench.json``, ``bench.md`` (with the stage profile: the headline
row, then a short-response row where training weighs more; on CUDA each mode's peak GPU memory)
and the report pictures, and names the device.

On CUDA the modes run one at a time (``--schedule``; ``oppo.bench.run_modes(one_at_a_time=True)``):
each mode's trainer is built, stepped, closed and freed before the next, so one mode's models are
resident at a time and the 1B policy fits one 80 GB GPU with the default micro-batch (five
resident trainers did not: issue 26). The price: machine noise is not shared across modes as
interleaved steps share it; a dedicated GPU is quiet enough for that, and rebuilding the trainers
for every round of interleaving would cost a model load per mode and step. On CPU the modes stay
interleaved (tiny models: all fit).

Random weights make rewards meaningless: read step times, busy fractions and the stage profile,
not reward curves. ``--engine``: ``trainer`` (``generation.backend`` as configured: auto, i.e. the
static backend with CUDA graphs on CUDA, eager on CPU), ``eager`` or ``static``.

``--check`` runs a few steps (``--steps``, default 3) of every mode with the eager and the static
engine, each combination in a child process of its own (freed memory, and a device-side assert,
which leaves a process's CUDA context unusable, cannot hide the combinations after it), and fails
on any exception or non-finite number: a step metric (losses, gradient norms, rewards, KL, ...:
checked before the timing-only filter) or a weight of the actor, the critic or the rollout
engine's copy. It prints and writes (``check.md``, ``check.json``) what passed and what failed,
naming engine, mode, step and metric, and exits 1 if anything failed.

``--device cpu --tiny`` is the smoke mode (0.2M models, B = 8, lengths up to 64, two steps per
mode, one torch thread): every file the GPU run writes, in about a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

from oppo.bench import (WORKLOADS, LengthWorkload, jsonable, machine, run_modes, settings_yaml, slug, stage_profile,
                        summarize, to_markdown, write_synthetic_models)
from oppo.config import MODES, load_config

ENGINES = {"trainer": [], "eager": ["generation.backend=eager"], "static": ["generation.backend=static"]}
"""--engine: the settings each choice adds (trainer: generation.backend as configured, auto by default)."""
CHECK_ENGINES = ("eager", "static")

# The second row: the same models, short responses (a tiny-model/CPU-like profile, training heavier).
SHORT = LengthWorkload("short", sigma=0.25, median=16, max_new_tokens=32,
                       description="short responses: log-normal lengths, median 16, sigma 0.25, at most 32 tokens")


def trainer_settings(paths: dict[str, Path], device: str, B: int, workload, tiny: bool) -> list[str]:
    """The trainer's settings of a GPU bench run (also ``gpu_profile.py``'s): the synthetic models of
    ``paths`` (``write_synthetic_models``), B sequences a step in two minibatches, the workload's
    longest response; tiny: the smoke sizes, one torch thread."""
    mb = max(1, B // 4) if tiny else min(16, B // 2)  # a divisor of the minibatch (B / 2)
    return [
        f"policy.path={paths['policy']}", f"reward.path={paths['reward']}", f"data.prompts={paths['prompts']}",
        f"policy.device={device}", "policy.dtype=auto", f"ppo.batch_size={B}", f"ppo.minibatch_size={B // 2}",
        f"ppo.micro_batch_size={mb}", f"generation.max_new_tokens={workload.max_new_tokens}",
        f"data.max_prompt_tokens={32 if tiny else 128}", "log.progress=false", "run.samples=0",
    ] + (["placement.threads=1"] if tiny else [])


def parse(argv):
    p = argparse.ArgumentParser(prog="gpu_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/gpu", help="Output directory (bench.json, bench.md, PNGs).")
    p.add_argument("--models", default=None,
                   help="Where the synthetic models are written, or reused if they match (default OUT/models).")
    p.add_argument("--device", default="cuda", help="cuda (the bench) or cpu (with --tiny: the smoke test).")
    p.add_argument("--tiny", action="store_true", help="Smoke sizes: tiny models, B = 8, lengths up to 64, 2 steps.")
    p.add_argument("--policy-size", default=None, help="Policy size (oppo.bench.MODEL_SIZES; default 350m).")
    p.add_argument("--reward-size", default=None, help="Reward/critic size (default 125m).")
    p.add_argument("--batch", type=int, default=None, help="B, sequences per PPO step (default 64).")
    p.add_argument("--steps", type=int, default=None,
                   help="Most steps per mode, the first untimed (default 8; --check: 3).")
    p.add_argument("--budget-min", type=float, default=20.0, help="Stop stepping before this many minutes in all.")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--workload", default="representative", choices=sorted(WORKLOADS))
    p.add_argument("--engine", default="trainer", choices=tuple(ENGINES),
                   help="trainer: the trainer's own choice (generation.backend=auto: static with CUDA graphs on "
                        "CUDA, eager on CPU); eager: the eager backend; static: StaticBackend (CUDA "
                        "graphs on CUDA, uncaptured on CPU).")
    p.add_argument("--schedule", default="auto", choices=("auto", "interleaved", "one-at-a-time"),
                   help="interleaved: every mode's trainer resident, steps interleaved; one-at-a-time: one mode's "
                        "models resident at a time (built, stepped, freed); auto: one at a time on CUDA.")
    p.add_argument("--check", action="store_true",
                   help="Run --steps (default 3) steps of every mode with the eager and the static backend, each in "
                        "a child process, and exit 1 naming engine, mode, step and metric if any failed or any "
                        "number was not finite.")
    p.add_argument("--check-engines", default=",".join(CHECK_ENGINES),
                   help="--check: the engines to check, comma-separated (default: %(default)s).")
    p.add_argument("--check-one", default=None, metavar="ENGINE:MODE", help=argparse.SUPPRESS)
    p.add_argument("--no-short-row", action="store_true", help="Skip the short-response stage-profile row.")
    p.add_argument("overrides", nargs="*", help="section.key=value settings shared by every mode.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    started = time.time()
    deadline = started + args.budget_min * 60
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    check_engines = tuple(e.strip() for e in args.check_engines.split(",") if e.strip())
    if args.check and not set(check_engines) <= set(ENGINES):
        raise SystemExit(f"gpu_bench: --check-engines {args.check_engines!r}: choose from {', '.join(ENGINES)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu_bench: no CUDA device; use --device cpu --tiny for the CPU smoke run.")
    tiny = args.tiny
    policy_size = args.policy_size or ("tiny" if tiny else "350m")
    reward_size = args.reward_size or ("tiny" if tiny else "125m")
    B = args.batch or (8 if tiny else 64)
    steps = args.steps or (3 if args.check or args.check_one else 2 if tiny else 8)
    workload = WORKLOADS[args.workload]
    if tiny:
        workload = workload.scaled(64)
    short = SHORT.scaled(16) if tiny else SHORT
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    on_cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if on_cuda else torch.float32

    say(f"gpu_bench: building {policy_size} policy + {reward_size} reward model from config on {args.device}")
    paths = write_synthetic_models(Path(args.models) if args.models else out / "models", policy_size, reward_size,
                                   args.device if on_cuda else "cpu", dtype,
                                   prompt_words=(4, 24) if tiny else (16, 96))
    built = time.time() - started
    settings = trainer_settings(paths, args.device, B, workload, tiny) + list(args.overrides)
    if args.check_one:
        return check_one(args.check_one, settings, steps, workload, out, say)
    if args.check:
        return check_all(argv, modes, out, paths["policy"].parent, say, engines=check_engines)
    settings += ENGINES[args.engine]
    base = load_config(None, settings)
    one_at_a_time = args.schedule == "one-at-a-time" or (args.schedule == "auto" and on_cuda)
    schedule = "one mode at a time" if one_at_a_time else "interleaved"
    # the short row gets about a tenth of what is left; the headline run the rest
    reserve = 0.0 if args.no_short_row else 0.1 * (deadline - time.time())
    say(f"gpu_bench: {', '.join(modes)} x up to {steps} steps, {schedule}, workload {workload.name} -> {out}")
    records = run_modes(base, modes, steps, out / "runs", progress=say, lengths=workload,
                        deadline=deadline - reserve, one_at_a_time=one_at_a_time)
    result = summarize(records)
    label = f"{workload.name} lengths ({policy_size} policy, B={B})"
    ran = next(iter(records.values())).get("backend") or args.engine
    result.update(
        machine=machine(), command="python benchmarks/gpu_bench.py " + " ".join(argv),
        steps=len(next(iter(records.values()))["metrics"]), schedule=schedule,
        workload=f"synthetic {policy_size} policy and {reward_size} reward/critic (random weights, built from "
                 f"config), {dtype} on {args.device}, B={B}, engine={args.engine}: {ran}, {workload.name} lengths",
        settings=settings_yaml(base), stage_profile=[stage_profile(records, label)],
        workload_lengths={"name": workload.name, "description": workload.description, **workload.stats(base.run.seed)},
        model_build_s=built)
    if not args.no_short_row:
        say(f"gpu_bench: stage profile of short responses ({short.name}), sequential")
        short_cfg = load_config(None, settings + [f"generation.max_new_tokens={short.max_new_tokens}"])
        rec = run_modes(short_cfg, ["sequential"], 2 if tiny else 3, out / "short", progress=say, lengths=short,
                        one_at_a_time=one_at_a_time)
        result["stage_profile"].append(stage_profile(rec, f"{short.name} lengths (same models)"))
    result["seconds"] = time.time() - started
    (out / "bench.json").write_text(json.dumps(jsonable(result), indent=1))
    (out / "bench.md").write_text(to_markdown(result).replace("# oppo bench", "# oppo GPU bench", 1))
    from oppo.report import make_report

    make_report([out / "runs" / slug(m) for m in modes], out, labels=modes)
    say((out / "bench.md").read_text())
    return 0


class NonFinite(RuntimeError):
    """A step's metric or a weight that is not a finite number (``--check``)."""


def non_finite(metrics: dict) -> list[str]:
    """The names of ``metrics`` whose value is a number that is not finite."""
    return [k for k, v in metrics.items() if isinstance(v, (int, float)) and not math.isfinite(v)]


def non_finite_weights(trainer) -> list[str]:
    """``model.parameter`` names holding a non-finite element: the trained actor and critic and
    the rollout backend's copy of the policy (one device sync per model)."""
    models = {**trainer.models(), "rollout_policy": trainer.roles.rollout_policy}
    bad = []
    for name, model in models.items():
        params = list(model.named_parameters())
        if params and not bool(torch.stack([torch.isfinite(p).all() for _, p in params]).all()):
            bad += [f"{name}.{n}" for n, p in params if not bool(torch.isfinite(p).all())]
    return bad


def check_one(spec: str, settings: list[str], steps: int, workload, out: Path, say) -> int:
    """``--check-one ENGINE:MODE`` (a child of ``--check``): ``steps`` steps of one mode with one
    engine; every step's metrics and the weights must be finite. Writes ``check.json`` under
    ``out`` whatever happens; returns 0 if the combination passed."""
    engine, mode = spec.split(":", 1)
    result = {"engine": engine, "mode": mode, "steps": 0, "ok": False, "error": None, "ran": None}

    def guard(mode_: str, step: int, metrics: dict, trainer) -> None:
        result["ran"] = trainer.roles.backend
        bad = non_finite(metrics)
        if bad:
            raise NonFinite(f"step {step}: non-finite " + ", ".join(f"{k}={metrics[k]}" for k in bad[:8])
                            + (f" and {len(bad) - 8} more" if len(bad) > 8 else ""))
        weights = non_finite_weights(trainer)
        if weights:
            raise NonFinite(f"step {step}: non-finite weights in {', '.join(weights[:8])}"
                            + (f" and {len(weights) - 8} more" if len(weights) > 8 else ""))
        result["steps"] = step + 1

    try:
        cfg = load_config(None, settings + ENGINES[engine])
        run_modes(cfg, [mode], steps, out / "runs", progress=say, lengths=workload, one_at_a_time=True,
                  on_step=guard)
        result["ok"] = True
    except BaseException as e:  # reported, whatever it is (the learner's NonFiniteError, a CUDA error, ...)
        cause = e.__cause__ or e.__context__
        result["error"] = f"{type(e).__name__}: {e}" + (f" (from {type(cause).__name__}: {cause})" if cause else "")
        if not isinstance(e, Exception):
            raise
    finally:
        out.mkdir(parents=True, exist_ok=True)
        (out / "check.json").write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


def check_all(argv: list[str], modes: list[str], out: Path, models: Path, say, run=subprocess.run,
              engines: tuple[str, ...] = CHECK_ENGINES) -> int:
    """``--check``: every mode with each of ``engines`` (:data:`CHECK_ENGINES` by default), one child
    process each (``run``: how a child runs, ``subprocess.run``), on the synthetic models in
    ``models``; a table of what passed; 1 if anything failed."""
    parent = [a for i, a in enumerate(argv) if a not in ("--check", "--check-engines")
              and not a.startswith("--check-engines=") and (i == 0 or argv[i - 1] != "--check-engines")]
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # (the models were built here) the children get the GPU's memory
    rows = []
    for engine in engines:
        for mode in modes:
            where = out / "check" / f"{engine}-{slug(mode)}"
            (where / "check.json").unlink(missing_ok=True)
            say(f"gpu_bench --check: {engine} engine, {mode}")
            proc = run([sys.executable, str(Path(__file__).resolve()), *parent, "--check-one", f"{engine}:{mode}",
                        "--out", str(where), "--models", str(models)])
            try:
                row = json.loads((where / "check.json").read_text())
            except (OSError, ValueError):
                row = {"engine": engine, "mode": mode, "steps": 0, "ok": False, "ran": None,
                       "error": f"the child process exited with code {proc.returncode} and no result (its output "
                                f"is above)"}
            rows.append(row)
    failed = [r for r in rows if not r["ok"]]
    lines = ["# gpu_bench --check", "", f"Machine: {machine()}", "", f"Command: `python benchmarks/gpu_bench.py "
             f"{' '.join(argv)}`", "", "| engine | mode | result | steps | engine that ran | error |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        error = (r["error"] or "").replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['engine']} | {r['mode']} | {'pass' if r['ok'] else 'FAIL'} | {r['steps']} "
                     f"| {r['ran'] or '-'} | {error[:500]} |")
    lines += ["", f"{len(rows) - len(failed)} of {len(rows)} passed." if not failed else
              f"FAILED: {len(failed)} of {len(rows)}: " + "; ".join(f"{r['engine']} / {r['mode']}" for r in failed), ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "check.md").write_text("\n".join(lines))
    (out / "check.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
