"""The one shape of a pluggable part, and the one registry every kind of part keeps.

A part (a rollout backend, a learner engine, an algorithm, a placement, a reward term) is a spec:
``name``, ``help``, ``settings`` (fields made with :func:`setting`) and ``checks(own, cfg)``; each
kind's spec adds its own fields. Every kind keeps one :class:`Registry`, all of them here: built-ins
(:data:`BUILT_IN`), entry points, and :meth:`Registry.register`. :func:`modules_by_value` names the
plugin modules Ray must pickle by value. This module imports nothing of oppo.

Design notes: docs/design.md, "One shape of part, one registry"."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import types
from collections.abc import Sequence
from typing import Any, Callable, Dict, Generic, Iterable, Iterator, Protocol, TypeVar


class PartSpec(Protocol):
    """What every part's spec has (module docstring); a kind's spec adds its builders and facts."""

    @property
    def name(self) -> str: ...

    @property
    def help(self) -> str: ...

    @property
    def settings(self) -> Any: ...

    @property
    def checks(self) -> Callable[[Any, Any], list[str]] | None: ...


T = TypeVar("T", bound=PartSpec)


class UnknownPart(KeyError, ValueError):
    """No part of that kind is called that; the message names the known ones (a ``KeyError`` for a
    lookup, a ``ValueError`` for a value the user gave)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def setting(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A field of a part's own settings dataclass with its help text (and its allowed values), read
    by the config the way it reads its own fields (``rollout.<backend>.<field>``,
    ``placement.<name>.<field>``, ``learner.<engine>.<field>``)."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    return dataclasses.field(default=default, metadata=meta)


def check_section(what: str, settings: Any) -> None:
    """A part's own settings must be a dataclass, or None for none; ``what`` names the part."""
    if settings is not None and not (isinstance(settings, type) and dataclasses.is_dataclass(settings)):
        raise ValueError(f"{what}: settings must be a dataclass, got {settings!r}")


class Registry(Generic[T]):
    """The parts of one kind by name (module docstring).

    ``kind``: the part's kind in messages, with its article ("a rollout backend"); ``section``: the
    config section that holds each part's own settings as ``<section>.<name>.*`` (None: the kind has
    no such sections); ``entry_points``: the group plugins declare under; ``built_in``: oppo's own,
    as ``"module:attribute"``; ``chosen_by``: the setting that picks one (for help and messages);
    ``describe``: a part's help line, where the kind says more than its help (default: the help and
    its section)."""

    def __init__(self, kind: str, section: str | None, entry_points: str, built_in: Iterable[str] = (),
                 chosen_by: str = "", describe: Callable[[Any], str] | None = None):
        self.kind, self.section, self.entry_points = kind, section, entry_points
        self.built_in, self.chosen_by, self._describe = tuple(built_in), chosen_by, describe
        self.items: Dict[str, T] = {}
        self.broken: Dict[str, str] = {}
        """Plugin name -> why it failed to load."""
        self.loaded = False

    @property
    def noun(self) -> str:
        return self.kind.partition(" ")[2]

    def register(self, item: T, replace: bool = False) -> T:
        """Add ``item`` under its name; a name taken by another item is refused unless ``replace``.
        Returns it, so a module can write ``SPEC = register(Spec(...))``."""
        if self.section is not None:
            check_section(f"{self.noun} {item.name!r}", item.settings)
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
        """The built-ins, then those registered before first use, then the entry points', once."""
        if self.loaded:
            return
        self.loaded = True
        from importlib import import_module

        early = dict(self.items)
        self.items.clear()  # (the same dict: a module may hold it)
        for module, _, attr in (ref.partition(":") for ref in self.built_in):
            self.register(getattr(import_module(module), attr))
        for item in early.values():  # (registered before first use: listed after the built-ins)
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

    def live_names(self) -> Sequence[str]:
        """The registered names, read at each use (a part registered later is in it)."""
        return _Names(self)

    def find(self, name: str) -> T | None:
        self.load()
        return self.items.get(name)

    def get(self, name: str, known: Iterable[str] | None = None) -> T:
        """The part called ``name``; an unknown name raises :class:`UnknownPart` naming the
        ``known`` ones (default: the registered names) and, for a plugin that failed to load, why."""
        item = self.find(name)
        if item is None:
            raise UnknownPart(f"unknown {self.noun} {name!r}{self.why_missing(name)}; valid: "
                              f"{', '.join(known or self.names())}")
        return item

    def why_missing(self, name: str) -> str:
        """" (its plugin failed to load: ...)" for a plugin that did; "" for a name nobody declared."""
        return f" (its plugin failed to load: {self.broken[name]})" if name in self.broken else ""

    def default_settings(self) -> dict[str, Any]:
        """``{name: its settings at their defaults}`` for every part with settings of its own (the
        config's ``<section>.<name>`` sections)."""
        return {n: s.settings() for n in self.names() if (s := self.get(n)).settings is not None}

    def help_lines(self) -> list[str]:
        """A line per part for the help of the setting that picks one."""
        return [self.describe(self.get(n)) for n in self.names()]

    def describe(self, item: T) -> str:
        if self._describe is not None:
            return self._describe(item)
        return f"{item.name}: {item.help}.{self.section_note(item)}"

    def section_note(self, item: T) -> str:
        """" Its settings: <section>.<name>.*." where the part has settings of its own."""
        if item.settings is None or self.section is None:
            return ""
        under = f" (read under {self.chosen_by}={item.name} only)" if self.chosen_by else ""
        return f" Its settings: {self.section}.{item.name}.*{under}."

    @contextlib.contextmanager
    def built_ins_only(self) -> Iterator[None]:
        """Within: the registry holds oppo's own parts only (``built_in``), whatever is installed or
        registered at run time (the generated ``docs/settings.md`` documents what oppo ships)."""
        from importlib import import_module

        saved = (dict(self.items), dict(self.broken), self.loaded)
        self.items.clear()
        self.broken.clear()
        self.loaded = True
        try:
            for module, _, attr in (ref.partition(":") for ref in self.built_in):
                item = getattr(import_module(module), attr)
                self.items[item.name] = item
            yield
        finally:
            self.items.clear()
            self.items.update(saved[0])
            self.broken.clear()
            self.broken.update(saved[1])
            self.loaded = saved[2]

    def checks(self, name: str, own: Any, cfg: Any) -> list[str]:
        """Part ``name``'s checks of ``own`` (its settings in ``cfg``) against the whole ``cfg``."""
        check = self.get(name).checks
        return list(check(own, cfg)) if check is not None else []


class _Names(Sequence):
    """A registry's names, read live; compares equal to a tuple of the same names."""

    def __init__(self, registry: Registry):
        self._registry = registry

    def __getitem__(self, i):
        return self._registry.names()[i]

    def __len__(self) -> int:
        return len(self._registry.names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._registry.names())

    def __contains__(self, name: object) -> bool:
        return name in self._registry.names()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and not isinstance(other, str) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._registry.names())


# ---------------------------------------------------------------- the kinds and their built-ins

BUILT_IN: dict[str, tuple[str, ...]] = {
    "rollout": ("oppo.rollout.eager:BACKEND", "oppo.rollout.static:BACKEND", "oppo.rollout.vllm:BACKEND"),
    "learner": ("oppo.learner.replicate:ENGINE", "oppo.learner.fsdp2:ENGINE"),
    "algo": ("oppo.algo.ppo:SPEC", "oppo.algo.grpo:SPEC", "oppo.algo.rloo:SPEC", "oppo.algo.reinforce_pp:SPEC"),
    "placement": ("oppo.placements.local:SPEC", "oppo.placements.ray:SPEC"),
    "reward": ("oppo.rewards.mathcheck:MATH_ACCURACY", "oppo.rewards.shape:FORMAT_REWARD",
               "oppo.rewards.shape:BOXED_FORMAT", "oppo.rewards.shape:GSM8K_FORMAT", "oppo.rewards.shape:THINK_FORMAT",
               "oppo.rewards.shape:LENGTH_PENALTY", "oppo.rewards.sentiment:VADER_SENTIMENT",
               "oppo.rewards.sentiment:AFINN_SENTIMENT"),
}
"""oppo's own parts by kind, ``"module:attribute"`` each: adding one is its file and a line here."""


def _learner_line(engine: Any) -> str:
    return f"{engine.name}: {engine.help} (runs {engine.where()}).{LEARNERS.section_note(engine)}"


BACKENDS: Registry = Registry("a rollout backend", "rollout", "oppo.rollout_backends", BUILT_IN["rollout"],
                              chosen_by="generation.backend")
LEARNERS: Registry = Registry("a learner engine", "learner", "oppo.learner_engines", BUILT_IN["learner"],
                              chosen_by="placement.learner", describe=_learner_line)
ALGORITHMS: Registry = Registry("an algorithm", "algo", "oppo.algorithms", BUILT_IN["algo"], chosen_by="algo.name")
PLACEMENTS: Registry = Registry("a placement", "placement", "oppo.placements", BUILT_IN["placement"],
                                chosen_by="placement.name")
REWARD_TERMS: Registry = Registry("a reward term", None, "oppo.reward_terms", BUILT_IN["reward"])


ALL: tuple[Registry, ...] = (BACKENDS, LEARNERS, ALGORITHMS, PLACEMENTS, REWARD_TERMS)
"""Every kind's registry."""


@contextlib.contextmanager
def built_ins_only() -> Iterator[None]:
    """Every registry holding oppo's own parts only, within (:meth:`Registry.built_ins_only`)."""
    with contextlib.ExitStack() as stack:
        for registry in ALL:
            stack.enter_context(registry.built_ins_only())
        yield


# ---------------------------------------------------------------- plugins' code for other processes

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
