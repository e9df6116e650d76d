"""The scorer worker: streaming scorers beside the decoding actor, fed by a queue of small messages.

``ScorerWorker`` runs them on a thread; on GPU it puts their work on its own CUDA stream (or the
scorers sit on their own devices, by their settings). ``ProcessScorerWorker`` (the CPU default,
``overlap.scorer_process``) runs the same message loop in a child process, because as a thread
it shared the GIL with the actor and slowed its decode 1.6x (measured, docs/overlap.md). Either
way the worker has its own torch thread count (``overlap.scorer_threads``), so on 2 cores the
actor and the scorers each own one.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch

from .config import PPOConfig
from .learner import CriticBatch, critic_update
from .rollout import Chunk
from .scoring import ScoredOutputs, StreamingScorer
from .trace import Tracer
from .weights import copy_weights


@dataclass(frozen=True)
class AdmitMsg:
    uids: tuple[int, ...]
    prompts: tuple[tuple[int, ...], ...]
    step: int


@dataclass(frozen=True)
class ChunksMsg:
    chunks: tuple[Chunk, ...]
    step: int


@dataclass(frozen=True)
class ForgetMsg:
    uids: frozenset[int]


@dataclass(frozen=True)
class TrainCriticMsg:
    batch: CriticBatch
    minibatches: tuple[torch.Tensor, ...]
    step: int


@dataclass(frozen=True)
class BarrierMsg:
    id: int


@dataclass(frozen=True)
class StopMsg:
    pass


class ScorerWorker:
    """Runs the streaming scorers of the reward model, reference and critic on one thread."""

    # the critic's trained weights when they are not the scorer's (fp32 masters under bf16,
    # weights.py); set by the trainer. None: the scorer's critic is the trained one.
    critic_master: torch.nn.Module | None = None
    compute_dtype: torch.dtype = torch.float32

    def __init__(self, scorers: dict[str, StreamingScorer], threads: int, tracer: Tracer, name: str = "scorer",
                 critic_trainer: tuple[torch.optim.Optimizer, PPOConfig] | None = None):
        self.scorers, self.threads, self.tracer, self.name = scorers, threads, tracer, name
        self.critic_opt, self.ppo_cfg = critic_trainer or (None, None)
        self.train_stats: dict[str, float] = {}
        self.q: queue.Queue = queue.Queue()
        self.results: dict[str, dict[int, ScoredOutputs]] = {role: {} for role in scorers}
        self.error: BaseException | None = None
        self.busy_s = 0.0
        self.stream = None
        devices = {s.device for s in scorers.values()}
        if len(devices) == 1 and next(iter(devices)).type == "cuda":
            self.stream = torch.cuda.Stream(device=next(iter(devices)))
        self._events: dict[int, threading.Event] = {}
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ controller side

    def admit(self, uids: list[int], prompts: list[list[int]], step: int) -> None:
        self.q.put(AdmitMsg(tuple(uids), tuple(tuple(p) for p in prompts), step))

    def feed(self, chunks: list[Chunk], step: int) -> None:
        if chunks:
            self.q.put(ChunksMsg(tuple(chunks), step))

    def forget(self, uids: set[int]) -> None:
        self.q.put(ForgetMsg(frozenset(uids)))

    def train_critic(self, batch: CriticBatch, minibatches: list[torch.Tensor], step: int) -> None:
        """Start the critic's PPO update on this worker; its stats come from ``take_train_stats``
        after the next barrier. Needs the worker built with ``critic_trainer``."""
        if self.critic_opt is None:
            raise RuntimeError("internal error: this scorer worker was built without a critic optimizer")
        if batch.mask.is_cuda:  # the batch was computed on the controller's stream; the worker has its own
            torch.cuda.current_stream(batch.mask.device).synchronize()
        self.q.put(TrainCriticMsg(batch, tuple(minibatches), step))

    def take_train_stats(self) -> dict[str, float]:
        stats, self.train_stats = self.train_stats, {}
        return stats

    def barrier(self) -> None:
        """Wait until every message sent so far has been processed; re-raise a worker error."""
        ev = threading.Event()
        self._events[id(ev)] = ev
        self.q.put(BarrierMsg(id(ev)))
        while not ev.wait(0.5):
            if not self.thread.is_alive():
                break
        if self.error is not None:
            raise RuntimeError(f"scorer worker failed: {self.error!r}") from self.error

    def take(self, uids: list[int]) -> dict[str, list[ScoredOutputs]]:
        """Outputs for ``uids`` (all must be complete: call barrier() first)."""
        return {role: [res.pop(u) for u in uids] for role, res in self.results.items()}

    def close(self) -> None:
        self.q.put(StopMsg())
        self.thread.join(timeout=10)

    # ------------------------------------------------------------------ worker side

    def _run(self) -> None:
        torch.set_num_threads(self.threads)
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else _null()
        with ctx:
            while True:
                msgs = [self.q.get()]
                while True:  # batch the chunks on hand: drain what is queued
                    try:
                        msgs.append(self.q.get_nowait())
                    except queue.Empty:
                        break
                try:
                    if self._handle(msgs):
                        return
                except BaseException as e:  # surfaced by barrier()
                    self.error = e
                    for m in msgs:
                        if isinstance(m, BarrierMsg):
                            self._events.pop(m.id).set()

    def _handle(self, msgs: list) -> bool:
        pending: dict[int, tuple[tuple[int, ...], bool]] = {}
        step = 0
        for m in msgs:
            if isinstance(m, ChunksMsg):
                step = m.step
                for c in m.chunks:  # consecutive chunks of one sequence are concatenated
                    prev = pending.get(c.uid, ((), False))
                    pending[c.uid] = (prev[0] + c.tokens, c.final)
                continue
            self._flush(pending, step)
            pending = {}
            if isinstance(m, AdmitMsg):
                with self.tracer.span(self.name, "prefill_prompt", m.step):
                    for s in self.scorers.values():
                        self._adapt_threads()
                        s.admit(list(m.uids), [list(p) for p in m.prompts])
            elif isinstance(m, ForgetMsg):
                for s in self.scorers.values():
                    s.forget(set(m.uids))
            elif isinstance(m, TrainCriticMsg):
                scorer_critic = self.scorers["critic"].model
                master = self.critic_master if self.critic_master is not None else scorer_critic
                with self.tracer.span(self.name, "train_critic", m.step):
                    self.train_stats = critic_update(master, self.critic_opt, m.batch, list(m.minibatches),
                                                     self.ppo_cfg, self._adapt_threads, self.compute_dtype)
                    copy_weights(master, scorer_critic)  # the bf16 copy it scores with (no-op in fp32)
            elif isinstance(m, BarrierMsg):
                if self.stream is not None:
                    self.stream.synchronize()
                self._ack(m)
            elif isinstance(m, StopMsg):
                return True
        self._flush(pending, step)
        return False

    def _ack(self, m: BarrierMsg) -> None:
        self._events.pop(m.id).set()

    def _adapt_threads(self) -> None:
        """A thread worker keeps its thread count (torch's is per process, shared with the actor)."""

    def _flush(self, pending: dict, step: int) -> None:
        if not pending:
            return
        for role, s in self.scorers.items():
            self._adapt_threads()
            with self.tracer.span(self.name, f"score_{role}", step, tokens=sum(len(t) for t, _ in pending.values())):
                s.feed(pending)
            self.results[role].update(s.take_done())


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class ProcessScorerWorker(ScorerWorker):
    """The same scorer loop in a child process (CPU): no GIL shared with the decoding actor.

    The models' weights are moved to shared memory before the child starts, so the learner's
    in-place optimizer updates of the critic are what the child reads, and (``critic_trainer``)
    the critic's AdamW state is too: the child updates weights and moments in place, the parent
    checkpoints them. Only one side touches the critic at a time: the controller reads it only
    after a barrier. Results, busy spans, peak cache sizes and training stats come back on a
    second queue at each barrier.
    """

    def __init__(self, scorers: dict[str, StreamingScorer], threads: int, tracer: Tracer, name: str = "scorer",
                 critic_trainer: tuple[torch.optim.Optimizer, PPOConfig] | None = None):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")  # fork after OpenMP/threads started is unsafe
        self.threads, self.tracer, self.name = threads, tracer, name
        self.scorers = scorers  # parent-side handles (for peak_cache_bytes); the child has its own
        for s in scorers.values():
            s.model.share_memory()
        self.critic_opt, self.ppo_cfg = critic_trainer or (None, None)
        self.train_stats = {}
        opt_spec = None
        if self.critic_opt is not None:
            opt_spec = (share_adam_state(self.critic_opt), self.ppo_cfg)
        self.q, self.out = ctx.Queue(), ctx.Queue()
        # set while the controller blocks at a barrier: the child may then use the controller's cores too
        self.boost = ctx.Value("b", 0, lock=False)
        self.results = {role: {} for role in scorers}
        self.error = None
        self._next_barrier = 0
        spec = {role: (s.kind, s.model, s.pad_id, s.temperature) for role, s in scorers.items()}
        threads = (threads, max(threads, torch.get_num_threads()))  # (normal, while the controller waits)
        import os

        # the child exits when this process dies, however it dies (see _die_with_parent)
        parent = (os.getpid(), threading.current_thread() is threading.main_thread())
        self.proc = ctx.Process(target=_child_main, args=(spec, threads, name, self.q, self.out, opt_spec,
                                                          self.boost, parent), daemon=True)
        self.proc.start()

    def barrier(self) -> None:
        self._next_barrier += 1
        self.q.put(BarrierMsg(self._next_barrier))
        self.boost.value = 1
        try:
            self._wait_barrier()
        finally:
            self.boost.value = 0

    def _wait_barrier(self) -> None:
        while True:
            try:
                kind, payload = self.out.get(timeout=1.0)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError("scorer process died") from None
                continue
            if kind == "error":
                raise RuntimeError(f"scorer process failed: {payload}")
            results, spans, peaks, train_stats, bid = payload
            self.train_stats.update(train_stats)
            for role, res in results.items():
                self.results[role].update(res)
            for sp in spans:
                self.tracer.add(sp.worker, sp.stage, sp.step, sp.start, sp.end, **sp.args)
            for role, peak in peaks.items():
                self.scorers[role].peak_cache_bytes = peak
            if bid == self._next_barrier:
                return

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.q.put(StopMsg())
                self.proc.join(timeout=10)
        finally:
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(timeout=5)
            if self.proc.is_alive():  # stuck in a kernel that ignores SIGTERM
                self.proc.kill()
                self.proc.join(timeout=5)


class _ChildLoop(ScorerWorker):
    """The child's side: ScorerWorker's message loop, replying on a queue instead of Events."""

    def __init__(self, scorers, threads, name, q, out, critic_opt=None, ppo_cfg=None, boost=None):
        self.scorers, self.name, self.q, self.out = scorers, name, q, out
        (self.threads, self.boost_threads), self.boost = threads, boost
        self.critic_opt, self.ppo_cfg, self.train_stats = critic_opt, ppo_cfg, {}
        self.tracer = Tracer(enabled=True)
        self.results = {role: {} for role in scorers}
        self.error = None
        self.stream = None

    def _ack(self, m: BarrierMsg) -> None:
        spans = self.tracer.spans
        self.tracer.clear()
        results, self.results = self.results, {role: {} for role in self.scorers}
        peaks = {role: s.peak_cache_bytes for role, s in self.scorers.items()}
        self.out.put(("results", (results, spans, peaks, self.take_train_stats(), m.id)))

    def _adapt_threads(self) -> None:
        want = self.boost_threads if self.boost is not None and self.boost.value else self.threads
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)


def _die_with_parent(parent_pid: int, parent_is_main_thread: bool) -> None:
    """Make this child process exit when the process that started it dies, however it dies.

    A controller killed by a signal (kill -9, the OOM killer, SIGTERM with no handler) runs no
    cleanup: multiprocessing's ``daemon`` flag only acts at a normal exit, and the child would
    wait in ``q.get()`` forever, orphaned, holding its models' memory. Two guards:

    - Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, the kernel kills this process the moment its
      parent dies. The kernel ties it to the parent *thread* that started the child, so it is set
      only when that was the main thread (a worker started from a thread that ends earlier would
      otherwise be killed with that thread);
    - everywhere: a daemon thread polls ``os.getppid()`` each second. A dead parent's children
      are handed to init or a subreaper, so a changed parent pid means the parent is gone.

    The parent can die before either guard is up (the child spends seconds importing torch):
    comparing ``getppid()`` with the pid the parent passed covers that window.
    """
    import ctypes
    import os
    import signal
    import sys
    import time

    if sys.platform.startswith("linux") and parent_is_main_thread:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the watchdog below still acts
            pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def watchdog() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)  # no cleanup to run: the parent owns every file and shared tensor

    threading.Thread(target=watchdog, name="parent-watchdog", daemon=True).start()


def _child_main(spec, threads, name, q, out, opt_spec, boost, parent=None) -> None:
    if parent is not None:
        _die_with_parent(*parent)
    try:
        scorers = {role: StreamingScorer(kind, model, pad_id, temperature)
                   for role, (kind, model, pad_id, temperature) in spec.items()}
        opt = ppo_cfg = None
        if opt_spec is not None:
            (hyper, states), ppo_cfg = opt_spec
            params = list(scorers["critic"].model.parameters())
            opt = torch.optim.AdamW(params, **hyper)
            for p, st in zip(params, states):
                opt.state[p] = st  # the parent's shared tensors: updated in place here
        loop = _ChildLoop(scorers, threads, name, q, out, opt, ppo_cfg, boost)
        torch.set_num_threads(loop.threads)
        while True:
            msgs = [q.get()]
            while True:
                try:
                    msgs.append(q.get_nowait())
                except queue.Empty:
                    break
            if loop._handle(msgs):
                return
    except BaseException as e:  # reported to the controller at its next barrier
        out.put(("error", repr(e)))


def share_adam_state(opt: torch.optim.Optimizer) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """Create an AdamW's per-parameter state now, in shared memory, as its first step would.

    Returns (hyperparameters, states in parameter order) for a copy of the optimizer in another
    process that updates the same tensors in place (``step``, ``exp_avg`` and ``exp_avg_sq``
    are all updated in place by torch's AdamW).
    """
    if type(opt) is not torch.optim.AdamW or len(opt.param_groups) != 1:
        raise TypeError("share_adam_state expects a single-group torch.optim.AdamW")
    group = opt.param_groups[0]
    if group["amsgrad"] or group.get("fused") or group.get("capturable"):
        raise ValueError("share_adam_state: amsgrad, fused and capturable AdamW are not supported")
    states = []
    for p in group["params"]:
        st = opt.state[p]
        if not st:
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        for v in st.values():
            v.share_memory_()
        states.append(st)
    hyper = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}
    return hyper, states


def load_optimizer_state_in_place(opt: torch.optim.Optimizer, state_dict: dict) -> None:
    """``opt.load_state_dict`` that keeps the existing state tensors (shared memory stays shared)."""
    old = {p: dict(st) for p, st in opt.state.items()}
    opt.load_state_dict(state_dict)
    for p, st in opt.state.items():
        for k, v in st.items():
            prev = old.get(p, {}).get(k)
            if torch.is_tensor(v) and torch.is_tensor(prev) and prev.shape == v.shape:
                prev.copy_(v)
                st[k] = prev
