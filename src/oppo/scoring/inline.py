"""The scorers in the controller's own thread (``Placement.scorer == "inline"``)."""

from __future__ import annotations

from ..api.records import Chunk
from ..trace import Tracer
from .streaming import StreamingScorer
from .worker import AdmitMsg, ChunksMsg, ForgetMsg, ScorerLoop


class InlineScorer:
    """The scorers in the controller's own thread: one-shot scoring (the sequential loop, and the
    modes that do not stream), and the streaming messages handled at once by the same
    :class:`~oppo.scoring.worker.ScorerLoop` the scorer workers run."""

    def __init__(self, scorers: dict[str, StreamingScorer]):
        self.scorers, self.roles = scorers, tuple(scorers)
        self.loop = ScorerLoop(scorers, tracer=Tracer(enabled=False))

    @property
    def peak_cache_bytes(self) -> dict[str, int]:
        return {role: s.peak_cache_bytes for role, s in self.scorers.items()}

    def admit(self, uids, prompts, step: int) -> None:
        self.loop.handle([AdmitMsg(tuple(uids), tuple(tuple(p) for p in prompts), step)], _no_reply)

    def feed(self, chunks, step: int) -> None:
        if chunks:
            self.loop.handle([ChunksMsg(tuple(chunks), step)], _no_reply)

    def admit_finished(self, uids, prompts, responses, step: int) -> None:
        self.admit(uids, prompts, step)
        self.feed([Chunk(u, tuple(r), True) for u, r in zip(uids, responses)], step)

    def forget(self, uids) -> None:
        self.loop.handle([ForgetMsg(frozenset(uids))], _no_reply)

    def barrier(self) -> None:
        pass  # every message was handled when it was sent

    def take(self, uids):
        self.loop.collect()  # (the outputs stay on the device until asked for: one read per role)
        return {role: [res.pop(u) for u in uids] for role, res in self.loop.results.items()}

    def score_full(self, role, prompts, responses):
        from ..scoring.streaming import score_full

        s = self.scorers[role]
        return score_full(s.kind, s.model, prompts, responses, s.pad_id, s.temperature)  # (reward_<name>: kind reward)

    def close(self) -> None:
        pass

def _no_reply(reply) -> None:
    raise RuntimeError("internal error: a barrier message reached the inline scorer")
