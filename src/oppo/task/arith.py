"""The built-in ``arith`` task: small questions with one verifiable number as the answer.

Rule-rewarded: no reward model, ``reward`` below is the whole reward (and the judge). Prompts:

    what is 7 plus 5?              -> the answer is 12.
    what is 13 minus 4?            -> the answer is 9.
    how many words are in cat sun dog?  -> the answer is 3.

Operands are 0-20 (differences never negative), word lists have 1-9 words. Every number is one
token (``0`` ... ``40``). The SFT policy is trained only briefly, so it answers right only part
of the time (``sft_accuracy`` in ``prepare.json``) and PPO has room to improve.

``reward``: 1.0 when the first number in the response is the right answer, 0.0 for a wrong
number, -0.5 when the response has no number at all; 0.2 less when the response does not end
with ``.`` (cut off, or stopped mid-sentence).
"""

from __future__ import annotations

import random
import re

from oppo.task.text import detokenize

MAX_OPERAND = 20
MAX_WORDS = 9
ITEMS = tuple("""
apple cat dog sun tree book cup hat fish bird car star moon rock shoe door bell coin key leaf
""".split())
NUMBERS = tuple(str(i) for i in range(2 * MAX_OPERAND + 1))
WORDS = ("what", "is", "plus", "minus", "how", "many", "words", "are", "in", "the", "answer")
PUNCTUATION = ("?", ".")

CORRECT, WRONG, NO_ANSWER, CUTOFF_PENALTY = 1.0, 0.0, -0.5, 0.2
MAX_NEW_TOKENS = 16

_ADD = re.compile(r"what is (\d+) plus (\d+)\s*\?")
_SUB = re.compile(r"what is (\d+) minus (\d+)\s*\?")
_COUNT = re.compile(r"how many words are in ([a-z ]+?)\s*\?")
_NUMBER = re.compile(r"\d+")


def vocabulary() -> list[str]:
    return list(WORDS + PUNCTUATION + NUMBERS + ITEMS)


def _question(rng: random.Random) -> tuple[list[str], int]:
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        return ["what", "is", str(a), "plus", str(b), "?"], a + b
    if kind == 1:
        a = rng.randint(0, MAX_OPERAND)
        b = rng.randint(0, a)
        return ["what", "is", str(a), "minus", str(b), "?"], a - b
    k = rng.randint(1, MAX_WORDS)
    words = [rng.choice(ITEMS) for _ in range(k)]
    return ["how", "many", "words", "are", "in", *words, "?"], k


def examples(n: int, seed: int, params: object = None) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """``n`` (prompt tokens, response tokens) pairs with correct answers, deterministic in seed."""
    rng = random.Random(f"oppo-arith-{seed}")
    out: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    for _ in range(n):
        q, answer = _question(rng)
        out.append((tuple(q), ("the", "answer", "is", str(answer), ".")))
    return out


def make_prompts(n: int, seed: int, params: object = None) -> list[str]:
    return [detokenize(p) for p, _ in examples(n, seed)]


def answer_of(prompt: str) -> int | None:
    """The right answer to a task prompt, or None if the prompt is not one of this task's."""
    p = prompt.lower()
    if m := _ADD.search(p):
        return int(m.group(1)) + int(m.group(2))
    if m := _SUB.search(p):
        return int(m.group(1)) - int(m.group(2))
    if m := _COUNT.search(p):
        return len(m.group(1).split())
    return None


def _first_number_right(prompts: list[str], responses: list[str]) -> list[bool | None]:
    """Per response: whether its first number is the right answer (None: it has no number).
    Raises on a prompt that is not an arith question."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    out = []
    for prompt, response in zip(prompts, responses):
        truth = answer_of(prompt)
        if truth is None:
            raise ValueError(f"not an arith prompt: {prompt!r}")
        m = _NUMBER.search(response)
        out.append(None if m is None else int(m.group()) == truth)
    return out


def accuracy(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 where the first number in the response is the right answer, else 0.0 (no cut-off
    penalty, no number counts as wrong): what a step logs as ``task/accuracy``."""
    return [float(right is True) for right in _first_number_right(prompts, responses)]


def reward(prompts: list[str], responses: list[str]) -> list[float]:
    """Rule reward: see the module docstring. Raises on a prompt that is not an arith question."""
    out = []
    for right, response in zip(_first_number_right(prompts, responses), responses):
        r = NO_ANSWER if right is None else (CORRECT if right else WRONG)
        if not response.rstrip().endswith("."):
            r -= CUTOFF_PENALTY
        out.append(r)
    return out
