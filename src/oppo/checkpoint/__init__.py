"""Checkpoints: written atomically and resumed exactly (:mod:`.store`), and the upgrades of saved
formats on load (:mod:`.formats`).

The store's names are imported from here (``from oppo.checkpoint import save_checkpoint``) and load
it, with torch, on first use: ``formats`` imports nothing of oppo and no torch, and the pure state
machines (the tuner, the scheduler) import it without the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .store import (CKPT_DIR, CONFIG_FILE, DATA_ROLES, IN_FLIGHT_FILE, MANIFEST_FILE, MODELS_FILE,
                        RESUMABLE_CHANGES, RESUMABLE_SECTIONS, WEIGHTS_ONLY, CheckpointError, check_models,
                        checkpoint_dirs, checkpoint_settings, checkpoint_step, is_weights_only, latest_checkpoint,
                        load_checkpoint, save_checkpoint, settings_mismatches, sha256_file, verify_checkpoint)

__all__ = ["CKPT_DIR", "CONFIG_FILE", "DATA_ROLES", "IN_FLIGHT_FILE", "MANIFEST_FILE", "MODELS_FILE",
           "RESUMABLE_CHANGES", "RESUMABLE_SECTIONS", "WEIGHTS_ONLY", "CheckpointError", "check_models",
           "checkpoint_dirs", "checkpoint_settings", "checkpoint_step", "is_weights_only", "latest_checkpoint",
           "load_checkpoint", "save_checkpoint", "settings_mismatches", "sha256_file", "verify_checkpoint"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import store

    value = getattr(store, name)
    globals()[name] = value  # later lookups skip this function
    return value
