"""A LoRA policy in vLLM: served as base + adapter (each update sends the adapter) against sent
merged (each update sends the whole model), on one machine, with the figures that decide between
them: the load per update, and the decode speed each engine then has.

    .venv/bin/python benchmarks/vllm/bench_lora.py --model /tmp/smol/hf --rank 16 --updates 6 --rounds 3 \\
        --out benchmarks/vllm/lora.json

Two engines (``lora_sync="merged"`` and ``"adapter"``, ``oppo.rollout.vllm.lora``) on the same
peft policy, both up at once and used in turn, so the machine's other jobs weigh on both alike.
Each of ``--updates`` rounds perturbs the adapter (outside the timing) and loads it into each
engine; each of ``--rounds`` generation rounds samples ``--batch`` sequences of exactly
``--new-tokens`` tokens (forced lengths: the same work in both). Then, per engine, the cost of a
PPO step's rollout: one load plus one round's generation. ``--check``: after the last update, each
engine's log-probs against the peft forward of the same weights.
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
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", nargs="*", default=[], help="lora.target_modules (none: every linear layer)")
    ap.add_argument("--updates", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from oppo.models import apply_lora
    from oppo.rollout.vllm.backend import VLLMRolloutBackend

    peft = apply_lora(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval(), args.rank,
                      2.0 * args.rank, 0.0, args.targets).eval()
    g = torch.Generator().manual_seed(0)

    def perturb(scale: float) -> None:
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_" in name:
                    p.add_(torch.randn(p.shape, generator=g) * scale)

    perturb(0.01)
    n_adapter = sum(p.numel() for n, p in peft.named_parameters() if "lora_" in n)
    load_before = os.getloadavg()
    eos = peft.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos or 0
    engines = {}
    for way in ("merged", "adapter"):
        engines[way] = VLLMRolloutBackend(
            str(args.model), (eos,), 0, args.new_tokens, temperature=1.0, seed=0, max_num_seqs=args.batch,
            max_model_len=256, weights=peft, lora_sync=way)
        torch.set_num_threads(args.threads)
        print(f"{way}: engine up in {engines[way].startup_s:.1f} s", flush=True)
    loads: dict[str, list[float]] = {w: [] for w in engines}
    parts: dict[str, list[dict]] = {w: [] for w in engines}
    version = 0
    for k in range(args.updates):
        perturb(0.002)
        version += 1
        for way, eng in engines.items():
            eng.load_weights(peft, version)
            loads[way].append(eng.last_weight_sync_s)
            parts[way].append(dict(eng.last_weight_sync_parts))
            print(f"update {k} {way:7s} {eng.last_weight_sync_s:.3f} s  {eng.weight_path}", flush=True)
    speed: dict[str, list[float]] = {w: [] for w in engines}
    for k in range(args.rounds):
        for way, eng in engines.items():
            speed[way].append(generate(eng, args.batch, args.new_tokens, start=10_000 * (k + 1)))
            print(f"round {k} {way:7s} {speed[way][-1]:.0f} tokens/s", flush=True)
    checks = {way: logprob_gap(eng, peft) for way, eng in engines.items()} if args.check else {}
    load_after = os.getloadavg()
    for eng in engines.values():
        eng.close()
    tokens = args.batch * args.new_tokens
    summary = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "loadavg_before": load_before, "loadavg_after": load_after},
        "model": str(args.model), "rank": args.rank, "targets": args.targets or "all-linear",
        "parameters": sum(p.numel() for p in peft.get_base_model().parameters()) - n_adapter,
        "adapter_parameters": n_adapter, "batch": args.batch, "new_tokens": args.new_tokens,
        "median_load_s": {w: statistics.median(v) for w, v in loads.items()},
        "load_s_each": loads,
        "median_parts_s": {w: {a: statistics.median(float(p.get(a, 0.0)) for p in ps)
                               for a in ps[-1] if a.endswith("_s")} for w, ps in parts.items()},
        "median_tokens_per_s": {w: statistics.median(v) for w, v in speed.items()},
        "tokens_per_s_each": speed,
        "rollout_s_per_step": {w: statistics.median(loads[w]) + tokens / statistics.median(speed[w]) for w in engines},
        "max_abs_logprob_gap": checks,
    }
    print(json.dumps({k: summary[k] for k in ("median_load_s", "median_parts_s", "median_tokens_per_s",
                                               "rollout_s_per_step", "max_abs_logprob_gap")}, indent=1))
    print(f"load average before {load_before}, after {load_after}")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))


def generate(eng, batch: int, new_tokens: int, start: int) -> float:
    """Tokens per second of ``batch`` sequences of exactly ``new_tokens`` tokens."""
    from oppo.rollout.eager.backend import Rollout

    rows = [Rollout(start + u, u, "", [1 + u, 2 + 3 * u, 100 + u, 7, 40 + u, 9], 0, target_length=new_tokens)
            for u in range(batch)]
    t = time.perf_counter()
    eng.admit(rows)
    done = eng.generate_all()
    dt = time.perf_counter() - t
    return sum(len(r.response_ids) for r in done) / dt


def logprob_gap(eng, model) -> float:
    """The largest |log p_vLLM - log p_peft| over a short generation (4 prompts, ``max_new_tokens`` each)."""
    from oppo.rollout.eager.backend import Rollout

    # no stop token and no forced length (a forced length bans EOS before it: vLLM's log-probs are
    # then of the renormalised distribution), so every token is drawn from the policy as it is
    eos, eng.eos_ids = eng.eos_ids, ()
    rows = [Rollout(900 + u, u, "", [1 + u, 2 + 3 * u, 100 + u, 7], 0) for u in range(4)]
    eng.admit(rows)
    gap = 0.0
    for r in eng.generate_all():
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(r.prompt_ids) - 1:-1].float()
        ref = torch.log_softmax(logits, -1).gather(1, ids[0, len(r.prompt_ids):, None])[:, 0]
        gap = max(gap, float((torch.tensor(r.logprobs) - ref).abs().max()))
    eng.eos_ids = eos
    return gap


if __name__ == "__main__":
    main()
