"""One command for the GPU bench: sequential, intra, inter and oppo side by side, in bf16.

    python benchmarks/gpu_bench.py --out benchmarks/gpu

On a bare GPU machine (PyTorch and Transformers installed, no internet) it builds a ~340M
Llama-style policy and a ~100M reward model (also the critic) from config with random weights,
a synthetic word-level tokenizer and prompt set, and runs every mode on the representative
workload (``oppo.bench.WORKLOADS["representative"]``: long-tailed forced response lengths,
p99/p50 ~ 5.7, up to 512 tokens, so the step is generation-bound as in real RLHF whatever the
random weights would sample). Steps are interleaved across modes and stop before the time
budget (default 20 minutes, model building included). It writes ``bench.json``, ``bench.md``
(with the stage profile: the headline row, then a short-response row where training weighs
more) and the report pictures, and names the device.

Random weights make rewards meaningless: read step times, busy fractions and the stage profile,
not reward curves. ``--engine static`` swaps in ``oppo.fastdecode.StaticRolloutEngine`` (CUDA
graphs on CUDA) for every mode; the default is the trainer's own engine.

``--device cpu --tiny`` is the smoke mode (0.2M models, B = 8, lengths up to 64, two steps per
mode, one torch thread): every file the GPU run writes, in about a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from oppo.bench import (WORKLOADS, LengthWorkload, _jsonable, _settings_yaml, machine, run_modes, stage_profile,
                        static_engine, summarize, to_markdown, write_synthetic_models)
from oppo.config import MODES, load_config

# The second row: the same models, short responses (a tiny-model/CPU-like profile, training heavier).
SHORT = LengthWorkload("short", sigma=0.25, median=16, max_new_tokens=32,
                       description="short responses: log-normal lengths, median 16, sigma 0.25, at most 32 tokens")


def parse(argv):
    p = argparse.ArgumentParser(prog="gpu_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/gpu", help="Output directory (bench.json, bench.md, PNGs).")
    p.add_argument("--device", default="cuda", help="cuda (the bench) or cpu (with --tiny: the smoke test).")
    p.add_argument("--tiny", action="store_true", help="Smoke sizes: tiny models, B = 8, lengths up to 64, 2 steps.")
    p.add_argument("--policy-size", default=None, help="Policy size (oppo.bench.MODEL_SIZES; default 350m).")
    p.add_argument("--reward-size", default=None, help="Reward/critic size (default 125m).")
    p.add_argument("--batch", type=int, default=None, help="B, sequences per PPO step (default 64).")
    p.add_argument("--steps", type=int, default=None, help="Most steps per mode, the first untimed (default 8).")
    p.add_argument("--budget-min", type=float, default=20.0, help="Stop stepping before this many minutes in all.")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--workload", default="representative", choices=sorted(WORKLOADS))
    p.add_argument("--engine", default="trainer", choices=("trainer", "static"),
                   help="trainer: the trainer's own rollout engine; static: StaticRolloutEngine "
                        "(CUDA graphs on CUDA, eager on CPU).")
    p.add_argument("--no-short-row", action="store_true", help="Skip the short-response stage-profile row.")
    p.add_argument("overrides", nargs="*", help="section.key=value settings shared by every mode.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    started = time.time()
    deadline = started + args.budget_min * 60
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu_bench: no CUDA device; use --device cpu --tiny for the CPU smoke run.")
    tiny = args.tiny
    policy_size = args.policy_size or ("tiny" if tiny else "350m")
    reward_size = args.reward_size or ("tiny" if tiny else "125m")
    B = args.batch or (8 if tiny else 64)
    steps = args.steps or (2 if tiny else 8)
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
    paths = write_synthetic_models(out / "models", policy_size, reward_size, args.device if on_cuda else "cpu",
                                   dtype, prompt_words=(4, 24) if tiny else (16, 96))
    built = time.time() - started
    mb = max(1, B // 4) if tiny else 16
    settings = [
        f"policy.path={paths['policy']}", f"reward.path={paths['reward']}", f"data.prompts={paths['prompts']}",
        f"policy.device={args.device}", "policy.dtype=auto", f"ppo.batch_size={B}", f"ppo.minibatch_size={B // 2}",
        f"ppo.micro_batch_size={mb}", f"generation.max_new_tokens={workload.max_new_tokens}",
        f"data.max_prompt_tokens={32 if tiny else 128}", "log.progress=false", "run.samples=0",
    ] + (["run.threads=1"] if tiny else []) + list(args.overrides)
    base = load_config(None, settings)
    make_engine = static_engine("cuda_graph" if on_cuda else "none") if args.engine == "static" else None
    # the short row gets about a tenth of what is left; the headline run the rest
    reserve = 0.0 if args.no_short_row else 0.1 * (deadline - time.time())
    say(f"gpu_bench: {', '.join(modes)} x up to {steps} steps, interleaved, workload {workload.name} -> {out}")
    records = run_modes(base, modes, steps, out / "runs", progress=say, lengths=workload, make_engine=make_engine,
                        deadline=deadline - reserve)
    result = summarize(records)
    label = f"{workload.name} lengths ({policy_size} policy, B={B})"
    result.update(
        machine=machine(), command="python benchmarks/gpu_bench.py " + " ".join(argv),
        steps=len(next(iter(records.values()))["metrics"]),
        workload=f"synthetic {policy_size} policy and {reward_size} reward/critic (random weights, built from "
                 f"config), {dtype} on {args.device}, B={B}, engine={args.engine}, {workload.name} lengths",
        settings=_settings_yaml(base), stage_profile=[stage_profile(records, label)],
        workload_lengths={"name": workload.name, "description": workload.description, **workload.stats(base.run.seed)},
        model_build_s=built)
    if not args.no_short_row:
        say(f"gpu_bench: stage profile of short responses ({short.name}), sequential")
        short_cfg = load_config(None, settings + [f"generation.max_new_tokens={short.max_new_tokens}"])
        rec = run_modes(short_cfg, ["sequential"], 2 if tiny else 3, out / "short", progress=say, lengths=short,
                        make_engine=make_engine)
        result["stage_profile"].append(stage_profile(rec, f"{short.name} lengths (same models)"))
    result["seconds"] = time.time() - started
    (out / "bench.json").write_text(json.dumps(_jsonable(result), indent=1))
    (out / "bench.md").write_text(to_markdown(result).replace("# oppo bench", "# oppo GPU bench", 1))
    from oppo.report import make_report

    make_report([out / "runs" / m for m in modes], out, labels=modes)
    say((out / "bench.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
