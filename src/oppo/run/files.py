"""The files a run writes beside its metrics: ``config.yaml``, ``lengths.jsonl`` kept up to a
resumed step, the trace's earlier spans, and ``failure.txt`` for a run that failed."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml

from ..config import Config, to_dict
from ..setup.inputs import SETTINGS, Inputs
from ..marker import is_marker

FAILURE_FILE = "failure.txt"  # a run that failed with an error: when, the error, and how to go on (removed on resume)


def _objects_comment(cfg: Config, inputs: Inputs) -> str:
    """``config.yaml``'s comment lines on the settings given as objects (``<object: ...>``)."""
    lines = []
    for kw, key in SETTINGS.items():
        section, name = key.split(".")
        if is_marker(getattr(getattr(cfg, section), name)):
            role = {"reward_model": "reward"}.get(kw, kw)
            where = f"; saved to {inputs.saved[role]}" if role in inputs.saved else ""
            lines.append(f"# {key}: given from Python as an object ({kw}=){where}\n")
    lines += [f"# reward.terms term {name!r}: given from Python as a callable (cfg.reward.terms)\n"
              for name in inputs.reward_terms]
    if inputs.tokenizer is not None:
        lines.append("# the policy's tokenizer: given from Python as an object (tokenizer=); saved with every "
                     "checkpoint's policy\n")
    return "".join(lines)


def _used_settings(cfg: Config) -> dict:
    """The run's settings for its ``config.yaml``: ``data.task`` only where the built-in task ran."""
    d = to_dict(cfg)
    if not cfg.uses_builtin_task:
        del d["data"]["task"]
    return d


def write_config(run_dir: Path, cfg: Config, inputs: Inputs, backend: str | None) -> None:
    """``config.yaml``: the settings the run used (a file ``--config`` takes), with comments naming
    the rollout backend that ran and the settings given as objects."""
    (run_dir / "config.yaml").write_text((f"# rollout backend: {backend}\n" if backend else "")
                                         + _objects_comment(cfg, inputs)
                                         + yaml.safe_dump(_used_settings(cfg), sort_keys=False))


def keep_lines_before(path: Path, step: int) -> None:
    """Drop the records of steps >= ``step`` from a JSONL file (rewritten atomically)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True)
            if line.strip() and (k := _step_of(line)) is not None and k < step]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a torn last line from a killed run


def earlier_spans(path: Path, before: int):
    """The trace's spans of the steps before ``before`` (a resumed run's trace goes on from them)."""
    from ..trace import load_trace

    if before <= 0 or not path.is_file():
        return []
    try:
        return [s for s in load_trace(path) if s.step < before]
    except (OSError, ValueError, KeyError, TypeError):
        return []  # unreadable (a run killed mid-write cannot leave one: saves are atomic)


def record_failure(run_dir: Path, e: BaseException, line: str) -> None:
    """Write ``failure.txt`` in ``run_dir``: the time, the error's first line and the recovery line."""
    first = (str(e).strip().splitlines() or [""])[0]
    try:
        (run_dir / FAILURE_FILE).write_text(f"failed at {time.strftime('%Y-%m-%d %H:%M:%S %z')}: "
                                            f"{type(e).__name__}: {first}\n{line.removeprefix('oppo: ')}\n")
    except OSError:
        pass  # (a full or read-only disk: the message on stderr is what there is)
