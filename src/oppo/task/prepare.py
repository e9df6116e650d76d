"""``prepare``: build (once) and cache everything a built-in task needs to train offline.

The cache is ``<home>/<task>/`` (``home``: argument, else ``$OPPO_HOME``, else ``~/.cache/oppo``):
tokenizer, policy, reward model, prompts and ``prepare.json``. Idempotent (a cache whose
fingerprint matches and whose files check out is reused; ``force=True`` rebuilds), installed from
the package's shipped build where one matches (``oppo.task.shipped``), and atomic (built in a
temporary sibling directory, renamed into place when complete).

Design notes (the layout, the steps of each task): docs/task.md, "The build"."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, cast

import torch

from oppo.checkpoint import sha256_file
from oppo.procs import pid_alive
from oppo.task import models as M
from oppo.task import positive
from oppo.task.registry import Task, get_task
from oppo.task.text import detokenize
from oppo.task.tokenizer import BOS_ID, build_tokenizer

PREPARE_VERSION = 2
"""Bump when the build changes in a way that makes old caches stale. 2: one thread whatever the
load (:data:`BUILD_THREADS`), weights rounded to float16 (:func:`_round_to_fp16`)."""


@dataclass(frozen=True)
class PrepareSizes:
    """How much ``prepare`` builds. Task defaults: ``default_sizes(task)``; tests use
    ``PrepareSizes.tiny()`` to run the whole pipeline in seconds."""

    n_prompts: int = 5000
    """Training prompts written to ``prompts.jsonl``."""
    n_eval_prompts: int = 300
    """Held-out prompts written to ``eval_prompts.jsonl`` (disjoint from the training ones)."""
    model: M.ModelSize = field(default_factory=M.ModelSize)
    """Policy shape; the reward model has the same shape (it starts from the policy)."""
    sft_steps: int = 700
    sft_batch_size: int = 64
    sft_lr: float = 1e-3
    rm_prompts: int = 1200
    """Corpus prompts whose responses (corpus + two policy samples) make the RM's train pairs."""
    rm_eval_prompts: int = 300
    """The same, with other prompts, for the held-out pairs."""
    rm_steps: int = 400
    rm_batch_size: int = 32
    rm_lr: float = 3e-4
    rm_margin: float = 0.1
    """Pairs whose judge scores differ by less are dropped (train and held-out alike)."""
    eval_samples: int = 1024
    """Policy samples (temperature 1, on eval prompts) behind the SFT metrics."""
    sample_batch_size: int = 128

    @classmethod
    def tiny(cls) -> PrepareSizes:
        """A miniature build for tests: seconds on a laptop, bars not expected to hold. Heads of
        48 as the default model's (what vLLM's CPU attention lacks: served padded). Enough SFT
        steps at a high rate that samples end with ``<eos>``: the samples behind the metrics and
        the reward model's pairs then stop after tens of tokens, not at ``max_new_tokens``."""
        return cls(n_prompts=50, n_eval_prompts=20, model=M.ModelSize(hidden=96, layers=1,
                   heads=2, intermediate=64, max_positions=256), sft_steps=24, sft_batch_size=8,
                   sft_lr=5e-3, rm_prompts=8, rm_eval_prompts=4, rm_steps=2, rm_batch_size=8,
                   eval_samples=8, sample_batch_size=16)

    def to_dict(self) -> dict:
        return asdict(self)


def default_sizes(task: str) -> PrepareSizes:
    if task == "arith":
        return PrepareSizes(
            n_prompts=5000, n_eval_prompts=300,
            model=M.ModelSize(hidden=128, layers=2, heads=4, intermediate=384, max_positions=64),
            sft_steps=500, sft_batch_size=64, sft_lr=2e-3, eval_samples=512)
    return PrepareSizes()


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` built (or found)."""

    task: Task
    root: Path
    policy_path: Path
    reward_path: Path | None
    """None for rule-rewarded tasks."""
    tokenizer_path: Path
    prompts_path: Path
    eval_prompts_path: Path
    info: dict
    """The contents of ``prepare.json``."""
    reused: bool
    """True when a valid cache was found and nothing was built."""

    def prompts(self) -> list[str]:
        return read_task_prompts(self.prompts_path)

    def eval_prompts(self) -> list[str]:
        return read_task_prompts(self.eval_prompts_path)


def default_home() -> Path:
    return Path(os.environ.get("OPPO_HOME") or Path.home() / ".cache" / "oppo")


def read_task_prompts(path: str | Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def fingerprint(task: Task, seed: int, sizes: PrepareSizes) -> str:
    """Identity of a build: what it was asked for, ``PREPARE_VERSION``, and a digest of the
    task's data (vocabulary, a few generated texts and their judge scores), so that an edit
    of the word lists, grammar or judge makes old caches stale even without a version bump."""
    key = {"version": PREPARE_VERSION, "task": task.name, "params": task.params_dict(),
           "seed": seed, "sizes": sizes.to_dict(), "max_new_tokens": task.max_new_tokens,
           "data": _task_digest(task)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _task_digest(task: Task) -> str:
    examples = task.examples(64, 0)
    prompts = [detokenize(p) for p, _ in examples]
    responses = [detokenize(r) for _, r in examples]
    # Cut-off and empty variants too, so the judge's penalties are part of the digest.
    scores = task.judge(prompts * 3, responses + [r[: len(r) // 2] for r in responses]
                        + [""] * len(responses))
    key = [task.vocabulary(), examples, [round(x, 6) for x in scores]]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


# --- the entry point ----------------------------------------------------------------------------


def prepare(task: str | Task = "positive", home: str | Path | None = None, seed: int = 0,
            force: bool = False, progress: bool = True, *,
            sizes: PrepareSizes | None = None) -> Prepared:
    """Build (or reuse, or install from the package's shipped build) the cache of ``task`` under
    ``<home>/<task>/``; see the module doc. ``force``: build from scratch whatever is there."""
    task = get_task(task) if isinstance(task, str) else task
    sizes = sizes or default_sizes(task.name)
    home = Path(home) if home is not None else default_home()
    home.mkdir(parents=True, exist_ok=True)
    root = home / task.name
    fp = fingerprint(task, seed, sizes)
    log = _Log(progress)
    with _lock(home / f".{task.name}.lock"):
        if not force:
            problem = verify(root, fp)
            if problem is None:
                log(f"reusing {root} (fingerprint {fp})")
                return _prepared(task, root, json.loads((root / "prepare.json").read_text()),
                                 reused=True)
            _remove_stale_tmp(home, task.name)
            installed = _install_shipped(task, fp, home, root, log)
            if installed is not None:
                return installed
            if root.exists():
                log(f"rebuilding {root}: {problem}")
        _remove_stale_tmp(home, task.name)
        tmp = home / f".{task.name}.tmp-{os.getpid()}-{time.time_ns()}"
        tmp.mkdir()
        try:
            with _threads(), torch.random.fork_rng(devices=[]), log.heartbeat():
                info = _build(task, tmp, seed, sizes, fp, log)
            _swap_into_place(tmp, root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log(f"done in {info['seconds']:.0f}s: {root}")
    return _prepared(task, root, info, reused=False)


def _install_shipped(task: Task, fp: str, home: Path, root: Path, log: _Log) -> Prepared | None:
    """The package's shipped build of ``task`` installed as the cache ``root`` (seconds, no
    training: ``oppo.task.shipped``), or None where none is shipped for ``fp`` or it does not check
    out (then ``prepare`` builds; said in the log)."""
    from oppo.task import shipped

    src = shipped.shipped_build(task.name, fp)
    if src is None:
        return None
    t0 = time.time()
    tmp = home / f".{task.name}.tmp-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    try:
        shipped.install(src, tmp)
        problem = verify(tmp, fp)
        if problem is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            log(f"the shipped build of {task.name!r} does not check out ({problem}); building it instead")
            return None
        _swap_into_place(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    info = json.loads((root / "prepare.json").read_text())
    log(f"installed the shipped {task.name!r} models into {root} in {time.time() - t0:.1f}s (fingerprint {fp}, "
        f"weight hashes checked); `oppo prepare --force` builds them from scratch")
    return _prepared(task, root, info, reused=False)


def verify(root: Path, fp: str) -> str | None:
    """None when ``root`` is a complete cache with fingerprint ``fp``, else what is wrong."""
    try:
        info = json.loads((root / "prepare.json").read_text())
    except FileNotFoundError:
        return "no prepare.json"
    except (OSError, json.JSONDecodeError) as e:
        return f"unreadable prepare.json ({e})"
    if info.get("fingerprint") != fp:
        return f"fingerprint {info.get('fingerprint')} != {fp} (other task/params/seed/sizes/version)"
    for name in ("prompts.jsonl", "eval_prompts.jsonl", "tokenizer/tokenizer.json"):
        if not (root / name).is_file():
            return f"missing {name}"
    for model_dir, digest in info.get("weights_sha256", {}).items():
        d = root / model_dir
        try:
            json.loads((d / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            return f"bad {model_dir}/config.json ({e})"
        if not (d / "tokenizer.json").is_file():
            return f"missing {model_dir}/tokenizer.json"
        weights = d / "model.safetensors"
        if not weights.is_file() or sha256_file(weights) != digest:
            return f"{model_dir}/model.safetensors missing or changed"
    if "policy" not in info.get("weights_sha256", {}):
        return "no policy in prepare.json"
    return None


# --- the build ----------------------------------------------------------------------------------


def _build(task: Task, out: Path, seed: int, sizes: PrepareSizes, fp: str, log: _Log) -> dict:
    t0 = time.time()
    cpu0 = time.process_time()
    log.phases = 4 if task.uses_reward_model else 2
    n = torch.get_num_threads()
    log(f"preparing task {task.name!r} (seed {seed}, {n} thread{'s' if n > 1 else ''}, whatever the "
        f"load: the same models on every machine of this kind) into {out.parent / task.name}; "
        f"{log.phases} phases")
    tokenizer = build_tokenizer(task.vocabulary(), model_max_length=sizes.model.max_positions)
    vocab = tokenizer.get_vocab()
    tokenizer.save_pretrained(str(out / "tokenizer"))

    def ids(tokens: tuple[str, ...]) -> list[int]:
        return [vocab[t] for t in tokens]  # KeyError = a generator word missing from the vocab

    # Prompts: training ones, then held-out ones (not among them, where the task allows).
    train_prompts = task.prompts(sizes.n_prompts, _sub(seed, 1))
    if task.eval_disjoint:
        seen = set(train_prompts)
        eval_prompts: list[str] = []
        for extra in range(100):
            for p in task.prompts(2 * sizes.n_eval_prompts, _sub(seed, 2) + 1000 * extra):
                if p not in seen:
                    seen.add(p)
                    eval_prompts.append(p)
            if len(eval_prompts) >= sizes.n_eval_prompts:
                break
        eval_prompts = eval_prompts[: sizes.n_eval_prompts]
    else:
        eval_prompts = task.prompts(sizes.n_eval_prompts, _sub(seed, 2))
    _write_prompts(out / "prompts.jsonl", train_prompts)
    _write_prompts(out / "eval_prompts.jsonl", eval_prompts)

    # 1. SFT policy.
    t = time.time()
    examples = task.examples(sizes.sft_steps * sizes.sft_batch_size, _sub(seed, 3))
    seqs = [[BOS_ID] + ids(p) + ids(r) + [tokenizer.eos_token_id] for p, r in examples]
    torch.manual_seed(_sub(seed, 4))
    policy = M.build_policy(sizes.model, len(tokenizer), task.max_new_tokens)
    log.phase(f"SFT policy: {M.n_params(policy) / 1e6:.2f}M parameters, {len(seqs)} texts, "
        f"{sizes.sft_steps} steps")
    sft_stats = M.train_sft(policy, seqs, steps=sizes.sft_steps, batch_size=sizes.sft_batch_size,
                            lr=sizes.sft_lr, seed=_sub(seed, 5), progress=log.enabled,
                            tick=log.work(sizes.sft_steps, "step"))
    sft_seconds = time.time() - t
    _round_to_fp16(policy, "SFT policy")
    _save_model(policy, tokenizer, out / "policy", log.enabled)

    # 2. SFT metrics: samples at temperature 1 on the held-out prompts.
    t = time.time()
    log.phase(f"SFT metrics: trained in {sft_seconds:.0f}s (final loss {sft_stats['final_loss']:.3f}); sampling "
              f"{sizes.eval_samples} responses on held-out prompts")
    eval_p = [eval_prompts[i % len(eval_prompts)] for i in range(sizes.eval_samples)]
    eval_ids = [tokenizer(p)["input_ids"] for p in eval_p]
    samples = M.sample(policy, eval_ids, max_new_tokens=task.max_new_tokens,
                       batch_size=sizes.sample_batch_size, seed=_sub(seed, 6),
                       tick=log.work(len(eval_ids), "response"))
    texts = [cast(str, tokenizer.decode(s.ids, skip_special_tokens=True)) for s in samples]  # (one sequence: a str)
    judged = task.judge(eval_p, texts)
    lengths = sorted(len(s.ids) + int(s.ended) for s in samples)  # generated tokens, EOS included
    info: dict = {
        "version": PREPARE_VERSION,
        "fingerprint": fp,
        "task": task.name,
        "task_params": task.params_dict(),
        "seed": seed,
        "sizes": sizes.to_dict(),
        "max_new_tokens": task.max_new_tokens,
        "judge_function": task.judge_function,
        "reward_function": task.reward_function,
        "special_tokens": {"pad": tokenizer.pad_token_id, "bos": tokenizer.bos_token_id,
                           "eos": tokenizer.eos_token_id, "unk": tokenizer.unk_token_id},
        "adds_bos": True,
        "vocab_size": len(tokenizer),
        "policy_parameters": M.n_params(policy),
        "sft_final_loss": round(sft_stats["final_loss"], 4),
        "sft_eos_rate": sum(s.ended for s in samples) / len(samples),
        "length_p50": _quantile(lengths, 0.50),
        "length_p90": _quantile(lengths, 0.90),
        "length_p99": _quantile(lengths, 0.99),
        "length_max": lengths[-1],
        "length_unit": "generated tokens incl. EOS, SFT policy, temperature 1, eval prompts",
        "sft_judge_mean": sum(judged) / len(judged),
        "eval_samples": len(samples),
    }
    info["length_ratio_p99_p50"] = info["length_p99"] / max(1, info["length_p50"])
    if task.name == "arith":
        right = [r >= 1.0 for r in judged]
        info["sft_accuracy"] = sum(right) / len(right)
        by_kind: dict[str, list[bool]] = {}
        for p, ok in zip(eval_p, right):
            kind = "plus" if "plus" in p else "minus" if "minus" in p else "count"
            by_kind.setdefault(kind, []).append(ok)
        info["sft_accuracy_by_kind"] = {k: round(sum(v) / len(v), 4)
                                        for k, v in sorted(by_kind.items())}
    log(f"SFT metrics: eos rate {info['sft_eos_rate']:.3f}, length p50 "
        f"{info['length_p50']} p99 {info['length_p99']}, judge mean {info['sft_judge_mean']:.3f}")
    timings = {"sft": sft_seconds, "sft_eval": time.time() - t}

    # 3. Reward model (tasks without a rule reward).
    hashes = {"policy": sha256_file(out / "policy" / "model.safetensors")}
    if task.uses_reward_model:
        t = time.time()
        rm_info = _build_reward_model(task, policy, tokenizer, ids, out / "reward", seed, sizes,
                                      eval_p, samples, judged, log)
        info.update(rm_info)
        timings["reward_model"] = time.time() - t
        hashes["reward"] = sha256_file(out / "reward" / "model.safetensors")
    info["weights_sha256"] = hashes
    info["timings"] = {k: round(v, 1) for k, v in timings.items()}
    info["threads"] = torch.get_num_threads()
    info["cpu_seconds"] = round(time.process_time() - cpu0, 1)
    info["seconds"] = round(time.time() - t0, 1)
    info["versions"] = _versions()
    (out / "prepare.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return info


def _build_reward_model(task: Task, policy, tokenizer, ids, out: Path, seed: int,
                        sizes: PrepareSizes, eval_p: list[str], eval_samples: list[M.Sample],
                        eval_judged: list[float], log: _Log) -> dict:
    log.phase(f"reward model pairs: sampling the policy on {sizes.rm_prompts} + {sizes.rm_eval_prompts} prompts, "
              f"labelling pairs with the judge")
    tick = log.work(2 * (sizes.rm_prompts + sizes.rm_eval_prompts), "response")  # (two samples a prompt)
    train_pairs, _ = _preference_pairs(task, policy, tokenizer, ids, sizes.rm_prompts,
                                       _sub(seed, 7), sizes, tick)
    held_pairs, held_kinds = _preference_pairs(task, policy, tokenizer, ids,
                                               sizes.rm_eval_prompts, _sub(seed, 8), sizes,
                                               lambda n: tick(2 * sizes.rm_prompts + n))
    torch.manual_seed(_sub(seed, 9))
    rm = M.build_reward_model(sizes.model, len(tokenizer), init_from=policy)
    log.phase(f"reward model: {len(train_pairs)} train pairs, {len(held_pairs)} held-out, "
        f"{sizes.rm_steps} steps")
    stats = M.train_reward_model(rm, train_pairs, steps=sizes.rm_steps,
                                 batch_size=sizes.rm_batch_size, lr=sizes.rm_lr,
                                 seed=_sub(seed, 10), progress=log.enabled,
                                 tick=log.work(sizes.rm_steps, "step"))
    # Scale the score head so that scores of SFT samples have standard deviation 1 (the mean
    # stays; the head has no bias): PPO reward scales then start out like N(mean, 1).
    seqs = [tokenizer(p)["input_ids"] + s.ids + ([tokenizer.eos_token_id] if s.ended else [])
            for p, s in zip(eval_p, eval_samples)]
    raw_std = _std(M.reward_model_scores(rm, seqs))
    with torch.no_grad():
        rm.score.weight.div_(max(raw_std, 1e-6))
    _round_to_fp16(rm, "reward model")
    _save_model(rm, tokenizer, out, log.enabled)

    # Held-out pairwise accuracy, overall and by kind of pair.
    chosen = M.reward_model_scores(rm, [c for c, _ in held_pairs])
    rejected = M.reward_model_scores(rm, [r for _, r in held_pairs])
    right = [c > r for c, r in zip(chosen, rejected)]
    by_kind: dict[str, list[bool]] = {}
    for kind, ok in zip(held_kinds, right):
        by_kind.setdefault(kind, []).append(ok)

    # Agreement with the judge on the SFT samples of the eval prompts (never trained on).
    rm_scores = M.reward_model_scores(rm, seqs)
    info = {
        "reward_parameters": M.n_params(rm),
        "rm_train_pairs": len(train_pairs),
        "rm_heldout_pairs": len(held_pairs),
        "rm_final_train_loss": round(stats["final_loss"], 4),
        "rm_pairwise_accuracy": sum(right) / max(1, len(right)),
        "rm_accuracy_by_kind": {k: round(sum(v) / len(v), 4) for k, v in sorted(by_kind.items())},
        "rm_judge_correlation": _spearman(rm_scores, eval_judged),
        "rm_judge_correlation_kind": "spearman",
        "rm_judge_pearson": _pearson(rm_scores, eval_judged),
        "rm_score_mean": sum(rm_scores) / len(rm_scores),
        "rm_score_std": _std(rm_scores),
        "rm_score_scale": 1.0 / max(raw_std, 1e-6),
        "rm_score_stats_on": "SFT samples on eval prompts (after scaling the head to std 1)",
    }
    log(f"reward model: held-out accuracy {info['rm_pairwise_accuracy']:.3f}, "
        f"spearman with judge {info['rm_judge_correlation']:.3f}")
    return info


def _preference_pairs(task: Task, policy, tokenizer, ids, n: int, seed: int, sizes: PrepareSizes,
                      tick: Callable[[int], None] | None = None,
                      ) -> tuple[list[tuple[list[int], list[int]]], list[str]]:
    """(chosen ids, rejected ids) pairs and their kinds, labelled by the judge, from ``n`` corpus
    texts and two policy samples on each of their prompts:

    - ``policy``: sample vs sample (where PPO will query the RM);
    - ``corpus``: the corpus response vs a sample;
    - ``degenerate``: a clean response vs a corrupted one (loops, repeated words, cut-offs,
      word salad, empty) -- so the RM learns the judge's penalties;
    - ``flip``: a corpus response vs itself with some sentiment words flipped.
    """
    rng = random.Random(f"pairs-{seed}")
    examples = task.examples(n, seed)
    prompt_ids = [[BOS_ID] + ids(p) for p, _ in examples]
    tick = tick or (lambda n: None)  # (the responses sampled so far: 2 per prompt)
    s1 = M.sample(policy, prompt_ids, max_new_tokens=task.max_new_tokens,
                  batch_size=sizes.sample_batch_size, seed=seed + 1, tick=tick)
    s2 = M.sample(policy, prompt_ids, max_new_tokens=task.max_new_tokens,
                  batch_size=sizes.sample_batch_size, seed=seed + 2, tick=lambda k: tick(n + k))
    vocab_inv = {i: t for t, i in tokenizer.get_vocab().items()}
    eos = tokenizer.eos_token_id

    def tokens_of(s: M.Sample) -> tuple[str, ...]:
        return tuple(vocab_inv[i] for i in s.ids)

    pairs: list[tuple[list[int], list[int]]] = []
    kinds: list[str] = []
    for i, (p_tok, r_tok) in enumerate(examples):
        prompt = detokenize(p_tok)
        cands: list[tuple[str, tuple[str, ...], tuple[str, ...], bool, bool]] = []
        a, b = tokens_of(s1[i]), tokens_of(s2[i])
        cands.append(("policy", a, b, s1[i].ended, s2[i].ended))
        cands.append(("corpus", r_tok, b, True, s2[i].ended))
        base, base_ended = (r_tok, True) if rng.random() < 0.5 else (a, s1[i].ended)
        bad = positive.corrupt(rng, base)
        # A degenerate response that stopped without a terminator either hit the token budget
        # (no EOS) or stopped mid-sentence (EOS): teach the RM both.
        bad_ended = bool(bad) and (bad[-1] in ".!" or rng.random() < 0.5)
        cands.append(("degenerate", base, bad, base_ended, bad_ended))
        flipped = positive.flip_sentiment(rng, r_tok)
        if flipped != r_tok:
            cands.append(("flip", r_tok, flipped, True, True))
        for kind, x, y, x_end, y_end in cands:
            jx, jy = task.judge([prompt, prompt], [detokenize(x), detokenize(y)])
            if abs(jx - jy) < sizes.rm_margin:
                continue
            sx = prompt_ids[i] + ids(x) + ([eos] if x_end else [])
            sy = prompt_ids[i] + ids(y) + ([eos] if y_end else [])
            pairs.append((sx, sy) if jx > jy else (sy, sx))
            kinds.append(kind)
    return pairs, kinds


# --- helpers ------------------------------------------------------------------------------------


HEARTBEAT_S = 30.0
"""Without a terminal, a progress line this often (seconds): phase, step count, time left."""


class _Log:
    """Concise progress lines on stderr (silent when ``progress=False``): one when each phase
    starts (numbered, so a log without a terminal shows where the build is) and one with its
    results. The phases' own bars (``task/models.py``) show only on a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.t0 = time.time()
        self.phases = 0
        self._phase = 0
        self._phase_t0 = self._work_t0 = self.t0
        self.done = self.total = 0
        self.unit = "step"

    def phase(self, msg: str) -> None:
        self._phase += 1
        self._phase_t0 = time.time()
        self.total = 0
        self(f"phase {self._phase}/{self.phases}: {msg}")

    def work(self, total: int, unit: str) -> Callable[[int], None]:
        """Count a loop of ``total`` ``unit`` (steps, responses) in this phase: the callback the
        loop calls with the count done, read by :meth:`status`."""
        self.done, self.total, self.unit, self._work_t0 = 0, total, unit, time.time()

        def tick(n: int) -> None:
            self.done = n

        return tick

    def status(self) -> str:
        """'phase 1/4: step 212/700, 318s so far, about 7 min left' (the time left at this phase's
        rate so far; absent before its first step)."""
        line = f"phase {self._phase}/{self.phases}"
        if not self.total:
            return f"{line} still running ({time.time() - self._phase_t0:.0f}s so far)"
        spent = time.time() - self._work_t0
        line += f": {self.unit} {self.done}/{self.total}, {time.time() - self._phase_t0:.0f}s so far"
        if self.done:
            left = spent / self.done * (self.total - self.done)
            line += f", about {left / 60:.0f} min left" if left >= 90 else f", about {left:.0f}s left"
        return line

    @contextlib.contextmanager
    def heartbeat(self, every: float | None = None):
        """Without a terminal (no bars), a line every ``every`` seconds of a long phase, so a log
        shows the build is alive and where it is."""
        if not self.enabled or sys.stderr.isatty():
            yield
            return
        from ..procs import periodic

        every = HEARTBEAT_S if every is None else every

        def beat() -> None:
            if self._phase:
                self(self.status())

        with periodic(every, beat, "prepare-heartbeat"):
            yield

    def __call__(self, msg: str) -> None:
        if self.enabled:
            print(f"[oppo prepare {time.time() - self.t0:5.0f}s] {msg}", file=sys.stderr,
                  flush=True)


def _sub(seed: int, k: int) -> int:
    """Independent sub-seed ``k`` of ``seed``."""
    return seed * 1009 + k * 7919


def _write_prompts(path: Path, prompts: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")


def _save_model(model, tokenizer, path: Path, progress: bool) -> None:
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    if not (progress and sys.stderr.isatty()):  # without a terminal, a bar is a line of \r noise
        hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(path), safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(str(path))


def _round_to_fp16(model: torch.nn.Module, name: str) -> None:
    """Round every weight to the nearest float16 (kept as float32), before the model is measured
    and saved: the shipped copy stores float16 (half the bytes, ``oppo.task.shipped``) and turns
    back into exactly the float32 file this build writes, and every metric in ``prepare.json``
    is of the weights a run loads. The weights of these models are far inside float16's range."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            half = p.to(torch.float16)
            if not torch.isfinite(half).all():
                raise RuntimeError(f"{name}: weight {pname} does not fit in float16 (largest "
                                   f"{p.abs().max().item():.3g}); the build went wrong")
            p.copy_(half)


def _quantile(sorted_values: list[int], q: float) -> int:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _std(x: list[float]) -> float:
    m = sum(x) / len(x)
    return math.sqrt(sum((v - m) ** 2 for v in x) / len(x))


def _pearson(x: list[float], y: list[float]) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sx = math.sqrt(sum((a - mx) ** 2 for a in x))
    sy = math.sqrt(sum((b - my) ** 2 for b in y))
    return sxy / (sx * sy) if sx > 0 and sy > 0 else 0.0


def _ranks(x: list[float]) -> list[float]:
    order = sorted(range(len(x)), key=lambda i: x[i])
    ranks = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2  # ties share their mean rank
        i = j + 1
    return ranks


def _spearman(x: list[float], y: list[float]) -> float:
    return _pearson(_ranks(x), _ranks(y))


def _versions() -> dict:
    import tokenizers
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "python": sys.version.split()[0], "cpu": _cpu_name()}


def _cpu_name() -> str:
    """The CPU model: the build is deterministic on one kind of CPU (with the same library versions
    and thread count), not across kinds, whose float kernels differ (README, "deterministic")."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


BUILD_THREADS = 1
"""Torch intra-op threads of the build, whatever the machine and its load.

Fixed so that the models depend on the seed alone: torch's CPU reductions split their work
across threads, so a sum (a loss, a gradient norm) rounds differently at another thread count
(``torch.randn(4_000_000).sum()`` at 1 and 2 threads differs in its 6th digit, torch 2.13 CPU),
and 700 steps of training carry that into other weights. The build took the idle cores before,
so two users with the same seed got different models depending on their machine's load at the
start (issue 51). One thread, because the models are tiny and their matmuls sync often: on the
2-core machine busy with other jobs, 15 SFT steps took 139-189 s wall with 2 threads against
53-56 s with 1; on idle cores 2 threads were faster (docs/task.md). The shipped models
(``oppo.task.shipped``) make the build rare."""


@contextlib.contextmanager
def _threads():
    """The build's :data:`BUILD_THREADS`, then the caller's count again."""
    before = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _lock(path: Path):
    """An exclusive lock so two processes don't build the same cache at once (POSIX only)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no lock
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_stale_tmp(home: Path, name: str) -> None:
    """Delete temp (and moved-aside) dirs left by killed prepares (their pid is gone)."""
    for d in [*home.glob(f".{name}.tmp-*"), *home.glob(f".{name}.old-*")]:
        try:
            pid = int(d.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if pid == os.getpid() or not pid_alive(pid):
            shutil.rmtree(d, ignore_errors=True)


def _swap_into_place(tmp: Path, root: Path) -> None:
    """Rename the finished build to ``root``; an old ``root`` is moved aside, then deleted."""
    old = None
    if root.exists():
        old = root.with_name(f".{root.name}.old-{os.getpid()}-{time.time_ns()}")
        root.rename(old)
    tmp.rename(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _prepared(task: Task, root: Path, info: dict, reused: bool) -> Prepared:
    return Prepared(
        task=task, root=root, policy_path=root / "policy",
        reward_path=(root / "reward") if "reward" in info.get("weights_sha256", {}) else None,
        tokenizer_path=root / "tokenizer", prompts_path=root / "prompts.jsonl",
        eval_prompts_path=root / "eval_prompts.jsonl", info=info, reused=reused)


__all__ = ["PREPARE_VERSION", "PrepareSizes", "Prepared", "default_home", "default_sizes",
           "fingerprint", "prepare", "read_task_prompts", "verify"]
