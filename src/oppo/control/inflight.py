"""The sequences in flight across a checkpoint: saved between steps (or drained where the rollout
backend cannot hand them out), restored on resume, and reloaded by the live run so that it goes on
as a run resumed from that checkpoint would (``checkpoint/store.py``, ``Trainer.state_dict``).
"""

from __future__ import annotations

from ..api.records import Rollout
from ..api.roles import RoleHandles
from ..scheduler import Scheduler
from .streams import Streams


class InFlight:
    """Checkpoint save, restore and drain of the rows in flight (``streams``) over the roles and
    the scheduler's tickets. ``streams_mode``: the run streams chunks to the scorers."""

    def __init__(self, roles: RoleHandles, scheduler: Scheduler, streams: Streams, streams_mode: bool):
        self.roles, self.scheduler, self.streams, self.streams_mode = roles, scheduler, streams, streams_mode

    def between_steps(self) -> None:
        """Bring the run to a state a checkpoint saves: a pipeline run's next step, begun while
        the learner trained, is un-begun (its sequences stay admitted, for the drain)."""
        if self.streams.next_begun:
            self.scheduler.suspend()
            self.streams.next_begun = False

    def save(self) -> dict:
        """What a checkpoint saves of the sequences admitted and not yet trained (carried ones, a
        finished group member waiting for its siblings, a pipeline run's begun step), between
        steps. ``{"how": "saved", "sequences": [Rollout.state_dict()...]}``: each one's prompt,
        tokens so far and every token's version and log-probs, in admission order (the scheduler's
        tickets are in its own state). Where the rollout backend cannot hand its rows out, they
        are drained instead (:meth:`drain`): ``{"how": "drained", "count": n, "sequences": []}``."""
        self.between_steps()
        rows = self.roles.rollout.in_flight()
        if rows is None:
            return {"how": "drained", "count": self.drain(), "sequences": []}
        self.streams.add(rows)  # their progress, as the backend holds it
        rollouts = self.streams.rollouts
        return {"how": "saved", "count": len(rollouts), "sequences": [r.state_dict() for r in rollouts.values()]}

    def restore(self, sequences: list[dict], step: int) -> None:
        """Admit saved sequences (:meth:`save`) again, their scheduler tickets restored already.
        The running ones go back into the rollout backend with their partial responses: it
        prefills prompt + response so far under its current weights (as ``stale_kv=recompute``
        does, so their next tokens carry the current version) and decodes on where each stopped.
        Saved tokens keep their versions and behaviour log-probs, so the off-policy correction
        and the staleness metrics see them as before. Streaming scorers prefill each prompt and
        get the response so far as the sequence's first chunk (``emitted`` is reset: the backend
        sends it with its next chunk); a finished one gets it as its final chunk."""
        rows = [Rollout.from_state_dict(d) for d in sequences]
        if not rows:
            return
        rollout, scorer = self.roles.rollout, self.roles.scorer
        for r in rows:
            r.emitted = 0
            r.scored_version = rollout.version  # the scorers score it afresh, with the weights they hold now
        self.streams.add(rows)
        running = [r for r in rows if not r.finished]
        with self.roles.tracer.span("actor", "prefill_prompt", step):
            rollout.admit(running)
        done = [r for r in rows if r.finished]
        if self.streams_mode and running:
            scorer.admit([r.uid for r in running], [r.prompt_ids for r in running], step)
            self.streams.stream(running)
        if self.streams_mode and done:
            scorer.admit_finished([r.uid for r in done], [r.prompt_ids for r in done], [r.response_ids for r in done],
                                  step)
            for r in done:
                r.emitted = len(r.response_ids)
            self.streams.stream(done, whole=True)

    def reload(self, saved: dict, step: int) -> None:
        """After a checkpoint saved the sequences in flight, the live run continues as a run
        resumed from it would: every untrained sequence leaves the rollout backend and the
        scorers and is restored from the saved state (:meth:`restore`). Costs one prefill of the
        carried rows per checkpoint, and makes the live and the resumed run take the same path."""
        uids = set(self.streams.rollouts)
        if not uids:
            return
        self._leave(uids)
        self.restore(saved["sequences"], step)

    def drain(self) -> int:
        """Abort every sequence in flight and requeue its prompt (before a checkpoint, where the
        backend cannot hand them out); returns how many."""
        self.between_steps()
        drained = self.scheduler.drain_for_checkpoint()
        if drained:
            self._leave({t.uid for t in drained})
        return len(drained)

    def _leave(self, uids: set[int]) -> None:
        """``uids`` leave the rollout backend, the scorers and the rows in flight."""
        self.roles.rollout.abort(uids)
        self.roles.scorer.forget(uids)
        self.roles.scorer.barrier()
        self.streams.forget(uids)
