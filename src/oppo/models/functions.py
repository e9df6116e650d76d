"""Reward functions named ``package.module:function``, and the guard on what they return."""

from __future__ import annotations

import functools
import importlib
import os
import sys
from typing import Callable

import torch

from .errors import ModelLoadError


def reward_function(fn: Callable, name: str) -> Callable:
    """``fn`` (the user's reward function), refusing a return that is a torch tensor, or a list of
    them, with the fix named (``.tolist()``): the scorer wants Python numbers, and a tensor's
    elements are not (numpy arrays and scalars are, and pass)."""

    @functools.wraps(fn)  # (its signature is fn's: scoring.reward_fn reads which inputs fn asks for)
    def checked(prompts, responses, **inputs):
        out = fn(prompts, responses, **inputs)
        if isinstance(out, torch.Tensor) or (isinstance(out, (list, tuple)) and out
                                             and isinstance(out[0], torch.Tensor)):
            shape = f" of shape {list(out.shape)}" if isinstance(out, torch.Tensor) else " of tensors"
            raise TypeError(f"{name} returned a {type(out).__name__}{shape}, not a list of floats; return "
                            f"scores.tolist() (a tensor's elements are not Python numbers).")
        return out

    return checked



def load_function(spec: str, role: str = "reward.function") -> Callable:
    """Import 'package.module:function'. The current directory is importable, as users expect.

    ``oppo.rewards:<name>`` (what a bare built-in name becomes) resolves through the reward-term
    registry (``parts.REWARD_TERMS``), never by attribute: a term defined in a file named after it
    (``rewards/constant.py`` defining ``constant``) would otherwise be shadowed by its own module."""
    if ":" not in spec:
        raise ModelLoadError(f"{role}={spec!r} must look like 'package.module:function'.")
    mod_name, fn_name = spec.split(":", 1)
    if mod_name == "oppo.rewards":
        from ..parts import REWARD_TERMS

        term = REWARD_TERMS.find(fn_name)
        if term is None:
            raise ModelLoadError(f"{role}: oppo.rewards has no reward term {fn_name!r}; the registered ones are "
                                 f"{', '.join(REWARD_TERMS.names())}.")
        return term.function
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ModelLoadError(f"{role}: cannot import module {mod_name!r} ({e}). Make it importable "
                             f"(run from its directory or add it to PYTHONPATH).") from None
    except Exception as e:  # the module itself is broken (SyntaxError, NameError, ... at import)
        raise ModelLoadError(f"{role}: importing module {mod_name!r} failed: {type(e).__name__}: {e}") from e
    missing = object()
    fn = getattr(mod, fn_name, missing)
    if fn is missing:
        raise ModelLoadError(f"{role}: module {mod_name!r} has no function {fn_name!r}.")
    if not callable(fn):
        shown = repr(fn) if len(repr(fn)) <= 60 else repr(fn)[:57] + "..."
        raise ModelLoadError(f"{role}: module {mod_name!r} has {fn_name!r}, but it is not callable: it is "
                             f"{shown}, of type {type(fn).__name__}. Point {role} at a function "
                             f"fn(prompts, responses) -> list[float].")
    return fn
