"""The training loop of a run: steps until ``run.steps`` or a stop, each logged (metrics, lengths,
progress, the controller's decisions), checkpoints on the cadence, and the final checkpoint."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

from ..checkpoint import save_checkpoint
from ..config import RunConfig, to_dict
from ..metrics import MetricsLogger, ProgressBar
from .dirs import point_link
from .files import earlier_spans, keep_lines_before
from .heartbeat import step_heartbeat
from .lines import print_samples
from .stop import STOP, Preempted

if TYPE_CHECKING:
    from ..trainer import Trainer


def train_steps(trainer: Trainer, run_dir: Path, link: Path | None, resumed: bool, objects: bool) -> None:
    """Train from ``trainer.step`` to ``run.steps`` in ``run_dir`` (``link``: the ``latest`` link, pointed
    at it once a step has finished); a resumed run's files are cut back to its step first. A stop
    (:data:`STOP`) ends the step in progress and raises :class:`Preempted` with its checkpoint."""
    cfg, first = trainer.cfg, trainer.step
    lengths_path = run_dir / "lengths.jsonl"
    keep_lines_before(lengths_path, first)
    earlier = earlier_spans(run_dir / "trace.json", first) if cfg.log.trace else []
    logger = MetricsLogger(run_dir, tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb,
                           wandb_project=cfg.log.wandb_project, config=to_dict(cfg), resume=resumed)
    if resumed:
        logger.truncate_after(first - 1)
    bar = ProgressBar(cfg.run.steps, initial=first, enabled=cfg.log.progress)
    STOP.signum, STOP.active, STOP.final, STOP.run_dir = None, True, False, run_dir
    try:
        with open(lengths_path, "a" if resumed else "w") as lengths:
            _steps(trainer, run_dir, link, logger, lengths, bar)
    finally:
        bar.close()
        if cfg.log.trace:  # also when interrupted: the trace of the steps run so far
            trainer.tracer.save(run_dir / "trace.json", previous=earlier)
    _finish(trainer, run_dir, logger, first, objects)


def _save_due(run: RunConfig, step: int, minutes: float) -> bool:
    """A periodic checkpoint is due after ``step`` steps, ``minutes`` after the last save (the
    ``run`` section: ``save_every``, ``save_every_minutes``, ``steps``)."""
    due = (run.save_every and step % run.save_every == 0
           or run.save_every_minutes and minutes >= run.save_every_minutes)
    return bool(due) and step < run.steps


def _steps(trainer: Trainer, run_dir: Path, link: Path | None, logger: MetricsLogger, lengths: IO[str],
           bar: ProgressBar) -> None:
    cfg, first = trainer.cfg, trainer.step
    saved_at = time.monotonic()  # run.save_every_minutes counts from the start (or the resume)
    while trainer.step < cfg.run.steps and STOP.signum is None:  # (a stop asked during a save)
        step = trainer.step
        with step_heartbeat(step, bar.note, trainer.tracer):  # a line a minute while a step runs long
            metrics = trainer.run_step()
        res = trainer.last_result
        assert res is not None and res.exp.scores is not None  # run_step's trained, scored batch
        if trainer.step >= cfg.run.steps:  # the last step is done: a signal from now on waits for the final
            STOP.final = True  # checkpoint, and says so (it said "finishing this step": issue 53)
        if step == first:
            print_samples(f"samples at step {step}:", res.texts, res.exp.scores.tolist(), cfg.run.samples)
        logger.log(step, metrics)
        if step == first and link is not None:  # a step has finished: the run is the latest
            point_link(link, run_dir)
        _write_lengths(lengths, step, res.exp)
        bar.update(step, metrics)
        for line in trainer.loop.take_decisions():  # the overlap controller's changes, with reasons
            bar.note(f"[oppo] {line}")
        if STOP.signum is not None:  # preempted: the step is whole; save below
            break
        if _save_due(cfg.run, trainer.step, (time.monotonic() - saved_at) / 60):
            save_checkpoint(trainer, run_dir, cfg.run.keep_checkpoints)
            saved_at = time.monotonic()


def _write_lengths(lengths: IO[str], step: int, exp) -> None:
    """One ``lengths.jsonl`` line: per trained sequence its length, its data position and uid (a
    prompt is trained once, across resumes too) and the oldest version among its tokens (carried
    across a checkpoint: older than the resume)."""
    rows = exp.rollouts
    lengths.write(json.dumps({"step": step, "lengths": exp.mask.sum(1).int().tolist(),
                              "prompt_index": [r.prompt_index for r in rows], "uid": [r.uid for r in rows],
                              "oldest_version": [min(r.versions, default=step) for r in rows]}) + "\n")
    lengths.flush()


def _finish(trainer: Trainer, run_dir: Path, logger: MetricsLogger, first: int, objects: bool) -> None:
    """After the loop: a stopped run's checkpoint and :class:`Preempted`, or the last samples and the
    final checkpoint (``run.save_final``)."""
    cfg = trainer.cfg
    # STOP stays active through the last save: a signal now (the loop is done) waits for the checkpoint
    # that holds every step, instead of interrupting it and losing them all
    STOP.final = True
    if STOP.signum is not None and trainer.step < cfg.run.steps:
        # with the sequences in flight (trainer.state_dict), as every checkpoint
        saved = save_checkpoint(trainer, run_dir, cfg.run.keep_checkpoints)
        logger.close()
        raise Preempted(STOP.signum, run_dir, saved, cfg.run.steps, objects=objects)
    if trainer.step - 1 > first:  # (the first step's samples were printed when it finished)
        res = trainer.last_result
        assert res is not None and res.exp.scores is not None  # the last step's trained, scored batch
        print_samples(f"samples at step {trainer.step - 1}:", res.texts, res.exp.scores.tolist(), cfg.run.samples)
    final = None
    if cfg.run.save_final != "none":
        final = save_checkpoint(trainer, run_dir, cfg.run.keep_checkpoints,
                                weights_only=cfg.run.save_final == "weights")
    logger.close()
    STOP.active = False
    if STOP.signum is not None:  # asked during the last step or the last save: both were finished
        kept = f"the final checkpoint {final} holds them" if final is not None else "run.save_final=none"
        print(f"oppo: {signal.Signals(STOP.signum).name} arrived as the run ended: all {cfg.run.steps} steps "
              f"are trained and {kept}; nothing is left to resume.", file=sys.stderr)
