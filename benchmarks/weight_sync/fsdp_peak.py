"""Peak memory of FSDP2 learner rank 0 during a weight sync: the collective path (one parameter
gathered at a time, streamed in buckets) against the object-store path's gather (the whole state
dict on rank 0, ``fsdp.full_model_state``, then ``weight_sync.pack_state``).

    PYTHONPATH=src python benchmarks/weight_sync/fsdp_peak.py --size 125M

Three processes (``torch.multiprocessing``, gloo, CPU): two learner ranks holding a synthetic
Llama-shaped model (``measure.py``'s) sharded with ``fully_shard`` (built on the meta device, so no
rank ever holds the whole model before the sync), and a receiver. Rank 0's peak resident set
(``ru_maxrss``) is read before any sync, after a collective sync, then after the object-store
path's gather and pack; a peak never falls, so the collective sync runs first.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from measure import SIZES, build, params  # noqa: E402


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _member(rank: int, ports: tuple[int, int], size: str, out: str) -> None:
    import datetime

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from oppo.learner.fsdp import full_model_state
    from oppo.weights.sync import Manifest, SyncGroup, WeightReceiver, WeightSender, full_tensors, \
        pack_state

    torch.set_num_threads(1)
    learn_port, sync_port = ports
    timeout = datetime.timedelta(seconds=600)
    if rank == 2:  # the receiver: hosts the sync group's store
        store = dist.TCPStore("127.0.0.1", sync_port, is_master=True, wait_for_workers=False, timeout=timeout)
        model = build(size, torch.float32, "cpu", fill=0.0)
        member = WeightReceiver.connect(SyncGroup("127.0.0.1", sync_port, 1, 2, "cpu", store=store), model)
        member.receive(1)
        assert next(model.parameters()).min().item() == 1.0
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{learn_port}", rank=rank, world_size=2,
                            timeout=timeout)
    model = build(size, torch.float32, "meta", fill=None)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(1.0)
    named = list(model.named_parameters())
    sender = None
    if rank == 0:
        group = SyncGroup("127.0.0.1", sync_port, 0, 2, "cpu")
        sender = WeightSender.connect(group, Manifest.of(named))
    dist.barrier()
    before = _peak_mib()
    if sender is not None:
        sender.send(1, Manifest.of(named), full_tensors(named))
    else:
        for gathered in full_tensors(named):  # the gathers rank 0 needs
            del gathered
    dist.barrier()
    collective = _peak_mib()
    state = full_model_state(model)  # the object-store path's rank-0 work, up to the object store
    packed = pack_state(state) if rank == 0 else None
    dist.barrier()
    gathered = _peak_mib()
    del state, packed
    if rank == 0:
        Path(out).write_text(json.dumps({"before": before, "after_collective": collective,
                                         "after_gather": gathered}))
    dist.destroy_process_group()


def main() -> None:
    import tempfile

    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="125M", choices=list(SIZES))
    a = ap.parse_args()
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_member, args=(tuple(ports), a.size, f"{d}/r.json"), nprocs=3, join=True)
        r = json.loads(Path(f"{d}/r.json").read_text())
    n = params(a.size)
    print(f"{a.size}: {n / 1e6:.1f}M params, fp32 {n * 4 / 2**20:.0f} MiB, sharded over 2 ranks "
          f"({n * 2 / 2**20:.0f} MiB each)")
    print(f"rank 0 peak RSS: before any sync {r['before']:.0f} MiB; after a collective sync "
          f"{r['after_collective']:.0f} MiB (+{r['after_collective'] - r['before']:.0f}); after the object-store "
          f"path's gather and pack {r['after_gather']:.0f} MiB (+{r['after_gather'] - r['after_collective']:.0f} more)")


if __name__ == "__main__":
    main()
