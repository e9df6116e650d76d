"""The eager engine's spec (``generation.backend=eager``): oppo's own engine with a growing KV cache
per batch (:mod:`.engine`), the reference the other backends are tested against. It has no settings
of its own. Importing this module imports no torch."""

from __future__ import annotations

from typing import Any

from .registry import BackendSpec, BuildRequest


def _build(req: BuildRequest):
    from .engine import RolloutEngine

    s = req.settings
    engine = RolloutEngine(req.model, s.stop_ids, s.pad_id, s.max_new_tokens, s.temperature, s.top_k, s.top_p,
                           seed=s.seed)
    engine.kv_budget_mb = s.kv_budget_mb or None
    return engine


def _probe(eng: Any, rows: int, max_len: int, new_tokens: int):
    from .engine import RolloutEngine

    if type(eng) is not RolloutEngine:
        return None
    return RolloutEngine(eng.model, -1, eng.pad_id, new_tokens, eng.temperature, eng.top_k, eng.top_p)


BACKEND = BackendSpec(
    "eager", "oppo's engine with a growing KV cache per batch (the fallback to set by hand if the static "
             "engine misbehaves)", _build, probe=_probe)
