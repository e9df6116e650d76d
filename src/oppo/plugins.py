"""The registry every pluggable kind keeps (algorithms, learner engines, rollout backends): items
by name, built-in first, then those installed packages declare under an entry point group, loaded
once on first use. A plugin that fails to load is skipped, and asking for it by name says why.
Imports nothing of oppo, so any layer may hold one.

Plugins reach other processes: Ray actors (learner ranks, rollout workers) receive the parts of a
registered item (an algorithm's loss, a learner engine's update strategy, a rollout backend's
build) pickled, and a part defined in a module those processes cannot import (a test file, a
user's module on the controller's path only, another node) would fail to unpickle there. Every
registry notes the modules that define its items' parts; :func:`modules_by_value` names those no
installed distribution provides, which ``cluster`` has Ray pickle by value (cloudpickle's
``register_pickle_by_value``) before it starts actors, so that their code travels with them.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any, Callable, Dict, Generic, Iterable, Protocol, TypeVar


class Named(Protocol):
    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=Named)


def check_section(what: str, settings: Any) -> None:
    """A part's own settings (the config section ``--help`` lists and ``validate`` checks) must be a
    dataclass, or None for none; ``what`` names the part in the message."""
    if settings is not None and not dataclasses.is_dataclass(settings):
        raise ValueError(f"{what}: settings must be a dataclass, got {settings!r}")


class Registry(Generic[T]):
    """``kind``: the item's kind in messages, with its article ("an algorithm"); ``entry_points``:
    the group plugins declare under; ``built_in``: oppo's own items, registered on first use (for
    kinds whose built-ins import what the registry's module must not); ``check``: raises
    ``ValueError`` for an item that cannot be registered."""

    def __init__(self, kind: str, entry_points: str, built_in: Callable[[], Iterable[T]] | None = None,
                 check: Callable[[T], None] | None = None):
        self.kind, self.entry_points, self._built_in, self._check = kind, entry_points, built_in, check
        self.items: Dict[str, T] = {}
        self.broken: Dict[str, str] = {}
        """Plugin name -> why it failed to load."""
        self.loaded = False

    def register(self, item: T, replace: bool = False) -> T:
        """Add ``item`` under its name; a name taken by another item is refused unless ``replace``.
        Returns it, so a module can write ``SPEC = register(Spec(...))``."""
        if self._check is not None:
            self._check(item)
        old = self.items.get(item.name)
        if old is not None and old is not item and not replace:
            raise ValueError(f"{self.kind} named {item.name!r} is already registered; pick another name or pass "
                             f"replace=True")
        self.items[item.name] = item
        _PART_MODULES.update(dict.fromkeys(part_modules(item)))
        return item

    def unregister(self, name: str) -> None:
        self.items.pop(name, None)

    def load(self) -> None:
        """The built-ins, then the entry points' items, once."""
        if self.loaded:
            return
        self.loaded = True
        early = dict(self.items)  # registered before first use: listed after the built-ins
        self.items.clear()  # (the same dict: a module may hold it, as algo.algorithms.SPECS does)
        for item in self._built_in() if self._built_in is not None else ():
            self.register(item)
        for item in early.values():
            self.register(item)
        from importlib.metadata import entry_points

        for ep in entry_points(group=self.entry_points):
            if ep.name in self.items:
                continue
            try:
                self.register(ep.load())
            except Exception as e:  # noqa: BLE001 (reported when the item is asked for by name)
                self.broken[ep.name] = f"{type(e).__name__}: {e}"

    def names(self) -> tuple[str, ...]:
        """The registered names, built-in first."""
        self.load()
        return tuple(self.items)

    def find(self, name: str) -> T | None:
        self.load()
        return self.items.get(name)

    def get(self, name: str, known: Iterable[str] | None = None) -> T:
        """The item called ``name``; an unknown name raises ``KeyError`` naming the ``known`` ones
        (default: the registered names) and, for a plugin that failed to load, why."""
        item = self.find(name)
        if item is None:
            noun = self.kind.partition(" ")[2]
            raise KeyError(f"no {noun} {name!r}{self.why_missing(name)}; known: {', '.join(known or self.names())}")
        return item

    def why_missing(self, name: str) -> str:
        """" (its plugin failed to load: ...)" for a plugin that did; "" for a name nobody declared."""
        return f" (its plugin failed to load: {self.broken[name]})" if name in self.broken else ""


def from_refs(refs: Iterable[str]) -> Callable[[], list]:
    """A ``built_in`` loader for :class:`Registry`: the items named ``"module:attribute"``, their
    modules imported on first use (so the registry's own module imports none of them)."""
    def load() -> list:
        from importlib import import_module

        return [getattr(import_module(module), attr) for module, _, attr in (ref.partition(":") for ref in refs)]
    return load


def setting(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A field of a part's own settings dataclass with its help text (and its allowed values), read
    by the config the way it reads its own fields (``rollout.<backend>.<field>``,
    ``placement.<name>.<field>``)."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    return dataclasses.field(default=default, metadata=meta)


_PART_MODULES: Dict[str, None] = {}
"""The modules defining the parts of every item registered in this process (ordered, no repeats)."""


def part_modules(item: object) -> list[str]:
    """The modules that define ``item``'s parts: its class, and each field's value (a dataclass
    item's), where that is a function, a class or an instance of one."""
    values = [getattr(item, f.name) for f in dataclasses.fields(item)] if dataclasses.is_dataclass(item) else []
    out: list[str | None] = [type(item).__module__]
    for v in values:
        if v is not None:
            own = isinstance(v, (type, types.FunctionType, types.MethodType))
            out.append(getattr(v, "__module__", None) if own else type(v).__module__)
    return [m for m in dict.fromkeys(out) if isinstance(m, str)]


def modules_by_value() -> list[types.ModuleType]:
    """The modules (imported here) that define registered items' parts and that no installed
    distribution provides, nor the standard library: what another process may be unable to import
    (module docstring). ``__main__`` is not among them: cloudpickle already sends its code."""
    own = __name__.partition(".")[0]
    names = [n for n in _PART_MODULES if n != "__main__" and n in sys.modules
             and n.partition(".")[0] not in (own, *sys.stdlib_module_names)]
    if not names:  # (oppo's own items only: no need to read the installed distributions)
        return []
    installed = _installed_packages()
    return [sys.modules[n] for n in names if n.partition(".")[0] not in installed]


_INSTALLED: set[str] | None = None


def _installed_packages() -> set[str]:
    """Top-level import names the installed distributions provide (read once: ~0.5 s)."""
    global _INSTALLED
    if _INSTALLED is None:
        from importlib.metadata import packages_distributions

        _INSTALLED = set(packages_distributions())
    return _INSTALLED
