"""oppo: PPO-based RLHF for Hugging Face causal language models, with overlapped stages.

The Python API, without the CLI::

    import oppo

    cfg = oppo.load_config(overrides=["run.steps=20"])   # or a YAML path
    trainer = oppo.Trainer.from_config(cfg)  # run_step() trains one step; close() when done
    run_dir = oppo.train(cfg)             # or all of `oppo train`: run directory, checkpoints
    oppo.make_report([run_dir], run_dir / "report")

Your own objects in place of paths: ``oppo.Trainer.from_config(cfg, policy=model, tokenizer=tok,
reward_fn=score, prompts=dataset)``. Names are imported on first use, so ``import oppo`` loads
neither torch nor transformers. Examples in full: docs/python-api.md, "What `import oppo` gives"."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Config": "config", "ConfigError": "config", "load_config": "config", "help_text": "config",
    "Trainer": "trainer",
    "train": "run", "start_run": "run", "run_summary": "run",
    "PreflightError": "setup.preflight",
    "read_metrics": "metrics",
    "make_report": "report",
    "latest_checkpoint": "checkpoint",
    "prepare": "task",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


_RENAMED = {"plan_run": "start_run"}  # old name -> new (issue 52): an error that names the new one, no alias


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        if name in _RENAMED:
            raise AttributeError(f"oppo.{name} is now oppo.{_RENAMED[name]} (docs/python-api.md, \"Moved and renamed\")")
        raise AttributeError(f"module 'oppo' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
