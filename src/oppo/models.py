"""Loading the four roles' models and reading their heads.

Every role is an ordinary Hugging Face model:

- policy and reference: ``AutoModelForCausalLM``;
- reward: ``AutoModelForSequenceClassification`` with one label;
- critic: ``AutoModelForSequenceClassification`` with one label, i.e. a causal-LM backbone with a
  scalar value head read at every position (initialised from the reward model, as OpenRLHF and
  the OPPO paper's peers do, or from the policy with a fresh head). It saves and loads with
  ``save_pretrained``/``from_pretrained`` like any other model.

Streaming needs the backbone's hidden states with a KV cache, then the head applied by us, so
:func:`backbone_and_head` splits a model into the two.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from pathlib import Path
from typing import Callable

import torch


class ModelLoadError(ValueError):
    """A model, tokenizer or function could not be loaded; the message names the fix."""


def resolve_device(spec: str, fallback: str | None = None) -> torch.device:
    if spec == "auto":
        if fallback is not None:
            return torch.device(fallback)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"Device {spec!r} was asked for but CUDA is not available; use cpu.")
    return dev


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec]


def _looks_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or os.path.exists(path) or path.count("/") > 1


def check_model_path(path: str, role: str) -> None:
    """Fail early, before anything expensive, on a local path that does not exist."""
    if _looks_local(path):
        p = Path(path).expanduser()
        if not p.is_dir():
            raise ModelLoadError(f"{role} model path {path!r} does not exist or is not a directory. "
                                 f"Give a directory written by save_pretrained, or a hub name such as 'org/model'.")
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{role} model directory {path!r} has no config.json; it is not a Hugging Face "
                                 f"model directory (save one with model.save_pretrained).")


def _from_pretrained(cls, path: str, role: str, **kw):
    check_model_path(path, role)
    try:
        return cls.from_pretrained(str(Path(path).expanduser()) if _looks_local(path) else path, **kw)
    except OSError as e:
        raise ModelLoadError(f"Could not load the {role} model from {path!r}: {e}. Check the path or hub name; "
                             f"without internet only local directories work.") from None


def load_tokenizer(path: str):
    """The policy's tokenizer, left-padded for generation. Falls back to EOS as pad (warning)."""
    from transformers import AutoTokenizer

    check_model_path(path, "policy")
    try:
        tok = AutoTokenizer.from_pretrained(str(Path(path).expanduser()) if _looks_local(path) else path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"Could not load a tokenizer from {path!r}: {e}. The policy directory must "
                             f"hold its tokenizer (tokenizer.save_pretrained).") from None
    if tok.eos_token_id is None:
        raise ModelLoadError(f"The tokenizer at {path!r} has no EOS token; PPO needs one to end responses. "
                             f"Set tokenizer.eos_token and save it again.")
    if tok.pad_token_id is None:
        warnings.warn(f"The tokenizer at {path!r} has no pad token; using EOS ({tok.eos_token!r}) as pad.",
                      stacklevel=2)
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_causal_lm(path: str, role: str, device: torch.device, dtype: torch.dtype, trust_remote_code=False):
    from transformers import AutoModelForCausalLM

    model = _from_pretrained(AutoModelForCausalLM, path, role, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.to(device)


def load_reward_model(path: str, device: torch.device, dtype: torch.dtype, pad_token_id: int):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    check_model_path(path, "reward")
    cfg = AutoConfig.from_pretrained(str(Path(path).expanduser()) if _looks_local(path) else path)
    if getattr(cfg, "num_labels", 1) != 1:
        raise ModelLoadError(f"The reward model at {path!r} has {cfg.num_labels} labels; PPO needs a scalar reward "
                             f"(AutoModelForSequenceClassification with num_labels=1).")
    model = _from_pretrained(AutoModelForSequenceClassification, path, "reward", dtype=dtype, num_labels=1)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = pad_token_id
    return model.to(device).eval().requires_grad_(False)


def load_critic(path: str, device: torch.device, dtype: torch.dtype, pad_token_id: int):
    """A value model: sequence-classification head with one output, read at every position."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "newly initialised score head" is expected from a causal-LM checkpoint
    try:
        model = _from_pretrained(AutoModelForSequenceClassification, path, "critic", dtype=dtype, num_labels=1)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.config.pad_token_id = pad_token_id
    return model.to(device)


def backbone_and_head(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Split a CausalLM / SequenceClassification model into (backbone, head)."""
    backbone = model.base_model
    if backbone is model:
        raise ModelLoadError(f"{type(model).__name__} has no separate backbone (base_model); unsupported.")
    for name in ("score", "classifier", "v_head"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Module):
            return backbone, head
    head = model.get_output_embeddings()
    if head is None:
        raise ModelLoadError(f"{type(model).__name__}: cannot find its output head (score or lm_head).")
    return backbone, head


def load_function(spec: str, role: str = "reward.function") -> Callable:
    """Import 'package.module:function'. The current directory is importable, as users expect."""
    if ":" not in spec:
        raise ModelLoadError(f"{role}={spec!r} must look like 'package.module:function'.")
    mod_name, fn_name = spec.split(":", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ModelLoadError(f"{role}: cannot import module {mod_name!r} ({e}). Make it importable "
                             f"(run from its directory or add it to PYTHONPATH).") from None
    except Exception as e:  # the module itself is broken (SyntaxError, NameError, ... at import)
        raise ModelLoadError(f"{role}: importing module {mod_name!r} failed: {type(e).__name__}: {e}") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ModelLoadError(f"{role}: module {mod_name!r} has no function {fn_name!r}.")
    return fn
