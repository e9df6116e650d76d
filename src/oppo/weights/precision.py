"""Mixed precision and weight sync: fp32 master weights train; low-precision copies serve.

On GPU the roles compute in bf16 (``policy.dtype=auto``). Stepping AdamW on bf16 parameters
loses most small updates: bf16 keeps 8 mantissa bits, so an update below ~1/256 of a weight
rounds away (a 512x512 layer, 10 AdamW steps at lr 1e-5: 8.5% of the weights changed in bf16,
100% in fp32). As DeepSpeed and FSDP mixed precision do, the trained models (actor, critic) keep
fp32 master weights and fp32 optimizer state, their training forward runs under bf16 autocast,
and the rollout backend and the critic's scorer read bf16 copies that :func:`copy_weights`
refreshes after every update (the weight sync a distributed runtime does by broadcast).

In float32 there is one model per role and no copy: :func:`serving_copy` returns the master,
except with in-flight updates (``overlap.mode=pipeline``), where the learner trains the master
while the rollout backend and the scorers go on with the copies.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Iterator

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


def master_dtype(compute: torch.dtype) -> torch.dtype:
    """The dtype trained weights and optimizer state are kept in: fp32 under mixed precision."""
    return torch.float32 if compute in LOW_PRECISION else compute


def serving_copy(master: torch.nn.Module, compute: torch.dtype, separate: bool = False) -> torch.nn.Module:
    """The model the rollout backend/scorer runs: ``master`` itself when it already computes in ``compute``
    (unless ``separate``: in-flight updates train the master while the copy serves), else a
    frozen copy cast to ``compute``."""
    if next(master.parameters()).dtype == compute and not separate:
        return master
    served = copy.deepcopy(master)
    for p in served.parameters():
        p.data = p.data.to(compute)
    # Buffers keep the master's dtype: ``module.to(bf16)`` would also round the rotary
    # frequencies (``inv_freq``) to bf16, up to 0.4% off, a position error that grows with the
    # position (0.1 rad at 219 tokens, 0.9 at 2048 with head dim 64) between sampler, reference
    # and trainer. Hugging Face's ``from_pretrained(dtype=bfloat16)`` keeps them fp32 too.
    return served.eval().requires_grad_(False)


@torch.no_grad()
def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """``dst``'s parameters and buffers := ``src``'s (cast to ``dst``'s dtype). No-op when same."""
    if src is dst:
        return
    theirs: dict[str, torch.Tensor] = dict(dst.named_parameters())
    theirs.update(dict(dst.named_buffers()))
    for name, t in list(src.named_parameters()) + list(src.named_buffers()):
        target = theirs.get(name)
        if target is None:
            raise KeyError(f"internal error: weight {name!r} missing from the serving copy")
        target.copy_(t)


def autocast(device: torch.device, compute: torch.dtype):
    """The training forward's precision context: bf16 autocast over fp32 masters, or nothing."""
    if compute not in LOW_PRECISION:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute)


@contextlib.contextmanager
def cast_once(device: torch.device, compute: torch.dtype) -> Iterator[None]:
    """One optimizer step's micro-batches, each master weight cast to ``compute`` once, not once
    per micro-batch forward: a low-precision working copy kept in step with the masters.

    Autocast caches the casts of trainable leaf tensors until the outermost autocast region exits;
    this opens one (disabled, so the backward passes between the forwards run outside autocast, as
    recommended) around the micro-batches, and the forwards' own :func:`autocast` regions nest in
    it and share its cache. Code that casts by hand outside autocast (the fused head,
    ``forward.head_logprobs``) shares :func:`cast_weight`'s cache, opened here too. Exiting drops
    both, before the optimizer step changes the masters. Nothing for fp32 compute."""
    if compute not in LOW_PRECISION:
        yield
        return
    token = _CASTS.set({})
    try:
        with torch.autocast(device_type=device.type, dtype=compute), \
                torch.autocast(device_type=device.type, enabled=False):
            yield
    finally:
        _CASTS.reset(token)


# (weight's id, dtype) -> (weight, its cast), for the open cast_once region of this thread (the
# critic may train in another thread at the same time: a context variable is per thread)
_CASTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("oppo_casts", default=None)


def cast_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in ``dtype``, detached (the caller forms its gradient itself): cast once per
    :func:`cast_once` region (one optimizer step), or on every call outside one (a forward
    without backward: old log-probs, scoring)."""
    if weight.dtype == dtype:
        return weight.detach()
    cache = _CASTS.get()
    if cache is None:
        return weight.detach().to(dtype)
    hit = cache.get((id(weight), dtype))
    if hit is None or hit[0] is not weight:
        hit = cache[id(weight), dtype] = (weight, weight.detach().to(dtype))
    return hit[1]
