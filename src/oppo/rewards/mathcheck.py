"""Math answer checking with Hugging Face's ``math-verify`` (the ``[math]`` extra).

``math_accuracy`` scores a response 1.0 when the answer math-verify extracts from it (a
``\\boxed{}`` first, else the last LaTeX or plain expression) is mathematically equal to the gold
answer (``1/2`` = ``0.5`` = ``\\frac{1}{2}``, ``1,000`` = ``1000``), else 0.0. The gold answer comes
from a data set column (``answer``); a GSM8K solution's final ``#### 42`` line is read as ``42``.

math-verify bounds each parse with ``signal.alarm``, which only the main thread may set; called
from another thread (a scorer thread), it parses without that timeout.
"""

from __future__ import annotations

import re
import threading
from functools import lru_cache
from typing import Any, Sequence

from .terms import RewardTermSpec, optional_module

_GSM8K = re.compile(r"####\s*(.+?)\s*$", re.S)


def gold_answer(text: Any) -> str:
    """The final answer in a gold ``text``: what follows GSM8K's ``####`` (thousands separators
    dropped: ``#### 1,234`` -> ``1234``), else the whole text, stripped; a number as its string."""
    s = str(text)
    if m := _GSM8K.search(s):
        return m.group(1).replace(",", "").strip()
    return s.strip()


def _math_verify():
    return optional_module("math_verify", "math_accuracy", "math-verify", "math")


def _timeout() -> int | None:
    """math-verify's parse/verify timeout in seconds: its default in the main thread, none elsewhere
    (its timeout is a signal, main-thread only: module docstring)."""
    return 5 if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout: int | None):
    mv = _math_verify()
    parsed = mv.parse(gold, parsing_timeout=timeout)
    # a bare answer with no LaTeX anchor: read it as an inline formula too (math-verify's advice for gold)
    return parsed or mv.parse(f"${gold}$", parsing_timeout=timeout)


def is_correct(response: str, gold: Any) -> bool:
    """Whether ``response``'s final answer equals ``gold``'s (:func:`gold_answer`) to math-verify."""
    mv = _math_verify()
    timeout = _timeout()
    want = _parse_gold(gold_answer(gold), timeout)
    if not want:
        return False
    got = _parse_response(response, timeout)
    return bool(got) and bool(mv.verify(want, got, timeout_seconds=timeout))


@lru_cache(maxsize=8192)
def _parse_response(response: str, timeout: int | None):
    """math-verify's parse of a response, cached: samples of a batch repeat each other (a parse is
    milliseconds of sympy)."""
    return _math_verify().parse(response, parsing_timeout=timeout)


def math_accuracy(prompts: Sequence[str], responses: Sequence[str], answer: Sequence[Any], **_: Any) -> list[float]:
    """1.0 for each response whose final answer equals its gold ``answer`` (a data set column: a
    number, a LaTeX answer, or a GSM8K solution ending in ``#### N``), else 0.0."""
    if len(answer) != len(responses):
        raise ValueError(f"math_accuracy got {len(answer)} gold answers for {len(responses)} responses; the "
                         f"data set's answer column gives one per prompt.")
    return [1.0 if is_correct(r, a) else 0.0 for r, a in zip(responses, answer)]


MATH_ACCURACY = RewardTermSpec("math_accuracy", "1 where the final answer equals the data set's answer column "
                                                "(math-verify), else 0", math_accuracy)
