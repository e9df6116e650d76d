"""Rollout backends by name: ``generation.backend`` picks one entry of this registry.

A backend is one :class:`BackendSpec` that owns its whole vertical: its settings (a dataclass, the
config's ``rollout.<name>.*`` section), its checks (config validation, then the pre-run checks before
any model loads), its ``build`` (called in the controller's process and, unchanged, inside every Ray
rollout replica), its decode-step probe for ``oppo bench``, and the few facts the rest of oppo needs
(does it load the policy itself, may it run in Ray replicas, does it sample with other numerics than
the trainer's forward). Its weight endpoint is the Protocol's ``load_weights``. Nothing outside a
backend's own folder names it: config, preflight, setup, the Ray group and the bench ask this registry.

A backend is a part (:mod:`oppo.parts`): oppo's own backends are named in ``parts.BUILT_IN``
(one line each); other backends live in folders of their own and register through the
``oppo.rollout_backends`` entry point group (``pyproject.toml``; the entry's value is its
:class:`BackendSpec`), or by calling :func:`register` (a plugin imported by the user, a test). This module imports no torch, so the config can list the backends without loading one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..parts import BACKENDS, Registry, setting

if TYPE_CHECKING:
    import torch

    from ..api.protocols import RolloutBackend
    from ..config import GenerationConfig

ENTRY_POINTS = BACKENDS.entry_points
AUTO = "auto"  # not a backend: resolved per run (resolve_backend)
BUILT_IN = BACKENDS.built_in
"""oppo's own backends (``parts.BUILT_IN``), registered before any plugin."""


class BackendUnavailable(ValueError):
    """A rollout backend cannot serve this run; the message says why and what to do."""


@dataclass(frozen=True)
class BackendSettings:
    """What every rollout backend is built with (``generation.*``; ``backend_settings``).

    ``kind``: the backend's name (``generation.backend=auto`` resolved: :func:`resolve_backend`);
    ``max_rows``: the most rows in flight (B + Delta and refills: at most 2B); ``max_len``: the
    longest prompt plus response; ``reason``: which backend and why, for the run's log;
    ``backend``: the backend's own settings (its :attr:`BackendSpec.settings` dataclass, from
    ``rollout.<kind>.*``; None when it declares none)."""

    stop_ids: tuple[int, ...]
    pad_id: int
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    kv_budget_mb: float | None = None
    seed: int = 0
    kind: str = "eager"
    max_rows: int = 0
    max_len: int = 0
    reason: str = ""
    backend: Any = None


@dataclass(frozen=True)
class BuildRequest:
    """What a backend is built from, wherever it runs.

    ``settings``: the common settings and the backend's own (``settings.backend``). ``model``: the
    policy module to sample with, or None where the backend loads the policy itself
    (:attr:`BackendSpec.loads_own_weights`: then only ``policy_path`` and ``dtype`` matter, and
    ``model``, when given, holds the weights to start from). ``device``: a device type (``cpu``,
    ``cuda``, or ``auto``). ``role``: the name in messages; ``threads``: the CPU threads a replica was
    granted (None: the process's)."""

    settings: BackendSettings
    model: torch.nn.Module | None = None
    policy_path: str = ""
    dtype: torch.dtype | None = None
    device: str = "auto"
    role: str = "policy"
    threads: int | None = None

    @property
    def own(self) -> Any:
        """The backend's own settings (``rollout.<kind>.*``)."""
        return self.settings.backend


@dataclass(frozen=True)
class BackendSpec:
    """One rollout backend.

    - ``build(request)``: the :class:`~oppo.api.protocols.RolloutBackend`, in the controller's
      process or in a Ray rollout replica (the same call; ``request.model`` is None there for a
      backend that ``loads_own_weights``).
    - ``settings``: the dataclass of its own settings (fields made with :func:`setting`), the
      config's ``rollout.<name>.*``; None: it has none.
    - ``checks(own, cfg)``: problems of its settings against the whole config (a list of one-line
      messages naming the fix); asked by config validation when ``generation.backend`` names it.
    - ``for_device(own, device_type)``: its settings with ``auto`` values resolved for the device
      the backend will run on.
    - ``problems(policy_path, device)``: why it cannot serve that policy here (not installed, an
      architecture it lacks), each with its fix; reads config files only, loads no weights. Run by
      the pre-run checks and again before the models load.
    - ``unfit(model, max_len)``: why it cannot decode ``model`` (asked by ``generation.backend=auto``
      before choosing it); None: it can.
    - ``probe(like, rows, max_len, new_tokens)``: a fresh backend like ``like`` (one this backend
      built) for ``rows`` rows, to time its decode step alone (``oppo bench``); None: ``like`` is
      not one of its own, or it cannot.
    - ``loads_own_weights``: it loads the policy from its path and takes weight updates as
      ``(name, tensor)`` pairs; a Ray rollout replica then loads no Hugging Face copy for it.
    - ``in_replicas``: it can run inside ``placement.ray.rollout_replicas``.
    - ``other_numerics``: it samples with another implementation than the trainer's forward, so
      ``ppo.old_logprobs=auto`` recomputes the old log-probs with the trainer's.
    """

    name: str
    help: str
    build: Callable[[BuildRequest], RolloutBackend]
    problems: Callable[[str | None, str], list[str]] | None = None
    loads_own_weights: bool = False
    in_replicas: bool = True
    other_numerics: bool = False
    settings: type | None = None
    checks: Callable[[Any, Any], list[str]] | None = None
    for_device: Callable[[Any, str], Any] | None = None
    unfit: Callable[[Any, int], str | None] | None = None
    probe: Callable[[Any, int, int, int], Any] | None = None

    def __post_init__(self) -> None:
        if self.name == AUTO:
            raise ValueError(f"{AUTO!r} is not a backend name: generation.backend=auto picks eager or static")


REGISTRY: Registry[BackendSpec] = BACKENDS
register = REGISTRY.register
unregister = REGISTRY.unregister


def names() -> tuple[str, ...]:
    """The registered backends' names, built-in first."""
    return REGISTRY.names()


def choices() -> tuple[str, ...]:
    """What ``generation.backend`` accepts."""
    return (AUTO, *names())


def get(name: str) -> BackendSpec:
    """The backend called ``name``; an unknown name raises naming the known ones."""
    return REGISTRY.get(name, choices())


default_settings = REGISTRY.default_settings
help_lines = REGISTRY.help_lines


def build(request: BuildRequest) -> RolloutBackend:
    """The backend ``request.settings.kind`` names, built."""
    return get(request.settings.kind).build(request)


def build_backend(model: torch.nn.Module, settings: BackendSettings) -> RolloutBackend:
    """A backend that samples with ``model`` (oppo's own backends): :func:`build` without the rest."""
    return build(BuildRequest(settings, model))


def probe_backend(like: Any, rows: int, max_len: int, new_tokens: int) -> Any:
    """A fresh backend like ``like`` for ``rows`` rows from the spec that built it (its
    :attr:`BackendSpec.probe`), or None when no backend offers one."""
    for n in names():
        probe = get(n).probe
        fresh = probe(like, rows, max_len, new_tokens) if probe else None
        if fresh is not None:
            return fresh
    return None


FAST = "static"
"""What ``generation.backend=auto`` picks on CUDA where it can decode the policy (CUDA graphs)."""
FALLBACK = "eager"


def resolve_backend(requested: str, device: torch.device | str, unfit: Callable[[], str | None]) -> tuple[str, str]:
    """The backend ``generation.backend`` names, and a sentence saying which runs and why.

    ``auto``: :data:`FAST` on a CUDA device unless ``unfit()`` (asked only then: that backend's
    :attr:`BackendSpec.unfit` on the policy, which may run a two-token forward) names something it
    refuses; else :data:`FALLBACK`. On CPU the eager backend runs: CPU runs and their golden metrics
    stay as they were (without graphs the static backend is no faster there). Any other value is
    returned as asked.
    """
    if requested != AUTO:
        return requested, f"{requested} (generation.backend={requested})"
    kind = device if isinstance(device, str) else device.type
    if kind != "cuda":
        return FALLBACK, f"{FALLBACK} (generation.backend=auto: no CUDA graphs on {kind})"
    problem = unfit()
    if problem:
        return FALLBACK, (f"{FALLBACK} (generation.backend=auto: the {FAST} backend cannot decode this policy: "
                          f"{problem})")
    return FAST, f"{FAST} with CUDA graphs (generation.backend=auto; generation.backend={FALLBACK} is the fallback)"




def backend_settings(generation: GenerationConfig, rollout: Mapping[str, Any], stop_ids, pad_id: int,
                     max_new_tokens: int, device: torch.device, *, seed: int, max_rows: int, prompt_width: int,
                     model: torch.nn.Module | None = None) -> BackendSettings:
    """The rollout backend's settings from the config's ``generation`` section and ``rollout`` (the
    backends' own settings, ``{kind: its settings}``: the chosen one's resolved for ``device``), for
    a backend on ``device``; ``generation.backend=auto`` resolved there (:func:`resolve_backend`: the
    fast backend on CUDA when ``model``, the policy it will decode, suits it; else eager). Ray rollout
    replicas get settings for ``cpu``, so ``auto`` runs the eager backend in them. ``seed``:
    ``run.seed``; ``max_rows``: the most rows in flight (B + Delta); ``prompt_width``: the prompt
    columns (``data.PromptSet.width``: ``data.max_prompt_tokens``, or where it is empty the longest
    prompt)."""
    g = generation
    max_len = prompt_width + max_new_tokens

    def unfit() -> str | None:
        check = get(FAST).unfit
        if model is None:
            return "the policy was not given to check"
        return check(model, max_len) if check else None
    kind, reason = resolve_backend(g.backend, device, unfit)
    spec, own = get(kind), rollout.get(kind)
    if own is not None:  # a copy: the backend's settings do not change with the config object
        own = spec.for_device(own, device.type) if spec.for_device else dataclasses.replace(own)
    return BackendSettings(tuple(stop_ids), pad_id, max_new_tokens, g.temperature, g.top_k, g.top_p,
                          g.kv_budget_mb or None, seed, kind, max_rows=max_rows, max_len=max_len, reason=reason,
                          backend=own)


def backend_problems(name: str, policy_path: str | None, device: str) -> list[str]:
    """Every reason the rollout backend ``name`` cannot serve the policy at ``policy_path`` (None:
    not readable yet) on ``device`` (``BackendSpec.problems``: not installed, an architecture it
    lacks), with the fixes; none for ``auto`` and for a backend that names none. The run's one check
    asks it (``setup.preflight``)."""
    if name == AUTO:
        return []
    backend = get(name)
    return backend.problems(policy_path, device) if backend.problems else []


def check_backend(name: str, policy_path: str | None, device: str) -> None:
    """Raise :class:`BackendUnavailable` with :func:`backend_problems`, if there are any."""
    problems = backend_problems(name, policy_path, device)
    if problems:
        raise BackendUnavailable("\n".join(problems))
