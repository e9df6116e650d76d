"""Where a run writes and what it starts from, decided before anything is written or loaded, with
every check that needs no model, then the one check of its inputs (:func:`start_run`)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import CKPT_DIR, latest_checkpoint
from ..config import Config, LogConfig
from ..setup.check import Checked, check
from ..setup.inputs import Inputs
from .dirs import INPUTS_DIR, LINK_NAME, describe_run, holds_run, is_link, new_run_dir, out_dir_problems, writer_of
from .resume import resume_problems, resumed_settings, verified


@dataclass
class RunStart:
    """Where a run writes and what it starts from, decided before anything is written."""

    run_dir: Path
    """The run's own directory (created when the models have loaded, if it does not exist)."""
    link: Path | None
    """A ``latest`` link to point at ``run_dir``, or None."""
    checkpoint: Path | None
    """The checkpoint to resume from, or None for a new run."""
    checked: Checked
    """The settings the run goes on with (the ones given, but a resumed run's changed defaults at
    the checkpoint's values: ``run.resume.resumed_settings``) and its inputs, checked."""
    start_step: int = 0


def _new_run(mode: str, out_dir: str, out: Path, link: Path | None) -> tuple[Path, list[str]]:
    """A new run: its directory beside the link, or ``run.out_dir`` if that holds no run."""
    if link is not None:
        return new_run_dir(out.parent, mode), []
    if not holds_run(out):
        return out, []
    hint = (f" ({out} is a run directory from an older oppo: runs now get their own directories beside a "
            f"'{LINK_NAME}' link; rename it, e.g. mv {out} {out.parent / 'old-run'}, to go on with the "
            f"default)") if out.name == LINK_NAME else ""
    return out, [f"run.out_dir={out_dir} already holds a run ({describe_run(out)}); a new run never writes "
                 f"over another. To continue that run: oppo train --resume auto run.out_dir={out_dir} "
                 f"(with its settings). To start a new run: give a fresh directory, e.g. "
                 f"run.out_dir={out.parent / (out.name + '-2')}, or delete {out} first.{hint}"]


def _auto(out: Path, link: Path | None) -> tuple[Path, Path | None, list[str]]:
    """``--resume auto``: the run ``run.out_dir`` names (or links to) and its latest checkpoint."""
    if link is not None and not out.is_symlink():
        return out, None, [f"--resume auto: there is no run to resume: {out} does not exist yet. Start a run "
                           f"without --resume, or set run.out_dir to the directory of the run to continue."]
    run_dir = out.resolve() if link is not None else out
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return run_dir, None, [f"--resume auto: no checkpoint under {run_dir / CKPT_DIR}; start without --resume, "
                               f"or set run.out_dir to the directory of the run to continue."]
    return run_dir, ckpt, []


def _given(out_dir: str, out: Path, link: Path | None, resume: str) -> tuple[Path, Path | None, list[str]]:
    """``--resume DIR``: a checkpoint, or a run directory's latest one; the run continues in its own
    directory (or in an empty ``run.out_dir``)."""
    ckpt = Path(resume).expanduser()
    if not (ckpt / "state.json").is_file() and (latest := latest_checkpoint(ckpt)) is not None:
        ckpt = latest  # a run directory: its latest checkpoint
    if not (ckpt / "state.json").is_file():
        return out, None, [f"--resume {resume}: {ckpt} is not a checkpoint (no state.json). Give a "
                           f"{CKPT_DIR}/step_N directory, a run directory, or auto."]
    own = ckpt.parent.parent
    run_dir = own if link is not None else out
    if run_dir.resolve() != own.resolve() and holds_run(run_dir):
        return run_dir, ckpt, [f"--resume {resume}: run.out_dir={out_dir} holds another run "
                               f"({describe_run(run_dir)}); continue the checkpoint's run in its own directory "
                               f"(run.out_dir={own}) or give an empty run.out_dir."]
    return run_dir, ckpt, []


def start_run(cfg: Config, resume: str | None = None, inputs: Inputs | None = None) -> RunStart:
    """Decide the run directory and the checkpoint, and run every check that needs no model.
    ``inputs``: the objects given in place of paths (``cfg`` holds their markers: ``inputs.split_inputs``).

    Writes nothing. Raises :class:`~oppo.setup.preflight.PreflightError` listing every problem
    found: the run directory's, the checkpoint's, the logging's and the inputs' (the run's one
    check, :func:`oppo.setup.check.check`, which validates the settings first). A resume goes on
    with the checkpoint's values of the defaults changed since it was saved (each said on stderr).
    """
    out = Path(cfg.run.out_dir).expanduser()
    link = out if is_link(out) else None
    ckpt, step = None, 0
    if resume is None:
        run_dir, problems = _new_run(cfg.overlap.mode, cfg.run.out_dir, out, link)
    elif resume == "auto":
        run_dir, ckpt, problems = _auto(out, link)
    else:
        run_dir, ckpt, problems = _given(cfg.run.out_dir, out, link, resume)
    if ckpt is not None:
        assert resume is not None  # a checkpoint is picked only with --resume
        ckpt, found = verified(ckpt, resume)
        problems += found
        if ckpt is not None:
            cfg = resumed_settings(cfg, ckpt)
            found, step = resume_problems(cfg, ckpt, resume)
            problems += found
    writer = writer_of(run_dir) if run_dir.is_dir() else None
    if writer is not None:
        problems.append(f"oppo train ({writer}) is still writing {run_dir}; wait for it to end or stop it, "
                        f"then resume with --resume auto.")
    inputs = inputs if inputs is not None else Inputs()
    inputs.save_dir = run_dir / INPUTS_DIR  # (models that a role loads in another process are saved there)
    checked = check(cfg, inputs, found=[*out_dir_problems(cfg.run.out_dir), *problems, *logging_problems(cfg.log)])
    return RunStart(run_dir, link, ckpt, checked, step)


def logging_problems(log: LogConfig) -> list[str]:
    """The logging packages a run directory's logs ask for (a Trainer built in code logs nothing)."""
    problems = []
    for flag, package, extra in ((log.tensorboard, "tensorboard", "tensorboard"), (log.wandb, "wandb", "wandb")):
        if flag and importlib.util.find_spec(package) is None:
            problems.append(f"log.{package}=true but the '{package}' package is not installed: "
                            f"pip install 'oppo[{extra}]', or set log.{package}=false.")
    return problems
