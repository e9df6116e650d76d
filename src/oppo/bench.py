"""``oppo bench``: the same workload in every mode, side by side, in one invocation.

Every mode gets its own Trainer built from the same config (same data, seed, models, batch);
steps are interleaved (step 0 of every mode, then step 1 of every mode, ...) so that machine
noise hits all modes alike. Timings skip the first (warm-up) step. Reported per mode: median
and spread of step time, speedup over ``sequential``, tokens per second, each worker's busy
fraction, bubble ratio against the ideal bound (the busiest worker's busy time), and, on the
task's own lengths (below), mean reward at the last step and time to a target reward. ``--tail`` adds a synthetic workload whose response
lengths are drawn from a log-normal of the given sigma (heavier tail for larger sigma), to
measure speedup against tail heaviness. No mode is tuned differently from the others; the
settings table in bench.md says what all of them ran with.

A mode may carry settings of its own after colons, e.g. ``pipeline:overlap.stale_kv=recompute``
(keep vs recompute of the stale KV cache in one run) or ``sequential:placement.backend=local``.
Under a Ray placement (``placement.backend=ray``) the best single-process sequential run,
``sequential:placement.backend=local``, joins as a second baseline unless ``--modes`` names it,
and the table gains a column of speedups against it.

The main run forces its response lengths (``--workload``, default ``representative``,
:data:`WORKLOADS`): a long-tailed distribution like real RLHF's, where, on GPUs, generation is
the largest share of the sequential step (on the 2-vCPU machine with the tiny models training
still is, at 40% against 36%: ``benchmarks/representative_quick``). bench.md states the stage
profile (generate / score / train shares of the sequential step and the response lengths' p50,
p99 and maximum) of that headline run and,
as a second row, of a short sequential run on the task's own lengths (``--workload natural``
makes those the headline), so a reader sees which regime the speedups were measured in: a tiny
model on a CPU, where training dominates, says little about a GPU run where decoding the longest
response does. The tail sweep uses the task's own maximum length.

Forced-length runs (the main run's workload unless ``--workload natural``, and the tail sweep)
are **timing-only**: their learning metrics (reward, judge, accuracy, KL, PPO and value
statistics: :data:`LEARNING_PREFIXES`) are left out of their ``metrics.jsonl``,
``bench.json``, ``bench.md`` and pictures, and each step is marked ``bench/timing_only``. A
forced length bans EOS before the target and forces it there, so the responses are not draws
from the policy: the k1 KL estimate, whose expectation is >= 0 only under the policy's own
samples, went negative (-0.25 to -0.57), and no behaviour log-prob makes the update a PPO update
of the policy (the forced EOS has behaviour probability 1: its importance weight would be the
policy's own EOS probability, often ~0). The timings, lengths, staleness and sampler-vs-trainer
mismatch (``mismatch/*``: the same weights in the engine and the trainer, whatever was sampled)
are kept, and so are the losses and gradient norms (:data:`CHECKED`: a check that the numbers stay
finite, not a measure of learning; the non-finite guard runs in these runs too). ``--workload
natural`` compares learning across modes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import torch

from .config import MODES, load_config, to_dict, with_overrides
from .metrics import MetricsLogger
from .trace import busy_seconds

QUICK = ["ppo.batch_size=32", "ppo.minibatch_size=16", "ppo.micro_batch_size=16"]
LOCAL_BASELINE = "sequential:placement.backend=local"
"""The second baseline of a bench under a Ray placement: the best single-process sequential run."""


def split_mode(spec: str) -> tuple[str, list[str]]:
    """``"pipeline:overlap.stale_kv=recompute"`` -> ``("pipeline", ["overlap.stale_kv=recompute"])``."""
    mode, *over = [x.strip() for x in spec.split(":")]
    if mode not in MODES:
        raise ValueError(f"--modes: unknown mode {mode!r} in {spec!r}; choose from {', '.join(MODES)}, optionally "
                         f"with settings after colons (e.g. pipeline:overlap.stale_kv=recompute).")
    return mode, over


def mode_overrides(spec: str) -> list[str]:
    """The settings a mode spec sets: its overlap mode and its own settings (a local placement
    drops the Ray-only rollout workers)."""
    mode, over = split_mode(spec)
    local = [] if "placement.backend=local" not in over else ["placement.rollout_workers=0"]
    return [f"overlap.mode={mode}", *local, *over]


def _slug(spec: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "+" for c in spec.replace(":", "+"))


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    desc = f"{os.cpu_count()} CPU cores ({cpu}), torch {torch.__version__}"
    if torch.cuda.is_available():
        desc += f", GPU {torch.cuda.get_device_name(0)}"
    return desc


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _length_sampler(sigma: float, median: float, max_len: int, seed: int):
    def sample(prompt_index: int, member: int = 0) -> int:
        # member: a sequence's place in its group (GRPO/RLOO); the G answers to one prompt get
        # their own lengths, so some of a group finish before the rest, as sampled ones would
        key = seed * 1_000_003 + prompt_index if member == 0 else f"{seed}/{prompt_index}/{member}"
        rng = random.Random(key)
        return max(1, min(max_len, int(round(median * math.exp(rng.gauss(0.0, sigma))))))
    return sample


@dataclass(frozen=True)
class LengthWorkload:
    """Forced response lengths: log-normal around ``median`` with shape ``sigma``, clipped to
    [1, max_new_tokens]; the row's EOS is banned before its length and forced at it, so the
    distribution holds whatever the model's quality (random weights included)."""

    name: str
    sigma: float
    median: int
    max_new_tokens: int
    description: str

    def sampler(self, seed: int):
        """(prompt_index, member in its group = 0) -> forced length: the same sequence always gets
        the same length, in every mode."""
        return _length_sampler(self.sigma, self.median, self.max_new_tokens, seed)

    def scaled(self, max_new_tokens: int) -> "LengthWorkload":
        """The same shape at another maximum (smoke runs): median and clip scaled together."""
        f = max_new_tokens / self.max_new_tokens
        return LengthWorkload(f"{self.name} (x{f:g})", self.sigma, max(2, round(self.median * f)), max_new_tokens,
                              self.description)

    def stats(self, seed: int = 0, n: int = 2000) -> dict[str, float]:
        """p50, p99, max and p99/p50 of ``n`` draws (what a run's prompts draw from)."""
        lens = [self.sampler(seed)(i) for i in range(n)]
        p50, p99 = _pct(lens, 0.5), _pct(lens, 0.99)
        return {"p50": p50, "p99": p99, "max": max(lens), "p99_over_p50": p99 / p50, "mean": statistics.mean(lens)}


# p99/p50 = exp(2.326 sigma) = 5.7 at sigma 0.75; p99 ~ 240, max of 2000 draws 512 (the clip)
WORKLOADS = {
    "representative": LengthWorkload(
        "representative", sigma=0.75, median=42, max_new_tokens=512,
        description="long-tailed RLHF responses: log-normal lengths, median 42, sigma 0.75 (p99/p50 ~ 5.7), "
                    "clipped at 512 tokens; every mode draws the same length for the same prompt"),
}


class ModelSize(TypedDict):
    """A Llama-style decoder's shape, as ``LlamaConfig`` keywords."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int


# Llama-style decoders built from config (random weights), for benchmarks on machines without
# internet: sizes count every parameter (embeddings and, for a causal LM, the untied lm_head).
MODEL_SIZES: dict[str, ModelSize] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=176, vocab_size=512),  # ~0.2M
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=1408, vocab_size=8192),  # ~32M
    "125m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=32768),  # ~100M as a reward model, ~125M as a causal LM
    "350m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
                 intermediate_size=2816, vocab_size=32768),  # ~340M
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=5632, vocab_size=32768),  # ~0.86B
}


def synthetic_config(size: str, **extra):
    """A ``LlamaConfig`` of a named size (:data:`MODEL_SIZES`); ids 0/1/2 are pad/eos/unk."""
    from transformers import LlamaConfig

    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {', '.join(MODEL_SIZES)}.")
    return LlamaConfig(**MODEL_SIZES[size], max_position_embeddings=4096, pad_token_id=0, eos_token_id=1,  # type: ignore[call-arg]  # num_labels: not in LlamaConfig's signature, taken by PretrainedConfig
                       bos_token_id=None, tie_word_embeddings=False, num_labels=1, **extra)


def synthetic_tokenizer(vocab_size: int):
    """A word-level tokenizer over ``w3 .. w{vocab-1}`` (no download): whitespace-split words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(3, vocab_size)])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def write_synthetic_models(root: Path, policy_size: str, reward_size: str, device: str = "cpu",
                           dtype: torch.dtype = torch.float32, seed: int = 0, prompts: int = 512,
                           prompt_words: tuple[int, int] = (16, 96)) -> dict[str, Path]:
    """Write ``policy/`` (a causal LM), ``reward/`` (a sequence classifier; also the critic) and
    ``prompts.jsonl`` (random words, lengths uniform in ``prompt_words``) under ``root``, built
    from config with random weights (initialised on ``device``: fast for large sizes). Reuses
    what a previous call with the same arguments wrote."""
    import json as _json

    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    root = Path(root)
    stamp = f"{policy_size} {reward_size} {dtype} {seed} {prompts} {prompt_words}"
    paths = {"policy": root / "policy", "reward": root / "reward", "prompts": root / "prompts.jsonl"}
    if (root / "stamp.txt").is_file() and (root / "stamp.txt").read_text() == stamp:
        return paths
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    vocab = MODEL_SIZES[policy_size]["vocab_size"]
    if MODEL_SIZES[reward_size]["vocab_size"] != vocab:
        raise ValueError(f"policy size {policy_size} and reward size {reward_size} have different vocabularies.")
    for name, size, cls in (("policy", policy_size, LlamaForCausalLM),
                            ("reward", reward_size, LlamaForSequenceClassification)):
        with torch.device(device):
            model = cls(synthetic_config(size)).to(dtype)  # type: ignore[arg-type]  # transformers' functools.wraps(Module.to) reads as unbound
        model.save_pretrained(paths[name])
        synthetic_tokenizer(vocab).save_pretrained(paths[name])
        del model
    rng = random.Random(seed)
    with open(paths["prompts"], "w") as f:
        for _ in range(prompts):
            words = " ".join(f"w{rng.randrange(3, vocab)}" for _ in range(rng.randint(*prompt_words)))
            f.write(_json.dumps({"prompt": words}) + "\n")
    (root / "stamp.txt").write_text(stamp)
    return paths


LEARNING_PREFIXES = ("reward/", "judge/", "task/", "kl/", "loss/", "ppo/", "value/", "grad_norm/")
"""Metrics that describe learning, left out of forced-length (timing-only) runs (module docstring)."""

CHECKED = ("loss/policy", "loss/value", "grad_norm/")
"""Kept in timing-only runs all the same: not measures of learning there, but the numbers that show a
run stayed finite (the guard, ``guard.py``, runs in these runs too; issue 26: a GPU bench whose
gradient norms were NaN for steps reported nothing)."""


def timing_only(metrics: dict) -> dict:
    """A forced-length step's metrics: the learning ones (:data:`LEARNING_PREFIXES`) left out but
    for the losses and gradient norms (:data:`CHECKED`), and ``bench/timing_only`` = 1 (module docstring)."""
    return {**{k: v for k, v in metrics.items() if k.startswith(CHECKED) or not k.startswith(LEARNING_PREFIXES)},
            "bench/timing_only": 1}


def run_modes(base, modes: list[str], steps: int, out: Path, tail_sigma: float | None = None,
              progress=print, lengths: LengthWorkload | None = None,
              deadline: float | None = None, one_at_a_time: bool = False, on_step=None) -> dict[str, dict]:
    """Run every mode for ``steps`` steps; return per-mode raw records.

    By default the modes are interleaved (step 0 of every mode, then step 1, ...) with every
    mode's Trainer resident, so that machine noise hits them alike. ``one_at_a_time``: each mode
    is built, stepped, closed and freed (``gc.collect``, ``torch.cuda.empty_cache``) before the
    next is built, so one mode's models are resident at a time: what a large model on one GPU
    needs (five 1B trainers do not fit 80 GB). Each mode then runs its steps back to back, as a
    real run does; machine noise is no longer shared, which on a dedicated GPU costs less than on
    a shared CPU (rebuilding every trainer for each round of interleaving would cost a model load
    per mode and step). On CUDA each record then holds ``peak_cuda_mib``: the peak memory
    allocated on each device from the trainer's build to its close (``torch.cuda.max_memory_allocated``,
    reset before the build).

    ``lengths`` forces response lengths (a :class:`LengthWorkload`; ``tail_sigma`` is the sweep's
    shorthand for one); the rollout backend is the config's (``generation.engine``). ``deadline``
    (a ``time.time()``): stop after the round of steps that would end past it, once every mode
    has at least two steps (one warm-up, one timed); one mode at a time, each mode gets an equal
    share of the time left when it starts. ``on_step(mode, step, metrics, trainer)``, if given,
    sees each step's metrics as the trainer returned them (before :func:`timing_only`); what it
    raises stops the run (the trainers are closed). Forced lengths make the runs timing-only:
    their learning metrics are left out of the records and metrics files (:func:`timing_only`).
    """
    import gc

    from .trainer import Trainer

    trainers, loggers, records = {}, {}, {}
    cuda = torch.cuda.is_available()

    def build(mode: str):
        # run.steps: a pipeline run begins no step beyond the bench's; no checkpoints in a bench
        cfg = with_overrides(base, [*mode_overrides(mode), f"run.out_dir={out / _slug(mode)}",
                                    f"run.steps={steps}", "run.save_every=0"])
        Path(cfg.run.out_dir).mkdir(parents=True, exist_ok=True)
        t = Trainer(cfg, progress=False)
        trainers[mode] = t
        if tail_sigma is not None:
            t.length_sampler = _synthetic_sampler(tail_sigma, t.max_new_tokens, cfg.run.seed)
        elif lengths is not None:
            t.length_sampler = lengths.sampler(cfg.run.seed)
        loggers[mode] = MetricsLogger(cfg.run.out_dir)
        records[mode] = {"metrics": [], "sampler": t.length_sampler, "lengths": [], "engine": t.roles.engine}

    def run_step(mode: str, step: int) -> None:
        t = trainers[mode]
        m = t.run_step()
        if on_step is not None:
            on_step(mode, step, m, t)
        if t.length_sampler is not None:
            m = timing_only(m)
        loggers[mode].log(step, m)
        records[mode]["metrics"].append(m)
        assert t.last_result is not None  # run_step set it
        records[mode]["lengths"].append([int(n) for n in t.last_result.exp.mask.sum(1).tolist()])

    def finish(mode: str) -> None:
        t = trainers[mode]
        probe = engine_step_probe(t, t.cfg.ppo.batch_size)
        if probe is not None:
            records[mode]["engine_step_ms"] = 1e3 * probe
            records[mode]["engine_probe_rows"] = t.cfg.ppo.batch_size
        t.tracer.save(Path(t.cfg.run.out_dir) / "trace.json")
        records[mode]["windows"] = dict(t.step_windows)
        records[mode]["spans"] = t.tracer.spans

    def close(mode: str) -> None:
        t = trainers.pop(mode, None)
        if t is not None:
            t.close()
        if mode in loggers:
            loggers.pop(mode).close()

    if one_at_a_time:
        for i, mode in enumerate(modes):
            if cuda and torch.cuda.is_initialized():  # (before any CUDA work the peaks are 0, and the reset raises)
                for d in range(torch.cuda.device_count()):
                    torch.cuda.reset_peak_memory_stats(d)
            share = None if deadline is None else time.time() + (deadline - time.time()) / (len(modes) - i)
            try:
                build(mode)
                for step in range(steps):
                    t_step = time.time()
                    run_step(mode, step)
                    progress(f"  {mode} step {step + 1}/{steps}: {records[mode]['metrics'][-1]['time/step']:.2f}s")
                    if share is not None and step >= 1 and time.time() + (time.time() - t_step) > share:
                        progress(f"  {mode}: stopping after {step + 1} steps: the next would end past its share "
                                 f"of the time budget")
                        break
                finish(mode)
            finally:
                close(mode)
                gc.collect()  # the trainer's models, optimizer state, KV slots and CUDA graphs
                if cuda:
                    metrics = records.get(mode, {}).get("metrics", [])
                    if mode in records:
                        records[mode]["peak_cuda_mib"] = {
                            f"cuda:{d}": max([torch.cuda.max_memory_allocated(d) / 2**20]
                                             + [m.get(f"memory/cuda{d}_peak_mb", 0.0) for m in metrics])
                            for d in range(torch.cuda.device_count())}  # (the trainer resets the peak each step)
                    torch.cuda.empty_cache()
        return records
    try:
        for mode in modes:  # a mode, or a mode with settings of its own (split_mode)
            build(mode)
        for step in range(steps):
            t_round = time.time()
            for mode in modes:
                run_step(mode, step)
            progress(f"  step {step + 1}/{steps}: " + "  ".join(
                f"{mode} {records[mode]['metrics'][-1]['time/step']:.2f}s" for mode in modes))
            if deadline is not None and step >= 1 and time.time() + (time.time() - t_round) > deadline:
                progress(f"  stopping after {step + 1} steps: the next round would end past the time budget")
                break
        for mode in modes:
            finish(mode)
    finally:
        for mode in modes:
            close(mode)
    return records


def engine_step_probe(t, rows: int, prompt_len: int = 32, new_tokens: int = 16, repeats: int = 3) -> float | None:
    """Seconds per decode step of the trainer's rollout engine alone: a fresh engine of the same
    kind (its backend's ``probe``: eager, or static with the same capture) on the same model decodes ``rows`` rows of
    ``prompt_len`` random tokens for ``new_tokens`` sampled steps (the run's temperature, top-k and
    top-p) with no EOS; the median of
    ``repeats`` passes after an untimed one (``benchmarks/decode_speed.py``'s measure). None for a
    backend oppo does not build here (one that loads its own weights, Ray workers). All ``rows`` rows decode every step,
    where a trained step's rows finish one by one: the probe's step is the costlier, so the decode
    overhead it gives (``summarize``) errs low."""
    from .rollout import registry
    from .rollout.engine import Rollout

    eng = t.roles.rollout
    probe = registry.probe_engine(eng, rows, prompt_len + new_tokens, new_tokens)
    if probe is None:
        return None
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    vocab = t.roles.tokenizer.vocab_size if hasattr(t.roles.tokenizer, "vocab_size") else 100
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, max(4, vocab), (prompt_len,), generator=g).tolist() for _ in range(rows)]
    times = []
    for rep in range(repeats + 1):
        probe.admit([Rollout(i, i, "", list(p), 0) for i, p in enumerate(prompts)])
        sync()
        t0, steps = time.perf_counter(), 0
        while probe.active:
            probe.step()
            steps += 1
        sync()
        probe.finished = []
        if rep:
            times.append((time.perf_counter() - t0) / steps)
    probe.close()
    return statistics.median(times)


HARDWARE = {"generate_mfu": "perf/generate_mfu", "train_mfu": "perf/train_mfu", "train_tflops": "perf/train_tflops",
            "train_padded_frac": "perf/train_padded_frac", "decode_step_ms": "perf/decode_step_ms",
            "peak_tflops": "perf/peak_tflops"}
"""bench.json's per-mode ``hardware`` figures: the median over timed steps of these step metrics."""


def _hardware(rec: dict, ms: list[dict]) -> dict:
    """How hard a mode drove the hardware (``control.metrics.utilisation``), with the decode
    overhead: the generate stage's time per decode step over the engine's own (probe) step."""
    out = {}
    for name, key in HARDWARE.items():
        vals = [m[key] for m in ms if key in m]
        if vals:
            out[name] = statistics.median(vals)
    if "engine_step_ms" in rec:
        out["engine_step_ms"] = rec["engine_step_ms"]
        out["engine_probe_rows"] = rec["engine_probe_rows"]
        if "decode_step_ms" in out:
            out["decode_overhead"] = out["decode_step_ms"] / rec["engine_step_ms"]
    return out


def hardware_markdown(modes: dict) -> list[str]:
    """The hardware-use table of ``bench.md`` (modes with ``hardware`` figures)."""
    rows = {m: v["hardware"] for m, v in modes.items() if v.get("hardware")}
    if not rows:
        return []
    peak = next((h["peak_tflops"] for h in rows.values() if "peak_tflops" in h), float("nan"))

    def f(h, k, fmt):
        return format(h[k], fmt) if k in h else "-"

    lines = ["## Hardware use", "",
             f"Model FLOPs utilisation against this device's measured peak ({peak:.3g} TFLOP/s: a matmul in the "
             f"compute dtype, same run). Exact for sequential; in overlapped modes a stage also holds other steps' "
             f"work. Decode overhead: the generate stage's time per decode step over the engine's own step (a probe "
             f"of the same engine alone, every row decoding: it errs low). Padded: the share of the learner's "
             f"computed positions that are padding.", "",
             "| mode | generate MFU | train MFU | train TFLOP/s | padded | decode ms/step | engine ms/step (probe) "
             "| decode overhead |", "|---|---|---|---|---|---|---|---|"]
    for m, h in rows.items():
        lines.append(f"| {m} | {f(h, 'generate_mfu', '.2%')} | {f(h, 'train_mfu', '.2%')} | "
                     f"{f(h, 'train_tflops', '.3g')} | {f(h, 'train_padded_frac', '.1%')} | "
                     f"{f(h, 'decode_step_ms', '.2f')} | {f(h, 'engine_step_ms', '.2f')} | "
                     f"{f(h, 'decode_overhead', '.2f')}{'x' if 'decode_overhead' in h else ''} |")
    return lines + [""]


def summarize(records: dict[str, dict], warmup: int = 1, target: float | None = None) -> dict:
    """Per-mode figures from raw records (see the module docstring)."""
    seq = records.get("sequential")
    if target is None and seq is not None and all("reward/mean" in m for m in seq["metrics"]):
        last = [m["reward/mean"] for m in seq["metrics"][-3:]]
        target = sum(last) / len(last)
    out = {}
    for mode, rec in records.items():
        ms = rec["metrics"]
        times = [m["time/step"] for m in ms[warmup:]] or [m["time/step"] for m in ms]
        steps = sorted(rec["windows"])[warmup:] or sorted(rec["windows"])
        total = sum(rec["windows"][s][1] - rec["windows"][s][0] for s in steps)
        busy: dict[str, float] = {}
        busiest_sum = 0.0
        for s in steps:
            t0, t1 = rec["windows"][s]
            b = busy_seconds(rec["spans"], t0, t1)
            for w, v in b.items():
                busy[w] = busy.get(w, 0.0) + v
            busiest_sum += max(b.values(), default=0.0)
        wall, reached = 0.0, None
        timing = any(m.get("bench/timing_only") for m in ms)  # forced lengths: no learning metrics
        rewards = [m["reward/mean"] for m in ms] if not timing else []
        for i, m in enumerate(ms if not timing else []):
            wall += m["time/step"]
            avg = sum(rewards[max(0, i - 2): i + 1]) / len(rewards[max(0, i - 2): i + 1])
            if reached is None and target is not None and avg >= target:
                reached = wall
        out[mode] = {
            "steps": len(ms),
            "step_time_median_s": statistics.median(times),
            "step_time_p25_s": _pct(times, 0.25), "step_time_p75_s": _pct(times, 0.75),
            "tokens_per_s": statistics.median([m["perf/tokens_per_s"] for m in ms[warmup:]] or [0.0]),
            "busy_fraction": {w: v / total for w, v in sorted(busy.items())} if total else {},
            "bubble_ratio": 1.0 - busiest_sum / total if total else float("nan"),
            "timing_only": timing,
            "reward_last": rewards[-1] if rewards else None,
            "judge_last": ms[-1].get("judge/mean"),
            "time_to_target_s": reached,
            "response_length_mean": statistics.mean(m["response_length/mean"] for m in ms),
            "cpu_util": statistics.median([m["perf/cpu_util"] for m in ms[warmup:]] or [0.0]),
            "engine": rec.get("engine"),  # which rollout engine ran (generation.engine=auto resolved)
            "hardware": _hardware(rec, ms[warmup:] or ms),
            **({"peak_cuda_mib": rec["peak_cuda_mib"]} if "peak_cuda_mib" in rec else {}),  # (one mode at a time)
        }
    if "sequential" in out:
        base = out["sequential"]["step_time_median_s"]
        speed = {m: base / v["step_time_median_s"] for m, v in out.items()}
        seq_busiest = max(out["sequential"]["busy_fraction"].values(), default=float("nan"))
        util = {m: max(v["busy_fraction"].values(), default=float("nan")) / seq_busiest for m, v in out.items()}
    else:
        speed, util = {}, {}
    res = {"modes": out, "speedup": speed, "busiest_busy_ratio": util, "target_reward": target}
    if LOCAL_BASELINE in out:
        base = out[LOCAL_BASELINE]["step_time_median_s"]
        res["speedup_vs_local"] = {m: base / v["step_time_median_s"] for m, v in out.items()}
    return res


def stage_profile(records: dict[str, dict], workload: str, warmup: int = 1, mode: str = "sequential") -> dict:
    """Where the sequential step's time goes (median seconds and share of the step for generate,
    score and train) and the response lengths it trained on (p50, p99, max over every trained
    sequence). ``mode`` falls back to the first mode run when ``sequential`` was not."""
    if mode not in records:
        mode = next(iter(records))
    ms = records[mode]["metrics"]
    ms = ms[warmup:] or ms
    med = {k: statistics.median(m.get(f"time/{k}", 0.0) for m in ms) for k in ("generate", "score", "train", "step")}
    lens = [n for step in records[mode].get("lengths", [])[warmup:] or records[mode].get("lengths", []) for n in step]
    p50 = _pct(lens, 0.5) if lens else float("nan")
    p99 = _pct(lens, 0.99) if lens else float("nan")
    shares = {k: med[k] / med["step"] if med["step"] else float("nan") for k in ("generate", "score", "train")}
    return {"workload": workload, "mode": mode, "step_s": med["step"],
            **{f"{k}_s": med[k] for k in ("generate", "score", "train")},
            **{f"{k}_share": v for k, v in shares.items()},
            "largest": max(shares, key=lambda k: shares[k]),
            "length_p50": p50, "length_p99": p99, "length_max": max(lens) if lens else None,
            "p99_over_p50": p99 / p50 if lens and p50 else float("nan"), "sequences": len(lens)}


def stage_profile_markdown(rows: list[dict]) -> list[str]:
    """The stage-profile table: one row per workload, the headline first."""
    if not rows:
        return []
    lines = ["## Stage profile (where the sequential step's time goes)", "",
             "| workload | step (s) | generate | score | train | largest | response length p50 / p99 / max "
             "| p99/p50 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mx = r["length_max"] if r["length_max"] is not None else float("nan")
        lines.append(f"| {r['workload']} | {r['step_s']:.2f} | {r['generate_s']:.2f} s ({r['generate_share']:.0%}) "
                     f"| {r['score_s']:.2f} s ({r['score_share']:.0%}) | {r['train_s']:.2f} s ({r['train_share']:.0%}) "
                     f"| {r['largest']} | {r['length_p50']:.0f} / {r['length_p99']:.0f} / {mx:.0f} "
                     f"| {r['p99_over_p50']:.1f} |")
    head = rows[0]
    lines += ["", f"Measured on `{head['mode']}` (stages one after another; the first step excluded). Headline "
              f"workload: {head['largest']} is the largest share of the step ({head[head['largest'] + '_share']:.0%})"
              + (", as in real RLHF, where decoding the longest response bounds the step." if head["largest"] == "generate"
                 else "; real RLHF runs are generation-bound, so read these speedups as this regime's, not theirs.")
              + " Lengths are those of the sequences trained (forced where the workload says so).", ""]
    return lines


def to_markdown(result: dict) -> str:
    lines = ["# oppo bench", "", f"Machine: {result['machine']}", "",
             f"Command: `{result['command']}`", "",
             f"Workload: {result['workload']}; {result['steps']} steps per mode, "
             f"{result.get('schedule', 'interleaved')}; timings skip the first step.", "",
             "| mode | step time median (s) | p25-p75 (s) | speedup | tokens/s | busy fraction (actor / scorer / learner) "
             "| busiest vs sequential | bubble ratio | CPU use | reward (last) | time to target (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    local = result.get("speedup_vs_local")
    if local:
        lines[-2] = lines[-2].replace(" | speedup |", " | speedup | vs 1 process |")
        lines[-1] += "---|"
    for mode, v in result["modes"].items():
        bf = v["busy_fraction"]
        busy = " / ".join(f"{bf.get(w, 0.0):.2f}" for w in ("actor", "scorer", "learner"))
        if any(w.startswith("learner") and w != "learner" for w in bf):  # Ray learner ranks
            busy += " (ranks " + " / ".join(f"{bf[w]:.2f}" for w in sorted(bf) if w.startswith("learner")
                                            and w != "learner") + ")"
        ttt = f"{v['time_to_target_s']:.1f}" if v["time_to_target_s"] is not None else "not reached"
        reward = f"{v['reward_last']:.3f}" if v.get("reward_last") is not None else "-"
        if v.get("timing_only"):
            ttt = "- (timing only)"
        lines.append(f"| {mode} | {v['step_time_median_s']:.2f} | {v['step_time_p25_s']:.2f}-{v['step_time_p75_s']:.2f} "
                     f"| {result['speedup'].get(mode, float('nan')):.2f}x "
                     + (f"| {local.get(mode, float('nan')):.2f}x " if local else "")
                     + f"| {v['tokens_per_s']:.0f} | {busy} "
                     f"| {result['busiest_busy_ratio'].get(mode, float('nan')):.2f}x | {v['bubble_ratio']:.2f} "
                     f"| {v['cpu_util']:.0%} "
                     f"| {reward} | {ttt} |")
    cpu = ("CPU use: process CPU time over wall time times cores (how much of the machine the mode kept busy; "
           "OpenMP spin-waits count as busy, and a scorer worker in its own process is not counted).")
    if any(v.get("timing_only") for v in result["modes"].values()):
        lines += ["", "Timing only: the response lengths were forced (EOS banned before each target length and "
                  "forced at it), so the responses are not samples of the policy and no reward or KL of these "
                  "runs is reported (the k1 KL estimate of such runs went negative; their losses and gradient "
                  "norms stay in metrics.jsonl, as a check that the numbers stayed finite). `oppo bench --workload "
                  "natural` compares learning across modes. " + cpu, ""]
    else:
        target = result["target_reward"]
        lines += ["", (f"Target reward: {target:.3f}" if target is not None else "No target reward")
                  + " (sequential's mean over its last 3 steps unless --target was given); time to target uses a "
                  "3-step moving average. " + cpu, ""]
    peaks = {mode: v["peak_cuda_mib"] for mode, v in result["modes"].items() if v.get("peak_cuda_mib")}
    if peaks:
        lines += ["Peak GPU memory allocated per mode, from the trainer's build to its close "
                  "(`torch.cuda.max_memory_allocated`, reset between modes): " + "; ".join(
                      f"{mode} " + ", ".join(f"{mib / 1024:.1f} GiB" + (f" ({d})" if len(p) > 1 else "")
                                             for d, mib in p.items()) for mode, p in peaks.items()) + ".", ""]
    if result.get("workload_lengths"):
        w = result["workload_lengths"]
        lines += [f"Forced lengths ({w['name']}): {w['description']}; the distribution drawn from has p50 "
                  f"{w['p50']:.0f}, p99 {w['p99']:.0f}, max {w['max']:.0f} (p99/p50 {w['p99_over_p50']:.1f}).", ""]
    lines += hardware_markdown(result["modes"])
    lines += stage_profile_markdown(result.get("stage_profile", []))
    if result.get("tail_sweep"):
        lines += ["## Speedup against tail heaviness (synthetic lengths, log-normal sigma)", "",
                  "| sigma | length p50 | length p99 | " + " | ".join(f"{m} speedup" for m in result["tail_modes"]) + " |",
                  "|---|---|---|" + "---|" * len(result["tail_modes"])]
        for row in result["tail_sweep"]:
            lines.append(f"| {row['sigma']} | {row['length_p50']:.0f} | {row['length_p99']:.0f} | "
                         + " | ".join(f"{row['speedup'].get(m, float('nan')):.2f}x" for m in result["tail_modes"]) + " |")
        lines.append("")
    lines += ["## Settings (all modes)", "", "```yaml", result["settings"], "```", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="oppo bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="A small budget: under 10 minutes on 2 CPU cores.")
    p.add_argument("--out", default="benchmarks/latest", help="Output directory (bench.json, bench.md, PNGs).")
    p.add_argument("--modes", default=",".join(MODES), help="Comma-separated modes.")
    p.add_argument("--steps", type=int, default=None, help="Steps per mode, the first untimed (default 21; --quick 11).")
    p.add_argument("--tail", default=None,
                   help="Comma-separated log-normal sigmas for the synthetic-length sweep (e.g. 0.25,0.75,1.25).")
    p.add_argument("--tail-steps", type=int, default=4, help="Steps per mode at each sigma of the sweep.")
    p.add_argument("--tail-modes", default=",".join(MODES), help="Modes compared in the tail sweep.")
    p.add_argument("--workload", default="representative", choices=sorted(WORKLOADS) + ["natural"],
                   help="The main run's response lengths: representative (the default) = long-tailed, "
                        "like real RLHF (sets generation.max_new_tokens to its maximum unless "
                        "given); natural = the task's own (the tiny models' short responses, training-bound).")
    p.add_argument("--target", type=float, default=None, help="Target reward for time-to-target.")
    p.add_argument("--config", default=None, help="YAML settings shared by every mode.")
    p.add_argument("overrides", nargs="*", help="section.key=value settings shared by every mode.")
    args = p.parse_args(argv)
    if args.quick and args.tail is None:
        args.tail = "0.5,1.0,1.5"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        split_mode(m)  # an unknown mode fails here, before anything loads
    workload = WORKLOADS.get(args.workload)  # None: natural
    preset = [f"generation.max_new_tokens={workload.max_new_tokens}"] if workload else []
    shared = (QUICK if args.quick else []) + list(args.overrides) + ["log.progress=false", "run.samples=0"]
    base = load_config(args.config, preset + shared)
    natural = load_config(args.config, shared)  # the task's own lengths: the second profile row, the tail sweep
    for m in modes:  # each mode's own settings are valid, before anything loads
        with_overrides(base, mode_overrides(m))
    if base.placement.backend == "ray" and LOCAL_BASELINE not in modes and "sequential" in modes:
        modes.append(LOCAL_BASELINE)
    if workload:
        if base.generation.max_new_tokens is None:  # (an override cleared the preset)
            raise ValueError(f"--workload {args.workload} scales its lengths to generation.max_new_tokens: give it "
                             "a number, not an empty value (or use --workload natural)")
        if base.generation.max_new_tokens != workload.max_new_tokens:
            workload = workload.scaled(base.generation.max_new_tokens)
    steps = args.steps or (11 if args.quick else 21)  # the first step is a warm-up, not timed
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    started = time.time()
    say(f"oppo bench: {', '.join(modes)} x {steps} steps, interleaved -> {out}")
    records = run_modes(base, modes, steps, out / "runs", progress=say, lengths=workload)
    result = summarize(records, target=args.target)
    label = f"built-in task '{base.data.task}'" if base.uses_builtin_task else "user models"
    if workload:
        label += f", {workload.name} lengths"
        result["workload_lengths"] = {"name": workload.name, "description": workload.description,
                                      **workload.stats(base.run.seed)}
    result.update(machine=machine(), command="oppo bench " + " ".join(argv), steps=steps, workload=label,
                  settings=_settings_yaml(base), stage_profile=[stage_profile(records, label)])
    if workload is not None:  # the second row: the task's own lengths, sequential only, a few steps
        say("stage profile, second row: the task's own response lengths (sequential)")
        rec = run_modes(natural, ["sequential"], min(steps, 5), out / "natural", progress=say)
        own = (f"built-in task '{base.data.task}'" if base.uses_builtin_task else "user models") + ", its own lengths"
        result["stage_profile"].append(stage_profile(rec, own))
    if args.tail:
        tail_modes = [m.strip() for m in args.tail_modes.split(",")]
        sweep = []
        for sigma in (float(s) for s in args.tail.split(",")):
            say(f"tail sweep: sigma={sigma}")
            rec = run_modes(natural, tail_modes, args.tail_steps, out / "tail" / f"sigma_{sigma}", sigma,
                            progress=say)
            s = summarize(rec)
            sampler = rec[tail_modes[0]]["sampler"]
            sampler_lens = [sampler(i) for i in range(2000)]  # the distribution the runs drew from
            sweep.append({"sigma": sigma, "speedup": s["speedup"], "length_p50": _pct(sampler_lens, 0.5),
                          "length_p99": _pct(sampler_lens, 0.99),
                          "step_time_median_s": {m: v["step_time_median_s"] for m, v in s["modes"].items()}})
        result["tail_sweep"], result["tail_modes"] = sweep, tail_modes
    result["seconds"] = time.time() - started
    (out / "bench.json").write_text(json.dumps(_jsonable(result), indent=1))
    (out / "bench.md").write_text(to_markdown(result))
    from .report import make_report

    make_report([out / "runs" / _slug(m) for m in modes], out, labels=modes)
    say((out / "bench.md").read_text())
    return 0


def _synthetic_sampler(sigma: float, max_new_tokens: int, seed: int):
    """Log-normal response lengths with median max_new_tokens / 12, clipped to max_new_tokens."""
    return _length_sampler(sigma, max(2, max_new_tokens // 12), max_new_tokens, seed)


def _settings_yaml(cfg) -> str:
    import yaml

    d = to_dict(cfg)
    d.pop("log", None)
    d["overlap"].pop("mode", None)
    return yaml.safe_dump(d, sort_keys=False).strip()


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
