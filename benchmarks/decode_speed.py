"""Decode speed per token: the eager rollout backend vs the static one (vs captured, on GPU),
against the bandwidth bound.

    python benchmarks/decode_speed.py --device cpu --size small --threads 1 --out benchmarks/decode/cpu
    python benchmarks/decode_speed.py --device cuda --size 350m --out benchmarks/decode/cuda

A Llama-style model of a named size (``oppo.bench.MODEL_SIZES``, random weights, built from
config) decodes B rows of ``--prompt-len`` random prompt tokens for ``--new-tokens`` greedy
steps (no EOS: every row runs to the end), for each B in ``--batches``. The time of one engine
step (sample one token per row, feed it, compute the next logits; prefill excluded) is the
median over ``--repeats`` timed passes after an untimed one (which also captures the graphs);
passes alternate between engines.

The bound: a decode step must read every weight once (the input embedding only for the B rows
it looks up) and each row's KV cache so far (its mean length over the run), so
``bound = (weight bytes + KV bytes) / bandwidth``. On CPU the bandwidth is measured: a
``--copy-mb`` memcpy with the same thread count, (bytes read + bytes written) / time. On CUDA
a device-to-device copy is measured the same way and the nominal HBM figure of known parts is
shown beside it. At large B a step becomes compute-bound and the bandwidth bound is no longer
the one that binds.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from oppo.bench import machine, synthetic_config
from oppo.rollout.static import StaticBackend
from oppo.rollout.eager.backend import Rollout, EagerBackend

NOMINAL_HBM = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.04e12,
               "A100 80GB PCIe": 1.94e12, "A100": 1.55e12, "L40S": 0.864e12, "A10G": 0.6e12}


def nominal_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, bw in NOMINAL_HBM.items():  # most specific first
        if key in name:
            return bw
    return None


def measured_bandwidth(device: torch.device, mb: int, reps: int = 5) -> float:
    """(bytes read + bytes written) / time of the best of ``reps`` copies of ``mb`` MiB."""
    n = mb * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps + 1):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n * 4 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(model) -> int:
    """Bytes a decode step reads from the weights: everything but the input embedding table (of
    which it reads only the looked-up rows; negligible)."""
    emb = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)


def kv_bytes_per_token(model) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * next(model.parameters()).element_size()


def time_engines(engines: dict, prompts: list[list[int]], repeats: int, device: torch.device) -> dict[str, float]:
    """Median seconds per engine step for each engine over ``repeats`` timed passes, after one
    untimed pass each (which also captures the graphs). Passes alternate between engines, so a
    burst of load on a shared machine hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(repeats + 1):
        for name, eng in engines.items():
            eng.admit([Rollout(i, i, "", list(p), 0) for i, p in enumerate(prompts)])
            _sync(device)
            t = time.perf_counter()
            steps = 0
            while eng.active:
                eng.step()
                steps += 1
            _sync(device)
            if rep:
                times[name].append((time.perf_counter() - t) / steps)
            eng.finished = []
    return {name: statistics.median(ts) for name, ts in times.items()}


def run(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "bf16": torch.bfloat16,
             "fp32": torch.float32}[args.dtype]
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(synthetic_config(args.size)).to(dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    batches = [int(b) for b in args.batches.split(",")]
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    captures = ["none"] + (["cuda_graph"] if device.type == "cuda" else []) + (["compile"] if args.compile else [])
    # one instance per engine, reused across passes and batch sizes (the static slots reserved once)
    engines = {"eager": EagerBackend(model, -1, 0, args.new_tokens, greedy=True)}
    static = {c: StaticBackend(model, -1, 0, args.new_tokens, greedy=True, max_rows=max(batches),
                                     max_len=args.prompt_len + args.new_tokens, capture=c) for c in captures}
    engines.update({f"static/{c}": e for c, e in static.items()})
    load_start = os.getloadavg()[0]
    bw = measured_bandwidth(device, args.copy_mb)
    nominal = nominal_bandwidth(device)
    wbytes, kvtok = weight_bytes(model), kv_bytes_per_token(model)
    mean_len = args.prompt_len + (args.new_tokens - 1) / 2  # the KV a step reads, per row, on average
    rows = []
    for B in batches:
        prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(B)]
        row = {"batch": B}
        for name, sec in time_engines(engines, prompts, args.repeats, device).items():
            row[f"{name}_ms_per_step"] = sec * 1e3
            row[f"{name}_us_per_token"] = sec * 1e6 / B
            row[f"{name}_tokens_per_s"] = B / sec
            print(f"B={B:3d} {name:18s} {sec * 1e3:8.2f} ms/step  {B / sec:9.0f} tok/s", file=sys.stderr, flush=True)
        step_bytes = wbytes + B * mean_len * kvtok
        row["bytes_per_step"] = step_bytes
        row["bound_ms_per_step"] = step_bytes / bw * 1e3
        if nominal:
            row["nominal_bound_ms_per_step"] = step_bytes / nominal * 1e3
        rows.append(row)
    load = f"load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    return {"machine": machine() + (f"; {args.threads} torch thread(s)" if device.type == "cpu" else "")
            + f"; {load}" + (f"; {args.note}" if args.note else ""),
            "command": "python benchmarks/decode_speed.py " + shlex.join(args.argv),
            "size": args.size, "params": params, "dtype": str(dtype), "device": str(device),
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
            "weight_bytes": wbytes, "kv_bytes_per_token": kvtok, "bandwidth_measured_Bps": bw,
            "bandwidth_nominal_Bps": nominal, "engines": list(engines), "rows": rows,
            "captures": {c: e.captures for c, e in static.items()}}


def to_markdown(r: dict) -> str:
    names = r["engines"]
    gb = r["bandwidth_measured_Bps"] / 1e9
    lines = ["# Decode speed: eager vs static backend", "", f"Machine: {r['machine']}", "",
             f"Command: `{r['command']}`", "",
             f"Model: synthetic Llama `{r['size']}` ({r['params'] / 1e6:.1f}M parameters, {r['dtype']}, random "
             f"weights), prompts of {r['prompt_len']} tokens, {r['new_tokens']} greedy new tokens per row; the "
             f"median over {r['repeats']} timed passes after an untimed one. Weights read per step "
             f"{r['weight_bytes'] / 2**20:.1f} MiB; KV {r['kv_bytes_per_token'] / 1024:.1f} KiB per token.", "",
             f"Bound = (weights + each row's KV at its mean length) / bandwidth; bandwidth measured by a memcpy "
             f"(read + write): {gb:.1f} GB/s"
             + (f"; nominal HBM {r['bandwidth_nominal_Bps'] / 1e9:.0f} GB/s (the second bound)."
                if r.get("bandwidth_nominal_Bps") else "."), "",
             "Per decode step (ms; one token for each of B rows) and per token (us):", "",
             "| B | " + " | ".join(f"{n} ms/step" for n in names) + " | bound ms/step | "
             + " | ".join(f"{n} us/token" for n in names) + " | static vs eager | static / bound |",
             "|---|" + "---|" * (2 * len(names) + 3)]
    for row in r["rows"]:
        bound = f"{row['bound_ms_per_step']:.2f}"
        if "nominal_bound_ms_per_step" in row:
            bound += f" ({row['nominal_bound_ms_per_step']:.2f})"
        best_static = min(row[f"{n}_ms_per_step"] for n in names if n.startswith("static"))
        lines.append(f"| {row['batch']} | " + " | ".join(f"{row[f'{n}_ms_per_step']:.2f}" for n in names)
                     + f" | {bound} | " + " | ".join(f"{row[f'{n}_us_per_token']:.0f}" for n in names)
                     + f" | {row['eager_ms_per_step'] / best_static:.2f}x | {best_static / row['bound_ms_per_step']:.1f}x |")
    lines += ["", "static vs eager: the eager backend's step time over the best static backend's (higher is better). "
              "static / bound: how far the best static step is above the bandwidth bound (1.0x is the bound).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="decode_speed.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", default=None, help="Model size (oppo.bench.MODEL_SIZES; default: small on CPU, 350m on CUDA).")
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"), help="auto: bf16 on CUDA, fp32 on CPU.")
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=None, help="Default 64 on CPU, 256 on CUDA.")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="CPU: torch threads (the memcpy bandwidth uses the same).")
    p.add_argument("--compile", action="store_true", help="Also time capture='compile' (slow to compile on CPU).")
    p.add_argument("--copy-mb", type=int, default=512)
    p.add_argument("--note", default="", help="A note on the machine for the report (e.g. 'shared with other jobs').")
    p.add_argument("--out", default=None, help="Directory for decode_speed.json and decode_speed.md "
                                               "(default benchmarks/decode/<device type>).")
    args = p.parse_args(argv)
    args.argv = argv
    cuda = args.device.startswith("cuda")
    args.size = args.size or ("350m" if cuda else "small")
    args.new_tokens = args.new_tokens or (256 if cuda else 64)
    out = Path(args.out or f"benchmarks/decode/{torch.device(args.device).type}")
    out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    (out / "decode_speed.json").write_text(json.dumps(result, indent=1))
    (out / "decode_speed.md").write_text(to_markdown(result))
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
