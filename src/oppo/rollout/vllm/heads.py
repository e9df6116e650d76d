"""Serving a model whose attention head size vLLM's CPU attention lacks, exactly, by padding its heads.

:class:`HeadPadding` pads heads of size d to a supported size D > d with zero dimensions, moving
the rotary pairs and rescaling ``theta`` and the query so that every score is unchanged; it
rewrites the config and every weight on its way into the engine, and the trainer keeps the model
as it is. Only plain rotary embeddings of Llama, Mistral and Qwen2 are padded.
:class:`ServedCheckpoint` also serves tied input and output embeddings untied on the CPU, where an
in-place reload would leave vLLM's repacked head stale.

Design notes (the rotary mapping, the scale, the figures): docs/vllm.md, "Padded heads and untied
embeddings"."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

PADDABLE = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class HeadPadding:
    """Heads of ``old`` dimensions served as heads of ``new`` (module docstring)."""

    old: int
    new: int
    heads: int
    kv_heads: int

    @classmethod
    def plan(cls, config: dict, supported: list[int]) -> "HeadPadding | None":
        """The padding that makes ``config``'s heads servable, or None: they are already, or this
        model cannot be padded exactly (another architecture or rotary embedding)."""
        heads = config.get("num_attention_heads") or 0
        old = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0)
        if not old or old in supported or old % 2 or config.get("model_type") not in PADDABLE:
            return None
        for rope in (config.get("rope_parameters") or {}, config.get("rope_scaling") or {}):
            if rope.get("rope_type", rope.get("type", "default")) != "default":
                return None
            if rope.get("partial_rotary_factor", 1.0) != 1.0:  # (transformers reads it here too)
                return None
        if config.get("partial_rotary_factor", 1.0) != 1.0:
            return None
        larger = [s for s in supported if s > old]
        if not larger:
            return None
        return cls(old, min(larger), heads, config.get("num_key_value_heads") or heads)

    # ------------------------------------------------------------------ config

    def config(self, config: dict) -> dict:
        """``config`` with heads of ``new`` dimensions and the rotary base that keeps every
        frequency."""
        out = dict(config, head_dim=self.new)
        # The base the model uses, by transformers' precedence (``convert_rope_params_to_dict``):
        # the rotary block's own ``rope_theta``, else the top-level one, else the classes'
        # ``default_theta`` (10000 for all three architectures). The rewritten base goes
        # everywhere a reader may look, so no block is left with its old (or a default) base.
        blocks = [k for k in ("rope_scaling", "rope_parameters") if isinstance(out.get(k), dict)]
        base = next((out[k]["rope_theta"] for k in blocks if "rope_theta" in out[k]),
                    out.get("rope_theta", 10000.0))
        theta = base ** (self.new / self.old)
        for k in blocks:
            out[k] = dict(out[k], rope_theta=theta)
        out["rope_theta"] = theta
        return out

    # ------------------------------------------------------------------ weights

    def _index(self, n_heads: int) -> torch.Tensor:
        """For each of the ``n_heads * old`` rows, its row in the padded projection."""
        half, new_half = self.old // 2, self.new // 2
        within = torch.cat([torch.arange(half), new_half + torch.arange(half)])
        return (torch.arange(n_heads)[:, None] * self.new + within[None, :]).reshape(-1)

    def weight(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """One checkpoint tensor as the padded engine takes it (others unchanged)."""
        proj = next((p for p in ("q_proj", "k_proj", "v_proj", "o_proj") if f".{p}." in name), None)
        if proj is None:
            return w
        if proj == "o_proj":
            if not name.endswith(".weight"):
                return w  # its bias lives in the hidden dimension
            out = w.new_zeros(w.shape[0], self.heads * self.new)
            out[:, self._index(self.heads)] = w
            return out
        n = self.heads if proj == "q_proj" else self.kv_heads
        out = w.new_zeros(n * self.new, *w.shape[1:])
        out[self._index(n)] = w * math.sqrt(self.new / self.old) if proj == "q_proj" else w
        return out

    def adapter_weight(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """One LoRA adapter tensor (peft's names: ``...q_proj.lora_A.weight`` [r, in], ``...lora_B.weight``
        [out, r]) as the padded engine takes it. Padding is linear, so the adapter of a padded
        projection is padded where the projection's weight is: ``lora_B``'s rows for the query, key
        and value (the query's scale included), ``lora_A``'s columns for the output projection."""
        if ".lora_B." in name and any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj")):
            return self.weight(name.replace(".lora_B.", "."), w)
        if ".lora_A." in name and ".o_proj." in name:
            return self.weight(name.replace(".lora_A.", "."), w)
        return w


EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
HEAD = "lm_head.weight"


@dataclass(frozen=True)
class ServedCheckpoint:
    """How the engine's copy of a checkpoint differs from the trainer's: heads padded
    (:class:`HeadPadding`), and/or the output head untied from the input embedding."""

    padding: HeadPadding | None = None
    untie: bool = False

    @classmethod
    def plan(cls, config: dict, supported: list[int]) -> "ServedCheckpoint | None":
        """What serving ``config`` on vLLM's CPU backend needs (None: nothing)."""
        out = cls(HeadPadding.plan(config, supported), bool(config.get("tie_word_embeddings")))
        return out if out.padding is not None or out.untie else None

    def config(self, config: dict) -> dict:
        out = self.padding.config(config) if self.padding is not None else dict(config)
        if self.untie:
            out["tie_word_embeddings"] = False
        return out

    def state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole checkpoint's tensors as the engine takes them."""
        return dict(self.weights(state.items(), complete=True))

    def weights(self, pairs: Iterable[tuple[str, torch.Tensor]], complete: bool = False, clone: bool = True
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs as the engine takes them: padded, and with the output head as a
        copy of the embedding when untied (``complete``: the pairs are a whole checkpoint, which
        must hold the embedding; ``clone`` False: the embedding itself, for a caller that copies)."""
        head, embedding = False, None
        for name, w in pairs:
            head = head or name == HEAD
            if self.untie and name.endswith(EMBEDDINGS):
                embedding = w
            yield name, self.padding.weight(name, w) if self.padding is not None else w
        if self.untie and not head:
            if embedding is None:
                if complete:
                    raise ValueError(f"the checkpoint ties its output head to an input embedding named none of "
                                     f"{EMBEDDINGS}; generation.backend=vllm cannot serve it untied on the CPU")
                return  # (a partial load without the embedding leaves the head as it is)
            yield HEAD, embedding.clone() if clone else embedding

    def write(self, src: str | Path, dst: str | Path) -> Path:
        """A copy of the checkpoint directory ``src`` in ``dst`` that vLLM loads (config and
        safetensors weights; the tokenizer is not read: the engine takes token ids)."""
        from safetensors.torch import load_file, save_file

        src, dst = Path(src).expanduser(), Path(dst)
        files = sorted(src.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{src} has no .safetensors weights for vLLM's rewritten copy (padded heads "
                                    f"or an untied head); save the model with save_pretrained()")
        dst.mkdir(parents=True, exist_ok=True)
        config = json.loads((src / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(self.config(config), indent=1))
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        save_file({k: v.contiguous() for k, v in self.state(state).items()}, str(dst / "model.safetensors"),
                  metadata={"format": "pt"})
        if (src / "generation_config.json").is_file():
            shutil.copy(src / "generation_config.json", dst / "generation_config.json")
        return dst
