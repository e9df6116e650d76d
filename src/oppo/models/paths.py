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



def model_dir_config(path: str, subject: str) -> tuple[dict | None, str | None]:
    """A local model directory's ``config.json``, read without the weights, or the problem that
    stops ``path`` being one: a directory, with a ``config.json`` that is valid JSON. The one rule
    for a model path: the run's preflight (``preflight._model_problems``) and a loader called on its
    own (:func:`check_model_path`) both ask it. ``subject``: how the message names the path."""
    p = Path(path).expanduser()
    if not p.is_dir():
        return None, (f"{subject} does not exist or is not a directory. Give a directory written by "
                      f"save_pretrained, or a hub name such as 'org/model'.")
    if not (p / "config.json").is_file():
        return None, (f"{subject} has no config.json: it is not a Hugging Face model directory (write one "
                      f"with model.save_pretrained(dir)).")
    try:  # a corrupt one would otherwise be reported by whichever loader reads it first (the tokenizer)
        conf = json.loads((p / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, (f"{subject}: its config.json is not valid JSON ({e}). Write it again with "
                      f"model.save_pretrained(dir), or restore it from the model's source.")
    return conf if isinstance(conf, dict) else {}, None


def check_model_path(path: str, role: str) -> None:
    """A loader's guard when it is called on its own (a run's preflight has checked the path by
    the same rule already): a local path that is no model directory fails here, named, before
    Hugging Face's loader reports it as something else."""
    if is_marker(path):
        return  # an object given from Python (setup/inputs.py): checked by model_problems
    if looks_local(path):
        _, problem = model_dir_config(path, f"{role} model path {path!r}")
        if problem is not None:
            raise ModelLoadError(problem)


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
