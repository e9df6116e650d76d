"""The trained reward of every run as a composite of terms (:mod:`oppo.rewards.terms`):
``reward.terms``, or ``reward.path`` / ``reward.function`` as its one term (:func:`one_term`), so
that the controller scores every run one way. The scorers of the terms: each function
term as a checked :class:`~.streaming.RewardFunction`, each reward model term loaded as the
``reward`` role's model is (the first is the ``reward`` scorer, the others ``reward_<name>``: each
a :class:`~.streaming.StreamingScorer` of kind ``reward`` in the same scorer worker)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import torch

from ..marker import is_marker
from ..models import ModelLoadError, check_roles, load_function, load_reward_model, reward_function
from ..rewards.terms import CompositeReward, RewardTerm, check_settings, parse_terms
from .streaming import RewardFunction


def composite_functions(cfg_reward, objects: Mapping[str, Callable] | None = None,
                        ) -> tuple[list[RewardTerm], dict[str, RewardFunction]]:
    """The terms of ``cfg_reward.terms`` and their functions by term name: imported (or, for a
    term given as a callable from Python, ``objects[name]``: ``inputs.Inputs.reward_terms``), their
    ``kwargs`` checked against the signature and bound. Loads no model (fails before they do)."""
    terms = parse_terms(cfg_reward.terms)
    functions = {}
    for t in terms:
        if t.function is None:
            continue
        where = f"reward.terms term {t.name!r} ({t.function})"
        if is_marker(t.function):
            fn = (objects or {}).get(t.name)
            if fn is None:
                raise ModelLoadError(f"{where} stands for a callable the run was given from Python, and none is "
                                     f"given now: pass the config with the same callable as that term's function.")
        else:
            fn = load_function(t.function, where)
        check_settings(fn, t.kwargs, where)
        bound = functools.partial(fn, **t.kwargs) if t.kwargs else fn  # (its signature: fn's, kwargs bound)
        functions[t.name] = RewardFunction(reward_function(bound, where), f"{t.function} (term {t.name!r})",
                                           retries=cfg_reward.retries, backoff_s=cfg_reward.retry_backoff_s)
    return terms, functions


class OneTerm(CompositeReward):
    """``reward.path`` or ``reward.function`` as the trained reward: a composite of one term of
    weight 1 whose scores are the term's own (no sum is taken, so no bit of them changes) and
    which reports no term mean (such a run logs ``reward/mean`` only, as it always did)."""

    def __call__(self, prompts: list[str], responses: list[str], model_scores: dict[str, list[float]],
                 **kw: Any) -> tuple[list[float], dict[str, float]]:
        (t,) = self.terms
        scores = model_scores[t.role] if t.path is not None else self.functions[t.name](prompts, responses, **kw)
        return scores, {}


def one_term(path: str | None = None, function: str | None = None, fn: Callable | None = None) -> CompositeReward:
    """The reward of a run with ``reward.path`` (a reward model: the ``reward`` scorer) or
    ``reward.function`` (its spec, or the marker of a callable given from Python; ``fn``: it,
    checked and loaded), as a composite of that one term."""
    if path is not None:
        return OneTerm([RewardTerm("reward", 1.0, path=path, role="reward")], {})
    assert function is not None and fn is not None, "a reward is a model or a function"
    return OneTerm([RewardTerm("reward", 1.0, function=function)], {"reward": fn})


def check_model_terms(terms: list[RewardTerm], tokenizer) -> None:
    """Every reward model term's config and tokenizer, before any weights load (``models.check_roles``)."""
    for t in terms:
        if t.path is not None:
            check_roles(tokenizer, reward=t.path)


def load_model_terms(terms: list[RewardTerm], device: torch.device, dtype: torch.dtype,
                     pad_id: int) -> dict[str, torch.nn.Module]:
    """The reward model terms' models by scorer role, in the terms' order."""
    return {t.role: load_reward_model(t.path, device, dtype, pad_id) for t in terms if t.path is not None}


__all__ = ["CompositeReward", "OneTerm", "check_model_terms", "composite_functions", "load_model_terms", "one_term"]
