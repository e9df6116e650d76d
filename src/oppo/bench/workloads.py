"""The response lengths a bench forces (log-normal workloads, named in :data:`WORKLOADS`) and the
synthetic random-weight models of the sizes in :data:`MODEL_SIZES`."""

from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import torch


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def length_sampler(sigma: float, median: float, max_len: int, seed: int):
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
        return length_sampler(self.sigma, self.median, self.max_new_tokens, seed)

    def scaled(self, max_new_tokens: int) -> "LengthWorkload":
        """The same shape at another maximum (smoke runs): median and clip scaled together."""
        f = max_new_tokens / self.max_new_tokens
        return LengthWorkload(f"{self.name} (x{f:g})", self.sigma, max(2, round(self.median * f)), max_new_tokens,
                              self.description)

    def stats(self, seed: int = 0, n: int = 2000) -> dict[str, float]:
        """p50, p99, max and p99/p50 of ``n`` draws (what a run's prompts draw from)."""
        lens = [self.sampler(seed)(i) for i in range(n)]
        p50, p99 = pct(lens, 0.5), pct(lens, 0.99)
        return {"p50": p50, "p99": p99, "max": max(lens), "p99_over_p50": p99 / p50, "mean": statistics.mean(lens)}


# p99/p50 = exp(2.326 sigma) = 5.7 at sigma 0.75; p99 ~ 240, max of 2000 draws 512 (the clip)
WORKLOADS = {
    "representative": LengthWorkload(
        "representative", sigma=0.75, median=42, max_new_tokens=512,
        description="long-tailed RLHF responses: log-normal lengths, median 42, sigma 0.75 (p99/p50 ~ 5.7), "
                    "clipped at 512 tokens; every mode draws the same length for the same prompt"),
}


class LlamaShape(TypedDict):
    """A Llama-style decoder's shape, as ``LlamaConfig`` keywords."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int


# Llama-style decoders built from config (random weights), for benchmarks on machines without
# internet: sizes count every parameter (embeddings and, for a causal LM, the untied lm_head).
MODEL_SIZES: dict[str, LlamaShape] = {
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


def synthetic_sampler(sigma: float, max_new_tokens: int, seed: int):
    """Log-normal response lengths with median max_new_tokens / 12, clipped to max_new_tokens."""
    return length_sampler(sigma, max(2, max_new_tokens // 12), max_new_tokens, seed)
