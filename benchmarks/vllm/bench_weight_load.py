"""Weight loads into a running vLLM engine: vLLM's RPC (every tensor pickled) against the shared
buffer (``oppo.rollout.vllm.weights``), on one engine, alternating, after a real change of weights.
Three ways: ``rpc`` (the path before issue 27: every tensor through ``collective_rpc`` into vLLM's
``reload_weights``), ``shared`` (the buffer, then ``LiveLoader``: ``model.load_weights`` and the
post-load processing of the layers loaded) and ``shared-reload`` (the buffer, then vLLM's
``reload_weights`` from its views: what the transport alone saves).

    .venv/bin/python benchmarks/vllm/bench_weight_load.py --model /tmp/smol/hf --updates 8 \\
        --out benchmarks/vllm/weight_load.json

Each update perturbs the policy's weights in place (outside the timing), then loads them with one
transport; the transports alternate (rpc, shared, rpc, ...) so that both see the same load from the
machine's other jobs (and the third way); ``--ways`` times some of them only. Reports the median per transport and the parts of a load (prepare: the
trainer's pairs and the served rewrite; write: the copies into the buffer; wall: from the first copy
to the last result, the worker's part pipelined with the copies (``WEIGHT_RUNS`` runs of layers);
the worker's own worker_s, of which load_s (vLLM's weight loaders) and process_s (its post-load
processing: the CPU's repacking); rpc: the whole RPC of the RPC path). ``--check``: after the last update of each transport, a short generation's log-probs
against the Hugging Face forward of the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True, help="a Hugging Face directory (e.g. SmolLM2-135M-Instruct)")
    ap.add_argument("--updates", type=int, default=8, help="timed updates per transport")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    ap.add_argument("--check", action="store_true", help="compare vLLM's log-probs with the HF forward")
    ap.add_argument("--ways", nargs="+", default=["rpc", "shared", "shared-reload"],
                    choices=["rpc", "shared", "shared-reload"], help="the loads to time, alternating")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from oppo.rollout.vllm.backend import VLLMRolloutBackend

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    load_before = os.getloadavg()
    eng = VLLMRolloutBackend(str(args.model), (model.config.eos_token_id or 0,), 0, 8, temperature=1.0, seed=0,
                             max_num_seqs=8, max_model_len=256)
    torch.set_num_threads(args.threads)
    print(f"engine up in {eng.startup_s:.1f} s; {n_params / 1e6:.1f}M parameters", flush=True)
    g = torch.Generator().manual_seed(0)
    ways = tuple(args.ways)
    times: dict[str, list[float]] = {w: [] for w in ways}
    parts: dict[str, list[dict]] = {w: [] for w in ways}
    paths: dict[str, str] = {}
    checks: dict[str, float] = {}
    version = 0
    for transport in ways:  # (one untimed load each: the first shared one maps the buffer)
        eng.weight_transport = "rpc" if transport == "rpc" else "auto"
        eng.llm.collective_rpc(use_live_loader, None, (transport != "shared-reload",))
        version += 1
        eng.load_weights(model, version)
    for k in range(args.updates):
        for transport in ways:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 1e-3)
            eng.weight_transport = "rpc" if transport == "rpc" else "auto"
            eng.llm.collective_rpc(use_live_loader, None, (transport != "shared-reload",))
            version += 1
            eng.load_weights(model, version)
            times[transport].append(eng.last_weight_sync_s)
            parts[transport].append(dict(eng.last_weight_sync_parts))
            paths[transport] = eng.weight_path
            print(f"update {k} {transport:6s} {eng.last_weight_sync_s:.3f} s  {eng.weight_path}  "
                  + " ".join(f"{a}={b:.3f}" for a, b in eng.last_weight_sync_parts.items() if a.endswith("_s")),
                  flush=True)
            if args.check and k == args.updates - 1:
                checks[transport] = logprob_gap(eng, model)
    load_after = os.getloadavg()
    eng.close()
    summary = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "loadavg_before": load_before, "loadavg_after": load_after},
        "model": str(args.model), "parameters": n_params,
        "bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "updates": args.updates,
        "median_s": {t: statistics.median(v) for t, v in times.items()},
        "each_s": times,
        "median_parts_s": {t: {a: statistics.median(float(p[a]) for p in ps) for a in ps[0] if a.endswith("_s")}
                           for t, ps in parts.items()},
        "path": paths,
        "max_abs_logprob_gap": checks,
    }
    print(json.dumps({k: summary[k] for k in ("median_s", "median_parts_s", "path", "max_abs_logprob_gap")},
                     indent=1))
    print(f"load average before {load_before}, after {load_after}")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))


def use_live_loader(worker, on: bool) -> None:
    """Runs in vLLM's worker: load the mapped buffer with oppo's LiveLoader (on) or vLLM's reload."""
    m = getattr(worker, "_oppo_mapped", None)
    if m is None:
        return
    if not hasattr(m, "live"):
        m.live = m.loader
    m.loader = m.live if on else None


def logprob_gap(eng, model) -> float:
    """The largest |log p_vLLM - log p_HF| over a short generation (4 prompts x 8 tokens)."""
    from oppo.rollout.eager.backend import Rollout

    start = 1000 * eng.weight_loads  # (new uids: new requests)
    rows = [Rollout(start + u, start + u, "", [1 + u, 2 + 3 * u, 100 + u, 7], 0) for u in range(4)]
    eng.eos_ids = ()
    eng.admit(rows)
    done = eng.generate_all()  # (the backend's records: it never fills those it is given)
    gap = 0.0
    for r in done:
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(r.prompt_ids) - 1:-1].float()
        ref = torch.log_softmax(logits, -1).gather(1, ids[0, len(r.prompt_ids):, None])[:, 0]
        assert len(r.logprobs) == len(ref) > 0, (r.uid, len(r.logprobs))
        gap = max(gap, float((torch.tensor(r.logprobs) - ref).abs().max()))
    return gap


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - t0:.0f} s")
