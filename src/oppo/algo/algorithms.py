"""The algorithms oppo trains with, by name: PPO, GRPO, RLOO and REINFORCE++.

Each algorithm is one file (``ppo.py``, ``grpo.py``, ``rloo.py``, ``reinforce_pp.py``) that
defines its advantage estimator and an :class:`~oppo.algo.core.AlgorithmSpec` ``SPEC``: its
defaults (group size, KL placement and estimator, KL coefficient), whether it needs a critic or
groups, and which Config settings it reads. :data:`SPECS` below lists them; it is the only place
that names them all. Adding an algorithm is one file like those plus its line here (and its
tests): ``algo.name``'s choices and help, the config's defaults and checks, and
:func:`build_algorithm` follow from the spec.

``get_algorithm(name, **settings)`` builds one from settings (``algorithm_settings(name)`` lists
them with their defaults); ``build_algorithm(cfg)`` builds the configured one.
"""

from __future__ import annotations

from typing import Any, Dict

from . import grpo, ppo, reinforce_pp, rloo
from .core import Algorithm, AlgorithmSpec

__all__ = ["ALGORITHMS", "SPECS", "algorithm_settings", "build_algorithm", "get_algorithm", "get_spec"]

SPECS: Dict[str, AlgorithmSpec] = {s.name: s for s in (ppo.SPEC, grpo.SPEC, rloo.SPEC, reinforce_pp.SPEC)}
ALGORITHMS = tuple(SPECS)


def get_spec(name: str) -> AlgorithmSpec:
    """The spec of the algorithm called ``name``; ``ValueError`` naming the valid ones if none is."""
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(SPECS)}") from None


def algorithm_settings(name: str) -> Dict[str, Any]:
    """The settings ``get_algorithm(name, ...)`` accepts, with their defaults."""
    return get_spec(name).settings()


def get_algorithm(name: str, **settings: Any) -> Algorithm:
    """Build an algorithm by name ("ppo", "grpo", "rloo", "reinforce_pp").

    Unknown names and settings the algorithm does not use raise ``ValueError`` naming the valid
    ones (a setting is never silently ignored); invalid values raise from the parts. A KL
    estimator not given follows the KL placement: k1 in the reward, k3 in the loss.
    """
    return get_spec(name).build(**settings)


def build_algorithm(cfg: Any) -> Algorithm:
    """The configured Algorithm (``cfg``: an ``oppo.config.Config``). The shared settings are the
    ones the Config derives once from the spec (group size, KL placement and estimator, and the KL
    coefficient: ``ppo.kl_coef``, or the spec's ``kl_coef`` when it is empty); the algorithm's own
    come from its spec's ``from_config``."""
    spec = get_spec(cfg.algo.name)
    return spec.build(group_size=cfg.group_size, kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
                      kl_placement=cfg.kl_placement, **spec.from_config(cfg))
