"""Built-in reward functions and composite rewards.

Use one as ``reward.function: oppo.rewards:math_accuracy`` (or its bare name), or as a term of a
weighted sum (``reward.terms``, :mod:`.terms`). Each takes ``(prompts, responses, ...)`` as lists of
str and returns one float per response; settings are keywords (a term's ``kwargs``). See
docs/rewards.md.

- :func:`math_accuracy`: the final answer equals the data set's ``answer`` column (math-verify);
- :func:`format_reward` (``boxed_format``, ``gsm8k_format``, ``think_format``): a layout is kept;
- :func:`length_penalty`: a penalty past a length, hard or DAPO's soft overlong one.
"""

from __future__ import annotations

from typing import Callable

from .mathcheck import gold_answer, is_correct, math_accuracy
from .shape import FORMATS, boxed_format, format_reward, gsm8k_format, length_penalty, think_format
from .terms import BUILTINS, CompositeReward, RewardTerm, check_settings, function_spec, parse_terms

BUILTIN_FUNCTIONS: dict[str, Callable] = {
    "math_accuracy": math_accuracy, "format_reward": format_reward, "boxed_format": boxed_format,
    "gsm8k_format": gsm8k_format, "think_format": think_format, "length_penalty": length_penalty,
}
assert tuple(BUILTIN_FUNCTIONS) == BUILTINS  # (terms.py names them without importing them)

__all__ = ["BUILTINS", "BUILTIN_FUNCTIONS", "FORMATS", "CompositeReward", "RewardTerm", "boxed_format",
           "check_settings", "format_reward", "function_spec", "gold_answer", "gsm8k_format", "is_correct",
           "length_penalty", "math_accuracy", "parse_terms", "think_format"]
