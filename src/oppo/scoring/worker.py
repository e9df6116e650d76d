"""The scorer worker: streaming scorers beside the decoding actor, fed by a queue of small messages.

One controller-side handle, :class:`ScorerWorker`, and two transports it is composed with:

- ``transport="thread"``: the message loop runs on a thread of this process; on GPU its work goes
  on its own CUDA stream (or the scorers sit on their own devices, by their settings);
- ``transport="process"`` (the CPU default, ``placement.local.scorer_process``): the same loop in a child
  process, because as a thread it shares the GIL with the actor and slows its decode
  (measured in docs/overlap.md).

Either way the loop (:class:`ScorerLoop`) has its own torch thread count
(``placement.scorer_threads``), so on 2 cores the actor and the scorers each own one, and results
come back the same way: at each barrier, a :class:`BarrierReply` with every output completed
since the last one, the loop's busy spans, peak cache sizes and critic-training stats. The Ray
scorer actors (``scoring/ray.py``) run the same handle inside each actor.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..kernels import streams
from ..kernels.streams import Role
from ..learner.batch import CriticBatch
from ..learner.critic import CriticTrainer
from ..api.records import Chunk
from ..api.records import ScoredOutputs
from .streaming import StreamingScorer, score_full
from ..trace import Tracer


class ScorerDied(RuntimeError):
    """The scorer child process ended while the controller waited on it; the message names its
    roles, pid and signal (or exit code)."""


def death_message(name: str, roles, pid: int | None, exitcode: int | None, start_method: str) -> str:
    """'the scorer process (pid 123: the reward, reference and critic scorers) died: killed by SIGKILL'."""
    import signal

    if exitcode is not None and exitcode < 0:
        try:
            how = f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"killed by signal {-exitcode}"
        if -exitcode == signal.SIGKILL:
            how += " (by a user, or by the kernel when memory ran out: see dmesg)"
    elif exitcode is not None:
        how = f"it exited with status {exitcode}"
        if start_method != "fork":  # (a child started afresh imports the script that started oppo)
            how += (" (its error is printed above; a script that starts training at its top level must do it "
                    "under if __name__ == '__main__':, as the child process imports the script again)")
    else:
        how = "its exit status is unknown (the fork server that started it is gone too)"
    shown = ", ".join(roles[:-1]) + f" and {roles[-1]}" if len(roles) > 1 else "".join(roles)
    return f"the {name} process (pid {pid}: the {shown} scorer{'s' if len(roles) > 1 else ''}) died: {how}"


def unlink_semaphores(*queues) -> bool:
    """Remove the names of ``queues``' POSIX semaphores (``/dev/shm/sem.mp-*``) once both processes
    hold them open: they keep working, and nothing is left behind when a kill -9 of the process
    group also takes multiprocessing's resource tracker, which would unlink them at exit."""
    from multiprocessing import synchronize, util

    names = {getattr(getattr(getattr(q, attr, None), "_semlock", None), "name", None)
             for q in queues for attr in ("_rlock", "_wlock", "_sem")} - {None}
    # each name's own clean-up, run now (sem_unlink, then the resource tracker forgets it): the
    # finaliser multiprocessing registered for it at exit or collection (a fork start has none)
    for f in list(getattr(util, "_finalizer_registry", {}).values()):
        if getattr(f, "_callback", None) is getattr(synchronize.SemLock, "_cleanup", None) and (getattr(f, "_args", None) or
                                                                               (None,))[0] in names:
            try:
                f()
            except OSError:
                pass  # (unlinked already)
    return True


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
    minibatches: tuple  # each minibatch's rows: host lists (the learner's) or index tensors
    step: int


@dataclass(frozen=True)
class BarrierMsg:
    id: int


@dataclass(frozen=True)
class StopMsg:
    pass


@dataclass(frozen=True)
class BarrierReply:
    """What a barrier brings back: outputs completed since the last one (role -> uid -> outputs),
    the loop's busy spans, each role's peak KV-cache bytes, the critic's training stats."""

    id: int
    results: dict[str, dict[int, ScoredOutputs]]
    spans: list
    peaks: dict[str, int]
    train_stats: dict[str, float]


@dataclass
class ScorerLoop:
    """The message loop, wherever it runs: scorers, the outputs they completed, and (optionally)
    the critic's trainer. ``adapt_threads`` is called before each forward (a child process
    widens its thread count while the controller waits at a barrier)."""

    scorers: dict[str, StreamingScorer]
    name: str = "scorer"
    trainer: CriticTrainer | None = None
    adapt_threads: Callable[[], None] = lambda: None
    role: Role | None = None  # the thread transport's stream (kernels.streams); synchronised at each barrier
    tracer: Tracer = field(default_factory=lambda: Tracer(enabled=True))

    def __post_init__(self) -> None:
        self.results: dict[str, dict[int, ScoredOutputs]] = {role: {} for role in self.scorers}
        self.train_stats: dict[str, float] = {}

    def serve(self, get: Callable[[], object], get_nowait: Callable[[], object],
              reply: Callable[[BarrierReply], None]) -> None:
        """Handle messages until a StopMsg; the chunks on hand are batched into one forward."""
        while True:
            msgs = [get()]
            while True:  # batch the chunks on hand: drain what is queued
                try:
                    msgs.append(get_nowait())
                except queue.Empty:
                    break
            if self.handle(msgs, reply):
                return

    def handle(self, msgs: list, reply: Callable[[BarrierReply], None]) -> bool:
        """Process ``msgs`` in order; True at a StopMsg."""
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
                        self.adapt_threads()
                        s.admit(list(m.uids), [list(p) for p in m.prompts])
            elif isinstance(m, ForgetMsg):
                for s in self.scorers.values():
                    s.forget(set(m.uids))
            elif isinstance(m, TrainCriticMsg):
                if self.trainer is None:
                    raise RuntimeError("internal error: this scorer worker was built without a critic trainer")
                with self.tracer.span(self.name, "train_critic", m.step):
                    self.train_stats = self.trainer.train(self.scorers["critic"].model, m.batch, m.minibatches,
                                                          m.step, self.adapt_threads)
            elif isinstance(m, BarrierMsg):
                if self.role is not None:
                    self.role.synchronize()  # the outputs are read on the host at the barrier
                reply(self.take_reply(m.id))
            elif isinstance(m, StopMsg):
                return True
        self._flush(pending, step)
        return False

    def take_reply(self, bid: int) -> BarrierReply:
        """What a barrier brings back. The outputs of the sequences finished since the last one are
        read from the device here, one read per role (they stay on the device between chunk
        flushes: issue 50)."""
        spans = self.tracer.spans
        self.tracer.clear()
        self.collect()
        results, self.results = self.results, {role: {} for role in self.scorers}
        stats, self.train_stats = self.train_stats, {}
        return BarrierReply(bid, results, spans, {r: s.peak_cache_bytes for r, s in self.scorers.items()}, stats)

    def collect(self) -> None:
        """The finished sequences' outputs into ``results``: one read from the device per role."""
        for role, s in self.scorers.items():
            self.results[role].update(s.take_done())

    def _flush(self, pending: dict, step: int) -> None:
        if not pending:
            return
        for role, s in self.scorers.items():
            self.adapt_threads()
            with self.tracer.span(self.name, f"score_{role}", step, tokens=sum(len(t) for t, _ in pending.values())):
                s.feed(pending)  # (outputs stay on the device until the barrier: take_reply)


class _ThreadTransport:
    """The loop on a thread of this process, on its own role stream (``kernels.streams``: on GPU a CUDA
    stream, when the scorers share one device). Each message carries an event recorded on the
    sender's stream when it was sent; the loop's stream waits on it before handling the message (a
    critic batch, or critic weights the controller copied, were made on the sender's stream)."""

    def __init__(self, loop: ScorerLoop, threads: int, name: str):
        self.q: queue.Queue = queue.Queue()
        self.replies: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        devices = {s.device for s in loop.scorers.values()}
        self.device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
        loop.role = streams.role(f"scorer:{name}", self.device)
        self.loop, self.threads = loop, threads
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, msg) -> None:
        self.q.put((msg, streams.caller_event(self.device)))

    def wait_reply(self) -> BarrierReply:
        while True:
            try:
                reply = self.replies.get(timeout=0.5)
            except queue.Empty:
                if not self.thread.is_alive():
                    raise RuntimeError("scorer worker thread died") from self.error
                continue
            if isinstance(reply, BaseException):
                raise RuntimeError(f"scorer worker failed: {reply!r}") from reply
            return reply

    def _run(self) -> None:
        torch.set_num_threads(self.threads)
        role = self.loop.role
        assert role is not None  # (set in __init__)
        with role:
            while True:
                sent = [self.q.get()]
                while True:
                    try:
                        sent.append(self.q.get_nowait())
                    except queue.Empty:
                        break
                for _, ev in sent:
                    role.wait(ev)  # what the sender queued before each message
                msgs = [m for m, _ in sent]
                if self.error is not None:  # a failed loop's state is unknown: every later barrier fails too
                    for m in msgs:
                        if isinstance(m, BarrierMsg):
                            self.replies.put(self.error)
                        elif isinstance(m, StopMsg):
                            return
                    continue
                try:
                    if self.loop.handle(msgs, self.replies.put):
                        return
                except BaseException as e:  # surfaced at the barriers of this batch of messages, and later ones
                    self.error = e
                    for m in msgs:
                        if isinstance(m, BarrierMsg):
                            self.replies.put(e)

    def close(self) -> None:
        self.put(StopMsg())
        self.thread.join(timeout=10)


class _ProcessTransport:
    """The loop in a child process (CPU): no GIL shared with the decoding actor.

    The models' weights are moved to shared memory before the child starts, so the learner's
    in-place optimizer updates of the critic are what the child reads, and (critic trainer) the
    critic's AdamW state is too: the child updates weights and moments in place, the parent
    checkpoints them. Only one side touches the critic at a time: the controller reads it only
    after a barrier. Replies come back on a second queue.
    """

    def __init__(self, scorers: dict[str, StreamingScorer], threads: int, name: str, trainer: CriticTrainer | None):
        import os

        ctx = start_method(type(s.model).__module__ for s in scorers.values())
        for s in scorers.values():
            s.model.share_memory()
        opt_spec = None
        if trainer is not None:
            if trainer.master is not None:
                raise ValueError("internal error: the scorer process trains the critic it scores with (fp32 only)")
            opt_spec = (share_adam_state(trainer.opt), trainer.settings)
        self.q, self.out = ctx.Queue(), ctx.Queue()
        # set while the controller blocks at a barrier: the child may then use the controller's cores too
        self.boost = ctx.Value("b", 0, lock=False)
        spec = {role: (s.kind, s.model, s.pad_id, s.temperature) for role, s in scorers.items()}
        thread_counts = (threads, max(threads, torch.get_num_threads()))  # (normal, while the controller waits)
        # the child exits when this process dies, however it dies (see _die_with_parent)
        parent = (os.getpid(), threading.current_thread() is threading.main_thread())
        self.proc = ctx.Process(target=_child_main, args=(thread_counts, name, self.q, self.out, self.boost, parent),
                                daemon=True)
        self.proc.start()
        self.name, self.roles, self.start_method = name, tuple(scorers), ctx.get_start_method()
        self.forked = ctx.get_start_method() == "forkserver"
        # the models go as the first message, not as the process's arguments: a fork server passes
        # those in one message of at most 253 file descriptors, and each shared tensor is one
        self.q.put((spec, opt_spec))

    def put(self, msg) -> None:
        self.q.put(msg)

    def wait_reply(self) -> BarrierReply:
        self.boost.value = 1
        try:
            while True:
                try:
                    kind, payload = self.out.get(timeout=1.0)
                except queue.Empty:
                    if not self.alive():
                        raise ScorerDied(death_message(self.name, self.roles, self.proc.pid, self.proc.exitcode,
                                                       self.start_method)) from None
                    continue
                if kind == "error":
                    cause = payload if isinstance(payload, BaseException) else None
                    raise RuntimeError(f"scorer process failed: {payload!r}" if cause else
                                       f"scorer process failed: {payload}") from cause
                if not getattr(self, "unlinked", False):  # the child has opened the queues' semaphores: unlink
                    self.unlinked = unlink_semaphores(self.q, self.out)  # (kill -9 of the group leaves none)
                return payload
        finally:
            self.boost.value = 0

    def alive(self) -> bool:
        """Whether the child runs. A child of the fork server outlives a server killed by a signal
        (the process group's SIGTERM): ``Process`` then reads the server's end as the child's, so
        its own pid answers."""
        from ..procs import running

        return self.proc.is_alive() or (self.forked and running(self.proc.pid))

    def close(self) -> None:
        import os
        import signal
        import time

        def wait(limit: float) -> None:
            end = time.monotonic() + limit
            while self.alive() and time.monotonic() < end:
                if self.proc.exitcode is None:
                    self.proc.join(timeout=0.1)
                else:  # (the fork server is gone: the child's pid is all there is to watch)
                    time.sleep(0.1)

        try:
            if self.alive():
                self.q.put(StopMsg())
                wait(10)
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):  # (SIGKILL: stuck in a kernel that ignores SIGTERM)
                if self.alive():
                    os.kill(self.proc.pid, sig)
                    wait(5)


class ScorerWorker:
    """The streaming scorers of the reward model, reference and critic, on a thread or in a child
    process (``transport``); the controller's handle (the ``Scorer`` Protocol of
    ``api/protocols.py``).

    ``trainer``: the critic trains here, between the scoring messages (``train_critic``).
    ``score_full`` scores whole sequences in the caller's thread with the same models (the child
    process reads the very tensors, in shared memory): it must not run while the critic trains.
    """

    def __init__(self, scorers: dict[str, StreamingScorer], threads: int, tracer: Tracer, name: str = "scorer",
                 trainer: CriticTrainer | None = None, transport: str = "thread"):
        self.scorers, self.tracer, self.name = scorers, tracer, name
        self.roles = tuple(scorers)
        self.critic_trains_here = trainer is not None
        self.results: dict[str, dict[int, ScoredOutputs]] = {role: {} for role in scorers}
        self.peak_cache_bytes = {role: 0 for role in scorers}
        self.train_stats: dict[str, float] = {}
        self._next_barrier = 0
        self.transport: _ProcessTransport | _ThreadTransport
        if transport == "process":
            self.transport = _ProcessTransport(scorers, threads, name, trainer)
        elif transport == "thread":
            self.transport = _ThreadTransport(ScorerLoop(scorers, name, trainer), threads, name)
        else:
            raise ValueError(f"unknown scorer transport {transport!r}: thread or process")

    @property
    def proc(self):
        """The child process (process transport), for tests that kill its parent."""
        return self.transport.proc

    def admit(self, uids: list[int], prompts: list[list[int]], step: int) -> None:
        self.transport.put(AdmitMsg(tuple(uids), tuple(tuple(p) for p in prompts), step))

    def feed(self, chunks: list[Chunk], step: int) -> None:
        if chunks:
            self.transport.put(ChunksMsg(tuple(chunks), step))

    def admit_finished(self, uids, prompts, responses, step: int) -> None:
        self.admit(uids, prompts, step)
        self.feed([Chunk(u, tuple(r), True) for u, r in zip(uids, responses)], step)

    def forget(self, uids: set[int]) -> None:
        self.transport.put(ForgetMsg(frozenset(uids)))

    def train_critic(self, batch: CriticBatch, minibatches: "list[list[int]] | list[torch.Tensor]", step: int) -> None:
        """Start the critic's PPO update on this worker; its stats come from ``take_train_stats``
        after the next barrier. Needs the worker built with a ``trainer``."""
        if not self.critic_trains_here:
            raise RuntimeError("internal error: this scorer worker was built without a critic trainer")
        if batch.mask.is_cuda and isinstance(self.transport, _ProcessTransport):
            torch.cuda.current_stream(batch.mask.device).synchronize()  # (another process: no event to wait on)
        # (the thread transport's message carries an event: the worker's stream waits for the batch)
        self.transport.put(TrainCriticMsg(batch, tuple(minibatches), step))

    def take_train_stats(self) -> dict[str, float]:
        stats, self.train_stats = self.train_stats, {}
        return stats

    def barrier(self) -> None:
        """Wait until every message sent so far has been processed; collect what came back;
        re-raise a worker error."""
        self._next_barrier += 1
        self.transport.put(BarrierMsg(self._next_barrier))
        while True:
            reply = self.transport.wait_reply()
            self.train_stats.update(reply.train_stats)
            for role, res in reply.results.items():
                self.results[role].update(res)
            for sp in reply.spans:
                self.tracer.add(sp.lane, sp.stage, sp.step, sp.start, sp.end, **sp.args)
            self.peak_cache_bytes.update(reply.peaks)
            if reply.id == self._next_barrier:
                return

    def take(self, uids: list[int]) -> dict[str, list[ScoredOutputs]]:
        """Outputs for ``uids`` (all must be complete: call barrier() first)."""
        return {role: [res.pop(u) for u in uids] for role, res in self.results.items()}

    def score_full(self, role: str, prompts: list[list[int]], responses: list[list[int]]) -> list[ScoredOutputs]:
        s = self.scorers[role]
        return score_full(s.kind, s.model, prompts, responses, s.pad_id, s.temperature)  # (its kind: its role)

    def close(self) -> None:
        self.transport.close()


def start_method(modules=()):
    """How the scorer child starts: forked from multiprocessing's fork server where the platform has
    one, else spawned; never plain ``fork`` (the controller runs threads and OpenMP). The server
    imports this module (torch with it) and ``modules`` (the models' classes: transformers) once
    per process, when the first child starts; each child it forks then unpickles its models in
    milliseconds rather than importing for seconds, so every Trainer of a process after the first
    (a sweep, a notebook, a test session) starts its scorers sooner. The server keeps the
    environment of that moment."""
    import torch.multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    extra = [m for m in dict.fromkeys(modules) if m != "__main__"]  # (a script's own: each child imports it anyway)
    ctx.set_forkserver_preload([__name__, *extra])  # (read only when the server starts)
    return ctx


def _die_with_parent(parent_pid: int, parent_is_main_thread: bool) -> None:
    """Make this child process exit when the controller that started it (``parent_pid``) dies,
    however it dies.

    A controller killed by a signal (kill -9, the OOM killer, SIGTERM with no handler) runs no
    cleanup: multiprocessing's ``daemon`` flag only acts at a normal exit, and the child would
    wait in ``q.get()`` forever, orphaned, holding its models' memory. Two guards:

    - Linux, a spawned child: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, the kernel kills this process
      the moment its parent dies. The kernel ties it to the parent *thread* that started the
      child, so it is set only when that was the main thread (a worker started from a thread that
      ends earlier would otherwise be killed with that thread). A child of the fork server goes
      without: the server would take it down when a signal meant for the controller's process
      group kills the server (a scheduler's SIGTERM, which the controller answers with a
      checkpoint that needs this child);
    - everywhere: a daemon thread checks each second that the parent is unchanged (a dead
      parent's children are handed to init or a subreaper), or, for a child of the fork server,
      that the controller still runs (the server may die first, as above, and leave it running).

    The controller can die before either guard is up: the checks also run once before the thread
    starts.
    """
    import os
    import time

    from ..procs import kill_with_parent, running

    via = os.getppid()  # the controller, or the fork server it started
    if via == parent_pid and parent_is_main_thread:
        kill_with_parent()  # (where it cannot, the watchdog below still acts)

    def gone() -> bool:
        return os.getppid() != via if via == parent_pid else not running(parent_pid)

    if gone():
        os._exit(1)

    def watchdog() -> None:
        while not gone():
            time.sleep(1.0)
        os._exit(1)  # no cleanup to run: the parent owns every file and shared tensor

    threading.Thread(target=watchdog, name="parent-watchdog", daemon=True).start()


def _child_main(threads, name, q, out, boost, parent=None) -> None:
    import signal

    # Ctrl-C (and a scheduler's SIGTERM) reach the whole process group: the controller finishes its
    # step and checkpoints (run.STOP), then stops this process; it dies with the controller anyway
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if parent is not None:
        _die_with_parent(*parent)
    try:
        spec, opt_spec = q.get()
        scorers = {role: StreamingScorer(kind, model, pad_id, temperature)
                   for role, (kind, model, pad_id, temperature) in spec.items()}
        trainer = None
        if opt_spec is not None:
            (hyper, states), ppo_cfg = opt_spec
            params = list(scorers["critic"].model.parameters())
            opt = torch.optim.AdamW(params, **hyper)
            for p, st in zip(params, states):
                opt.state[p] = st  # the parent's shared tensors: updated in place here
            trainer = CriticTrainer(opt, ppo_cfg)
        normal, boosted = threads

        def adapt() -> None:
            want = boosted if boost.value else normal
            if torch.get_num_threads() != want:
                torch.set_num_threads(want)

        loop = ScorerLoop(scorers, name, trainer, adapt)
        torch.set_num_threads(normal)
        loop.serve(q.get, q.get_nowait, lambda reply: out.put(("reply", reply)))
    except BaseException as e:  # reported to the controller at its next barrier
        from ..guard import NonFiniteError

        out.put(("error", e if isinstance(e, NonFiniteError) else repr(e)))  # the guard's: whole, for the CLI


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
