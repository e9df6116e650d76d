"""The learner's micro-batches sized to the device (``ppo.micro_batch_tokens=-1``, the default).

On a GPU the learner pays per call (a forward and backward of 16 short sequences is mostly
launches and host time), so a micro-batch should hold as many tokens as memory allows: with the
default ``-1`` on CUDA, a minibatch is cut into micro-batches by a token budget alone (its
``micro_batch_size`` no longer sets a count), the budget being a share of the device's free memory
at start over the activation bytes a token keeps for the backward (:func:`activation_bytes`). On
the CPU, ``-1`` means no budget: micro-batches of ``micro_batch_size`` rows, as before. The loss is
the same either way (it is normalised by the minibatch's token count).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..config import PPOConfig

SHARE = 0.35
"""Of the free memory at start: the KV caches, CUDA-graph pools and the scorers' work come later."""
LOWEST, HIGHEST = 4096, 131072


def activation_bytes(model: torch.nn.Module, checkpointing: bool = False) -> float:
    """Bytes one token keeps for the backward through ``model`` under bf16 autocast: per layer its
    saved inputs of the norms (fp32), attention projections and MLP (bf16), ~ 20 h + 8 i
    (``i`` the MLP width, 4 h if unknown); with activation checkpointing, each layer's input only,
    plus one layer recomputed."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    h = int(getattr(cfg, "hidden_size", 0) or 1024)
    i = int(getattr(cfg, "intermediate_size", 0) or 4 * h)
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 24)
    per_layer = 20.0 * h + 8.0 * i
    return (2.0 * h * layers + per_layer) if checkpointing else per_layer * layers


def sized(ppo: PPOConfig, models: list[torch.nn.Module], checkpointing: bool = False,
          say=None) -> PPOConfig:
    """``ppo`` with ``micro_batch_tokens=-1`` resolved for the device of ``models`` (the trained
    ones): on CUDA a token budget from the free memory (and ``micro_batch_size`` = the minibatch:
    the budget alone cuts it), elsewhere 0 (no budget). Any other value is returned as given."""
    if ppo.micro_batch_tokens != -1:
        return ppo
    dev = next(models[0].parameters()).device
    if dev.type != "cuda":
        return dataclasses.replace(ppo, micro_batch_tokens=0)
    free, _ = torch.cuda.mem_get_info(dev)
    per_token = max(activation_bytes(m, checkpointing) for m in models)
    budget = int(SHARE * free / per_token) // 1024 * 1024
    budget = max(LOWEST, min(HIGHEST, budget))
    if say is not None:
        say(f"micro-batches: up to {budget} tokens each (ppo.micro_batch_tokens=-1: {SHARE:.0%} of the "
            f"{free / 2**30:.1f} GiB free at start over ~{per_token / 2**20:.2f} MiB a token keeps for the backward)")
    return dataclasses.replace(ppo, micro_batch_tokens=budget, micro_batch_size=ppo.minibatch_size)
