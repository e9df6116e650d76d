"""The one stepwise decode-and-stream loop: advance a rollout backend, hand each finished sequence
and each batch of chunks to whoever listens.

The controller (``control.stages.decode_once``: one advance, finished sequences to the scheduler,
chunks to the scorers) and a Ray rollout replica (``rollout.ray.RolloutHost.advance``: advances until
a row ends or a chunk is due, chunks straight to the scorer actors) run this same function; only
their :class:`DecodeSink` differs. It lives beside the Protocols because the controller may not
import the rollout package.
"""

from __future__ import annotations

from typing import Protocol

from .protocols import RolloutBackend
from .records import Chunk, ChunkReady, Rollout, SequenceFinished


class DecodeSink(Protocol):
    """Where the loop's output goes."""

    def advancing(self) -> None:
        """Called before each ``advance`` (a Ray rollout replica opens its decode span here)."""

    def finished(self, rollout: Rollout) -> None:
        """A sequence ended (the backend's record), in the order the backend reported them."""

    def chunks(self, chunks: list[Chunk]) -> None:
        """The chunks of one advance (never empty), after its finished sequences."""


def decode_and_stream(backend: RolloutBackend, chunk_size: int | None, sink: DecodeSink,
                      max_steps: int | None = 1) -> list[Rollout]:
    """Advance ``backend`` (``chunk_size``: as ``RolloutBackend.advance``) while it has active
    sequences, at most ``max_steps`` times (None: no limit), stopping after the first advance in
    which a sequence ended. Returns the sequences that ended."""
    steps = 0
    while backend.active and (max_steps is None or steps < max_steps):
        sink.advancing()
        events = backend.advance(chunk_size)
        steps += 1
        done = [e.rollout for e in events if isinstance(e, SequenceFinished)]
        for r in done:
            sink.finished(r)
        chunks = [e.chunk for e in events if isinstance(e, ChunkReady)]
        if chunks:
            sink.chunks(chunks)
        if done:
            return done
    return []
