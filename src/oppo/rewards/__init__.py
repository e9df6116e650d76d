"""Built-in reward functions and composite rewards.

Use one as ``reward.function: oppo.rewards:math_accuracy`` (or its bare name), or as a term of a
weighted sum (``reward.terms``, :mod:`.terms`). Each takes ``(prompts, responses, ...)`` as lists of
str and returns one float per response; settings are keywords (a term's ``kwargs``). See
docs/rewards.md.

- :func:`math_accuracy`: the final answer equals the data set's ``answer`` column (math-verify);
- :func:`format_reward` (``boxed_format``, ``gsm8k_format``, ``think_format``): a layout is kept;
- :func:`length_penalty`: a penalty past a length, hard or DAPO's soft overlong one;
- :func:`vader_sentiment`, :func:`afinn_sentiment`: a response's sentiment by two third-party
  lexicon scorers (the ``[sentiment]`` extra: vaderSentiment, afinn).
"""

from __future__ import annotations

from typing import Any, Callable

from ..parts import REWARD_TERMS
from .mathcheck import gold_answer, is_correct, math_accuracy
from .sentiment import afinn_sentiment, vader_sentiment
from .shape import FORMATS, boxed_format, format_reward, gsm8k_format, length_penalty, think_format
from .terms import BUILTINS, CompositeReward, RewardTermSpec, RewardTerm, check_settings, function_spec, parse_terms


def builtin_functions() -> dict[str, Callable]:
    """Every registered reward term's function by name (``parts.REWARD_TERMS``)."""
    return {n: REWARD_TERMS.get(n).function for n in REWARD_TERMS.names()}


def __getattr__(name: str) -> Any:
    """A registered reward term's function by its name: ``reward.function: oppo.rewards:<name>``
    reaches every term of the registry, also one defined in a file of its own."""
    if name == "BUILTIN_FUNCTIONS":
        return builtin_functions()
    found = REWARD_TERMS.find(name) if not name.startswith("__") else None
    if found is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return found.function


__all__ = ["BUILTINS", "FORMATS", "CompositeReward", "RewardTermSpec", "RewardTerm", "boxed_format",
           "builtin_functions", "check_settings", "format_reward", "function_spec", "gold_answer", "gsm8k_format",
           "is_correct", "length_penalty", "math_accuracy", "parse_terms", "think_format", "vader_sentiment",
           "afinn_sentiment"]
