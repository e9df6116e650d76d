"""The attention paths on this device, with no trainer: what ``ppo.attention=auto`` would choose and why.

    PYTHONPATH=src python benchmarks/attention_check.py --out /tmp/attn        (CUDA, about a minute)
    PYTHONPATH=src python benchmarks/attention_check.py --device cpu --tiny --out /tmp/attn   (the smoke)

Two parts, in the run's compute dtype (bf16 on CUDA, fp32 in the smoke):

- **learner**: ``oppo.kernels.attention.measure`` (the probe ``auto`` runs at start) on two layers of the 1B
  policy's shape (hidden 2048, 32 query heads, 8 K/V heads of 64), 4 packed rows with a padding
  tail at the run's widths (``probe_widths(640)``: 576, which is 64 mod 128, then 640 and 512 of the
  ladder): first-call milliseconds at each width (plan builds), steady milliseconds, finite
  gradients and the error against the math path, for cuDNN, memory-efficient, torch's order with
  grouped K/V heads (``oppo_sdpa_gqa``), transformers' ``sdpa`` and ``oppo_varlen`` (where
  ``oppo.kernels.varlen`` exists; skipped with a note where not), then :func:`oppo.kernels.attention.decide`'s
  verdicts and choice, with and without cuDNN refused by the version rule (``cudnn_refusal``);
- **decode**: one attention call as the static backend's decode step and a scorer's streamed chunk
  make it (64 rows, 1 or 16 queries against 640 cached columns under a padding mask, 32/8 heads),
  through each registered attention function: first-call and steady milliseconds, error against
  the fp32 math kernel, and whether ``repeat_kv`` ran (transformers' copy of K/V per head).

Writes ``attention.md`` and ``attention.json`` under ``--out`` as each part ends. Exit 1 when a path
oppo relies on fails (the math reference, ``oppo_sdpa_gqa``), when no path survives ``decide``,
or on any error; a refused fast path is a finding, not a failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from oppo.kernels import attention
from oppo.kernels.attention import GQA, REFERENCE, Measured

DECODE = {"decode": 1, "chunk": 16}
"""The masked calls of the decode case: queries per row against the cached columns."""


def _device_facts(dev: torch.device) -> dict:
    facts: dict = {"device": str(dev), "torch": torch.__version__}
    if dev.type == "cuda":
        cap = torch.cuda.get_device_capability(dev)
        facts.update(name=torch.cuda.get_device_name(dev), capability=f"{cap[0]}.{cap[1]}", cuda=torch.version.cuda,
                     cudnn=torch.backends.cudnn.version(),
                     cudnn_refusal=attention.cudnn_refusal(torch.backends.cudnn.version(), cap, torch.version.cuda))
    return facts


def learner(dev: torch.device, dtype: torch.dtype, tiny: bool, say) -> dict:
    """The probe at the learner's shapes (module docstring), with ``decide``'s verdicts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from oppo.bench import MODEL_SIZES

    torch.manual_seed(0)
    cfg = LlamaConfig(**{**MODEL_SIZES["tiny" if tiny else "1b"], "num_hidden_layers": 2},
                      max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(dev)  # fp32 weights under autocast, as the trainer's masters
    rows, width = (2, 40) if tiny else (4, 640)
    widths = attention.probe_widths(width)
    paths = [GQA, "sdpa"] + (["oppo_sdpa_cudnn", "oppo_sdpa_efficient"] if dev.type == "cuda" else [])
    notes = []
    if dev.type != "cuda":
        notes.append("oppo_sdpa_cudnn, oppo_sdpa_efficient: skipped: no CUDA")
    paths.append(attention.VARLEN)  # packed rows by their offsets (oppo.kernels.varlen; a stand-in kernel off CUDA)
    t = time.time()
    got = attention.measure(model, rows, widths, [REFERENCE, *paths], repeats=5, dtype=dtype if dtype != torch.float32
                            else None)
    say(f"attention_check: learner probe in {time.time() - t:.1f} s")
    refused = {}
    if dev.type == "cuda":
        why = attention.cudnn_refusal(torch.backends.cudnn.version(), torch.cuda.get_device_capability(dev),
                                      torch.version.cuda)
        if why is not None:
            refused["oppo_sdpa_cudnn"] = why
    every = {k: v for k, v in got.items() if k not in ("sdpa", attention.VARLEN)}  # (auto's candidates: sdpa is
    # GQA's copying twin; the variable-length path is no choice of auto: packed forwards take it by themselves)
    return {"rows": rows, "widths": widths, "paths": {k: (v.__dict__ if isinstance(v, Measured) else v)
                                                       for k, v in got.items()},
            "verdicts": attention.decide(got, refused)[1], "auto": attention.decide(every, refused)[0],
            "auto_without_version_rule": attention.decide(every)[0], "notes": notes}


class _Layer(torch.nn.Module):
    """What a transformers attention function reads of its module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.layer_idx = groups, True, 0


def decode(dev: torch.device, dtype: torch.dtype, tiny: bool, repeats: int, say) -> dict:
    """The decode case (module docstring) through each registered attention function."""
    import transformers.integrations.sdpa_attention as sdpa_mod
    from transformers import AttentionInterface

    attention.register()
    rows, heads, kv_heads, d, cols = (4, 4, 2, 16, 40) if tiny else (64, 32, 8, 64, 640)
    names = ["sdpa", GQA, REFERENCE] + (["oppo_sdpa_cudnn", "oppo_sdpa_efficient"] if dev.type == "cuda" else [])
    copies = {"n": 0}
    real_repeat = sdpa_mod.repeat_kv

    def counting(x, n):
        copies["n"] += n > 1
        return real_repeat(x, n)

    sdpa_mod.repeat_kv = counting
    out: dict = {"rows": rows, "heads": heads, "kv_heads": kv_heads, "head_dim": d, "columns": cols, "cases": {}}
    try:
        g = torch.Generator().manual_seed(0)
        valid = torch.randint(cols // 2, cols + 1, (rows,), generator=g)  # [R] each row's cached columns
        for case, q_len in DECODE.items():
            q = torch.randn(rows, heads, q_len, d, generator=g).to(dev, dtype)
            k = torch.randn(rows, kv_heads, cols, d, generator=g).to(dev, dtype)
            v = torch.randn(rows, kv_heads, cols, d, generator=g).to(dev, dtype)
            col = torch.arange(cols)
            # a row's last q_len valid columns are its queries' own: causal among them, padding masked
            qpos = valid[:, None] - q_len + torch.arange(q_len)[None]  # [R, Q]
            mask = ((col[None, None] <= qpos[:, :, None]) & (col[None, None] < valid[:, None, None]))[:, None]
            mask = mask.to(dev)  # [R, 1, Q, C] bool
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.float(), k.float().repeat_interleave(heads // kv_heads, 1), v.float().repeat_interleave(
                    heads // kv_heads, 1), attn_mask=mask).transpose(1, 2)  # [R, Q, H, D] fp32 math
            layer = _Layer(heads // kv_heads)
            rows_out = {}
            for name in names:
                fn = AttentionInterface._global_mapping[name]
                try:
                    times, copies["n"] = [], 0
                    for i in range(repeats + 1):
                        _sync(dev)
                        t = time.perf_counter()
                        with torch.no_grad():
                            o, _ = fn(layer, q, k, v, mask, dropout=0.0, scaling=d ** -0.5)
                        _sync(dev)
                        times.append(1e3 * (time.perf_counter() - t))
                    err = float((o.float() - ref).norm() / ref.norm())
                    rows_out[name] = {"first_ms": times[0], "steady_ms": sorted(times[1:])[len(times[1:]) // 2],
                                      "error": err, "finite": bool(torch.isfinite(o).all()),
                                      "repeat_kv": copies["n"] > 0}
                except Exception as e:  # a kernel this device or torch does not run for these shapes
                    rows_out[name] = f"failed ({type(e).__name__}: {str(e)[:160]})"
            out["cases"][case] = rows_out
            say(f"attention_check: {case}: " + "; ".join(
                f"{n} {r['steady_ms']:.3f} ms" if isinstance(r, dict) else f"{n} {r}" for n, r in rows_out.items()))
    finally:
        sdpa_mod.repeat_kv = real_repeat
    return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def problems(result: dict, tol: float) -> list[str]:
    """What fails the check (module docstring): the paths oppo relies on, and a choice at all."""
    bad = []
    learn = result.get("learner", {})
    for name in (REFERENCE, GQA):
        m = learn.get("paths", {}).get(name)
        if not isinstance(m, dict) or not m["finite"] or not m["max_err"] <= tol:
            bad.append(f"learner: {name}: {m}")
    if learn and learn.get("auto") is None:
        bad.append("learner: decide chose no path")
    for case, rows in result.get("decode", {}).get("cases", {}).items():
        r = rows.get(GQA)
        if not isinstance(r, dict) or not r["finite"] or not r["error"] <= tol or r["repeat_kv"]:
            bad.append(f"{case}: {GQA}: {r}")
    return bad


def to_markdown(r: dict) -> str:
    f = r["facts"]
    L = [f"# attention_check on {f.get('name', f['device'])}", "",
         ", ".join(f"{k} {v}" for k, v in f.items() if k != "cudnn_refusal"), ""]
    if f.get("cudnn_refusal"):
        L += [f"cuDNN not pinned by auto: {f['cudnn_refusal']}", ""]
    learn = r.get("learner")
    if learn:
        L += [f"## Learner: {learn['rows']} packed rows with a padding tail, widths {learn['widths']} "
              f"(the first: 64 mod 128; steady and gradients there)", "",
              "| path | first call ms (mean of widths) | steady ms | finite | error vs math | verdict |",
              "|---|---|---|---|---|---|"]
        for name, m in learn["paths"].items():
            if isinstance(m, dict):
                L.append(f"| {name} | {m['first_ms']:.1f} | {m['steady_ms']:.2f} | {m['finite']} | {m['max_err']:.2e} "
                         f"| {learn['verdicts'].get(name, '')} |")
            else:
                L.append(f"| {name} | - | - | - | - | {m} |")
        L += ["", f"auto chooses: **{learn['auto']}** (without the cuDNN version rule: "
                  f"{learn['auto_without_version_rule']})", *[f"- {n}" for n in learn["notes"]], ""]
    dec = r.get("decode")
    if dec:
        L += [f"## Decode: {dec['rows']} rows, {dec['heads']}/{dec['kv_heads']} heads of {dec['head_dim']}, "
              f"{dec['columns']} cached columns under a padding mask", "",
              "| case | path | first call ms | steady ms | error vs fp32 math | finite | K/V copied |",
              "|---|---|---|---|---|---|---|"]
        for case, rows in dec["cases"].items():
            for name, m in rows.items():
                L.append(f"| {case} | {name} | {m['first_ms']:.2f} | {m['steady_ms']:.3f} | {m['error']:.2e} | "
                         f"{m['finite']} | {m['repeat_kv']} |" if isinstance(m, dict) else f"| {case} | {name} | {m} |")
        L.append("")
    if r.get("problems"):
        L += ["## Problems", "", *[f"- {p}" for p in r["problems"]], ""]
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="attention_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/attention_check")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="Smoke sizes (with --device cpu).")
    p.add_argument("--repeats", type=int, default=20, help="Steady calls of the decode case.")
    args = p.parse_args(argv)
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("attention_check: no CUDA device; use --device cpu --tiny for the smoke.")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tol = attention.BF16_TOL if dtype == torch.bfloat16 else 1e-4
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"facts": _device_facts(dev), "dtype": str(dtype), "tolerance": tol}

    def write() -> None:
        result["problems"] = problems(result, tol)
        (out / "attention.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "attention.md").write_text(to_markdown(result))

    result["learner"] = learner(dev, dtype, args.tiny, say)
    write()
    result["decode"] = decode(dev, dtype, args.tiny, 3 if args.tiny else args.repeats, say)
    write()
    print((out / "attention.md").read_text())
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
