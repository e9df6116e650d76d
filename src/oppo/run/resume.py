"""Resume checks, before any model loads: the checkpoint intact (else the newest intact one before
it), its saved state in formats this release reads (``checkpoint/formats.py``), saved with the run's
settings and objects (a changed default taking the checkpoint's value: ``config.resumed_config``),
and short of ``run.steps``."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from ..checkpoint import (checkpoint_dirs, checkpoint_settings, checkpoint_step, is_weights_only,
                          settings_mismatches, verify_checkpoint)
from ..checkpoint.formats import FormatError
from ..config import Config, resumed_config, to_dict
from ..setup.inputs import keyword_of
from ..marker import is_marker
from ..scheduler.admission import check_state_format
from ..scheduler.tuner import check_format


def _fmt(v) -> str:
    return "empty" if v is None else str(v)


def _weights_only_problem(ckpt: Path, arg: str) -> str:
    full = [c for c in checkpoint_dirs(ckpt.parent.parent) if not is_weights_only(c)]
    earlier = f"resume from {full[-1]} (--resume {full[-1]}), or " if full else ""
    return (f"--resume {arg}: {ckpt} holds the weights only (saved with run.save_final=weights), no "
            f"optimizer state, so the run cannot go on from it exactly; {earlier}start a new run from "
            f"its weights (policy.path={ckpt / 'policy'}).")


def _settings_problems(cfg: Config, ckpt: Path, arg: str) -> list[str]:
    """The checkpoint's saved settings against the run's: objects to pass again, settings to restore."""
    saved = checkpoint_settings(ckpt)
    if saved is None:
        return []
    problems = []
    diffs = settings_mismatches(saved, to_dict(cfg))
    objects = [(k, a) for k, a, _ in diffs if is_marker(a)]  # given from Python to the run that saved it
    for k, a in objects:
        kw = keyword_of(k)
        problems.append(f"--resume {arg}: {k} was given as an object to the run that saved {ckpt} ({a}); pass "
                        f"the same object again to continue it, from Python: oppo.train(cfg, resume=..., "
                        f"{kw}=...).")
    diffs = [d for d in diffs if not is_marker(d[1])]
    if diffs:
        said = "; ".join(f"{k} is {_fmt(a)} in the checkpoint, {_fmt(b)} now" for k, a, b in diffs)
        fix = " ".join(f"{k}={'' if a is None else shlex.quote(str(a))}" for k, a, _ in diffs)
        problems.append(
            f"--resume {arg}: {ckpt} was saved with other settings: {said}. To continue that run, resume with "
            f"its settings ({fix}); to train with the new ones, start a new run (no --resume, a fresh "
            f"run.out_dir). The checkpoint's policy and critic, in Hugging Face format, are {ckpt / 'policy'} "
            f"and {ckpt / 'critic'}.")
    return problems


def resumed_settings(cfg: Config, ckpt: Path) -> Config:
    """``cfg`` with the checkpoint's own values of the settings whose default changed since it was
    saved and that the user did not set (``config.resumed_config``), each taken said on stderr."""
    saved = checkpoint_settings(ckpt)
    if saved is None:
        return cfg
    cfg, taken = resumed_config(cfg, saved)
    for line in taken:
        print(f"oppo: resuming with {line}.", file=sys.stderr)
    return cfg


def _format_problems(ckpt: Path, arg: str) -> list[str]:
    """The saved state a format this release cannot read (``formats.FormatError``), found from
    ``state.json`` alone, before any model loads."""
    state = json.loads((ckpt / "state.json").read_text())
    tuner, scheduler = state.get("tuner"), state.get("scheduler")
    try:
        if isinstance(scheduler, dict):
            check_state_format(scheduler)
        if isinstance(tuner, dict) and "format" in tuner:  # (the cost rule's; the reward-slope rule's has none)
            check_format(tuner)
    except FormatError as e:
        return [f"--resume {arg}: cannot resume from {ckpt}: {e}. To go on with this release instead, start a new run "
                f"from its weights (policy.path={ckpt / 'policy'}, no --resume, a fresh run.out_dir)."]
    return []


def resume_problems(cfg: Config, ckpt: Path, arg: str) -> tuple[list[str], int]:
    """What keeps ``ckpt`` from continuing under ``cfg`` (``arg``: the --resume value, as the
    messages quote it; ``cfg``: after :func:`resumed_settings`), and the checkpoint's step."""
    step = checkpoint_step(ckpt)
    if is_weights_only(ckpt):
        return [_weights_only_problem(ckpt, arg)], step
    problems = _format_problems(ckpt, arg) + _settings_problems(cfg, ckpt, arg)
    if cfg.run.steps <= step:
        problems.append(f"--resume {arg}: run.steps={cfg.run.steps} but {ckpt} is at step {step}, so there is nothing "
                        f"left to train. Set run.steps above {step} (e.g. run.steps={max(2 * step, step + 1)}) to "
                        f"train on.")
    return problems, step


def verified(ckpt: Path, arg: str) -> tuple[Path | None, list[str]]:
    """``ckpt`` if its files match its manifest; else, for ``--resume auto`` or a run directory, the
    newest earlier checkpoint that does (with a warning naming both); else a problem naming it."""
    bad = verify_checkpoint(ckpt)
    if bad is None:
        return ckpt, []
    picked = Path(arg).expanduser() if arg != "auto" else None
    if picked is None or not (picked / "state.json").is_file():  # auto or a run directory: fall back
        for earlier in reversed(checkpoint_dirs(ckpt.parent.parent)):
            if checkpoint_step(earlier) < checkpoint_step(ckpt) and verify_checkpoint(earlier) is None:
                print(f"oppo: warning: the newest checkpoint {ckpt} is damaged ({bad}); resuming from the previous "
                      f"one, {earlier}, instead (the steps after it are trained again).", file=sys.stderr)
                return earlier, []
    return None, [f"--resume {arg}: checkpoint {ckpt} is damaged ({bad}) and no earlier intact checkpoint is beside "
                  f"it in {ckpt.parent}; start the run again (a fresh run.out_dir)."]
