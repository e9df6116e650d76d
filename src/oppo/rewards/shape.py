"""Format and length rewards: rules on a response's text, configured by keyword settings.

A composite term binds the settings (``reward.terms: [{function: format_reward, kwargs:
{pattern: think}}]``); each function checks them on an empty batch when the run is built, so a bad
setting stops the run before any model loads.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Sequence

from .terms import RewardTermSpec

FORMATS = {
    # a non-empty \boxed{...} answer anywhere
    "boxed": r"\\boxed\{\s*[^\s}]",
    # GSM8K's last line: "#### <number>" at the very end
    "gsm8k": r"####\s*-?[\d,]*\d(\.\d+)?\s*\Z",
    # one <think>...</think> block first, then a non-empty answer outside any think tag (R1's layout)
    "think": r"\A\s*<think>(?:(?!</?think>).)+</think>(?:(?!</?think>).)*\S(?:(?!</?think>).)*\Z",
}


@lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern:
    try:
        return re.compile(FORMATS.get(pattern, pattern), re.S)
    except re.error as e:
        raise ValueError(f"format_reward: pattern {pattern!r} is neither one of {sorted(FORMATS)} nor a valid "
                         f"regular expression ({e}).") from None


def format_reward(prompts: Sequence[str], responses: Sequence[str], pattern: str = "boxed", reward: float = 1.0,
                  penalty: float = 0.0, **_: Any) -> list[float]:
    """``reward`` for each response in which ``pattern`` is found (``re.search``, ``.`` matching
    newlines), else ``penalty``. ``pattern``: ``boxed`` (a ``\\boxed{...}`` answer), ``gsm8k`` (ends
    with ``#### N``), ``think`` (``<think>...</think>`` then an answer), or a regular expression."""
    rx = _compiled(str(pattern))
    for key, v in (("reward", reward), ("penalty", penalty)):
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ValueError(f"format_reward: {key} must be a number, got {v!r}.")
    return [float(reward) if rx.search(r) else float(penalty) for r in responses]


def boxed_format(prompts: Sequence[str], responses: Sequence[str], **_: Any) -> list[float]:
    """1.0 for a response with a non-empty ``\\boxed{...}`` answer, else 0.0."""
    return format_reward(prompts, responses, "boxed")


def gsm8k_format(prompts: Sequence[str], responses: Sequence[str], **_: Any) -> list[float]:
    """1.0 for a response ending in GSM8K's ``#### <number>`` line, else 0.0."""
    return format_reward(prompts, responses, "gsm8k")


def think_format(prompts: Sequence[str], responses: Sequence[str], **_: Any) -> list[float]:
    """1.0 for a response laid out as one ``<think>...</think>`` block then an answer, else 0.0."""
    return format_reward(prompts, responses, "think")


@lru_cache(maxsize=4)
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _length(text: str, unit: str, tokenizer: str | None) -> int:
    if unit == "tokens":
        assert tokenizer is not None  # (checked by length_penalty)
        return len(_tokenizer(tokenizer)(text, add_special_tokens=False)["input_ids"])
    return len(text) if unit == "chars" else len(text.split())


def length_penalty(prompts: Sequence[str], responses: Sequence[str], max_length: int | None = None, buffer: int = 0,
                   unit: str = "words", tokenizer: str | None = None, **_: Any) -> list[float]:
    """0 for a response of at most ``max_length - buffer`` units; then falling linearly to -1 at
    ``max_length`` (DAPO's soft overlong punishment, with ``buffer`` its L_cache); -1 beyond.
    ``buffer`` 0: a hard -1 past ``max_length``. ``unit``: ``words`` (whitespace-separated),
    ``chars``, or ``tokens`` of ``tokenizer`` (a model directory or hub name)."""
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
        raise ValueError(f"length_penalty needs max_length, a positive integer (in {unit}), got {max_length!r}.")
    if not isinstance(buffer, int) or isinstance(buffer, bool) or not 0 <= buffer <= max_length:
        raise ValueError(f"length_penalty: buffer must be an integer from 0 to max_length={max_length}, got {buffer!r}.")
    if unit not in ("words", "chars", "tokens"):
        raise ValueError(f"length_penalty: unit must be words, chars or tokens, got {unit!r}.")
    if unit == "tokens" and not tokenizer:
        raise ValueError("length_penalty: unit=tokens needs tokenizer, the model directory or hub name whose "
                         "tokens to count (e.g. the policy's path).")
    out = []
    for r in responses:
        n = _length(r, unit, tokenizer)
        if n <= max_length - buffer:
            out.append(0.0)
        elif n <= max_length:
            out.append((max_length - buffer - n) / buffer)
        else:
            out.append(-1.0)
    return out


FORMAT_REWARD = RewardTermSpec("format_reward", "reward where a response keeps a layout (pattern: boxed, gsm8k, "
                                                "think or a regular expression)", format_reward)
BOXED_FORMAT = RewardTermSpec("boxed_format", "format_reward with the boxed answer's layout", boxed_format)
GSM8K_FORMAT = RewardTermSpec("gsm8k_format", "format_reward with GSM8K's '#### N' final line", gsm8k_format)
THINK_FORMAT = RewardTermSpec("think_format", "format_reward with R1's <think>...</think> then an answer", think_format)
LENGTH_PENALTY = RewardTermSpec("length_penalty", "a penalty past a length, hard or DAPO's soft overlong one",
                                length_penalty)
