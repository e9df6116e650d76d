"""The algorithms oppo trains with, by name: a registry of :class:`~oppo.algo.core.AlgorithmSpec`.

Each algorithm is one file (``ppo.py``, ``grpo.py``, ``rloo.py``, ``reinforce_pp.py``) holding
its ``SPEC``: estimator, policy loss, defaults, settings and checks. The built-in ones are
registered on the line below; others register from anywhere with :func:`register` (a plugin, a
test) or through the ``oppo.algorithms`` entry point group (``pyproject.toml``; the entry's value
is its spec). ``algo.name``'s choices and help, the config's defaults and checks, and
:func:`build_algorithm` follow from the registry. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Dict, Iterator

from ..plugins import Registry
from . import grpo, ppo, reinforce_pp, rloo
from .core import Algorithm, AlgorithmSpec

__all__ = ["ALGORITHMS", "ENTRY_POINTS", "REGISTRY", "SPECS", "algorithm_settings", "build_algorithm", "get_algorithm",
           "get_spec", "names", "register", "unregister"]

ENTRY_POINTS = "oppo.algorithms"

REGISTRY: Registry[AlgorithmSpec] = Registry("an algorithm", ENTRY_POINTS)
for _spec in (ppo.SPEC, grpo.SPEC, rloo.SPEC, reinforce_pp.SPEC):
    REGISTRY.register(_spec)
SPECS: Dict[str, AlgorithmSpec] = REGISTRY.items
"""The registry's items: name -> spec, built-in first."""
register = REGISTRY.register
unregister = REGISTRY.unregister


def names() -> tuple[str, ...]:
    """The registered algorithms' names, built-in first."""
    return REGISTRY.names()


class _Names(Sequence):
    """The registered names, read live (an algorithm registered later is in it): ``algo.name``'s
    choices. Compares equal to a tuple of the same names."""

    def __getitem__(self, i):
        return names()[i]

    def __len__(self) -> int:
        return len(names())

    def __iter__(self) -> Iterator[str]:
        return iter(names())

    def __contains__(self, name: object) -> bool:
        return name in names()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and not isinstance(other, str) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(names())


ALGORITHMS: Sequence[str] = _Names()


def get_spec(name: str) -> AlgorithmSpec:
    """The spec of the algorithm called ``name``; ``ValueError`` naming the valid ones if none is."""
    spec = REGISTRY.find(name)
    if spec is None:
        raise ValueError(f"unknown algorithm {name!r}{REGISTRY.why_missing(name)}; valid: {', '.join(SPECS)}")
    return spec


def algorithm_settings(name: str) -> Dict[str, Any]:
    """The settings ``get_algorithm(name, ...)`` accepts, with their defaults."""
    return get_spec(name).settings()


def get_algorithm(name: str, **settings: Any) -> Algorithm:
    """Build an algorithm by name. Unknown names and settings raise ``ValueError`` naming the
    valid ones (a setting is never silently ignored); invalid values raise from the parts. A KL
    estimator not given follows the KL placement: k1 in the reward, k3 in the loss."""
    return get_spec(name).build(**settings)


def build_algorithm(cfg: Any) -> Algorithm:
    """The configured Algorithm (``cfg``: an ``oppo.config.Config``; ``AlgorithmSpec.from_cfg``)."""
    return get_spec(cfg.algo.name).from_cfg(cfg)
