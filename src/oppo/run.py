"""``oppo train``: a Trainer in a run directory, with metrics, samples, trace and checkpoints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import Config, to_dict
from .metrics import MetricsLogger, ProgressBar


def _print_samples(title: str, texts, scores, n: int) -> None:
    if n <= 0:
        return
    print(f"\n{title}", file=sys.stderr)
    for (prompt, response), s in list(zip(texts, scores))[:n]:
        print(f"  [{s:+.3f}] {prompt} ||| {response}", file=sys.stderr)


def train(cfg: Config, resume: str | None = None, progress: bool = True) -> Path:
    """Run PPO as configured; return the run directory."""
    from transformers.utils import logging as hf_logging

    from .trainer import Trainer

    hf_logging.disable_progress_bar()  # "Loading weights" bars for every role drown the run's own output

    run_dir = Path(cfg.run.out_dir)
    ckpt = None
    if resume is not None:
        ckpt = latest_checkpoint(run_dir) if resume == "auto" else Path(resume)
        if ckpt is None:
            raise FileNotFoundError(f"--resume auto: no checkpoint under {run_dir}/checkpoints; "
                                    f"start without --resume or set run.out_dir to the earlier run's directory.")
        if not (Path(ckpt) / "state.json").is_file():
            raise FileNotFoundError(f"--resume {resume}: {ckpt} is not a checkpoint directory (no state.json).")
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, progress=progress)
    try:
        if ckpt is not None:
            load_checkpoint(trainer, Path(ckpt))
            print(f"resumed from {ckpt} at step {trainer.step}", file=sys.stderr)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        logger = MetricsLogger(run_dir, tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb,
                               wandb_project=cfg.log.wandb_project, config=to_dict(cfg), resume=ckpt is not None)
        if ckpt is not None:
            logger.truncate_after(trainer.step - 1)
        lengths_path = run_dir / "lengths.jsonl"
        bar = ProgressBar(cfg.run.steps, initial=trainer.step, enabled=cfg.log.progress)
        first = trainer.step
        with open(lengths_path, "a" if ckpt else "w") as lengths:
            while trainer.step < cfg.run.steps:
                step = trainer.step
                metrics = trainer.run_step()
                res = trainer.last_result
                if step == first:
                    _print_samples(f"samples at step {step}:", res.texts, res.exp.scores.tolist(), cfg.run.samples)
                logger.log(step, metrics)
                lengths.write(json.dumps({"step": step, "lengths": res.exp.mask.sum(1).int().tolist(),
                                          "prompt_index": [r.prompt_index for r in res.exp.rollouts]}) + "\n")
                lengths.flush()
                bar.update(step, metrics)
                if cfg.run.save_every and trainer.step % cfg.run.save_every == 0 and trainer.step < cfg.run.steps:
                    save_checkpoint(trainer, run_dir, cfg.run.keep_checkpoints)
        bar.close()
        if trainer.step > first:
            res = trainer.last_result
            _print_samples(f"samples at step {trainer.step - 1}:", res.texts, res.exp.scores.tolist(), cfg.run.samples)
        save_checkpoint(trainer, run_dir, cfg.run.keep_checkpoints)
        if cfg.log.trace:
            trainer.tracer.save(run_dir / "trace.json")
        logger.close()
    finally:
        trainer.close()
    return run_dir
