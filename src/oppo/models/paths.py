"""A model named by a path or a hub name: local or not, present, a Hugging Face directory; its config
read without its weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..marker import is_marker
from .errors import ModelLoadError


def looks_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or os.path.exists(path) or path.count("/") > 1



def said_where(path: str) -> str:
    """'at '<path>'' in messages, or 'given as an object' (``inputs.marker``)."""
    return "given as an object" if is_marker(path) else f"at {path!r}"



def check_model_path(path: str, role: str) -> None:
    """Fail early, before anything expensive, on a local path that does not exist."""
    if is_marker(path):
        return  # an object given from Python (inputs.py): checked by model_problems
    if looks_local(path):
        p = Path(path).expanduser()
        if not p.is_dir():
            raise ModelLoadError(f"{role} model path {path!r} does not exist or is not a directory. "
                                 f"Give a directory written by save_pretrained, or a hub name such as 'org/model'.")
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{role} model directory {path!r} has no config.json; it is not a Hugging Face "
                                 f"model directory (save one with model.save_pretrained).")
        try:  # a corrupt one would otherwise be reported by whichever loader reads it first (the tokenizer)
            json.loads((p / "config.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{role} model directory {path!r}: its config.json is not valid JSON ({e}). Write "
                                 f"it again with model.save_pretrained(dir), or restore it from the model's "
                                 f"source.") from None



def from_pretrained(cls, path: str, role: str, **kw):
    check_model_path(path, role)
    try:
        return cls.from_pretrained(str(Path(path).expanduser()) if looks_local(path) else path, **kw)
    except OSError as e:
        raise ModelLoadError(f"Could not load the {role} model from {path!r}: {e}. Check the path or hub name; "
                             f"without internet only local directories work.") from None



def load_model_config(path: str, role: str, trust_remote_code: bool = False):
    """A model directory's config only (fast): for the checks that run before any weights load."""
    from transformers import AutoConfig

    check_model_path(path, role)
    try:
        return AutoConfig.from_pretrained(str(Path(path).expanduser()) if looks_local(path) else path,
                                          trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"Could not read the {role} model's config at {path!r}: {e}") from None
