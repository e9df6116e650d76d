"""A LoRA policy served by vLLM as base model + adapter: each update sends the adapter only.

With ``rollout.vllm.lora_sync=adapter`` vLLM serves the frozen base with the policy's adapter on
top; after each update the trainer writes the adapter to a file in ``/dev/shm`` and vLLM reloads it
in place (``LoRARequest(load_inplace=True)``) between two engine steps. The base goes to the engine
once, and again only if it changed. ``auto`` serves the adapter on a GPU and merged weights on the
CPU; adapters vLLM cannot serve are merged (``auto``) or refused (``adapter``).

Design notes (exactness under padded heads, when it pays, what cannot be served): docs/vllm.md,
"LoRA as an adapter"."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from ...procs import pid_alive
from .heads import HeadPadding

if TYPE_CHECKING:
    from peft import PeftModel

SYNCS = ("auto", "adapter", "merged")
"""``rollout.vllm.lora_sync``'s values (``rollout.vllm.VLLMSettings``)."""

RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM's choices of ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``)."""

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder's linear layers vLLM adapts in the architectures it serves here (Llama, Mistral,
Qwen2: it packs q/k/v and gate/up itself)."""

ADAPTER_ID = 1
ADAPTER_NAME = "oppo-policy"
FILE = "adapter_model.safetensors"
CPU_SLOWDOWN = ("on the CPU vLLM's LoRA kernels decode 1.8-3x slower than the merged model (SmolLM2-135M: 40 "
                "against 121 tokens/s at r=16 on every linear layer, 64 against 114 at r=8 on q_proj and v_proj), "
                "which costs more than the adapter-only load saves (0.2 s against 0.76 s per update)")


def _peft_config(module: PeftModel):
    return module.peft_config[module.active_adapter]


def _rank(adapter) -> int:
    """The adapter's largest rank (``adapter``: its peft ``LoraConfig``, not oppo's; peft's
    ``rank_pattern`` may raise it for some layers)."""
    return max([adapter.r, *(getattr(adapter, "rank_pattern", None) or {}).values()])


def adapter_problem(module: torch.nn.Module) -> str:
    """Why vLLM cannot serve this peft policy as base + adapter ('' when it can)."""
    peft = cast("PeftModel", module)
    active = getattr(peft, "active_adapters", [peft.active_adapter])
    if len(peft.peft_config) != 1 or len(active) != 1:
        return f"the policy holds {len(peft.peft_config)} adapters ({', '.join(peft.peft_config)}); one is served"
    cfg = _peft_config(peft)
    if getattr(cfg, "use_dora", False):
        return "DoRA adapters (use_dora) are not served by vLLM"
    if getattr(cfg, "bias", "none") != "none" or getattr(cfg, "lora_bias", False):
        return f"adapter biases (bias={cfg.bias!r}) are not served by vLLM"
    if getattr(cfg, "modules_to_save", None):
        return f"modules_to_save ({', '.join(cfg.modules_to_save)}) are whole trained layers, not adapters"
    rank = _rank(cfg)
    if rank > RANKS[-1]:
        return f"rank {rank} is above vLLM's largest max_lora_rank, {RANKS[-1]}"
    inner = peft.get_base_model()
    for name, layer in inner.named_modules():
        if getattr(layer, "lora_embedding_A", None):
            return f"the adapter on {name} (an embedding) is not served as an adapter here"
        if not getattr(layer, "lora_A", None):
            continue
        if name.rsplit(".", 1)[-1] not in PROJECTIONS or not isinstance(layer.get_base_layer(), torch.nn.Linear):
            return (f"the adapter on {name} ({type(layer.get_base_layer()).__name__}) is not on one of the decoder's "
                    f"linear projections ({', '.join(PROJECTIONS)})")
    return ""


def max_rank(module: torch.nn.Module) -> int:
    """The smallest of vLLM's ``max_lora_rank`` choices that holds this policy's adapter."""
    rank = _rank(_peft_config(cast("PeftModel", module)))
    return next(r for r in RANKS if r >= rank)


def choose(sync: str, module: torch.nn.Module | None, on_cpu: bool) -> tuple[bool, str]:
    """(serve ``module`` as base + adapter?, why not, for the run's log). Raises ``ValueError`` naming
    the fix where ``sync`` is ``adapter`` and the adapter cannot be served so."""
    from ...models import is_peft

    if sync not in SYNCS:
        raise ValueError(f"rollout.vllm.lora_sync must be one of {', '.join(SYNCS)}, not {sync!r}")
    if module is None or not is_peft(module):
        return False, ""
    if sync == "merged":
        return False, "rollout.vllm.lora_sync=merged"
    problem = adapter_problem(module)
    if sync == "adapter" and problem:
        raise ValueError(f"rollout.vllm.lora_sync=adapter, but vLLM cannot serve this policy's adapter: {problem}. Set "
                         f"rollout.vllm.lora_sync=merged (or auto) to send the merged weights instead, or change lora.target_modules.")
    if problem:
        return False, problem
    if sync == "auto" and on_cpu:
        return False, CPU_SLOWDOWN + "; rollout.vllm.lora_sync=adapter serves the adapter anyway"
    return True, ""


def base_weights(module: torch.nn.Module):
    """The peft policy's frozen base weights under their Hugging Face names (no adapter merged)."""
    inner = cast("PeftModel", module).get_base_model()
    for name, p in inner.named_parameters():
        if "lora_" not in name:
            yield name.replace(".base_layer.", "."), p.detach()


PREFIX = "oppo-vllm-lora-"


def sweep_stale(root: Path) -> list[Path]:
    """Remove the adapter directories (``PREFIX<pid>-...``) of processes that no longer run: a
    trainer killed with SIGKILL cannot remove its own, and in ``/dev/shm`` it would hold memory until
    the machine restarts. Returns what it removed."""
    gone = []
    for d in root.glob(PREFIX + "*"):
        pid = d.name[len(PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d)
    return gone


def _shm_dir() -> str | None:
    """``/dev/shm`` where this process may write there (files in RAM), else the default temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class AdapterFiles:
    """The adapter's directory, as vLLM loads it (``adapter_config.json`` and ``FILE``), rewritten
    at every update; :meth:`request` gives the request every generation carries, and with
    ``load_inplace`` the one that reloads the adapter in place."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, padding: HeadPadding | None):
        self.dtype, self.padding = dtype, padding
        root = _shm_dir()
        sweep_stale(Path(root or tempfile.gettempdir()))
        self.dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root))
        self._config: dict | None = None  # the adapter_config.json written (rank, alpha, targets)
        self._write_config(module)
        self._base: list[tuple] = []  # each base parameter when last sent: (name, weakref, storage, version)

    def request(self, load_inplace: bool = False) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(self.dir), load_inplace=load_inplace)

    def tensors(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The adapter's tensors under peft's names, in the engine's dtype, padded as the engine's heads."""
        from peft import get_peft_model_state_dict

        out = {}
        for name, t in get_peft_model_state_dict(module).items():
            t = t.detach().to("cpu", self.dtype)
            if self.padding is not None:
                t = self.padding.adapter_weight(name, t)
            out[name] = t.contiguous()
        return out

    def write(self, module: torch.nn.Module) -> int:
        """Write the adapter's file (whole, then renamed over the old one); returns its bytes."""
        from safetensors.torch import save_file

        self._write_config(module)
        tensors = self.tensors(module)
        tmp = self.dir / (FILE + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, self.dir / FILE)
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def _write_config(self, module: torch.nn.Module) -> None:
        """``adapter_config.json`` (vLLM reads the scale alpha / r and the targets from it), where it
        differs from the one written."""
        cfg = _peft_config(cast("PeftModel", module))
        wanted = cfg.to_dict()
        if wanted != self._config:
            cfg.save_pretrained(str(self.dir))
            self._config = wanted

    def base_changed(self, module: torch.nn.Module) -> bool:
        """Whether the base weights are other tensors than those last sent (another module: a weak
        reference, not an address, which a freed module's successor may reuse), or those with
        their data replaced or written in place (storage, version counter)."""
        now = self._stamp(module)
        return len(now) != len(self._base) or any(
            n != m or ref() is not p or ptr != ptr2 or v != v2
            for (n, p, ptr, v), (m, ref, ptr2, v2) in zip(now, self._base))

    def base_sent(self, module: torch.nn.Module | None) -> None:
        """The engine now holds ``module``'s base weights (None: some other weights)."""
        self._base = ([(n, weakref.ref(p), ptr, v) for n, p, ptr, v in self._stamp(module)]
                      if module is not None else [])

    @staticmethod
    def _stamp(module: torch.nn.Module) -> list[tuple]:
        """(name, parameter, storage, version) of each frozen base parameter."""
        inner = cast("PeftModel", module).get_base_model()
        return [(n, p, p.untyped_storage().data_ptr(), p._version)
                for n, p in inner.named_parameters() if "lora_" not in n]

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
