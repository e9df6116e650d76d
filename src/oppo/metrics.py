"""Run metrics: one JSON line per step, optionally mirrored to TensorBoard and Weights & Biases.

``metrics.jsonl`` in the run directory is the source of truth (the report and ``oppo bench``
read it); TensorBoard and W&B are mirrors for people who already watch runs there.

File format: one JSON object per line, ``{"step": <int>, "<name>": <number or null>, ...}``.
A value that is not finite (NaN, +-inf) is written as ``null`` so that every line stays valid
JSON. Lines are flushed as they are written, so a crashed run leaves at most one torn last line,
which :func:`read_metrics` ignores.

Metric names: ``docs/metrics.md`` lists every one the trainer writes, grouped, with what it means
and what a healthy value looks like (``tests/test_metrics_doc.py`` keeps it in step with the source).
The progress line (:class:`ProgressBar`) shows a few of them.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["METRICS_FILE", "MetricsLogger", "ProgressBar", "read_metrics"]

METRICS_FILE = "metrics.jsonl"
_WANDB_ID_FILE = "wandb_run_id"


# ---------------------------------------------------------------------------------------------
# JSONL logger
# ---------------------------------------------------------------------------------------------


def _json_value(name: str, value: Any) -> bool | int | float | None:
    """A metric value as JSON: ints stay ints, non-finite floats become None (null)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    try:
        f = float(value)  # also takes numpy scalars and one-element tensors
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"metric {name!r} must be a number, got {type(value).__name__}: {value!r}"
        ) from e
    return f if math.isfinite(f) else None


def _parse_lines(text: str, path: Path) -> list[dict]:
    """Parse JSONL text; a torn last line (a crash mid-write) is dropped, other bad lines raise."""
    lines = text.splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON: {e}") from e
        if not isinstance(rec, dict) or "step" not in rec:
            raise ValueError(f"{path}: line {i + 1} is not a metrics record with a 'step' key")
        records.append(rec)
    return records


def read_metrics(path: str | Path) -> list[dict]:
    """Read a ``metrics.jsonl`` (or the run directory holding one) into a list of dicts.

    Values written as null (non-finite) come back as ``None``.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    return _parse_lines(path.read_text(encoding="utf-8"), path)


def _import_summary_writer() -> type[SummaryWriter]:
    try:
        import tensorboard  # noqa: F401  (torch's writer needs the package itself)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError(
            "TensorBoard logging was requested (tensorboard=True) but the 'tensorboard' package "
            "is not installed. Install it with: pip install 'oppo[tensorboard]'  "
            "(or turn TensorBoard logging off)."
        ) from e
    return SummaryWriter


def _import_wandb():
    try:
        import wandb
    except ImportError as e:
        raise ImportError(
            "Weights & Biases logging was requested (wandb=True) but the 'wandb' package is not "
            "installed. Install it with: pip install 'oppo[wandb]'  (then run `wandb login`), "
            "or turn W&B logging off."
        ) from e
    return wandb


class MetricsLogger:
    """Append one JSON line per step to ``run_dir/metrics.jsonl``; mirror to TB / W&B if asked.

    Optional back ends are imported here, in the constructor, so a missing package fails before
    any training starts.

    Resuming: with ``resume=True`` the existing file is kept, and the first :meth:`log` call
    drops every existing line whose step is >= the step being logged (those steps were run
    after the checkpoint being resumed and will be run again). :meth:`truncate_after` does the
    same explicitly. Without ``resume`` an existing file is overwritten.
    TensorBoard gets the same treatment through ``SummaryWriter(purge_step=...)``. W&B reuses
    the run id saved in ``run_dir/wandb_run_id``; W&B itself ignores steps lower than the
    last one it saw, so a resumed W&B chart skips the re-run steps rather than replacing them.
    """

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "oppo",
        config: dict | None = None,
        resume: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        # Import optional back ends first: fail before touching any file.
        self._summary_writer_cls = _import_summary_writer() if tensorboard else None
        wandb_mod = _import_wandb() if wandb else None

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._resume_pending = resume
        self._fh = open(self.path, "a" if resume else "w", encoding="utf-8")
        self._tb: SummaryWriter | None = None  # opened lazily: on resume it needs purge_step = first logged step
        self._tb_purge_step: int | None = None
        self._wandb_run = None
        if wandb_mod is not None:
            self._wandb_run = self._init_wandb(wandb_mod, wandb_project, config, resume)
        self._closed = False

    def _init_wandb(self, wandb_mod, project: str, config: dict | None, resume: bool):
        id_file = self.run_dir / _WANDB_ID_FILE
        if resume and id_file.exists():
            run_id = id_file.read_text(encoding="utf-8").strip()
        else:
            run_id = wandb_mod.util.generate_id()
            id_file.write_text(run_id + "\n", encoding="utf-8")
        return wandb_mod.init(
            project=project,
            config=config,
            dir=str(self.run_dir),
            id=run_id,
            name=self.run_dir.name,
            resume="allow",
        )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Write ``{"step": step, **metrics}`` as one flushed line (and to TB / W&B)."""
        if "step" in metrics:
            raise ValueError("'step' is reserved: pass it as the step argument, not a metric")
        step = int(step)
        record: dict[str, Any] = {"step": step}
        for name, value in metrics.items():
            record[name] = _json_value(name, value)
        line = json.dumps(record, allow_nan=False) + "\n"
        with self._lock:
            if self._closed:
                raise RuntimeError("MetricsLogger.log() called after close()")
            if self._resume_pending:
                self._resume_pending = False
                self._truncate_locked(lambda s: s < step, purge_step=step)
            self._fh.write(line)
            self._fh.flush()
            if self._summary_writer_cls is not None:
                if self._tb is None:
                    self._tb = self._summary_writer_cls(
                        log_dir=str(self.run_dir), purge_step=self._tb_purge_step
                    )
                for name, value in metrics.items():
                    v = record[name]
                    self._tb.add_scalar(name, float("nan") if v is None else float(v), step)
                self._tb.flush()
            if self._wandb_run is not None:
                self._wandb_run.log(
                    {k: (float("nan") if v is None else v) for k, v in record.items() if k != "step"},
                    step=step,
                )

    def truncate_after(self, step: int) -> None:
        """Keep only the lines with ``step <= step``, rewriting the file atomically.

        Call it when resuming from the checkpoint taken after ``step`` so that the metrics file
        matches the checkpoint. Later :meth:`log` calls append after the kept lines.
        """
        step = int(step)
        with self._lock:
            if self._closed:
                raise RuntimeError("MetricsLogger.truncate_after() called after close()")
            self._resume_pending = False
            self._truncate_locked(lambda s: s <= step, purge_step=step + 1)

    def _truncate_locked(self, keep, purge_step: int) -> None:
        self._fh.close()
        text = self.path.read_text(encoding="utf-8") if self.path.exists() else ""
        kept = [r for r in _parse_lines(text, self.path) if keep(r["step"])]
        # Write a sibling temp file and rename over: a crash leaves the old or the new file.
        fd, tmp = tempfile.mkstemp(dir=self.run_dir, prefix=".metrics.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for r in kept:
                    f.write(json.dumps(r, allow_nan=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        finally:
            self._fh = open(self.path, "a", encoding="utf-8")
        self._tb_purge_step = purge_step
        if self._tb is not None:
            # An open writer cannot purge; reopen it so TensorBoard drops the re-run steps.
            self._tb.close()
            self._tb = None

    def close(self) -> None:
        """Flush and close every back end. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._fh.close()
            if self._summary_writer_cls is not None and self._tb is None:
                # Nothing was logged: still leave an (empty) events file, as TB users expect.
                self._tb = self._summary_writer_cls(
                    log_dir=str(self.run_dir), purge_step=self._tb_purge_step
                )
            if self._tb is not None:
                self._tb.close()
            if self._wandb_run is not None:
                self._wandb_run.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Progress bar
# ---------------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "nan"
    try:
        return format(float(value), spec)
    except (TypeError, ValueError):
        return str(value)


def _fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressBar:
    """Training progress: a tqdm bar on a terminal, a compact line every few steps otherwise.

    Each :meth:`update` call counts one finished step; ``step`` is what the postfix shows
    (whatever indexing the caller uses). ``initial`` is the number of steps already done
    (when resuming).

    The bar is used only when ``enabled`` and stderr is a TTY. Otherwise (logs, CI, pipes,
    ``enabled=False``) one line goes to stderr every ``every`` steps, by default about 20 lines
    per run (``ceil(total_steps / 20)``), plus the first and the last step. ``every=0``
    silences it completely.
    """

    def __init__(
        self,
        total_steps: int,
        initial: int = 0,
        enabled: bool = True,
        *,
        every: int | None = None,
        file=None,
    ) -> None:
        self.total = int(total_steps)
        self.done = int(initial)
        self._initial = int(initial)
        self._file = file if file is not None else sys.stderr
        self._every = max(1, math.ceil(self.total / 20)) if every is None else int(every)
        self._start = time.perf_counter()
        self._bar = None
        isatty = getattr(self._file, "isatty", None)
        if enabled and isatty is not None and isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total,
                initial=self.done,
                unit="step",
                dynamic_ncols=True,
                file=self._file,
            )

    # (metric, label, format) of the line, in order, each shown only when the step has it: short
    # labels keep a step on one line (docs/metrics.md, "The progress line", names them)
    _SHOWN = (("reward/mean", "reward", ".3f"),
              ("judge/mean", "judge", ".3f"),  # the independent check on reward hacking, when there is one
              ("kl/mean", "kl", ".4f"),
              ("loss/policy", "ploss", ".4f"),
              ("ppo/clipfrac", "clip", ".3f"),
              ("loss/value", "vloss", ".4g"),  # absent in critic-free algorithms (grpo, rloo, ...)
              ("response_length/mean", "len", ".1f"))

    @classmethod
    def _summary(cls, step: int, metrics: Mapping[str, Any]) -> dict[str, str]:
        out = {"step": str(step)}
        for key, label, spec in cls._SHOWN:
            if key in metrics:
                out[label] = _fmt(metrics[key], spec)
        if "time/step" in metrics:
            out["step_time"] = _fmt(metrics["time/step"], ".2f") + "s"
        return out

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one finished step and show its number and, where the step has them, reward, judge,
        KL, policy loss, clip fraction, value loss, mean response length and step time."""
        self.done += 1
        summary = self._summary(step, metrics)
        if self._bar is not None:
            self._bar.set_postfix(summary, refresh=False)
            self._bar.update(1)
            return
        if self._every <= 0:
            return
        ran = self.done - self._initial
        if not (ran == 1 or ran % self._every == 0 or self.done >= self.total):
            return
        elapsed = time.perf_counter() - self._start
        parts = [f"step {summary.pop('step')} ({self.done}/{self.total})"]
        parts += [f"{k} {v}" for k, v in summary.items()]
        parts.append(f"elapsed {_fmt_duration(elapsed)}")
        if 0 < self.done < self.total:
            parts.append(f"eta {_fmt_duration(elapsed / ran * (self.total - self.done))}")
        print("[oppo] " + " | ".join(parts), file=self._file, flush=True)

    def note(self, text: str) -> None:
        """One line of its own (a decision of the run's), above the bar where there is one."""
        if self._bar is not None:
            self._bar.write(text, file=self._file)
        else:
            print(text, file=self._file, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
