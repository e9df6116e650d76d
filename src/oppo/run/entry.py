"""``oppo train``: a Trainer in a run directory, with metrics, samples, trace and checkpoints.

One path from a config to a step: the objects split from the settings (:mod:`oppo.setup.inputs`),
the one check (:func:`~oppo.run.start.start_run`: the run directory and the checkpoint, then
``setup.check``: the settings validated, every path and object, before any model loads), the
roles built (``Trainer``), then
the loop (:mod:`oppo.run.loop`). A resume continues in the run's own directory. SIGTERM or
Ctrl-C (:data:`~oppo.run.stop.STOP`) finish the step in progress, write a checkpoint with the
sequences in flight and raise :class:`~oppo.run.stop.Preempted`; a second signal interrupts at
once. What a user sees: ``docs/guide.md``, "Run directories, resuming, and what a run tells you";
objects passed from Python: ``docs/python-api.md``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..checkpoint import load_checkpoint
from ..config import Config
from ..setup.inputs import split_inputs
from ..setup.preflight import PreflightError
from .dirs import create, remove_unfinished, take_lock
from .files import FAILURE_FILE, record_failure, write_config
from .lines import loading_line, machine_threads, policy_line, threads_lines
from .loop import train_steps
from .start import RunStart, start_run
from .stop import STOP
from .summary import recovery_line, run_summary

if TYPE_CHECKING:
    from ..trainer import Trainer


@dataclass
class _Claim:
    """The run directory this process writes: what it held before the run (None: the run makes
    it), and, once created and locked, its path and the open lock file."""

    found: set[Path] | None
    run_dir: Path | None = None
    lock: Any = None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.close()  # releases the flock


def train(cfg: Config, resume: str | None = None, progress: bool = True, *, policy: Any = None,
          tokenizer: Any = None, reference: Any = None, critic: Any = None, reward_model: Any = None,
          reward_fn: Callable | str | None = None, judge: Callable | str | None = None, prompts: Any = None) -> Path:
    """Run PPO as configured; return the run directory.

    ``resume``: None for a new run, ``"auto"`` for the latest checkpoint of ``run.out_dir``, or a
    checkpoint (or run) directory. Raises :class:`~oppo.setup.preflight.PreflightError` before loading
    anything when the run directory, the checkpoint or the inputs are wrong. The keywords after
    ``progress`` give objects in place of settings, as :class:`~oppo.trainer.Trainer` takes them;
    models that a role loads elsewhere are saved under the run directory's ``inputs/``. With
    ``progress``, a finished run prints its summary (:func:`run_summary`: ``done: N steps ...``) on
    stdout, as ``oppo train`` does.
    """
    from transformers.utils import logging as hf_logging

    t_start = time.perf_counter()
    cfg, inputs = split_inputs(cfg, policy=policy, tokenizer=tokenizer, reference=reference, critic=critic,
                               reward_model=reward_model, reward_fn=reward_fn, judge=judge, prompts=prompts)
    hf_logging.disable_progress_bar()  # "Loading weights" bars for every role drown the run's own output
    start = start_run(cfg, resume, inputs)  # the one check: nothing is checked again below
    cfg = start.checked.cfg  # (a resume: a default changed since the checkpoint takes its value)
    # the entries of an existing run directory before this run (None: this run makes it), so that a
    # run failing before its first step removes only what it wrote
    claim = _Claim(found=set(start.run_dir.iterdir()) if start.run_dir.is_dir() else None)
    trainer = _load(start, progress)
    try:
        run_dir = _open(trainer, start, claim, progress)
        first = trainer.step  # (a resume's: the checkpoint's step)
        train_steps(trainer, run_dir, start.link, resumed=start.checkpoint is not None, objects=bool(inputs))
    except BaseException as e:
        _on_failure(e, trainer, start, claim, objects=bool(inputs))
        raise
    finally:
        STOP.active = STOP.final = False
        trainer.close()
        claim.release()
    if progress:
        print(run_summary(run_dir, time.perf_counter() - t_start, link=cfg.run.out_dir, first_step=first),
              flush=True)
    return run_dir


def _load(start: RunStart, progress: bool) -> Trainer:
    """Build the roles from the run's checked settings and objects (the Trainer checks nothing
    again); objects that a role loads elsewhere are saved under the run directory's ``inputs/``."""
    from ..trainer import Trainer

    cfg = start.checked.cfg
    if progress:
        for line in threads_lines(cfg.placement, cfg.streams, *machine_threads()):
            print(line, file=sys.stderr)
        print(loading_line(cfg), file=sys.stderr, flush=True)
    t_load = time.perf_counter()
    trainer = Trainer(start.checked, progress=progress)
    if progress:
        print(f"models loaded in {time.perf_counter() - t_load:.1f}s", file=sys.stderr)
    return trainer


def _open(trainer: Trainer, start: RunStart, claim: _Claim, progress: bool) -> Path:
    """Restore the checkpoint, create and lock the run directory, say where the run writes and
    which rollout backend runs, and write its ``config.yaml``."""
    cfg, ckpt = trainer.cfg, start.checkpoint
    if ckpt is not None:
        load_checkpoint(trainer, ckpt)
        print(f"resumed from {ckpt} at step {trainer.step}", file=sys.stderr)
    made = bool(trainer.inputs.saved)  # (models given as objects, saved in the run directory for other processes)
    run_dir = create(start.run_dir, fresh=start.link is not None and ckpt is None and not made)
    claim.run_dir, claim.lock = run_dir, take_lock(run_dir)
    if claim.lock is None:  # another run took the directory since the check
        raise PreflightError([f"another oppo train is writing {run_dir} (started since the checks); "
                              f"give a fresh run.out_dir."])
    backend = trainer.roles.backend  # generation.backend=auto resolved: which backend runs, and why
    if progress:
        linked = f" ({start.link} will point to it once a step has finished)" if start.link is not None else ""
        print(f"run directory: {run_dir}{linked}", file=sys.stderr)
        if backend:
            print(f"rollout backend: {backend}", file=sys.stderr)
        print(policy_line(cfg.overlap, cfg.ppo), file=sys.stderr)
    (run_dir / FAILURE_FILE).unlink(missing_ok=True)  # (an earlier failure of this run: it goes on now)
    write_config(run_dir, cfg, trainer.inputs, backend)
    return run_dir


def _on_failure(e: BaseException, trainer: Trainer, start: RunStart, claim: _Claim, objects: bool) -> None:
    """A run that this process had claimed failed: a new run with no finished step removes what it
    wrote; an error (not a signal's stop, which has its own message: cli.py) prints how to go on,
    and a run that is kept records it in ``failure.txt``."""
    if claim.lock is None or claim.run_dir is None:
        return
    removed = start.checkpoint is None and trainer.step == 0  # a new run of ours, no step done
    if removed:
        remove_unfinished(claim.run_dir, claim.found)
    if isinstance(e, Exception):
        line = recovery_line(claim.run_dir, trainer.step, removed, objects=objects)
        print(line, file=sys.stderr, flush=True)
        if not removed:  # the directory says it failed, and why, to whoever finds it later
            record_failure(claim.run_dir, e, line)
