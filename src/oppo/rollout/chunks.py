"""What every stepwise rollout backend does with its rows' new tokens: cut them into the chunks the
streaming scorers prefill (oppo's backends and vLLM alike)."""

from __future__ import annotations

from ..api.records import Chunk


def take_chunks(finished, active, chunk_size: int) -> list[Chunk]:
    """Chunks for the streaming scorers: each ``finished`` row's final chunk (possibly empty), and
    each ``active`` row with at least ``chunk_size`` unstreamed tokens; marks them streamed."""
    out = []
    for row in finished:
        out.append(Chunk(row.uid, tuple(row.response_ids[row.emitted:]), True))
        row.emitted = len(row.response_ids)
    for row in active:
        if len(row.response_ids) - row.emitted >= chunk_size:
            out.append(Chunk(row.uid, tuple(row.response_ids[row.emitted:]), False))
            row.emitted = len(row.response_ids)
    return out
