"""Composite rewards: the reward PPO trains on as a weighted sum of reward models and functions.

    reward:
      terms:
        - {path: my-reward-model, weight: 1.0}                 # a reward model, streamed
        - {function: math_accuracy, weight: 0.5}               # a built-in (oppo.rewards) or module:function
        - {function: length_penalty, weight: 0.1, kwargs: {max_length: 300, buffer: 50}}

``parse_terms`` checks a ``reward.terms`` list (config validation: before any model loads) and
names each term; :class:`CompositeReward` adds the terms' scores up, ``sum_i weight_i * score_i``,
and reports each term's batch mean as ``reward/<name>/mean``. ``reward.path`` and
``reward.function`` remain the one-term case.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..parts import REWARD_TERMS
from ..marker import is_marker


@dataclass(frozen=True)
class RewardTermSpec:
    """A built-in reward term, a part (:mod:`oppo.parts`): a function any term (or
    ``reward.function``) may name bare, ``name``. Its settings are the function's keywords (a
    term's ``kwargs``, checked against its signature), so ``settings`` and ``checks`` are None.
    oppo's own are named in ``parts.BUILT_IN``; others register with ``REWARD_TERMS.register`` or
    the ``oppo.reward_terms`` entry point group. A term is reached as ``oppo.rewards:<name>``,
    which resolves through the registry (``models.functions.load_function``), so the file that
    defines one may be named as the term."""

    name: str
    help: str
    function: Callable
    settings: None = None
    checks: None = None


BUILTINS: Sequence[str] = REWARD_TERMS.live_names()
"""The registered reward terms' names (:mod:`oppo.rewards`'s functions first); a term (or
``reward.function``) may name them bare."""

TERM_KEYS = ("name", "weight", "path", "function", "kwargs")
_NAME = re.compile(r"[a-z0-9_]+")


def function_spec(spec: str) -> str:
    """``spec`` as 'module:function': a bare built-in name becomes ``oppo.rewards:<name>``."""
    return f"oppo.rewards:{spec}" if spec in BUILTINS else spec


@dataclass(frozen=True)
class RewardTerm:
    """One term of the trained reward: a reward model (``path``) or a function (``function``,
    'module:function', or the marker of a callable given from Python, called with ``kwargs``
    bound), times ``weight``. ``role``: a model term's
    scorer (``reward`` for the first, ``reward_<name>`` for the others; empty for a function)."""

    name: str
    weight: float
    path: str | None = None
    function: str | None = None
    kwargs: dict = field(default_factory=dict)
    role: str = ""

    @property
    def metric(self) -> str:
        return f"reward/{self.name}/mean"


def _default_name(path: str | None, function: str | None) -> str:
    """A term's name when it has none: the function's name, else the model directory's last part,
    lower-cased, other characters as ``_``."""
    raw = function.rsplit(":", 1)[-1] if function else re.split(r"[\\/]", str(path).rstrip("/\\"))[-1]
    return term_name(raw)


def term_name(raw: str) -> str:
    """``raw`` (a function's name) as a term name: lower-cased, other characters as ``_``."""
    return re.sub(r"[^a-z0-9_]+", "_", raw.lower()).strip("_") or "term"


def parse_terms(raw: Any, key: str = "reward.terms") -> list[RewardTerm]:
    """The terms of a ``reward.terms`` list, or ValueError naming the first problem and its fix."""
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{key} must be a list of terms such as [{{path: my-rm, weight: 1.0}}, "
                         f"{{function: math_accuracy, weight: 0.5}}], got {raw!r}.")
    terms: list[RewardTerm] = []
    models = 0
    for i, t in enumerate(raw):
        at = f"{key}[{i}]"
        if not isinstance(t, dict):
            raise ValueError(f"{at} must be a mapping such as {{function: math_accuracy, weight: 1.0}}, got {t!r}.")
        for k in t:
            if k not in TERM_KEYS:
                close = difflib.get_close_matches(str(k), TERM_KEYS, n=1)
                hint = f" Did you mean '{close[0]}'?" if close else ""
                raise ValueError(f"{at} has an unknown key {k!r}.{hint} A term takes {', '.join(TERM_KEYS)}.")
        path, fn = t.get("path"), t.get("function")
        if (path is None) == (fn is None):
            raise ValueError(f"{at} needs exactly one of path (a reward model) and function ('module:function' or a "
                             f"built-in: {', '.join(BUILTINS)}), {'not both' if path is not None else 'got neither'}.")
        if path is not None and (not isinstance(path, str) or not path.strip()):
            raise ValueError(f"{at}.path must be a model directory or hub name, got {path!r}.")
        if callable(fn):
            raise ValueError(f"{at}.function is a Python callable ({getattr(fn, '__name__', type(fn).__name__)}): "
                             f"give the config to oppo.train or oppo.Trainer, which take callables as terms (the "
                             f"config records each as <object: ...>), or name it as 'package.module:function'.")
        if fn is not None and not is_marker(fn):
            if not isinstance(fn, str) or not (fn in BUILTINS or (":" in fn and all(fn.split(":", 1)))):
                raise ValueError(f"{at}.function={fn!r} must look like 'package.module:function' or be a built-in "
                                 f"reward: {', '.join(BUILTINS)}.")
            fn = function_spec(fn)
        w = t.get("weight", 1.0)
        if not isinstance(w, numbers.Real) or isinstance(w, bool) or not math.isfinite(float(w)):
            raise ValueError(f"{at}.weight must be a finite number (negative for a penalty, 0 to log the term "
                             f"without training on it), got {w!r}.")
        kwargs = t.get("kwargs", {}) or {}
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError(f"{at}.kwargs must map setting names to values, e.g. {{max_length: 300}}, got {kwargs!r}.")
        if kwargs and path is not None:
            raise ValueError(f"{at}.kwargs: a reward model term takes no kwargs (they set a function's keywords).")
        name = t.get("name", None)
        name = _default_name(path, fn) if name is None else name
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{at}.name={name!r} must be lower-case letters, digits and _ (it names the metric "
                             f"reward/<name>/mean).")
        if any(o.name == name for o in terms):
            raise ValueError(f"{key}: two terms are named {name!r}; give them distinct names (name: ...).")
        role = ("reward" if models == 0 else f"reward_{name}") if path is not None else ""
        models += path is not None
        terms.append(RewardTerm(name, float(w), path, fn, dict(kwargs), role))
    for t in terms:
        if t.function and t.function.startswith("oppo.rewards:"):
            check_settings(_builtin(t.function), t.kwargs, f"{key} term {t.name!r}", strict=True)
    return terms


def _builtin(spec: str) -> Callable:
    name = spec.split(":", 1)[1]
    found = REWARD_TERMS.find(name)
    if found is None:
        raise ValueError(f"oppo.rewards has no reward {name!r}; the built-ins are {', '.join(BUILTINS)}.")
    return found.function


def optional_module(module: str, term: str, package: str, extra: str) -> Any:
    """``module`` imported for the built-in reward ``term``, or an ImportError naming the package it
    needs and the extra that installs it (the built-ins' scorers are optional dependencies)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f'oppo.rewards.{term} needs the {package} package: pip install "oppo[{extra}]" '
                          f"(or pip install {package}).") from None


def check_settings(fn: Callable, kwargs: dict, where: str, strict: bool = False) -> None:
    """Raise ValueError when ``kwargs`` names a keyword ``fn`` does not take (``strict``: one that is
    not among its named parameters, even if it takes ``**kwargs``: the built-ins, which swallow data
    set columns); a built-in is also called on an empty batch, which checks the values."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return  # (a callable without a signature: nothing to check)
    named = [n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)][2:]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = [k for k in kwargs if k not in named and (strict or not takes_any)]
    if unknown:
        raise ValueError(f"{where}: kwargs {', '.join(map(repr, unknown))} "
                         f"{'is' if len(unknown) == 1 else 'are'} not a setting of {getattr(fn, '__name__', fn)}; "
                         f"it takes {', '.join(named) or 'none'}.")
    if strict:
        try:
            fn([], [], **{n: [] for n in named if n not in kwargs and params[n].default is params[n].empty}, **kwargs)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


class CompositeReward:
    """The trained reward, ``sum_i weight_i * score_i`` over ``terms``, in their order.

    ``functions``: each function term's callable by name (``scoring.streaming.RewardFunction``:
    it checks each score is a finite number). The model terms' scores are handed in, by role.
    """

    def __init__(self, terms: Sequence[RewardTerm], functions: Mapping[str, Callable]):
        self.terms, self.functions = tuple(terms), functions
        self.model_roles = tuple(t.role for t in terms if t.path is not None)

    def describe(self) -> str:
        """'1.0 x helpful + 0.5 x math_accuracy' (the run's log)."""
        return " + ".join(f"{t.weight:g} x {t.name}" for t in self.terms)

    def __call__(self, prompts: list[str], responses: list[str], model_scores: dict[str, list[float]],
                 **kw: Any) -> tuple[list[float], dict[str, float]]:
        """(the weighted sum per response, ``{reward/<name>/mean: the term's mean}``); ``kw``
        (step, indices: for errors) goes to every function term."""
        total = [0.0] * len(responses)
        stats: dict[str, float] = {}
        for t in self.terms:
            scores = model_scores[t.role] if t.path is not None else self.functions[t.name](prompts, responses, **kw)
            total = [a + t.weight * s for a, s in zip(total, scores)]
            stats[t.metric] = sum(scores) / len(scores) if scores else float("nan")
        return total, stats
