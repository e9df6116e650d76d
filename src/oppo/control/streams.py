"""The rows in flight: the sequences admitted and not yet trained, and which of them stream to
the scorers. One owner for the controller's bookkeeping of rows, so that admission, the decode
sink, the step's close and the in-flight checkpoint (``inflight.py``) read and change it one way.

A row is *streamed* once the scorers hold its prompt (and maybe a prefix of its response), and
*scored whole* once they got its final chunk. A row admitted while the controller scored one-shot
is neither; one whose prefix the scorers hold but not its end is dropped from them at the close
and scored one-shot there (:meth:`Streams.split`).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..api.records import Chunk, Rollout


class Streams:
    """The controller's rows in flight (module docstring). ``streaming``: this step's chunks
    stream to the scorers (the controller may score a step one-shot); ``next_begun``: a pipeline
    run admitted the next step's prompts while the learner trained."""

    def __init__(self) -> None:
        self.rollouts: dict[int, Rollout] = {}  # admitted, not yet trained, in admission order
        self.streamed: set[int] = set()  # uids the scorers hold a prefix of (admitted to them)
        self.scored_whole: set[int] = set()  # streamed uids whose final chunk the scorers got
        self.streaming = False
        self.next_begun = False

    def add(self, rows: Iterable[Rollout]) -> None:
        """Rows admitted (or a finished row as the rollout backend holds it: its record, not ours)."""
        self.rollouts.update((r.uid, r) for r in rows)

    def stream(self, rows: Iterable[Rollout], whole: bool = False) -> None:
        """The scorers were given ``rows``' prompts (``whole``: and their whole responses)."""
        uids = [r.uid for r in rows]
        self.streamed.update(uids)
        if whole:
            self.scored_whole.update(uids)

    def fed(self, chunks: list[Chunk]) -> list[Chunk]:
        """Of the rollout backend's ``chunks``, those of rows the scorers hold (a row admitted while
        the controller scored one-shot is not theirs), a final one marking its row scored whole."""
        mine = [c for c in chunks if c.uid in self.streamed]
        self.scored_whole.update(c.uid for c in mine if c.final)
        return mine

    def split(self, batch: list[Rollout]) -> tuple[list[int], list[int], set[int]]:
        """The closed ``batch``'s positions the scorers scored whole, those scored one-shot, and the
        uids among the latter whose prefix the scorers hold (to be dropped from them)."""
        whole = [i for i, r in enumerate(batch) if r.uid in self.scored_whole]
        rest = [i for i, r in enumerate(batch) if r.uid not in self.scored_whole]
        return whole, rest, {batch[i].uid for i in rest} & self.streamed

    def unstream(self, uids: Iterable[int]) -> None:
        """The scorers no longer hold ``uids``."""
        uids = set(uids)
        self.streamed.difference_update(uids)
        self.scored_whole.difference_update(uids)

    def forget(self, uids: Iterable[int]) -> None:
        """``uids`` left flight (trained, drained, or aborted to be restored)."""
        uids = set(uids)
        for u in uids:
            self.rollouts.pop(u, None)
        self.unstream(uids)

    def untrained(self, decoding: Iterable[Rollout]) -> dict[int, Rollout]:
        """The rows admitted and not yet trained, by uid, in admission order; a ``decoding`` one as
        the rollout backend holds it now (its progress lives in the backend's record, not ours)."""
        now = {r.uid: r for r in decoding}
        return {u: now.get(u, r) for u, r in self.rollouts.items()}
