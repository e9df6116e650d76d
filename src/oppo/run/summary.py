"""What a run says as it ends: the closing summary, or, for a run that failed, how to go on."""

from __future__ import annotations

import shlex
from pathlib import Path

from ..checkpoint import checkpoint_step, latest_checkpoint
from ..metrics import read_metrics


def continue_with(run_dir: Path, objects: bool) -> str:
    """The command that continues the run in ``run_dir``: from Python with the same objects where the
    run was given objects, else ``oppo train --resume``."""
    if objects:
        return (f"oppo.train(cfg, resume={str(run_dir)!r}, ...) with the same settings and objects (the policy as "
                f"it was at the start)")
    return f"oppo train --resume {run_dir} (and the same settings)"


def recovery_line(run_dir: Path, step: int, removed: bool, objects: bool = False) -> str:
    """What a run that failed with an error kept, and how to go on: the run directory removed (no
    step had finished), no checkpoint to resume from, or the checkpoint and the command (from
    Python with the same objects, where the run was given objects)."""
    if removed:
        return (f"oppo: the run failed before its first step finished: nothing was trained, and what it wrote in "
                f"{run_dir} was removed. Once fixed, start it again.")
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return (f"oppo: the run failed in step {step}: the metrics and trace of its {step} finished steps are in "
                f"{run_dir}, but it wrote no checkpoint (run.save_every, run.save_every_minutes), so it cannot be "
                f"resumed. Once fixed, start a new run (a fresh run.out_dir).")
    return (f"oppo: the run failed in step {step}; its last checkpoint is {ckpt} (step {checkpoint_step(ckpt)}). "
            f"Once fixed, continue with: {continue_with(run_dir, objects)}.")



def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _mean(records: list[dict], key: str) -> float | None:
    vals = [r[key] for r in records if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def run_summary(run_dir: str | Path, wall_seconds: float | None = None, link: str | Path | None = None,
                first_step: int = 0) -> str:
    """A few lines that close a run: steps, reward and judge at the start and the end, wall time,
    the run directory and the command that draws its pictures. ``wall_seconds``: this command's
    time, which trained the steps from ``first_step`` on (a resume's: the checkpoint's step); the
    training time beside it is theirs (``time/wallclock`` counts from the run's first step, across
    resumes: a resumed run's summary said "2m16s of it training" of 1m32s, issue 53)."""
    run_dir = Path(run_dir)
    try:
        ms = read_metrics(run_dir)
    except (OSError, ValueError):
        ms = []
    lines = []
    if ms:
        k = 5 if len(ms) >= 10 else 1
        head, tail = ms[:k], ms[-k:]
        took = f" in {_duration(wall_seconds)}" if wall_seconds is not None else ""
        before = [m for m in ms if m["step"] < first_step]
        resumed = first_step > ms[0]["step"]
        if resumed:
            took = f", steps {first_step}-{ms[-1]['step']} by this command{took}"
        train_s = ms[-1].get("time/wallclock")
        if train_s is not None and before:  # (the steps of this command only)
            train_s -= before[-1].get("time/wallclock", 0.0)
        lines.append(f"done: {len(ms)} steps ({ms[0]['step']}-{ms[-1]['step']}){took}"
                     + (f", {_duration(train_s)} of it training" if train_s is not None and wall_seconds else ""))
        parts = []
        for key, name in (("reward/mean", "reward"), ("judge/mean", "judge"), ("task/accuracy", "accuracy")):
            a, b = _mean(head, key), _mean(tail, key)
            if a is not None and b is not None:
                parts.append(f"{name} {a:.3f} -> {b:.3f}")
        kl = _mean(tail, "kl/mean")
        if kl is not None:
            parts.append(f"KL {kl:.3g} at the end")
        if parts:
            which = f"means of the first and last {k} steps" if k > 1 else "first and last step"
            lines.append(f"  {', '.join(parts)} ({which})")
    where = f"  run directory: {run_dir}"
    if link is not None and Path(link).is_symlink() and Path(link).resolve() == run_dir.resolve():
        where += f"  ({link} points to it)"
    lines.append(where)
    if ms:
        lines.append(f"  pictures:      oppo report {shlex.quote(str(run_dir))}")
    return "\n".join(lines)
