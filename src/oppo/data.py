"""Prompt sets: JSONL, anything ``datasets`` loads, or (from Python) a ``datasets.Dataset`` or a
list of str or dicts; tokenised once; an endless seeded stream. A prompt is a text or a
conversation: a list of messages (``[{"role": "user", "content": "..."}]``, the format of TRL's
conversational data sets), which always goes through the tokenizer's chat template.

Position ``i`` of the stream is prompt ``order(epoch)[i % N]`` with ``epoch = i // N`` and a
per-epoch permutation seeded by ``(seed, epoch)``, so the data position alone (an int saved in
checkpoints) says which prompt comes next, and which record a sequence came from: the record's
other columns, which a reward function may ask for (``scoring.reward_fn``), are looked up by it
(:meth:`PromptSet.context`), never copied into checkpoints.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field as dc_field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:  # (the config reads no data: no import back at run time)
    from .config import DataConfig


class DataError(ValueError):
    """The prompt set cannot be used; the message names the file, line or field."""


RAW_PROMPTS, FORMATTED_PROMPTS = "raw_prompts", "formatted_prompts"
"""The inputs every record gives a reward function besides its columns (``PromptSet.context``)."""
ALL_COLUMNS = ("*",)
"""``columns=ALL_COLUMNS``: carry every column (a reward function with ``**kwargs``)."""


def is_conversation(x: Any) -> bool:
    """Whether ``x`` is a prompt given as messages: a non-empty list of dicts, each with a ``role``
    and a ``content``."""
    return (isinstance(x, (list, tuple)) and len(x) > 0
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in x))


def is_prompt(x: Any) -> bool:
    """A text or a conversation (:func:`is_conversation`)."""
    return isinstance(x, str) or is_conversation(x)


MESSAGES = '[{"role": "user", "content": "..."}]'


def _prompt_value(x: Any) -> Any:
    """A prompt as read: a conversation as a list of plain dicts, anything else as text."""
    return [dict(m) for m in x] if is_conversation(x) else str(x)


@dataclass
class Records:
    """A prompt set as read, before tokenising: each record's prompt and the other columns asked
    for (name -> one value per record); ``available``: every column every record has."""

    texts: list  # each a str, or a conversation (a list of message dicts)
    columns: dict[str, list] = dc_field(default_factory=dict)
    available: list[str] = dc_field(default_factory=list)


def _wanted(available: Sequence[str], columns: Sequence[str]) -> list[str]:
    return list(available) if tuple(columns) == ALL_COLUMNS else [c for c in columns if c in available]


def read_jsonl(path: Path, field: str) -> list[str]:
    return read_jsonl_records(path, field).texts


def read_jsonl_records(path: Path, field: str, columns: Sequence[str] = ()) -> Records:
    """The records of a JSONL file; ``columns``: the other fields to carry (where every record has them)."""
    out, recs = [], []
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
            if not is_prompt(rec[field]):
                raise DataError(f"{path}:{lineno}: field {field!r} must be a string or a list of messages "
                                f"({MESSAGES}), got {_kind(rec[field])}.")
            out.append(rec[field])
            if columns:
                recs.append(rec)
    return _from_dicts(out, recs, columns)


def _kind(x: Any) -> str:
    if isinstance(x, list):
        return "a list that is not messages (each needs a 'role' and a 'content')" if x else "an empty list"
    return type(x).__name__


def _from_dicts(texts: list[str], recs: list[dict], columns: Sequence[str]) -> Records:
    """``Records`` of ``texts`` with the ``columns`` every one of ``recs`` (dicts) has."""
    if not recs:
        return Records(texts)
    available = [k for k in recs[0] if all(k in r for r in recs)]
    return Records(texts, {c: [r[c] for r in recs] for c in _wanted(available, columns)}, available)


def records_from_object(obj: Any, field: str, split: str = "train", columns: Sequence[str] = ()) -> Records:
    """A prompt set given from Python: a ``datasets.Dataset`` (or ``DatasetDict``: its ``split``),
    a list of str, or a list of dicts with the prompt under ``field``. Raises DataError naming
    what is wrong (:func:`object_problems` finds the same before anything loads)."""
    problems = object_problems(obj, field, split)
    if problems:
        raise DataError(problems[0])
    available = object_columns(obj, field, split)
    if _is_dataset(obj):
        ds = obj[split] if _is_dataset_dict(obj) else obj
        return Records([_prompt_value(x) for x in ds[field]], {c: list(ds[c]) for c in _wanted(available, columns)},
                       available)
    items = list(obj)
    if not isinstance(items[0], dict):  # the prompts themselves: texts or conversations
        return Records(items, {c: list(items) for c in _wanted(available, columns)}, available)
    return Records([r[field] for r in items], {c: [r[c] for r in items] for c in _wanted(available, columns)},
                   available)


def object_columns(obj: Any, field: str, split: str = "train") -> list[str]:
    """The columns every record of a prompt set given as an object has (one without problems:
    :func:`object_problems`), without reading its values."""
    if _is_dataset(obj):
        return list((obj[split] if _is_dataset_dict(obj) else obj).column_names)
    items = list(obj)
    if not isinstance(items[0], dict):
        return [field]
    return [k for k in items[0] if all(k in r for r in items)]


def _is_dataset(obj: Any) -> bool:
    return type(obj).__module__.startswith("datasets.")


def _is_dataset_dict(obj: Any) -> bool:
    return _is_dataset(obj) and isinstance(obj, dict)


def object_problems(obj: Any, field: str, split: str = "train") -> list[str]:
    """What is wrong with a prompt set given as an object (``prompts=``), in the words of the
    file checks: its type, emptiness, the prompt field ``data.field``."""
    key = "prompts"
    if _is_dataset(obj):
        if _is_dataset_dict(obj):
            if split not in obj:
                return [f"{key}: the DatasetDict has no split {split!r} (it has {', '.join(obj)}); set data.split."]
            obj = obj[split]
        if not hasattr(obj, "column_names") or not hasattr(obj, "__len__"):
            return [f"{key}: a {type(obj).__name__} cannot be read as a whole (a streaming dataset); give a "
                    f"datasets.Dataset (load_dataset(..., streaming=False)) or a list."]
        if field not in obj.column_names:
            return [f"{key}: the Dataset has no column {field!r} (it has {', '.join(obj.column_names)}); set "
                    f"data.field."]
        if len(obj) == 0:
            return [f"{key}: the Dataset is empty. Give at least one prompt."]
        bad = next((i for i, x in enumerate(obj[field]) if x is None), None)
        return [] if bad is None else [f"{key}: record {bad} has no value in column {field!r}."]
    if isinstance(obj, (str, bytes)) or not isinstance(obj, (list, tuple)):
        return [f"{key} must be a datasets.Dataset, a list of str or a list of dicts (with the prompt under "
                f"data.field={field!r}), got {type(obj).__name__}. (A path is given as data.prompts.)"]
    if not obj:
        return [f"{key} is an empty list. Give at least one prompt."]
    if all(is_prompt(x) for x in obj):  # texts, conversations (lists of messages), or both
        return []
    for i, x in enumerate(obj):
        if not isinstance(x, dict):
            return [f"{key}[{i}] is {_kind(x)}: give a list of prompts (each a str or a list of messages, "
                    f"{MESSAGES}), or a list of dicts each with the prompt under data.field={field!r}, not a mix."]
        if field not in x:
            return [f"{key}[{i}] has no key {field!r} (it has {', '.join(map(repr, x)) or 'none'}); set "
                    f"data.field to the name of the prompt field."]
        if not is_prompt(x[field]):
            return [f"{key}[{i}][{field!r}] must be a string or a list of messages ({MESSAGES}), got "
                    f"{_kind(x[field])}."]
    return []


_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt")


def source_problems(source: str | None, field: str) -> tuple[list[str], str | None]:
    """``data.prompts``' problems found without reading the whole set (present, not empty, its
    first record readable with the prompt field ``data.field``), and the hub dataset it names
    (None: a local file or directory, or nothing). ``source``: a path or hub name, None for none."""
    if not source:
        return [], None
    if source.lstrip().startswith("["):
        return [f"data.prompts={source!r} looks like a list of prompts, but data.prompts names a file or "
                f"data set. Write the prompts to a JSONL file (one {{\"{field}\": ...}} per line), "
                f"or, from Python, pass the list: oppo.train(cfg, prompts=[...])."], None
    p = Path(source).expanduser()
    if not (p.exists() or source.startswith(("/", "./", "../", "~")) or p.suffix in _SUFFIXES):
        return [], source
    if not p.exists():
        return [f"data.prompts={source!r}: no such file or directory. Set data.prompts to an existing "
                f"prompt file (JSONL with a {field!r} field per line)."], None
    if p.is_dir():
        return ([f"data.prompts={source!r} is an empty directory."] if not any(p.iterdir()) else []), None
    if p.suffix not in _SUFFIXES:
        return [f"data.prompts={source!r}: cannot tell its format from the name; use .jsonl (one "
                f"{{\"{field}\": ...}} object per line), .json, .csv, .parquet or .txt."], None
    if p.suffix == ".parquet":
        return [], None  # binary: the reader checks it
    first = _first_line(p)
    if first is None:
        return [f"data.prompts={source!r} is empty. Give a file with at least one prompt."], None
    if p.suffix == ".jsonl" or (p.suffix == ".json" and first[1].lstrip().startswith("{")):
        lineno, line = first
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            return [f"{source}:{lineno}: not valid JSON ({e.msg}). Each line must be one JSON object such as "
                    f"{{\"{field}\": \"...\"}}."], None
        if not isinstance(rec, dict) or field not in rec:
            keys = ", ".join(map(repr, rec)) if isinstance(rec, dict) else "none"
            return [f"{source}:{lineno}: no field {field!r} (the record has {keys}). Set data.field to the name "
                    f"of the prompt field."], None
    return [], None


def _first_line(p: Path) -> tuple[int, str] | None:
    """(line number, text) of a text file's first non-blank line, None if it has none."""
    with open(p, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                return lineno, line
    return None


def known_columns(source: str | None, obj: Any, field: str, split: str) -> list[str] | None:
    """The prompt set's columns where they are known without reading it: an object's (``obj``), a
    JSONL file's first record's keys, a CSV file's header; else None. ``source``: ``data.prompts``."""
    if obj is not None:
        return None if object_problems(obj, field, split) else object_columns(obj, field, split)
    if source is None:
        return None
    p = Path(source).expanduser()
    if not p.is_file() or p.suffix not in (".jsonl", ".json", ".csv"):
        return None
    try:
        first = _first_line(p)
        if first is None:
            return None
        if p.suffix == ".csv":
            import csv

            return next(csv.reader([first[1]]), [])
        rec = json.loads(first[1])
    except (OSError, ValueError):
        return None
    return list(rec) if isinstance(rec, dict) else None


def read_prompts(source: str, field: str = "prompt", split: str = "train") -> list[str]:
    """Prompts from a .jsonl file, or a local file/directory or hub name that ``datasets`` loads."""
    return read_records(source, field, split).texts


def read_records(source: str, field: str = "prompt", split: str = "train", columns: Sequence[str] = ()) -> Records:
    """:func:`read_prompts` with the other ``columns`` each record has (``ALL_COLUMNS``: all)."""
    p = Path(source).expanduser()
    if p.suffix == ".jsonl" or (p.is_file() and p.suffix == ".json" and _is_jsonl(p)):
        if not p.is_file():
            raise DataError(f"Prompt file {source} not found. Set data.prompts to an existing file.")
        records = read_jsonl_records(p, field, columns)
    else:
        records = _read_with_datasets(source, p, field, split, columns)
    if not records.texts:
        raise DataError(f"The prompt set {source} is empty. Give a file with at least one prompt.")
    return records


def _is_jsonl(p: Path) -> bool:
    first = p.read_text(encoding="utf-8").lstrip()[:1]
    return first == "{"


def _read_with_datasets(source: str, p: Path, field: str, split: str, columns: Sequence[str] = ()) -> Records:
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
    cols = _wanted(ds.column_names, columns)
    return Records([_prompt_value(x) for x in values], {c: list(ds[c]) for c in cols}, list(ds.column_names))


@dataclass
class PromptSet:
    """Tokenised prompts plus counts of those truncated or skipped (reported in the metrics).

    ``texts``: each prompt as the policy sees it (chat template applied, truncated); ``raw``: as
    the data set holds it (a text, or a conversation's messages); ``columns``: the other columns
    carried for the reward function and the judge (name -> one value per prompt), all aligned with
    ``ids``; ``templated``: some prompts went through the tokenizer's chat template."""

    texts: list[str]
    ids: list[list[int]]
    truncated: int
    skipped: int
    seed: int
    shuffle: bool
    raw: list = dc_field(default_factory=list)
    columns: dict[str, list] = dc_field(default_factory=dict)
    templated: bool = False
    sources: list[int] = dc_field(default_factory=list)
    """Each prompt's record number in the data as given (its line of a JSONL file, its row of a data
    set), where prompts were skipped; empty: the same as its index."""
    budget: int | None = None
    """The most tokens a prompt was allowed (``data.max_prompt_tokens``, or where that is empty the
    models' positions less ``generation.max_new_tokens``); None: no limit was known, none was cut."""
    setting: int | None = None
    """``data.max_prompt_tokens`` as set (None: empty)."""

    @property
    def width(self) -> int:
        """The prompt columns a rollout backend reserves: ``data.max_prompt_tokens`` where set (the
        shapes stay the setting's), else the longest prompt kept (with the setting empty the budget
        can be a large model's whole context: no column for a prompt that is not there)."""
        return self.setting if self.setting is not None else max(map(len, self.ids))

    def __len__(self) -> int:
        return len(self.ids)

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self)))
        g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        return torch.randperm(len(self), generator=g).tolist()

    def record(self, position: int) -> int:
        """The index (into ``texts``, ``ids``, ...) of the prompt at data position ``position``."""
        epoch, i = divmod(position, len(self))
        orders = self.__dict__.setdefault("_orders", {})
        if epoch not in orders:
            if len(orders) >= 2:  # this epoch's and the one before (carried sequences): no more
                orders.pop(min(orders))
            orders[epoch] = self.order(epoch)
        return orders[epoch][i]

    def record_numbers(self, positions: Sequence[int]) -> list[int]:
        """The record numbers in the data as given (0-based) of the prompts at data positions
        ``positions``: what a message names, not the position (past the set's end after an epoch)."""
        idx = [self.record(p) for p in positions]
        return [self.sources[j] for j in idx] if self.sources else idx

    def at(self, position: int) -> tuple[str, list[int]]:
        j = self.record(position)
        return self.texts[j], self.ids[j]

    def context(self, positions: Sequence[int]) -> dict[str, list]:
        """The inputs a reward function may ask for by keyword (``scoring.reward_fn``), for the
        prompts at data positions ``positions``: ``raw_prompts``, ``formatted_prompts`` and each
        carried column, one value per position."""
        idx = [self.record(p) for p in positions]
        out = {name: [values[j] for j in idx] for name, values in self.columns.items()}
        out[RAW_PROMPTS] = [(self.raw or self.texts)[j] for j in idx]
        out[FORMATTED_PROMPTS] = [self.texts[j] for j in idx]
        return out


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


def build_prompt_set(texts: list, tokenizer, cfg: DataConfig, seed: int,
                     columns: dict[str, list] | None = None, room: int | None = None,
                     say=lambda line: print(line, file=sys.stderr)) -> PromptSet:
    """Tokenise the prompts: a conversation (a list of messages) through the tokenizer's chat
    template, a text too when ``data.chat_template`` asks (as one user message). A prompt longer
    than its budget, ``data.max_prompt_tokens``, or where that is empty ``room`` (the models'
    positions less ``generation.max_new_tokens``: every prompt that fits is kept whole; None, no
    model names its positions: none is cut), is skipped, or truncated: its frame (BOS, the
    template's header and assistant turn) stays and the start of the user's text is cut, keeping
    its end, nearest to where the response begins. The prompt text the reward function sees is
    then the decoded truncated prompt, what the policy actually saw. When any prompt is cut or
    skipped, one line through ``say`` says how many and names the setting to change (issue 53:
    a metric was the only sign). ``columns``: the records' other columns (one value per text),
    kept for the prompts kept.

    Tokenised with ``verbose=False``: transformers' "Token indices sequence length is longer than
    the specified maximum sequence length for this model ... will result in indexing errors" is
    about the tokenizer's ``model_max_length``, not about the models oppo runs (whose positions
    the run checks itself, ``models.context_problem``), and came with every long prompt set."""
    raw = list(texts)
    chats = [is_conversation(t) for t in raw]
    templated = [c or cfg.chat_template for c in chats]
    if any(templated) and not getattr(tokenizer, "chat_template", None):
        if any(chats):
            first = chats.index(True)
            raise DataError(f"prompt {first} (and {sum(chats) - 1} more) is a conversation (a list of messages), "
                            f"which goes through the tokenizer's chat template, but the policy's tokenizer has none. "
                            f"Use a tokenizer with a chat template (an instruct model's), or give plain-text "
                            f"prompts.")
        raise DataError("data.chat_template=true but the policy's tokenizer has no chat template; "
                        "set data.chat_template=false or use a tokenizer with one.")
    texts = [tokenizer.apply_chat_template(t if c else [{"role": "user", "content": t}], tokenize=False,
                                           add_generation_prompt=True) if tm else t
             for t, c, tm in zip(raw, chats, templated)]
    budget = cfg.max_prompt_tokens if cfg.max_prompt_tokens is not None else room
    setting = (f"data.max_prompt_tokens={budget}" if cfg.max_prompt_tokens is not None else
               f"data.max_prompt_tokens (empty: the models' positions less generation.max_new_tokens, {budget})")
    frames: dict[bool, list[int]] = {}
    keep_texts, ids, kept, truncated, skipped, too_long, longest = [], [], [], 0, 0, 0, 0
    for j, t in enumerate(texts):
        tm = templated[j]
        tok = tokenizer(t, add_special_tokens=not tm, verbose=False)["input_ids"]  # (verbose: the docstring)
        if not tok:
            skipped += 1
            continue
        if budget is not None and len(tok) > budget:
            too_long += 1
            longest = max(longest, len(tok))
            if cfg.on_long_prompt == "skip":
                skipped += 1
                continue
            if tm not in frames:
                frames[tm] = _frame(tokenizer, tm)
            cut = _truncate(tok, frames[tm], budget)
            if cut is None:
                raise DataError(f"{setting} leaves no room for the prompt's text beside its frame tokens (BOS, "
                                f"chat template: {len(frames[tm])}); raise it"
                                + ("" if cfg.max_prompt_tokens is not None else
                                   " by lowering generation.max_new_tokens") + ".")
            tok = cut
            t = tokenizer.decode(tok, skip_special_tokens=not tm)
            truncated += 1
        keep_texts.append(t)
        ids.append(tok)
        kept.append(j)
    if too_long:
        done = "skipped (data.on_long_prompt=skip)" if cfg.on_long_prompt == "skip" else \
            "cut to it, keeping their ends (data.on_long_prompt=skip drops them instead)"
        say(f"oppo: {too_long} of {len(texts)} prompts are longer than {setting} tokens (the longest {longest}) "
            f"and were {done}; to keep them whole, raise data.max_prompt_tokens"
            + (" or lower generation.max_new_tokens" if cfg.max_prompt_tokens is None else
               " (empty: as much as the models' positions leave)") + ".")
    if not ids:
        raise DataError(f"No usable prompt: all {len(texts)} were empty or longer than {setting} with "
                        f"data.on_long_prompt=skip.")
    return PromptSet(keep_texts, ids, truncated, skipped, seed, cfg.shuffle, raw=[raw[j] for j in kept],
                     columns={name: [values[j] for j in kept] for name, values in (columns or {}).items()},
                     templated=any(templated[j] for j in kept), sources=kept if skipped else [], budget=budget,
                     setting=cfg.max_prompt_tokens)
