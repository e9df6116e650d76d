"""The scorers of a composite reward (``reward.terms``, :mod:`oppo.rewards.terms`): each function
term as a checked :class:`~.streaming.RewardFunction`, each reward model term loaded as the
``reward`` role's model is (the first is the ``reward`` scorer, the others ``reward_<name>``: each
a :class:`~.streaming.StreamingScorer` of kind ``reward`` in the same scorer worker)."""

from __future__ import annotations

import functools
from typing import Callable, Mapping

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


def check_model_terms(terms: list[RewardTerm], tokenizer) -> None:
    """Every reward model term's config and tokenizer, before any weights load (``models.check_roles``)."""
    for t in terms:
        if t.path is not None:
            check_roles(tokenizer, reward=t.path)


def load_model_terms(terms: list[RewardTerm], device: torch.device, dtype: torch.dtype,
                     pad_id: int) -> dict[str, torch.nn.Module]:
    """The reward model terms' models by scorer role, in the terms' order."""
    return {t.role: load_reward_model(t.path, device, dtype, pad_id) for t in terms if t.path is not None}


__all__ = ["CompositeReward", "check_model_terms", "composite_functions", "load_model_terms"]
