"""The algorithms oppo trains with, by name: the registry of :class:`~oppo.algo.core.AlgorithmSpec`
(``parts.ALGORITHMS``, :mod:`oppo.parts`).

Each algorithm is one file (``ppo.py``, ``grpo.py``, ``rloo.py``, ``reinforce_pp.py``) holding
its ``SPEC``: estimator, policy loss, defaults, settings and checks; the built-in ones are named in
``parts.BUILT_IN`` (a line each). Others register from anywhere with :func:`register` (a plugin, a
test) or through the ``oppo.algorithms`` entry point group (``pyproject.toml``; the entry's value
is its spec). ``algo.name``'s choices and help, the config's defaults and checks, and
:func:`build_algorithm` follow from the registry. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Dict

from ..parts import ALGORITHMS as REGISTRY
from .core import Algorithm, AlgorithmSpec

__all__ = ["ALGORITHMS", "ENTRY_POINTS", "REGISTRY", "SPECS", "algorithm_settings", "build_algorithm", "get_algorithm",
           "get_spec", "names", "register", "unregister"]

ENTRY_POINTS = REGISTRY.entry_points
REGISTRY.load()  # (the built-ins, here: SPECS holds them once this module is imported)
SPECS: Dict[str, AlgorithmSpec] = REGISTRY.items
"""The registry's items: name -> spec, built-in first."""
register = REGISTRY.register
unregister = REGISTRY.unregister
names = REGISTRY.names

ALGORITHMS: Sequence[str] = REGISTRY.live_names()
"""The registered names, read live (an algorithm registered later is in it): ``algo.name``'s choices."""


def get_spec(name: str) -> AlgorithmSpec:
    """The spec of the algorithm called ``name``; ``ValueError`` naming the valid ones if none is."""
    return REGISTRY.get(name)


def algorithm_settings(name: str) -> Dict[str, Any]:
    """The settings ``get_algorithm(name, ...)`` accepts, with their defaults."""
    return get_spec(name).defaults()


def get_algorithm(name: str, **settings: Any) -> Algorithm:
    """Build an algorithm by name. Unknown names and settings raise ``ValueError`` naming the
    valid ones (a setting is never silently ignored); invalid values raise from the parts. A KL
    estimator not given follows the KL placement: k1 in the reward, k3 in the loss."""
    return get_spec(name).build(**settings)


def build_algorithm(cfg: Any) -> Algorithm:
    """The configured Algorithm (``cfg``: an ``oppo.config.Config``; ``AlgorithmSpec.from_cfg``)."""
    return get_spec(cfg.algo.name).from_cfg(cfg)
