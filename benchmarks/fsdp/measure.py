"""FSDP2 vs data-parallel replicas on CPU (gloo): bytes of parameters, gradients and AdamW state per
rank, and the time of one PPO update, for 1, 2 and 4 ranks.

    PYTHONPATH=src python benchmarks/fsdp/measure.py [--hidden 256 --layers 4 --ranks 1 2 4]
        [--lora R] [--dtype bfloat16]

Each rank trains an actor (Llama, causal LM) and a critic (Llama, sequence classification) of the
given size with oppo's Learner on a synthetic PPO batch (the update of tests/test_fsdp.py); the
bytes are counted on the rank's local tensors (DTensor shards under FSDP2) after the update.
``--lora R``: the actor trains rank-R adapters over its frozen base (held in the compute dtype);
``--dtype bfloat16``: bf16 compute over fp32 masters (FSDP2: its MixedPrecisionPolicy).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]


def _rank(rank, world, port, mode, paths, out, reps, lora, dtype):
    import torch.distributed as dist

    from oppo.algo import get_algorithm
    from oppo.config import PPOConfig
    from oppo.models import load_tokenizer
    from oppo.learner.dp import dp_update
    from oppo.learner.fsdp import build_sharded, fsdp_update
    from oppo.learner.group import LearnerSpec, local_bytes
    from oppo.api.specs import ModelSpec
    from test_fsdp import _experience

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    pad = load_tokenizer(paths["policy"]).pad_token_id
    cfg = PPOConfig(batch_size=16, minibatch_size=8, micro_batch_size=2, epochs=1, actor_lr=1e-4, critic_lr=1e-4)
    algo = get_algorithm("ppo")
    dtype = getattr(torch, dtype)
    spec = LearnerSpec(actor=ModelSpec("policy", paths["policy"], dtype if lora else torch.float32, device="cpu"),
                       critic=ModelSpec("critic", paths["reward"], pad_id=pad, device="cpu"),
                       ppo=cfg, temperature=1.0, seed=0, algorithm=algo, compute_dtype=dtype,
                       lora=(lora, 2.0 * lora, 0.0, []) if lora else None)
    if mode == "fsdp2":
        learner, update = build_sharded(spec), fsdp_update
    else:
        learner, update = spec.build(), dp_update
        with torch.no_grad():
            for m in (learner.actor, learner.critic):
                for t in m.parameters():
                    dist.broadcast(t.data, 0)
    plain = spec.build()  # scores the synthetic batches (the same on every rank); not measured
    times = []
    for step in range(reps + 1):
        exp = _experience(plain.actor, plain.critic, pad, cfg, algo, seed=step)
        dist.barrier()
        t0 = time.perf_counter()
        update(learner, exp, step, rank, world)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    mem = local_bytes(learner)
    if rank == 0:
        Path(out).write_text(json.dumps({"mode": mode, "world": world, "bytes": mem,
                                         "update_s": sorted(times[1:])[len(times[1:]) // 2]}))
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    from conftest import make_models
    from transformers import LlamaForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank of the actor's adapters (0: none)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    paths = {k: str(v) for k, v in make_models(tmp, hidden=args.hidden, layers=args.layers).items()}
    n = sum(p.numel() for p in LlamaForCausalLM.from_pretrained(paths["policy"]).parameters())
    rows = []
    for world in args.ranks:
        for mode in ("replicate", "fsdp2"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            out = tmp / f"{mode}{world}.json"
            mp.spawn(_rank, args=(world, port, mode, paths, str(out), args.reps, args.lora, args.dtype),
                     nprocs=world, join=True)
            rows.append(json.loads(out.read_text()))
    print(f"actor parameters: {n:,}")
    print(f"{'mode':>10} {'ranks':>5} {'params MiB':>10} {'grads MiB':>9} {'adamw MiB':>9} {'total MiB':>9} "
          f"{'update s':>8}")
    for r in rows:
        b = r["bytes"]
        tot = sum(b.values())
        print(f"{r['mode']:>10} {r['world']:>5} {b['params'] / 2**20:10.2f} {b['grads'] / 2**20:9.2f} "
              f"{b['optim'] / 2**20:9.2f} {tot / 2**20:9.2f} {r['update_s']:8.2f}")


if __name__ == "__main__":
    main()
