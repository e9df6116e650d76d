"""The static rollout backend (``generation.backend=static``; ``auto`` picks it on CUDA):
preallocated KV slots and a decode step captured in CUDA graphs (:mod:`.backend`).

This module is its spec: its settings (``rollout.static.*``), checks, build and bench probe. It
imports no torch; the backend's names (``StaticBackend``, ``static_decode_problem``, ...) are
read from :mod:`.backend` when first asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..registry import BackendSpec, BuildRequest, setting

CAPTURES = ("auto", "none", "cuda_graph", "compile")


@dataclass
class StaticSettings:
    capture: str = setting("auto", "How the decode step runs: cuda_graph (captured once per shape bucket and "
                                   "replayed; needs CUDA), compile (torch.compile, reduce-overhead on CUDA), none "
                                   "(eagerly, exact shapes); auto: cuda_graph on CUDA, none elsewhere.", CAPTURES)


def _for_device(own: StaticSettings, device_type: str) -> StaticSettings:
    if own.capture != "auto":
        return replace(own)
    return replace(own, capture="cuda_graph" if device_type == "cuda" else "none")


def _checks(own: StaticSettings, cfg: Any) -> list[str]:
    if own.capture == "cuda_graph" and cfg.policy.device == "cpu":
        return ["rollout.static.capture=cuda_graph needs the policy on CUDA, but policy.device=cpu; set "
                "rollout.static.capture=auto (none on the CPU) or policy.device=cuda."]
    return []


def _build(req: BuildRequest):
    from .backend import StaticBackend

    s = req.settings
    own = req.own if req.own is not None else StaticSettings()
    if own.capture == "auto":
        assert req.model is not None  # (oppo's own backends sample with the trainer's module)
        own = _for_device(own, next(req.model.parameters()).device.type)
    backend = StaticBackend(req.model, s.stop_ids, s.pad_id, s.max_new_tokens, s.temperature, s.top_k, s.top_p,
                            seed=s.seed, max_rows=s.max_rows, max_len=s.max_len, capture=own.capture)
    backend.kv_budget_mb = s.kv_budget_mb or None
    # cuda_graph: each (Rb, Lb) bucket is captured on its first decode step, so a run pays only for
    # the buckets its rows reach (backend.capture_stats(); the bench reports them)
    return backend


def _unfit(model: Any, max_len: int) -> str | None:
    from .backend import static_decode_problem

    return static_decode_problem(model, max_len, probe=True)


def _probe(like: Any, rows: int, max_len: int, new_tokens: int):
    from .backend import StaticBackend

    if type(like) is not StaticBackend:
        return None
    return StaticBackend(like.model, -1, like.pad_id, new_tokens, like.temperature, like.top_k, like.top_p,
                         max_rows=rows, max_len=max_len, capture=like.capture)


BACKEND = BackendSpec(
    "static", "oppo's backend with preallocated KV slots of 2B rows x (max_prompt_tokens + max_new_tokens) "
              "columns; on CUDA its decode step is captured in CUDA graphs (docs/benchmarks-notes.md has "
              "the measured speed-up); attention-only decoders with sdpa or eager attention", _build,
    in_replicas=False, settings=StaticSettings, checks=_checks, for_device=_for_device, unfit=_unfit, probe=_probe)


def __getattr__(name: str) -> Any:
    """The backend module's names (``from oppo.rollout.static import StaticBackend``), imported
    on first use so that reading this spec loads no torch."""
    if name.startswith("__") or name == "backend":  # (the submodule itself: imported, never looked up here)
        raise AttributeError(name)
    from importlib import import_module

    backend = import_module(f"{__name__}.backend")
    try:
        return getattr(backend, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
