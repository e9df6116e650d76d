"""Tiny Llama models for the built-in tasks: build, SFT-train, sample, reward-model-train.

Everything here runs on CPU in a few minutes and is deterministic given the seed: data order
comes from ``random.Random(seed)``, weights and sampling from seeded ``torch`` generators.

Sequence layout (policy and reward model alike)::

    <bos> prompt tokens ... response tokens ... [<eos>]

``<eos>`` is present when the response ended; a response cut off by ``max_new_tokens`` has
none. The reward model reads its score at the last real token (``LlamaForSequenceClassification``
pools at the last non-pad token, so left or right padding both work).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import (
    DynamicCache,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

from oppo.task.tokenizer import BOS_ID, EOS_ID, PAD_ID


@dataclass(frozen=True)
class ModelSize:
    """Shape of a tiny Llama."""

    hidden: int = 192
    layers: int = 4
    heads: int = 4
    intermediate: int = 512
    max_positions: int = 512

    def to_dict(self) -> dict:
        return asdict(self)


def llama_config(size: ModelSize, vocab_size: int, **extra) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.heads,
        max_position_embeddings=size.max_positions,
        tie_word_embeddings=True,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        **extra,
    )


def build_policy(size: ModelSize, vocab_size: int, max_new_tokens: int) -> LlamaForCausalLM:
    model = LlamaForCausalLM(llama_config(size, vocab_size))
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
    )
    return model


def build_reward_model(size: ModelSize, vocab_size: int,
                       init_from: LlamaForCausalLM | None = None) -> LlamaForSequenceClassification:
    """A ``num_labels=1`` scorer; the transformer starts from ``init_from`` (the SFT policy) when
    given -- the usual RLHF recipe, and it makes the few-minute training budget enough."""
    model = LlamaForSequenceClassification(llama_config(size, vocab_size, num_labels=1))
    if init_from is not None:
        missing, unexpected = model.model.load_state_dict(init_from.model.state_dict(), strict=True)
        assert not missing and not unexpected
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.02 / math.sqrt(size.hidden))
    return model


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- batching -----------------------------------------------------------------------------------


def _pad_right(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # [B, T]
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def _pad_left(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # [B, T]
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids, mask


def sortish_batches(lengths: list[int], batch_size: int, rng: random.Random,
                    pool: int = 50) -> list[list[int]]:
    """Index batches of similar lengths (little padding with a long tail), in random order:
    shuffle, sort within pools of ``pool`` batches, cut, shuffle the batches."""
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    batches: list[list[int]] = []
    span = batch_size * pool
    for start in range(0, len(idx), span):
        chunk = sorted(idx[start:start + span], key=lambda i: lengths[i])
        batches += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def _lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _bar(total: int, desc: str, progress: bool):
    from tqdm.auto import tqdm

    import sys

    # A bar redrawn into a log file (CI, nohup) is thousands of lines; there the "[oppo prepare]"
    # summary lines already say where prepare is.
    return tqdm(total=total, desc=desc, disable=not (progress and sys.stderr.isatty()), leave=False,
                dynamic_ncols=True, mininterval=0.5)


# --- SFT ----------------------------------------------------------------------------------------


def train_sft(model: LlamaForCausalLM, seqs: list[list[int]], *, steps: int, batch_size: int,
              lr: float, seed: int, progress: bool = True, desc: str = "sft",
              tick: Callable[[int], None] | None = None) -> dict:
    """Next-token cross-entropy on every token of each ``<bos> prompt response <eos>`` sequence.
    ``tick(n)``: called with the steps done after each one (``prepare``'s progress lines)."""
    torch.manual_seed(seed)
    rng = random.Random(f"sft-{seed}")
    lengths = [len(s) for s in seqs]
    mean_tokens = sum(lengths) / len(lengths) - 1  # predicted tokens per sequence
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    model.train()
    batches: list[list[int]] = []
    losses: list[tuple[float, int]] = []  # (per-token mean loss, tokens) per step
    bar = _bar(steps, desc, progress)
    for step in range(steps):
        if not batches:
            batches = sortish_batches(lengths, batch_size, rng)
        ids, mask = _pad_right([seqs[i] for i in batches.pop()])  # [B, T]
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, lr, warmup=max(1, steps // 20))
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]  # [B, T-1, V]
        targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)  # [B, T-1]
        # Sum over tokens / a constant, not a per-batch mean: batches are length-sorted, and a
        # per-batch mean would weight the tokens of short texts more, which over-predicts an
        # early EOS and cuts the long tail short.
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=-100, reduction="sum") / (len(ids) * mean_tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        n_tok = int((targets != -100).sum())
        losses.append((loss.item() * len(ids) * mean_tokens / n_tok, n_tok))  # per-token mean
        bar.update(1)
        if tick is not None:
            tick(step + 1)
        if step % 20 == 0:
            bar.set_postfix(loss=f"{_token_mean(losses[-20:]):.3f}")
    bar.close()
    model.eval()
    return {"final_loss": _token_mean(losses[-max(1, steps // 10):]), "steps": steps}


def _token_mean(losses: list[tuple[float, int]]) -> float:
    return sum(l * n for l, n in losses) / max(1, sum(n for _, n in losses))


# --- sampling -----------------------------------------------------------------------------------


@dataclass
class Sample:
    """One sampled response. ``ids`` excludes ``<eos>``; ``ended`` says whether it was emitted."""

    prompt_index: int
    ids: list[int]
    ended: bool


@torch.no_grad()
def sample(model: LlamaForCausalLM, prompts: list[list[int]], *, max_new_tokens: int,
           batch_size: int, seed: int, temperature: float = 1.0,
           progress: bool = False, tick: Callable[[int], None] | None = None) -> list[Sample]:
    """Sample one response per prompt (ids start with ``<bos>``), plain multinomial sampling.
    ``tick(n)``: called with the responses done after each batch.

    A small KV-cache loop rather than ``model.generate``: rows that emitted ``<eos>`` leave the
    batch at once, which matters with a long tail (most rows finish in a few tokens)."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    out: list[Sample] = []
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # less left padding
    bar = _bar(len(prompts), "sample", progress)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        ids, mask = _pad_left([prompts[i] for i in rows])  # [B, P]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                       past_key_values=cache, use_cache=True).logits[:, -1]  # [B, V]
        alive = torch.arange(len(rows))  # batch row -> index into rows
        next_pos = pos[:, -1] + 1  # [B]
        tokens: list[list[int]] = [[] for _ in rows]
        ended = [False] * len(rows)
        for _ in range(max_new_tokens):
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            tok = torch.multinomial(probs, 1, generator=gen).squeeze(1)  # [b]
            tok_list = tok.tolist()  # CPU-GPU sync point (once per decode step)
            keep: list[int] = []
            for j, (row, t) in enumerate(zip(alive.tolist(), tok_list)):
                if t == EOS_ID:
                    ended[row] = True
                else:
                    tokens[row].append(t)
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(tok_list):
                sel = torch.tensor(keep, dtype=torch.long)
                cache.batch_select_indices(sel)
                alive, tok, mask, next_pos = alive[sel], tok[sel], mask[sel], next_pos[sel]
            mask = torch.cat([mask, torch.ones((len(keep), 1), dtype=mask.dtype)], dim=1)
            logits = model(input_ids=tok[:, None], attention_mask=mask,
                           position_ids=next_pos[:, None], past_key_values=cache,
                           use_cache=True).logits[:, -1]
            next_pos = next_pos + 1
        out += [Sample(rows[j], tokens[j], ended[j]) for j in range(len(rows))]
        bar.update(len(rows))
        if tick is not None:
            tick(len(out))
    bar.close()
    out.sort(key=lambda s: s.prompt_index)
    return out


# --- reward model -------------------------------------------------------------------------------


def train_reward_model(model: LlamaForSequenceClassification,
                       pairs: list[tuple[list[int], list[int]]], *, steps: int, batch_size: int,
                       lr: float, seed: int, progress: bool = True,
                       tick: Callable[[int], None] | None = None) -> dict:
    """Bradley-Terry: minimise ``-log sigmoid(r(chosen) - r(rejected))`` over (chosen, rejected)
    id sequences. ``tick(n)``: called with the steps done after each one."""
    torch.manual_seed(seed)
    rng = random.Random(f"rm-{seed}")
    lengths = [max(len(c), len(r)) for c, r in pairs]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    model.train()
    batches: list[list[int]] = []
    losses: list[float] = []
    accs: list[float] = []
    bar = _bar(steps, "reward model", progress)
    for step in range(steps):
        if not batches:
            batches = sortish_batches(lengths, batch_size, rng)
        b = batches.pop()
        ids, mask = _pad_right([pairs[i][0] for i in b] + [pairs[i][1] for i in b])  # [2B, T]
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, lr, warmup=max(1, steps // 20))
        r = model(input_ids=ids, attention_mask=mask).logits[:, 0]  # [2B]
        margin = r[: len(b)] - r[len(b):]
        loss = -F.logsigmoid(margin).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        accs.append((margin > 0).float().mean().item())
        bar.update(1)
        if tick is not None:
            tick(step + 1)
        if step % 20 == 0:
            n = min(20, len(losses))
            bar.set_postfix(loss=f"{sum(losses[-n:]) / n:.3f}", acc=f"{sum(accs[-n:]) / n:.2f}")
    bar.close()
    model.eval()
    tail = max(1, steps // 10)
    return {"final_loss": sum(losses[-tail:]) / tail, "final_train_accuracy": sum(accs[-tail:]) / tail,
            "steps": steps}


@torch.no_grad()
def reward_model_scores(model: LlamaForSequenceClassification, seqs: list[list[int]],
                        batch_size: int = 128) -> list[float]:
    model.eval()
    out = [0.0] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        ids, mask = _pad_right([seqs[i] for i in rows])
        scores = model(input_ids=ids, attention_mask=mask).logits[:, 0].tolist()
        for i, s in zip(rows, scores):
            out[i] = s
    return out
