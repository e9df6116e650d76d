"""Rollout backends by name: ``generation.engine`` picks one entry of this registry.

A backend is one :class:`Backend`: its name, a line of help, one ``build`` function (called in the
controller's process and, unchanged, inside every Ray rollout worker), its checks before any model
loads, and the few facts the rest of oppo needs to know about it (does it load the policy itself,
may it run in Ray workers, does it sample with other numerics than the trainer's forward). Nothing
outside a backend's own folder names it: config, preflight, setup, the Ray group and the bench ask
this registry.

oppo's own engines (``eager``, ``static``) are registered here. Other backends live in folders of
their own and register through the ``oppo.rollout_backends`` entry point group
(``pyproject.toml``; the entry's value is its :class:`Backend`), or by calling :func:`register`
(a plugin imported by the user, a test). This module imports no torch, so the config can list the
backends without loading one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

    from ..api.protocols import RolloutBackend
    from .engine import EngineSettings

ENTRY_POINTS = "oppo.rollout_backends"
AUTO = "auto"  # not a backend: resolved per run (rollout.engine.resolve_engine)


class BackendUnavailable(ValueError):
    """A rollout backend cannot serve this run; the message says why and what to do."""


@dataclass(frozen=True)
class BuildRequest:
    """What a backend is built from, wherever it runs.

    ``settings``: the sampling and capacity settings (``setup.plan.engine_settings``; ``kind`` is this
    backend's name). ``model``: the policy module to sample with, or None where the backend loads
    the policy itself (:attr:`Backend.loads_own_weights`: then only ``policy_path`` and ``dtype``
    matter, and ``model``, when given, holds the weights to start from). ``device``: a device type
    (``cpu``, ``cuda``, or ``auto``). ``role``: the name in messages; ``threads``: the CPU threads a
    worker was granted (None: the process's)."""

    settings: EngineSettings
    model: torch.nn.Module | None = None
    policy_path: str = ""
    dtype: torch.dtype | None = None
    device: str = "auto"
    role: str = "policy"
    threads: int | None = None


@dataclass(frozen=True)
class Backend:
    """One rollout backend.

    - ``build(request)``: the :class:`~oppo.api.protocols.RolloutBackend`.
    - ``problems(policy_path, device)``: why it cannot serve that policy here (not installed, an
      architecture it lacks), each with its fix; reads config files only, loads no weights. Run by
      the pre-run checks and again before the models load.
    - ``loads_own_weights``: it loads the policy from its path and takes weight updates as
      ``(name, tensor)`` pairs; a Ray rollout worker then loads no Hugging Face copy for it.
    - ``in_workers``: it can run inside ``placement.rollout_workers``.
    - ``other_numerics``: it samples with another implementation than the trainer's forward, so
      ``ppo.old_logprobs=auto`` recomputes the old log-probs with the trainer's.
    """

    name: str
    help: str
    build: Callable[[BuildRequest], RolloutBackend]
    problems: Callable[[str | None, str], list[str]] | None = None
    loads_own_weights: bool = False
    in_workers: bool = True
    other_numerics: bool = False


_BACKENDS: dict[str, Backend] = {}
_plugins_loaded = False


def register(backend: Backend, replace: bool = False) -> Backend:
    """Add ``backend`` under its name; a name taken by another backend is refused unless
    ``replace``. Returns it, so a module can write ``BACKEND = register(Backend(...))``."""
    if backend.name == AUTO:
        raise ValueError(f"{AUTO!r} is not a backend name: generation.engine=auto picks eager or static")
    old = _BACKENDS.get(backend.name)
    if old is not None and old is not backend and not replace:
        raise ValueError(f"a rollout backend named {backend.name!r} is already registered; pick another name "
                         f"or pass replace=True")
    _BACKENDS[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    _BACKENDS.pop(name, None)


def _load_plugins() -> None:
    """The backends installed packages declare under :data:`ENTRY_POINTS`, once. A plugin that fails
    to load is skipped here: asking for it by name then says why."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINTS):
        if ep.name in _BACKENDS:
            continue
        try:
            backend = ep.load()
        except Exception as e:  # noqa: BLE001 (reported when the backend is asked for)
            _broken[ep.name] = f"{type(e).__name__}: {e}"
            continue
        register(backend)


_broken: dict[str, str] = {}


def names() -> tuple[str, ...]:
    """The registered backends' names, built-in first."""
    _load_plugins()
    return tuple(_BACKENDS)


def choices() -> tuple[str, ...]:
    """What ``generation.engine`` accepts."""
    return (AUTO, *names())


def get(name: str) -> Backend:
    """The backend called ``name``; an unknown name raises naming the known ones."""
    _load_plugins()
    backend = _BACKENDS.get(name)
    if backend is None:
        why = f" (its plugin failed to load: {_broken[name]})" if name in _broken else ""
        raise KeyError(f"no rollout backend {name!r}{why}; known: {', '.join(choices())}")
    return backend


def build(request: BuildRequest) -> RolloutBackend:
    """The backend ``request.settings.kind`` names, built."""
    return get(request.settings.kind).build(request)


def build_engine(model: torch.nn.Module, settings: EngineSettings) -> RolloutBackend:
    """A backend that samples with ``model`` (oppo's own engines): :func:`build` without the rest."""
    return build(BuildRequest(settings, model))


def _eager(req: BuildRequest) -> RolloutBackend:
    from .engine import RolloutEngine

    s = req.settings
    engine = RolloutEngine(req.model, s.stop_ids, s.pad_id, s.max_new_tokens, s.temperature, s.top_k, s.top_p,
                           seed=s.seed)
    engine.kv_budget_mb = s.kv_budget_mb or None
    return engine


def _static(req: BuildRequest) -> RolloutBackend:
    from .static import StaticRolloutEngine

    s = req.settings
    engine = StaticRolloutEngine(req.model, s.stop_ids, s.pad_id, s.max_new_tokens, s.temperature, s.top_k, s.top_p,
                                 seed=s.seed, max_rows=s.max_rows, max_len=s.max_len, capture=s.capture)
    engine.kv_budget_mb = s.kv_budget_mb or None
    return engine


register(Backend(
    "eager", "oppo's engine with a growing KV cache per batch (the fallback to set by hand if the static "
             "engine misbehaves)", _eager))
register(Backend(
    "static", "oppo's engine with preallocated KV slots of 2B rows x (max_prompt_tokens + max_new_tokens) "
              "columns; on CUDA its decode step is captured in CUDA graphs (1B decode step 5.1 ms against 18.4 ms "
              "eager on an H100); attention-only decoders with sdpa or eager attention", _static, in_workers=False))
