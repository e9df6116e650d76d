"""Rollout replicas on Ray: N copies of the policy, each with its own backend, that decode on
their own and stream their chunks straight to the scorer actors (``placement.ray.rollout_replicas``).

:class:`RayRolloutGroup` is a ``RolloutBackend``: ``admit`` spreads sequences over the replicas,
``advance`` lets each decode a stretch on its own (one Ray round trip per stretch, not per token)
and returns the rows that ended anywhere. The controller relays no token: each
:class:`RolloutHost` feeds the scorer actors itself, and ``flush`` makes the controller's barrier
cover those chunks. Each replica hosts any registered backend (its spec sent from the controller's
registry, which alone holds run-time plugins), samples with its own generator
(``run.seed + rank``: one replica samples what the local backend samples) and receives weights from
the object store or the collective sync. Design: ``docs/distributed.md``, "Rollout replicas".
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..models import resolve_device
from . import registry
from .registry import BackendSettings, BuildRequest
from ..trace import Tracer
from ..api.decode import decode_and_stream
from ..api.records import Event, Rollout, RolloutStats, SequenceFinished
from ..cluster import ActorGroup, one_line
from ..api.specs import ModelSpec
from ..api.protocols import Wait, WeightSource
from ..weights.sync import (Packed, RemoteWeights, SyncGroup, WeightReceiver, WeightSyncError, pack, pack_state,
                            unpack_into, unpacked_tensors)


class RolloutHost:
    """The actor: a policy loaded from ``spec`` and its rollout backend. ``scorers``: the scorer actors'
    handles (None: no streaming; the sequential loop scores one-shot). Plain class;
    :class:`RayRolloutGroup` wraps it with ``ray.remote``. ``backend``: the spec of
    ``settings.kind`` (None: the registry's here)."""

    def __init__(self, spec: ModelSpec, settings: BackendSettings, seed: int, threads: int, name: str,
                 scorers: list | None = None, backend: registry.BackendSpec | None = None):
        torch.set_num_threads(threads)
        self.name = name
        settings = dataclasses.replace(settings, seed=seed)
        entry = backend if backend is not None else registry.get(settings.kind)
        # a backend that loads the checkpoint itself gets no Hugging Face copy here (docs/distributed.md)
        self.model = None if entry.loads_own_weights else spec.load().requires_grad_(False)
        self.backend = entry.build(BuildRequest(settings, self.model, spec.path, spec.dtype,
                                                resolve_device(spec.device).type, role=name, threads=threads))
        self.scorers = scorers or []
        self.sent: list = []  # refs of the calls made to the scorers since the last flush
        self.chunks_sent = 0  # chunks streamed since the last flush
        self.tracer = Tracer(enabled=True)
        self._span: tuple[float, int] | None = None  # (start, step) of the decode span not yet recorded
        self._step = 0  # the step advance decodes for

    def admit(self, rollouts: list[Rollout], step: int) -> None:
        if self.scorers:  # first to the scorers, so that they hold the prompt before any chunk
            uids, prompts = [r.uid for r in rollouts], [list(r.prompt_ids) for r in rollouts]
            self.sent += [a.admit.remote(uids, prompts, step) for a in self.scorers]
        with self.tracer.span(self.name, "prefill_prompt", step):
            self.backend.admit(rollouts)

    def advance(self, chunk: int | None, step: int) -> list[Rollout]:
        """Decode on its own until a row ends, or for ``chunk`` steps (None: until a row ends);
        the chunks of ``chunk`` tokens (and each row's end) go to the scorers as they complete
        (``api.decode.decode_and_stream``, the controller's loop). Returns the rows that ended
        (whole: tokens, log-probs, versions)."""
        self._step = step
        done = decode_and_stream(self.backend, (chunk or 1 << 30) if self.scorers else None, self, max_steps=chunk)
        if done and not self.backend.active:
            self._close_span()
        return done

    # the DecodeSink of decode_and_stream
    def advancing(self) -> None:
        if self._span is None:
            self._span = (time.perf_counter(), self._step)

    def finished(self, rollout: Rollout) -> None:
        pass  # (returned by advance)

    def chunks(self, chunks: list) -> None:
        self._close_span()  # one decode span per stretch between two sends, as the controller's
        self.sent += [a.feed.remote(chunks, self._step) for a in self.scorers]
        self.chunks_sent += len(chunks)

    def _close_span(self) -> None:
        if self._span is not None:
            self.tracer.add(self.name, "decode", self._span[1], self._span[0], time.perf_counter())
            self._span = None

    def generate_all(self, step: int) -> list[Rollout]:
        with self.tracer.span(self.name, "generate", step):
            return self.backend.generate_all()

    def flush(self) -> tuple[list, int, int]:
        """Wait until every call sent to the scorers has run; return (this replica's spans since
        the last flush, its KV-cache peak in bytes, the chunks it streamed)."""
        import ray

        self._close_span()
        sent, self.sent = self.sent, []
        try:
            ray.get(sent)
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"a scorer actor that {self.name} streams to died: {one_line(e)}") from None
        spans, peak, sent_chunks = self.tracer.spans, self.backend.take_stats().kv_peak_bytes, self.chunks_sent
        self.tracer.clear()
        self.chunks_sent = 0
        return spans, peak, sent_chunks

    def set_version(self, version: int) -> None:
        self.backend.set_version(version)

    def recompute(self) -> None:
        self.backend.recompute()

    def abort(self, uids: set[int]) -> None:
        """Drop these sequences (the group sends each replica only its own)."""
        self.backend.abort(uids)

    def load_weights(self, weights: Packed, version: int) -> None:
        if self.model is None:  # a backend with weights of its own: its reload, from the object store's arrays
            self.backend.load_weights(unpacked_tensors(weights), version)
            return
        unpack_into(self.model, weights, partial=True)
        self.backend.set_version(version)

    def in_flight(self) -> list[Rollout] | None:
        return self.backend.in_flight()

    def join_weight_sync(self, host: str, port: int, rank: int, world: int, timeout_s: float) -> str:
        """Join the collective weight sync (``weight_sync.CollectiveSync``) as receiver ``rank``:
        into the model's tensors, or (a backend with weights of its own: no model here) whole tensors handed to the backend's
        in-place reload after each sync. Returns "" or why the group could not form; a manifest this
        model cannot take raises."""
        try:
            if self.model is None:  # its reload takes CPU tensors here, so this member is on CPU
                group = SyncGroup(host, port, rank, world, "cpu", timeout_s=timeout_s)
                self.weight_receiver = WeightReceiver.connect(group, None, sink=self.backend.load_weights)
                return ""
            group = SyncGroup(host, port, rank, world, next(self.model.parameters()).device, timeout_s=timeout_s)
            self.weight_receiver = WeightReceiver.connect(group, self.model, partial=True)
        except WeightSyncError:
            raise
        except Exception as e:  # noqa: BLE001 (reported: placement.ray.weight_sync=auto falls back)
            return f"{type(e).__name__}: {e}"
        return ""

    def receive_weights(self, version: int) -> None:
        """One collective sync into the model (the learner must send ``version``); then sample as
        ``version``."""
        self.weight_receiver.receive(version)  # (a backend's own reload sets the version itself)
        self.backend.set_version(version)

    def state_dict(self) -> dict:
        return self.backend.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.backend.load_state_dict(state)

    def close(self) -> None:
        """End the backend's own processes (vLLM's workers, say) before the actor is killed."""
        self.backend.close()


class RayRolloutGroup:
    """N rollout replicas behind the ``RolloutBackend`` Protocol (module docstring).
    ``scorer``: the :class:`~.ray_scorer.RayScorerWorker` to stream to (None: no streaming). Call
    :func:`.cluster.init_ray` first."""

    def __init__(self, spec: ModelSpec, settings: BackendSettings, n: int, *, seed: int, tracer: Tracer,
                 scorer=None, num_cpus: float = 1, num_gpus: float = 0, threads: int = 1):
        handles = list(scorer.actors) if scorer is not None else None
        backend = registry.get(settings.kind)  # (the replicas' registries lack run-time plugins: docs/distributed.md)
        self.group = ActorGroup(RolloutHost, n, lambda i: (spec, settings, seed + i, threads, f"rollout{i}", handles,
                                                           backend),
                                role="rollout replica", num_cpus=num_cpus, num_gpus=num_gpus)
        self.replicas = self.group.actors
        self.tracer, self.scorer = tracer, scorer
        if scorer is not None:
            scorer.feeders.append(self)  # its barrier flushes the replicas' chunks first
        self.version = 0
        self.rows: dict[int, int] = {}  # uid -> replica of every row decoding
        self.admitted = [0] * n  # sequences admitted to each replica so far
        self.chunks_sent = 0  # chunks the replicas streamed to the scorers so far
        self.peak_cache_bytes = 0
        self.group.call("set_version", 0)  # up, and named if it failed to load

    @property
    def active(self) -> int:
        return len(self.rows)

    def admit(self, rollouts: list[Rollout]) -> None:
        """Each new row to the replica with the fewest rows (the lowest rank on a tie)."""
        if not rollouts:
            return
        load = [0] * len(self.replicas)
        for w in self.rows.values():
            load[w] += 1
        share: list[list[Rollout]] = [[] for _ in self.replicas]
        for r in rollouts:
            w = min(range(len(load)), key=lambda i: (load[i], i))
            load[w] += 1
            self.admitted[w] += 1
            share[w].append(r)
            self.rows[r.uid] = w
        self.group.gather([self.replicas[i].admit.remote(rs, self.version) for i, rs in enumerate(share) if rs],
                          [i for i, rs in enumerate(share) if rs])

    def advance(self, chunk_size: int | None) -> list[Event]:
        """Every replica with rows decodes on its own (streaming chunks of ``chunk_size`` tokens to
        the scorers) until one of its rows ends or for ``chunk_size`` steps; the rows that ended,
        in replica order. No chunk events: the replicas sent them."""
        busy = sorted(set(self.rows.values()))
        done = self.group.call("advance", chunk_size, self.version, ranks=busy)
        return [SequenceFinished(self._take(r)) for rows in done for r in rows]

    def generate_all(self) -> list[Rollout]:
        busy = sorted(set(self.rows.values()))
        done = self.group.call("generate_all", self.version, ranks=busy)
        self.flush()  # (the sequential loop has no scorer barrier to bring the replicas' spans home)
        return [self._take(r) for rows in done for r in rows]

    def flush(self) -> None:
        """Every chunk the replicas sent has reached the scorers; their spans join the trace."""
        for spans, peak, sent in self.group.call("flush"):
            for sp in spans:
                self.tracer.add(sp.lane, sp.stage, sp.step, sp.start, sp.end, **sp.args)
            self.peak_cache_bytes = max(self.peak_cache_bytes, peak)
            self.chunks_sent += sent

    def set_version(self, version: int) -> None:
        self.version = version
        self.group.call("set_version", version)

    def recompute(self) -> None:
        self.group.call("recompute")

    def abort(self, uids: set[int]) -> None:
        mine: list[set[int]] = [set() for _ in self.replicas]  # each replica's rows among uids
        for u in uids:
            if u in self.rows:
                mine[self.rows[u]].add(u)
        self.group.gather([w.abort.remote(m) for w, m in zip(self.replicas, mine)])
        for u in uids:
            self.rows.pop(u, None)

    def load_weights(self, source: WeightSource, version: int) -> None:
        """New policy weights into every replica, which then sample as ``version``: a learner's
        ``RemoteWeights`` (loaded straight from the object store: not through the controller), or a
        module or ``(name, tensor)`` pairs (put there once here)."""
        import ray

        if isinstance(source, RemoteWeights):
            ref = source.ref
        elif isinstance(source, torch.nn.Module):
            ref = ray.put(pack(source))  # all of them: frozen or not
        else:
            ref = ray.put(pack_state(dict(source)))
        self.group.call("load_weights", ref, version)
        self.version = version

    # the collective weight sync's receiving end (api.protocols.WeightLinkReceiver)
    @property
    def link_members(self) -> int:
        return len(self.replicas)

    def open_weight_link(self, host: str, port: int, first: int, world: int, timeout_s: float) -> Wait:
        refs = [w.join_weight_sync.remote(host, port, first + k, world, timeout_s) for k, w in enumerate(self.replicas)]
        return lambda: [f"rollout replica {k}: {w}" if w else "" for k, w in enumerate(self.group.gather(refs))]

    def receive_weights(self, version: int) -> Wait:
        refs = self.group.submit("receive_weights", version)

        def wait() -> None:
            self.group.gather(refs)
            self.version = version
        return wait

    def in_flight(self) -> list[Rollout] | None:
        """The rows decoding on every replica, as the replicas hold them (``RolloutBackend.in_flight``),
        in admission order; None where a replica's backend cannot hand them out. ``admit`` takes them back: a replica prefills prompt + response so far and
        streams the response to the scorers again."""
        per_replica = self.group.call("in_flight")
        if any(rs is None for rs in per_replica):
            return None
        return sorted((r for rs in per_replica for r in rs), key=lambda r: r.uid)

    def state_dict(self) -> dict:
        """oppo's own backends: every replica's generator state (``{"generator": [...]}``, in rank
        order); a backend without a generator: every replica's backend state (``{"replicas": [...]}``)."""
        states = self.group.call("state_dict")
        if all("generator" in st for st in states):
            return {"generator": [st["generator"] for st in states]}
        return {"replicas": states}

    def load_state_dict(self, state: dict) -> None:
        """A list from a group of the same size restores each replica's; anything else (another
        count, a local backend's single state) restores replica 0's where it can and leaves the
        others at their seeds: the resume is then not bitwise the uninterrupted run."""
        if "replicas" in state or "workers" in state:  # ("workers": the key before the rename to replicas)
            states = state["replicas" if "replicas" in state else "workers"]
        else:
            gen = state.get("generator")
            if gen is None:  # another kind of backend's state (module docstring of rollout/eager/backend.py)
                return
            states = [{"generator": g} for g in (gen if isinstance(gen, list) else [gen])]
        if len(states) != len(self.replicas):
            states = states[:1]
        self.group.gather([w.load_state_dict.remote(st) for w, st in zip(self.replicas, states)])

    def take_stats(self) -> RolloutStats:
        stats = RolloutStats(self.peak_cache_bytes)  # (the replicas' peaks, gathered at each flush)
        self.peak_cache_bytes = 0
        return stats

    def close(self) -> None:
        # the backends' own processes first (vLLM's workers, say); a dead actor has none left
        self.group.shutdown("close", timeout_s=30)
        self.replicas = []

    def _take(self, remote: Rollout) -> Rollout:
        """A replica's finished row, no longer decoding anywhere."""
        del self.rows[remote.uid]
        return remote
