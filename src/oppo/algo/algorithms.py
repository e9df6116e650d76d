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

from . import grpo, ppo, reinforce_pp, rloo
from .core import Algorithm, AlgorithmSpec

__all__ = ["ALGORITHMS", "ENTRY_POINTS", "SPECS", "algorithm_settings", "build_algorithm", "get_algorithm",
           "get_spec", "names", "register", "unregister"]

ENTRY_POINTS = "oppo.algorithms"

SPECS: Dict[str, AlgorithmSpec] = {s.name: s for s in (ppo.SPEC, grpo.SPEC, rloo.SPEC, reinforce_pp.SPEC)}
"""The registry: name -> spec, built-in first."""

_plugins_loaded = False
_broken: Dict[str, str] = {}


def register(spec: AlgorithmSpec, replace: bool = False) -> AlgorithmSpec:
    """Add ``spec`` under its name; a name taken by another spec is refused unless ``replace``.
    Returns it, so a module can write ``SPEC = register(AlgorithmSpec(...))``."""
    old = SPECS.get(spec.name)
    if old is not None and old is not spec and not replace:
        raise ValueError(f"an algorithm named {spec.name!r} is already registered; pick another name or pass "
                         "replace=True")
    SPECS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    SPECS.pop(name, None)


def _load_plugins() -> None:
    """The specs installed packages declare under :data:`ENTRY_POINTS`, once. One that fails to
    load is skipped here; asking for it by name says why."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINTS):
        if ep.name in SPECS:
            continue
        try:
            register(ep.load())
        except Exception as e:  # noqa: BLE001 (reported when the algorithm is asked for)
            _broken[ep.name] = f"{type(e).__name__}: {e}"


def names() -> tuple[str, ...]:
    """The registered algorithms' names, built-in first."""
    _load_plugins()
    return tuple(SPECS)


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
    _load_plugins()
    try:
        return SPECS[name]
    except KeyError:
        why = f" (its plugin failed to load: {_broken[name]})" if name in _broken else ""
        raise ValueError(f"unknown algorithm {name!r}{why}; valid: {', '.join(SPECS)}") from None


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
