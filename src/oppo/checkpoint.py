"""Checkpoints: written atomically, resumed exactly.

A checkpoint ``<run>/checkpoints/step_000010/`` holds the policy (with its tokenizer) and the
critic in Hugging Face format (``from_pretrained`` loads them; with LoRA the policy directory
holds the adapter, which ``PeftModel.from_pretrained(base, path)`` loads; critic-free
algorithms have no critic), both optimizers, every RNG
state, the scheduler (data position, Delta, requeued prompts), the chunk-size tuner and the
step. It is written into a temporary directory beside the target and renamed into place, so an
interrupted save leaves the previous checkpoint intact and never a half-written one that looks
valid.

Each checkpoint also holds the run's settings (``config.yaml``), so that ``--resume`` can check,
before any model loads, that the run being resumed is configured as the one that was saved
(:func:`settings_mismatches`).

Sequences in flight at a checkpoint (inter-step overlap) are drained: their prompts are
requeued and regenerated first after the save (see ``Scheduler.drain_for_checkpoint``), so a
resumed run loses no prompt and trains none twice. Sequential and intra runs have nothing in
flight between steps, and their resumed steps equal an uninterrupted run's (tested).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch
import yaml

CKPT_DIR = "checkpoints"
CONFIG_FILE = "config.yaml"

# Settings that may differ between a checkpoint and the run resuming it: how long to run, where
# and how often to write, what to print, and where the work runs (placement changes neither the
# math nor the saved state). Every other setting changes what is trained or the shape of the saved
# state, so a resume with another value would not continue the same run.
RESUMABLE_CHANGES = frozenset({
    "run.steps", "run.out_dir", "run.save_every", "run.keep_checkpoints", "run.samples", "run.threads",
    "policy.device", "reference.device", "critic.device", "reward.device",
    "reward.retries", "reward.retry_backoff_s",  # (a run stopped by a flaky remote scorer resumes with retries)
    "overlap.scorer_process", "overlap.actor_threads", "overlap.scorer_threads",
    # the same math, other machinery: the decode engine, a memory cap, activation recomputation
    "generation.engine", "generation.kv_budget_mb", "policy.gradient_checkpointing",
})
# placement: a checkpoint of a data-parallel Ray run resumes on another worker count or locally
RESUMABLE_SECTIONS = frozenset({"log", "placement"})


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.name.startswith("step_") and (p / "state.json").is_file()),
                  key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def _rng_state(trainer) -> dict:
    import numpy as np

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "engine": trainer.engine.generator.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def checkpoint_step(ckpt: Path) -> int:
    """The step a checkpoint was saved at (the number of steps trained before it)."""
    return int(json.loads((Path(ckpt) / "state.json").read_text())["step"])


def checkpoint_settings(ckpt: Path) -> dict | None:
    """The settings a checkpoint was saved with, as nested dicts; None for checkpoints written
    before checkpoints held them (then the run directory's ``config.yaml`` is the best guess)."""
    ckpt = Path(ckpt)
    for path in (ckpt / CONFIG_FILE, ckpt.parent.parent / CONFIG_FILE):
        if path.is_file():
            return yaml.safe_load(path.read_text()) or {}
    return None


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def settings_mismatches(saved: dict, now: dict) -> list[tuple[str, object, object]]:
    """(setting, value in the checkpoint, value now) for every setting that must match on resume
    and does not. Settings the checkpoint does not know (added to oppo since) are not compared."""
    a, b = _flat(saved), _flat(now)
    out = []
    for key in sorted(a.keys() & b.keys()):
        if key in RESUMABLE_CHANGES or key.split(".")[0] in RESUMABLE_SECTIONS:
            continue
        if a[key] != b[key]:
            out.append((key, a[key], b[key]))
    return out


def save_checkpoint(trainer, run_dir: Path, keep: int = 2) -> Path:
    run_dir = Path(run_dir)
    root = run_dir / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    trainer.between_steps()
    drained = trainer.scheduler.drain_for_checkpoint()
    if drained:
        uids = {t.uid for t in drained}
        trainer.engine.abort(uids)
        if trainer.worker:
            trainer.worker.forget(uids)
            trainer.worker.barrier()
        for u in uids:
            trainer.rollouts.pop(u, None)
    for leftover in root.glob(".tmp-step_*"):  # from an interrupted save: never a valid checkpoint
        shutil.rmtree(leftover, ignore_errors=True)
    final = root / f"step_{trainer.step:06d}"
    tmp = root / f".tmp-step_{trainer.step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    optim = trainer.learner_state()  # on Ray: also brings the ranks' weights home
    trainer.policy.save_pretrained(tmp / "policy")
    trainer.tokenizer.save_pretrained(tmp / "policy")
    if trainer.critic is not None:  # critic-free algorithms have none
        trainer.critic.save_pretrained(tmp / "critic")
    torch.save(optim, tmp / "optim.pt")
    torch.save(_rng_state(trainer), tmp / "rng.pt")
    from .config import to_dict

    (tmp / CONFIG_FILE).write_text(yaml.safe_dump(to_dict(trainer.cfg), sort_keys=False))
    state = {"step": trainer.step, "wallclock": trainer.wallclock, "scheduler": trainer.scheduler.state_dict(),
             "tuner": trainer.tuner.state_dict(), "drained": len(drained)}
    (tmp / "state.json").write_text(json.dumps(state, indent=1))  # written last: marks the checkpoint complete
    if final.exists():
        old = root / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    for stale in checkpoint_dirs(run_dir)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def load_checkpoint(trainer, ckpt: Path) -> None:
    """Restore a Trainer built from the same config to the state saved in ``ckpt``."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from .models import is_peft

    ckpt = Path(ckpt)
    if not (ckpt / "state.json").is_file():
        raise FileNotFoundError(f"{ckpt} is not a complete checkpoint (no state.json). Give a step_* directory "
                                f"under {CKPT_DIR}/, or --resume auto.")
    state = json.loads((ckpt / "state.json").read_text())
    for model, cls, sub in ((trainer.policy, AutoModelForCausalLM, "policy"),
                            (trainer.critic, AutoModelForSequenceClassification, "critic")):
        if model is None:
            continue
        if is_peft(model):  # LoRA: the checkpoint holds the adapter (PeftModel.from_pretrained loads it)
            from peft import load_peft_weights, set_peft_model_state_dict

            set_peft_model_state_dict(model, load_peft_weights(str(ckpt / sub), device=str(trainer.device)))
            continue
        saved = cls.from_pretrained(ckpt / sub, dtype=next(model.parameters()).dtype)
        model.load_state_dict(saved.state_dict())
    trainer.sync_weights()  # the bf16 serving copies (weights.py), when there are any
    trainer.load_learner_state(torch.load(ckpt / "optim.pt", weights_only=False))
    rng = torch.load(ckpt / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    import numpy as np

    np.random.set_state(rng["numpy"])
    engine_rng = rng["engine"]
    if isinstance(engine_rng, list) and trainer.rollout_group is None:
        engine_rng = engine_rng[0]  # saved by Ray rollout workers (one state each): rank 0's, as theirs do
    trainer.engine.generator.set_state(engine_rng)
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.tuner.load_state_dict(state["tuner"])
    trainer.step = state["step"]
    trainer.wallclock = state["wallclock"]
