"""Prompt sets: JSONL or anything ``datasets`` loads; tokenised once; an endless seeded stream.

Position ``i`` of the stream is prompt ``order(epoch)[i % N]`` with ``epoch = i // N`` and a
per-epoch permutation seeded by ``(seed, epoch)``, so the data position alone (an int saved in
checkpoints) says which prompt comes next.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import DataConfig


class DataError(ValueError):
    """The prompt set cannot be used; the message names the file, line or field."""


def read_jsonl(path: Path, field: str) -> list[str]:
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}). Each line must be one JSON object "
                                f"such as {{\"{field}\": \"...\"}}.") from None
            if not isinstance(rec, dict) or field not in rec:
                raise DataError(f"{path}:{lineno}: no field {field!r} in this record. Set data.field to the "
                                f"name of the prompt field.")
            if not isinstance(rec[field], str):
                raise DataError(f"{path}:{lineno}: field {field!r} must be a string, got "
                                f"{type(rec[field]).__name__}.")
            out.append(rec[field])
    return out


def read_prompts(source: str, field: str = "prompt", split: str = "train") -> list[str]:
    """Prompts from a .jsonl file, or a local file/directory or hub name that ``datasets`` loads."""
    p = Path(source).expanduser()
    if p.suffix == ".jsonl" or (p.is_file() and p.suffix == ".json" and _is_jsonl(p)):
        if not p.is_file():
            raise DataError(f"Prompt file {source} not found. Set data.prompts to an existing file.")
        prompts = read_jsonl(p, field)
    else:
        prompts = _read_with_datasets(source, p, field, split)
    if not prompts:
        raise DataError(f"The prompt set {source} is empty. Give a file with at least one prompt.")
    return prompts


def _is_jsonl(p: Path) -> bool:
    first = p.read_text(encoding="utf-8").lstrip()[:1]
    return first == "{"


def _read_with_datasets(source: str, p: Path, field: str, split: str) -> list[str]:
    import datasets

    datasets.disable_progress_bars()
    try:
        if p.is_file():
            kind = {".csv": "csv", ".json": "json", ".parquet": "parquet", ".txt": "text"}.get(p.suffix)
            if kind is None:
                raise DataError(f"Cannot tell the format of {source}: use .jsonl, .json, .csv, .parquet or .txt.")
            ds = datasets.load_dataset(kind, data_files=str(p), split="train")
        elif p.is_dir():
            try:
                ds = datasets.load_from_disk(str(p))
            except FileNotFoundError:
                ds = datasets.load_dataset(str(p))
        elif source.startswith(("/", "./", "../", "~")) or p.suffix in (".json", ".csv", ".parquet", ".txt"):
            raise DataError(f"Prompt set {source} not found. Set data.prompts to an existing file or directory.")
        else:
            ds = datasets.load_dataset(source)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types; name the input and the cause
        raise DataError(f"Could not load the prompt set {source!r}: {type(e).__name__}: {e}") from None
    if isinstance(ds, (datasets.DatasetDict, dict)):
        if split not in ds:
            raise DataError(f"Prompt set {source} has no split {split!r} (it has {', '.join(ds)}); set data.split.")
        ds = ds[split]
    if field not in ds.column_names:
        raise DataError(f"Prompt set {source} has no column {field!r} (it has {', '.join(ds.column_names)}); "
                        f"set data.field.")
    values = ds[field]
    for i, x in enumerate(values):
        if x is None:
            raise DataError(f"Prompt set {source}: record {i} has no value in column {field!r}.")
    return [str(x) for x in values]


@dataclass
class PromptSet:
    """Tokenised prompts plus counts of those truncated or skipped (reported in the metrics)."""

    texts: list[str]
    ids: list[list[int]]
    truncated: int
    skipped: int
    seed: int
    shuffle: bool

    def __len__(self) -> int:
        return len(self.ids)

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self)))
        g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        return torch.randperm(len(self), generator=g).tolist()

    def at(self, position: int) -> tuple[str, list[int]]:
        epoch, i = divmod(position, len(self))
        if getattr(self, "_epoch", None) != epoch:
            self._epoch, self._order = epoch, self.order(epoch)
        j = self._order[i]
        return self.texts[j], self.ids[j]


def _frame(tokenizer, chat_template: bool) -> list[int]:
    """The tokens of an empty prompt: BOS (and EOS, for tokenizers that add one), or a chat
    template's system block, user header and assistant turn. Truncation keeps them."""
    if chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer("")["input_ids"]


def _truncate(tok: list[int], frame: list[int], budget: int) -> list[int] | None:
    """``tok`` cut to ``budget`` tokens: the frame's head and tail kept, the start of the text
    between them dropped. None when the frame alone fills the budget."""
    head = 0
    while head < min(len(tok), len(frame)) and tok[head] == frame[head]:
        head += 1
    tail = 0
    while tail < min(len(tok) - head, len(frame) - head) and tok[-1 - tail] == frame[-1 - tail]:
        tail += 1
    body = budget - head - tail
    if body < 1:
        return None
    return tok[:head] + tok[head: len(tok) - tail][-body:] + tok[len(tok) - tail:]


def build_prompt_set(texts: list[str], tokenizer, cfg: DataConfig, seed: int) -> PromptSet:
    """Tokenise the prompts (through the chat template when asked). A prompt longer than
    ``data.max_prompt_tokens`` is skipped, or truncated: its frame (BOS, the template's header
    and assistant turn) stays and the start of the user's text is cut, keeping its end, nearest
    to where the response begins. The prompt text the reward function sees is then the decoded
    truncated prompt, what the policy actually saw."""
    if cfg.chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("data.chat_template=true but the policy's tokenizer has no chat template; "
                            "set data.chat_template=false or use a tokenizer with one.")
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in texts]
    frame = None
    keep_texts, ids, truncated, skipped = [], [], 0, 0
    for t in texts:
        tok = tokenizer(t, add_special_tokens=not cfg.chat_template)["input_ids"]
        if not tok:
            skipped += 1
            continue
        if len(tok) > cfg.max_prompt_tokens:
            if cfg.on_long_prompt == "skip":
                skipped += 1
                continue
            if frame is None:
                frame = _frame(tokenizer, cfg.chat_template)
            cut = _truncate(tok, frame, cfg.max_prompt_tokens)
            if cut is None:
                raise DataError(f"data.max_prompt_tokens={cfg.max_prompt_tokens} leaves no room for the prompt's "
                                f"text beside its frame tokens (BOS, chat template: {len(frame)}); raise it.")
            tok = cut
            t = tokenizer.decode(tok, skip_special_tokens=not cfg.chat_template)
            truncated += 1
        keep_texts.append(t)
        ids.append(tok)
    if not ids:
        raise DataError(f"No usable prompt: all {len(texts)} were empty or longer than data.max_prompt_tokens="
                        f"{cfg.max_prompt_tokens} with data.on_long_prompt=skip.")
    return PromptSet(keep_texts, ids, truncated, skipped, seed, cfg.shuffle)
