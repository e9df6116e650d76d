"""Training memory of full fine-tuning, LoRA and gradient checkpointing, measured.

    python benchmarks/memory.py --out benchmarks/memory            # CPU: peak resident memory
    python benchmarks/memory.py --device cuda --size 350m ...       # GPU: peak allocated memory

Each configuration runs in a fresh process (so that one's peak cannot hide another's): the
synthetic policy (``--size``, built from config with random weights, ``oppo.bench.MODEL_SIZES``)
and a reward model/critic of the same size (one vocabulary), ``--batch`` sequences whose responses are forced to ``--length``
tokens, one sequential PPO step (``--micro`` sequences per training forward). Reported per
configuration: memory after the models load, the peak during the step and its growth over the
loaded state (on CPU: resident set size, ``VmRSS`` and ``ru_maxrss``; on CUDA:
``torch.cuda.max_memory_allocated``), the step time, and the trained parameters. Writes
``memory.json`` and ``memory.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    "full": [],
    "full + gradient checkpointing": ["policy.gradient_checkpointing=true"],
    "LoRA r=8": ["lora.r=8"],
    "LoRA r=8 + gradient checkpointing": ["lora.r=8", "policy.gradient_checkpointing=true"],
}


def rss_mb() -> float:
    """This process's resident set size now (MiB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@contextlib.contextmanager
def saved_for_backward(model):
    """Within the block, the tensors autograd saves for backward are counted (distinct storages,
    ``model``'s parameters excluded); yields a dict storage -> bytes, complete after the block."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(x):
        ptr = x.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        yield seen


def saved_by_actor_forward(t, micro: int) -> float:
    """MiB of the tensors that one actor training forward of ``micro`` sequences of the last
    batch saves for its backward: the activation memory, which the resident set size blurs
    with freed memory the allocator keeps."""
    import torch

    from oppo.learner.batch import micro_slices
    from oppo.models import checkpointing

    learner = t.roles.learner
    mb = micro_slices(t.last_result.exp, torch.arange(micro), learner.layout_rule(), learner.micro)
    with saved_for_backward(learner.actor) as seen, checkpointing(learner.actor):
        logprobs, entropy = learner._actor_logprobs(mb)
    del logprobs, entropy
    return sum(seen.values()) / 2**20


def child(args) -> dict:
    import torch

    from oppo.bench import write_synthetic_models
    from oppo.config import load_config
    from oppo.trainer import Trainer

    paths = write_synthetic_models(Path(args.out) / "models", args.size, args.size, "cpu", torch.float32,
                                   prompt_words=(16, 32))
    cfg = load_config(None, [
        f"policy.path={paths['policy']}", f"reward.path={paths['reward']}", f"data.prompts={paths['prompts']}",
        f"policy.device={args.device}", "policy.dtype=auto", "overlap.mode=sequential",
        f"ppo.batch_size={args.batch}", f"ppo.minibatch_size={args.batch}", f"ppo.micro_batch_size={args.micro}",
        f"generation.max_new_tokens={args.length}", "data.max_prompt_tokens=48", "log.progress=false",
        "run.samples=0", f"run.out_dir={Path(args.out) / 'run'}", *json.loads(args.child)])
    cuda = args.device.startswith("cuda")
    t = Trainer.from_config(cfg, progress=False)
    t.length_sampler = lambda i, member: args.length
    loaded = torch.cuda.memory_allocated() / 2**20 if cuda else rss_mb()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    m = t.run_step()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    trained = sum(p.numel() for p in t.roles.policy.parameters() if p.requires_grad)
    saved = saved_by_actor_forward(t, args.micro)
    t.close()
    return {"loaded_mb": loaded, "peak_mb": peak, "growth_mb": peak - loaded, "step_s": dt,
            "saved_forward_mb": saved,
            "policy_trained_params": trained, "policy_params": sum(p.numel() for p in t.roles.policy.parameters()),
            "response_length": m["response_length/mean"]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/memory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--size", default="small", help="Policy size (oppo.bench.MODEL_SIZES); default ~32M parameters.")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro", type=int, default=8, help="Sequences per training forward.")
    p.add_argument("--length", type=int, default=256, help="Forced response length (tokens).")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print("RESULT " + json.dumps(child(args)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name, extra in CONFIGS.items():
        cmd = [sys.executable, __file__, "--out", str(out), "--device", args.device, "--size", args.size,
               "--batch", str(args.batch), "--micro", str(args.micro), "--length", str(args.length),
               "--child", json.dumps(extra)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            raise SystemExit(f"{name}: the child failed:\n{proc.stderr[-3000:]}")
        rows[name] = json.loads(line[len("RESULT "):])
        print(f"{name}: {rows[name]}", file=sys.stderr, flush=True)
    import shutil

    shutil.rmtree(out / "run", ignore_errors=True)
    shutil.rmtree(out / "models", ignore_errors=True)
    from oppo.bench import machine

    what = "peak allocated (CUDA)" if args.device.startswith("cuda") else "resident set size (CPU)"
    lines = ["# Training memory", "", f"Machine: {machine()}", "",
             f"Command: `python benchmarks/memory.py {' '.join(argv)}`", "",
             f"One sequential PPO step of a {args.size} policy, {args.batch} sequences of {args.length} forced "
             f"response tokens, {args.micro} per training forward; memory is the {what}, each configuration in "
             f"a fresh process.", "",
             "| configuration | trained policy params | after load (MiB) | step peak (MiB) | growth in the step (MiB) "
             "| saved by one actor forward (MiB) | step (s) |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['policy_trained_params'] / 1e6:.2f}M of {r['policy_params'] / 1e6:.1f}M "
                     f"| {r['loaded_mb']:.0f} | {r['peak_mb']:.0f} | {r['growth_mb']:.0f} | {r['saved_forward_mb']:.0f} "
                     f"| {r['step_s']:.1f} |")
    (out / "memory.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    (out / "memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
