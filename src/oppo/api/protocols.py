"""What crosses a role boundary: the rollout backend, the scorer and the learner, as
``typing.Protocol`` classes, and the typed events a rollout backend reports.

The controller (``oppo.control``) only calls these methods. Where a role runs is decided once, by
``oppo.setup.build.build_roles``; every implementation of one Protocol passes the same conformance
suite (``tests/test_conformance.py``).

Design notes (the implementations of each): docs/design.md, "The role boundary"."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Union, runtime_checkable

import torch

from .records import Chunk, ChunkReady, Event, Rollout, RolloutStats, ScoredOutputs, SequenceFinished

if TYPE_CHECKING:  # (a record of its own: the weight sync imports these Protocols, not the reverse)
    from ..weights.remote import RemoteWeights

__all__ = ["ChunkReady", "Event", "LearnerEngine", "RolloutBackend", "Scorer", "SequenceFinished",
           "WeightLinkReceiver", "WeightLinkSender", "WeightSource"]


WeightSource = Union[torch.nn.Module, Iterable[tuple[str, torch.Tensor]], "RemoteWeights"]
"""What a weight sync carries from the learner to the rollout side: a module (the same process),
``(name, tensor)`` pairs in Hugging Face names, or ``weights.remote.RemoteWeights`` (held by
another process)."""

Wait = Callable[[], Any]
"""A call under way: calling it waits for it and returns its answer (the collective weight sync
starts every member before it waits for any)."""


# ---------------------------------------------------------------- rollout backend


@runtime_checkable
class RolloutBackend(Protocol):
    """Samples responses for admitted sequences, a step at a time; carries unfinished ones
    across PPO steps; loads new weights between two steps.

    Every sampled token gets its behaviour log-prob and the policy version that sampled it
    (``Rollout.logprobs`` / ``Rollout.versions``), and, when the backend truncates (top-k,
    top-p), the untruncated log-prob of its weights (``Rollout.policy_logprobs``), which the
    off-policy weights compare against (an untruncating backend may leave it empty).
    """

    version: int
    """The policy version the backend samples with (what new tokens are tagged with)."""

    @property
    def active(self) -> int:
        """Sequences admitted and not yet finished or aborted."""

    def admit(self, rollouts: list[Rollout]) -> None:
        """Start sampling these sequences (prompt, plus any response so far: a sequence restored
        from a checkpoint is prefilled with its partial response and decodes on from there, its
        earlier tokens, log-probs and versions kept). The backend samples into copies of its own
        (``Rollout.copy``): the records given are never changed; the backend's come back in
        :class:`SequenceFinished`, :meth:`generate_all` and :meth:`in_flight`."""

    def in_flight(self) -> list[Rollout] | None:
        """The active sequences as they stand (tokens, log-probs and versions so far), in
        admission order, as copies (changing them changes nothing in the backend), for a checkpoint
        to save; None where the backend cannot hand them out (the checkpoint then drains them)."""

    def advance(self, chunk_size: int | None) -> list[Event]:
        """Sample at least one token for every active sequence and report what happened, in
        order: every :class:`SequenceFinished`, then every :class:`ChunkReady`.

        ``chunk_size``: emit a chunk for each sequence with that many unstreamed tokens, and a
        final chunk for each finished one. None: no chunks (no streaming scorer listens, or the
        backend streams to them itself). A backend may sample several tokens per call (a Ray
        rollout replica decodes on its own until a sequence ends or a chunk is due); it returns no
        later than the first sequence that finishes.
        """

    def generate_all(self) -> list[Rollout]:
        """Sample until every active sequence has ended (the sequential rollout); return them."""

    def set_version(self, version: int) -> None:
        """Tag every token sampled from now on with ``version`` (its weights are loaded)."""

    def load_weights(self, source: WeightSource, version: int) -> None:
        """Load the learner's current policy weights (``LearnerEngine.weights_out``, or a module
        holding them), then sample as ``version``. Sequences in flight stay (their KV cache is kept;
        see :meth:`recompute`)."""

    def recompute(self) -> None:
        """Rebuild every active sequence's KV cache under the current weights
        (``overlap.stale_kv=recompute``)."""

    def abort(self, uids: set[int]) -> None:
        """Drop these sequences."""

    def take_stats(self) -> RolloutStats:
        """What the backend measured since the last call (KV-cache peak, decode steps); its
        counters restart."""

    def state_dict(self) -> dict:
        """The sampling state a checkpoint saves (random generators)."""

    def load_state_dict(self, state: dict) -> None:
        ...

    def close(self) -> None:
        ...


# ---------------------------------------------------------------- scorers


@runtime_checkable
class Scorer(Protocol):
    """The frozen and trained scorers (reward model, reference, critic), streaming or one-shot.

    Messages are processed in the order they are sent; ``barrier`` waits for all of them.
    """

    roles: tuple[str, ...]
    """Which of "reward", "reference", "critic" it scores."""

    @property
    def peak_cache_bytes(self) -> dict[str, int]:
        """Per role, the streaming scorer's KV-cache peak so far (as of the last barrier), in bytes:
        the run's ``memory/<role>_kv_peak_mb``."""

    def admit(self, uids: list[int], prompts: list[list[int]], step: int) -> None:
        """Prefill these sequences' prompts."""

    def feed(self, chunks: list[Chunk], step: int) -> None:
        """Prefill the chunks; a final chunk completes its sequence."""

    def admit_finished(self, uids: list[int], prompts: list[list[int]], responses: list[list[int]],
                       step: int) -> None:
        """Score sequences that finished elsewhere (restored from a checkpoint): prefill each prompt,
        then its whole response as its final chunk. The controller sends these itself, also where
        rollout replicas feed the scorers (``FedByRollout``)."""

    def forget(self, uids: set[int]) -> None:
        """Drop these sequences' state."""

    def barrier(self) -> None:
        """Wait until every message sent so far has been processed (re-raises the scorer worker's error)."""

    def take(self, uids: list[int]) -> dict[str, list[ScoredOutputs]]:
        """Completed outputs of these sequences, per role (after a barrier)."""

    def score_full(self, role: str, prompts: list[list[int]], responses: list[list[int]]
                   ) -> list[ScoredOutputs]:
        """One-shot scoring of whole sequences by one role."""

    def close(self) -> None:
        ...


# ---------------------------------------------------------------- learner


@runtime_checkable
class LearnerEngine(Protocol):
    """Trains the actor (and the critic, unless the scorer trains it beside its scoring). One
    registered engine each (``learner.registry``): local, replicated ranks, FSDP2 shards."""

    def old_logprobs(self, exp, version: int):
        """A new ``Experience`` with ``old_logprobs`` / ``is_weights`` under the current weights."""

    def minibatches(self, B: int, step: int, lengths: torch.Tensor | list[int] | None = None) -> list[list[int]]:
        """The row indices of every optimizer step of one update (seeded per step), host lists; with
        ``lengths`` [B], each minibatch's rows longest first (``local.Learner.minibatches``)."""

    def update(self, exp, step: int, critic: bool = True) -> dict[str, float]:
        """PPO epochs over ``exp``: actor (and critic); returns the stats."""

    def weights_out(self) -> WeightSource:
        """The policy's trained weights as the weight sync reads them (for
        ``RolloutBackend.load_weights``): the module itself in process, a ref to them elsewhere."""

    def checkpoint_state(self) -> dict:
        """The optimizer states a checkpoint saves (``{"actor"[, "critic"]}``); trained weights that
        live elsewhere (Ray ranks) are brought into the controller's modules first. A sharded learner
        returns a ``sharded_checkpoint.ShardedLearnerState`` (its ranks write their shards)."""

    def load_checkpoint_state(self, optim: dict) -> None:
        """Inverse of :meth:`checkpoint_state`, after the controller's modules hold the weights."""

    def close(self) -> None:
        ...


# ---------------------------------------------------------------- the collective weight sync


@runtime_checkable
class WeightLinkSender(Protocol):
    """A learner that streams its trained actor over a process group of its own
    (the weight sync's ``CollectiveSync``): it is the group's rank 0."""

    def open_weight_link(self, host: str, port: int, world: int, bucket_bytes: int, wire_dtype,
                         timeout_s: float) -> Wait:
        """Start joining the group at the store ``host:port``; the wait returns why it could not
        form, one line per member ("" where it did)."""

    def send_weights(self, version: int) -> Wait:
        """Start one sync of the trained actor as ``version``."""


class WeightLinkReceiver(Protocol):
    """Rollout replicas that take the weights from that group (ranks ``first .. first + members - 1``)."""

    @property
    def link_members(self) -> int:
        """How many ranks of the group it holds."""

    def open_weight_link(self, host: str, port: int, first: int, world: int, timeout_s: float) -> Wait:
        """Start joining the group; the wait returns why it could not form, one line per member."""

    def receive_weights(self, version: int) -> Wait:
        """Start receiving one sync; the wait returns once every member has loaded ``version``."""
