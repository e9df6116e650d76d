"""How oppo calls a user's reward function (and judge): ``fn(prompts, responses, **asked)``.

The first two parameters are positional: the prompts as the policy saw them and the decoded
responses. A function may ask for more by naming keyword parameters (as TRL's reward functions
take the data set's columns): ``raw_prompts``, ``formatted_prompts``, or any column of the prompt
set. :func:`function_problems` refuses a required one the prompt set lacks before any model loads;
:func:`call_reward` is the one place a reward function is called with them.

Design notes: docs/python-api.md, "Reward functions that ask for more" and "How oppo calls them"."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..data import FORMATTED_PROMPTS, RAW_PROMPTS

BUILTIN = (RAW_PROMPTS, FORMATTED_PROMPTS)
"""The keyword inputs every prompt set gives (besides its columns)."""
POSITIONAL = ("prompts", "responses")


@dataclass(frozen=True)
class Wants:
    """What a reward function asks for beyond ``(prompts, responses)``."""

    required: tuple[str, ...] = ()
    """Keyword parameters without a default: the prompt set must have them."""
    optional: tuple[str, ...] = ()
    """Keyword parameters with a default: filled when the prompt set has them."""
    everything: bool = False
    """It takes ``**kwargs``: every built-in input and column."""
    positional_ok: bool = True
    """It accepts two positional arguments (False: it cannot be called as ``fn(prompts, responses)``)."""

    @property
    def names(self) -> tuple[str, ...]:
        return self.required + self.optional

    @property
    def columns(self) -> tuple[str, ...]:
        """The data set columns it names (not the built-in inputs)."""
        return tuple(n for n in self.names if n not in BUILTIN)


def wants(fn: Callable) -> Wants:
    """Read ``fn``'s signature (module docstring). A callable whose signature Python cannot read
    (some builtins) is taken as ``fn(prompts, responses)``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return Wants()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind == p.VAR_POSITIONAL for p in params)
    taken = positional[:2]
    # (a third positional-only parameter without a default cannot be given by keyword: not callable)
    ok = (len(taken) == 2 or var_pos) and not any(
        p.kind == p.POSITIONAL_ONLY and p.default is p.empty for p in positional[2:])
    required: list[str] = []
    optional: list[str] = []
    for p in params:
        if p in taken or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            continue
        (optional if p.default is not p.empty else required).append(p.name)
    return Wants(tuple(required), tuple(optional), any(p.kind == p.VAR_KEYWORD for p in params), ok)


def describe(fn: Callable) -> str:
    """``fn``'s name for messages: ``module.qualname`` (or its type's, for a callable object)."""
    target = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(fn))}"


def signature_problems(key: str, fn: Callable, available: list[str] | None) -> list[str]:
    """Why ``fn`` cannot be called as a reward function on a prompt set with the columns
    ``available`` (None: not known yet; checked again once the prompt set is read)."""
    w = wants(fn)
    if not w.positional_ok:
        return [f"{key}: {describe(fn)} cannot be called as fn(prompts, responses): its first two parameters must "
                f"take the prompts and the responses, positionally (further ones by keyword: columns of the prompt "
                f"set, raw_prompts, formatted_prompts)."]
    if available is None:
        return []
    return [line for line in [missing_columns(key, fn, available)] if line]


def function_problems(key: str, spec: str | None, obj: Any, columns: list[str] | None,
                      bound: Mapping[str, Any] | None = None, keyword: str | None = None) -> list[str]:
    """Why ``spec`` (imported) or ``obj`` (a callable given from Python, as ``keyword=``) cannot
    score as a reward function: not importable, not callable, or asking for a column the prompt
    set lacks (``columns``: its columns, None where not known yet; ``bound``: a reward term's
    settings, given to the function, not asked of the data)."""
    if obj is None:
        from ..models import load_function
        from ..errors import ModelLoadError

        assert spec is not None
        try:
            obj = load_function(spec, key)
        except ModelLoadError as e:
            return [str(e)]
    elif not callable(obj):
        return [f"{keyword or key}= must be a function fn(prompts, responses) -> list[float], got "
                f"{type(obj).__name__}."]
    if bound:
        import functools

        obj = functools.partial(obj, **bound)
    return signature_problems(key, obj, columns)


def missing_columns(key: str, fn: Callable, available: list[str]) -> str:
    """One line naming the keyword parameters of ``fn`` without a default that neither the prompt
    set's columns ``available`` nor :data:`BUILTIN` give, and the fix; "" when none is missing."""
    have = set(available) | set(BUILTIN)
    lacking = [n for n in wants(fn).required if n not in have]
    if not lacking:
        return ""
    names = ", ".join(repr(n) for n in lacking)
    return (f"{key}: {describe(fn)} asks for the column{'s' if len(lacking) > 1 else ''} {names}, which the prompt "
            f"set does not have (it has: {', '.join(available) or 'no columns'}; every reward function may also ask "
            f"for {', '.join(BUILTIN)}). Add the column to the data, rename the parameter, or give it a default.")


def call_reward(fn: Callable, prompts: list[str], responses: list[str],
                context: Mapping[str, list] | None = None) -> Any:
    """``fn(prompts, responses, **the entries of context fn asks for)``: the one place a reward
    function (or judge) is called. ``context``: the batch's inputs by name, one value per
    response (``data.PromptSet.context``); None gives none (``fn(prompts, responses)``)."""
    w = wants(fn)
    if context is None or not (w.names or w.everything):
        return fn(list(prompts), list(responses))
    names = [n for n in context if n not in POSITIONAL] if w.everything else [n for n in w.names if n in context]
    return fn(list(prompts), list(responses), **{n: list(context[n]) for n in names})


class KeywordCall:
    """A judge (or the task's accuracy) called through :func:`call_reward`:
    ``judge(prompts, responses, context=...)`` as the controller calls it."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, prompts: list[str], responses: list[str], context: Mapping[str, list] | None = None):
        return call_reward(self.fn, prompts, responses, context)


__all__ = ["BUILTIN", "KeywordCall", "Wants", "call_reward", "describe", "missing_columns", "signature_problems",
           "wants"]
