"""Seconds per weight sync against model size: the object-store path against the collective,
bucketed path (``oppo/weights/sync.py``), on synthetic Llama-shaped states.

    PYTHONPATH=src python benchmarks/weight_sync/measure.py                       # CPU, gloo + object store
    PYTHONPATH=src python benchmarks/weight_sync/measure.py --device cuda         # NCCL (2 GPUs), no Ray

collective: two processes (``torch.multiprocessing``): a sender (learner rank 0's role) streams the
state in buckets of ``--bucket-mb`` to a receiver (a rollout worker's role) over a ``SyncGroup``;
the time is one sync as the receiver sees it (header, buckets, the copies into its tensors; on GPU
up to a stream synchronize), median of ``--repeats`` after one warm-up. The backend is NCCL when
the two processes have GPUs of their own (``--device cuda`` with 2 or more visible GPUs), else gloo
(with one GPU both processes share it, which NCCL refuses: the CUDA tensors are then staged
through CPU buckets over gloo, and the table says ``gloo``).

object_store: two Ray actors: the sender's ``weight_sync.pack`` (numpy views into the object store)
and the receiver's ``unpack_into``, as ``RayRolloutGroup.load_weights`` does with learner rank 0's
ref; timed from the controller, median of ``--repeats`` after one warm-up. CPU only (the
learner's GPU tensors would be copied to CPU first); skipped without Ray.

Prints a table and writes ``results-<device>.json`` beside this file (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

# name -> (hidden, layers, vocab): Llama-shaped (GQA with 4x fewer KV heads, SwiGLU MLP of 8/3
# hidden, untied embedding and output head, RMSNorm weights)
SIZES = {
    "10M": (128, 8, 32000),
    "50M": (512, 6, 32000),
    "125M": (768, 12, 32000),
    "250M": (1024, 18, 32000),
    "500M": (1024, 40, 32000),
    "1B": (2048, 18, 32000),
}


def llama_shapes(hidden: int, layers: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    inter, kv = (8 * hidden // 3 + 255) // 256 * 256, hidden // 4
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.k_proj.weight", (kv, hidden)),
                (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.o_proj.weight", (hidden, hidden)),
                (p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
                (p + "mlp.down_proj.weight", (hidden, inter)), (p + "input_layernorm.weight", (hidden,)),
                (p + "post_attention_layernorm.weight", (hidden,))]
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def params(size: str) -> int:
    return sum(torch.Size(s).numel() for _, s in llama_shapes(*SIZES[size]))


def build(size: str, dtype: torch.dtype, device: str, fill: float | None) -> torch.nn.Module:
    """A module holding the synthetic state (names with '.' -> '_': one flat module)."""
    m = torch.nn.Module()
    for name, shape in llama_shapes(*SIZES[size]):
        t = torch.empty(shape, dtype=dtype, device=device)
        if fill is not None:
            t.fill_(fill)
        m.register_parameter(name.replace(".", "_"), torch.nn.Parameter(t, requires_grad=False))
    return m


def _sync_now(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ====================================================================== collective (2 processes)

def _collective_member(rank: int, port: int, size: str, dtype_name: str, device: str, bucket_mb: float,
                       repeats: int, out_path: str) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from oppo.weights.sync import Manifest, SyncGroup, WeightReceiver, WeightSender, full_tensors

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    dtype = getattr(torch, dtype_name)
    if device.startswith("cuda"):
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False,
                          timeout=__import__("datetime").timedelta(seconds=600))
    group = SyncGroup("127.0.0.1", port, rank, 2, device, timeout_s=600, store=store)
    model = build(size, dtype, device, fill=1.0 if rank == 0 else 0.0)
    named = list(model.named_parameters())
    bucket = int(bucket_mb * 2**20)
    if rank == 0:
        manifest = Manifest.of(named)
        member = WeightSender.connect(group, manifest, bucket)
    else:
        member = WeightReceiver.connect(group, model)
    times = []
    for v in range(1 + repeats):
        _sync_now(device)
        t = time.perf_counter()
        if rank == 0:
            member.send(v, manifest, full_tensors(named))
        else:
            member.receive(v)
        _sync_now(device)
        times.append(time.perf_counter() - t)
    if rank == 1:
        first = next(model.parameters())
        assert first.float().min().item() == 1.0, "the receiver holds the sent weights"
        Path(out_path).write_text(json.dumps({"backend": group.backend, "times": times[1:],
                                              "bucket_mb": member.bucket_bytes / 2**20}))
    group.close()


def collective(size: str, dtype: str, device: str, bucket_mb: float, repeats: int) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = f"{d}/r.json"
        mp.spawn(_collective_member, args=(port, size, dtype, device, bucket_mb, repeats, out), nprocs=2, join=True)
        r = json.loads(Path(out).read_text())
    return {"path": "collective", "backend": r["backend"], "bucket_mb": r["bucket_mb"], "times_s": r["times"],
            "s_per_sync": statistics.median(r["times"])}


# ====================================================================== object store (Ray)

class _Side:
    def __init__(self, size: str, dtype_name: str, fill: float, threads: int):
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
        torch.set_num_threads(threads)
        self.model = build(size, getattr(torch, dtype_name), "cpu", fill)

    def pack(self):
        from oppo.weights.sync import pack

        return pack(self.model)

    def load(self, packed) -> float:
        from oppo.weights.sync import unpack_into

        unpack_into(self.model, packed)
        return next(self.model.parameters()).float().min().item()


def object_store(size: str, dtype: str, repeats: int) -> dict:
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}})
    side = ray.remote(num_cpus=0.5)(_Side)
    sender, receiver = side.remote(size, dtype, 1.0, 1), side.remote(size, dtype, 0.0, 1)
    times = []
    try:
        for _ in range(1 + repeats):
            t = time.perf_counter()
            got = ray.get(receiver.load.remote(sender.pack.remote()))
            times.append(time.perf_counter() - t)
        assert got == 1.0, "the receiver holds the sent weights"
    finally:
        ray.kill(sender)
        ray.kill(receiver)
    return {"path": "object_store", "backend": "ray", "times_s": times[1:], "s_per_sync": statistics.median(times[1:])}


# ====================================================================== main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--sizes", default="10M,50M,125M,250M,500M", help=f"of {', '.join(SIZES)}")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--paths", default="collective,object_store")
    ap.add_argument("--bucket-mb", type=float, default=0.0,
                    help="0: the sync's own default for the backend (256 MiB over NCCL, 4 MiB over gloo)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    bucket = a.bucket_mb
    paths = a.paths.split(",")
    if a.device == "cuda" and "object_store" in paths:
        paths.remove("object_store")  # (module docstring)
    if "object_store" in paths:
        try:
            import ray  # noqa: F401
        except ImportError:
            print("no Ray: the object-store path is skipped")
            paths.remove("object_store")
    machine = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
               "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
               if torch.cuda.is_available() else [], "load_avg": os.getloadavg()}
    rows = []
    print(f"machine: {machine}")
    print(f"{'size':>6} {'params':>8} {'dtype':>9} {'MiB':>7} {'path':>12} {'backend':>7} {'bucket':>6} {'s/sync':>8} "
          f"{'GB/s':>6}")
    for size in a.sizes.split(","):
        for dtype in a.dtypes.split(","):
            n = params(size)
            nbytes = n * getattr(torch, dtype).itemsize
            for path in paths:
                r = (collective(size, dtype, a.device, bucket, a.repeats) if path == "collective"
                     else object_store(size, dtype, a.repeats))
                r.update(size=size, params=n, dtype=dtype, bytes=nbytes, device=a.device)
                rows.append(r)
                bucket_col = f"{r['bucket_mb']:g}M" if "bucket_mb" in r else "-"
                print(f"{size:>6} {n / 1e6:>7.1f}M {dtype:>9} {nbytes / 2**20:>7.0f} {path:>12} {r['backend']:>7} "
                      f"{bucket_col:>6} {r['s_per_sync']:>8.3f} {nbytes / r['s_per_sync'] / 1e9:>6.2f}", flush=True)
    out = Path(a.out or Path(__file__).with_name(f"results-{a.device}.json"))
    out.write_text(json.dumps({"machine": machine, "args": vars(a), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
