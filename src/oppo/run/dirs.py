"""Run directories: where a run writes, the lock that keeps two writers apart, the ``latest`` link.

A new run never writes into another run's directory: the default ``runs/latest`` is a link to the
newest run's own ``runs/<date>-<time>-<mode>/``; any other ``run.out_dir`` is the run directory
itself, refused when it already holds a run (``docs/guide.md``, "Run directories, resuming, and
what a run tells you").
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from ..checkpoint import CKPT_DIR, checkpoint_step, latest_checkpoint
from ..metrics import METRICS_FILE, read_metrics

LINK_NAME = "latest"
RUN_FILES = ("config.yaml", METRICS_FILE, "trace.json", "lengths.jsonl", CKPT_DIR)
INPUTS_DIR = "inputs"  # models given as objects, saved for the roles that load them elsewhere (setup/inputs.py)
LOCK_FILE = ".oppo.lock"  # held (flock) by the process writing the run; the kernel drops it when that dies


def take_lock(run_dir: Path, mark: bool = True):
    """An open file holding the run directory's lock (with this pid written in it when ``mark``),
    or None if another process holds it."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock
        return open(os.devnull)
    f = open(run_dir / LOCK_FILE, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    if mark:
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
    return f


def writer_of(run_dir: Path) -> str | None:
    """'pid N' of a live process writing ``run_dir``, or None."""
    if not (run_dir / LOCK_FILE).is_file():
        return None
    lock = take_lock(run_dir, mark=False)  # a check only: leaves the file as it is
    if lock is not None:
        lock.close()
        return None
    pid = (run_dir / LOCK_FILE).read_text().strip()
    return f"pid {pid}" if pid else "another process"


def holds_run(d: Path) -> bool:
    """Whether directory ``d`` already holds (part of) a run."""
    return any((Path(d) / f).exists() for f in RUN_FILES)


def describe_run(d: Path) -> str:
    """What a run directory holds, for a message: its steps of metrics and its latest checkpoint."""
    ckpt = latest_checkpoint(d)
    try:
        steps = len(read_metrics(d))
    except (OSError, ValueError):
        steps = 0
    bits = [f"{steps} steps of metrics" if steps else "no metrics yet"]
    if ckpt is not None:
        bits.append(f"a checkpoint at step {checkpoint_step(ckpt)}")
    return ", ".join(bits)


def is_link(out: Path) -> bool:
    """``out`` is the 'latest' link (or where it will be), not a run directory."""
    return out.name == LINK_NAME and (out.is_symlink() or not out.exists())


def new_run_dir(parent: Path, mode: str) -> Path:
    """A fresh ``<date>-<time>-<mode>`` directory name under ``parent`` (not created)."""
    base = f"{time.strftime('%Y%m%d-%H%M%S')}-{mode}"
    cand, n = parent / base, 2
    while cand.exists():
        cand, n = parent / f"{base}-{n}", n + 1
    return cand


def create(run_dir: Path, fresh: bool) -> Path:
    """Create the run directory; ``fresh`` (a new run beside the link): another name if a
    concurrent run took this one. The link is pointed at it once a step has finished, so a run
    that fails before leaves the link on the last run that trained."""
    if fresh:
        base, n = run_dir, 2
        while True:
            try:
                run_dir.mkdir(parents=True)
                break
            except FileExistsError:
                run_dir, n = base.with_name(f"{base.name}-{n}"), n + 1
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def point_link(link: Path, target: Path) -> None:
    """Atomically (re)point ``link`` at ``target`` (a relative link when they are siblings)."""
    rel = target.name if target.resolve().parent == link.parent.resolve() else str(target.resolve())
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(rel, target_is_directory=True)
        os.replace(tmp, link)
    except OSError as e:  # a filesystem without symlinks: the run still has its directory
        tmp.unlink(missing_ok=True)
        print(f"oppo: note: could not point {link} at {target} ({e})", file=sys.stderr)


def remove_unfinished(run_dir: Path, found: set[Path] | None) -> None:
    """Remove what a new run that failed before finishing a step wrote: its directory, or, in a
    directory that existed before it (``found``: its entries then), only the entries it added."""
    if found is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for p in set(run_dir.iterdir()) - found:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def out_dir_problems(out_dir: str | os.PathLike) -> list[str]:
    """``run.out_dir`` must be a directory, or creatable as one: not a file, not under a file, and
    writable. (Found here, before the models load, not by the first write after them.)"""
    key = f"run.out_dir={str(out_dir)!r}"
    p = Path(out_dir).expanduser()
    if p.is_symlink() and not p.exists():
        return []  # a dangling 'latest' link: the run points it at its new directory
    if p.exists() and not p.is_dir():
        return [f"{key} is a file, not a directory. Set run.out_dir to a directory (created if missing), or move "
                f"the file {p} away."]
    existing = p
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return [f"{key}: {existing} is a file, so no directory can be made under it. Set run.out_dir to a path "
                f"outside it (e.g. {existing.parent / 'runs'}), or move the file away."]
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "the run directory" if existing == p else f"its nearest existing parent, {existing},"
        return [f"{key}: {what} is not writable by this user. Set run.out_dir to a writable directory, or fix "
                f"the permissions."]
    return []
