"""The eager rollout backend (``generation.backend=eager``): oppo's own backend with a growing KV cache
per batch (:mod:`.backend`), the reference the other backends are tested against.

This module is its spec: it has no settings of its own. Importing it imports no torch."""

from __future__ import annotations

from typing import Any

from ..registry import BackendSpec, BuildRequest


def _build(req: BuildRequest):
    from .backend import EagerBackend

    s = req.settings
    backend = EagerBackend(req.model, s.stop_ids, s.pad_id, s.max_new_tokens, s.temperature, s.top_k, s.top_p,
                           seed=s.seed)
    backend.kv_budget_mb = s.kv_budget_mb or None
    return backend


def _probe(like: Any, rows: int, max_len: int, new_tokens: int):
    from .backend import EagerBackend

    if type(like) is not EagerBackend:
        return None
    return EagerBackend(like.model, -1, like.pad_id, new_tokens, like.temperature, like.top_k, like.top_p)


BACKEND = BackendSpec(
    "eager", "oppo's backend with a growing KV cache per batch (the fallback to set by hand if the static "
             "backend misbehaves)", _build, probe=_probe)
