"""LoRA: adapters on the policy, and the frozen base as the reference without a second copy."""

from __future__ import annotations

import torch

from .errors import ModelLoadError


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")



def apply_lora(model, r: int, alpha: float, dropout: float, target_modules: list[str]):
    """Wrap ``model`` with peft LoRA adapters: base weights frozen, adapters trainable (fp32)."""
    from peft import LoraConfig, get_peft_model

    targets = list(target_modules) if target_modules else "all-linear"
    cfg = LoraConfig(r=r, lora_dropout=dropout, target_modules=targets, bias="none", task_type="CAUSAL_LM",
                     lora_alpha=alpha)  # type: ignore[arg-type]  # peft says int; it only divides it (alpha / r)
    try:
        return get_peft_model(model, cfg)
    except ValueError as e:
        raise ModelLoadError(f"LoRA could not be applied to the policy ({type(model).__name__}): {e}. "
                             f"Set lora.target_modules to module names the model has.") from None



def base_view(peft_model) -> torch.nn.Module:
    """The LoRA policy's base model without adapters, as a separate module whose weights are the
    *same tensors* as the policy's frozen base weights (no second copy in memory): the
    reference policy. Separate modules, so the reference can score on the scorer worker while the actor
    decodes with its adapters on (toggling ``disable_adapter`` would race)."""
    import copy

    inner = peft_model.get_base_model()  # the transformers model with LoRA layers injected
    with torch.device("meta"):
        view = type(inner)(copy.deepcopy(inner.config))
    shared = {}
    # (the state dict names a tied weight under both its names: a tied output head is no parameter of its own)
    for name, t in list(inner.state_dict(keep_vars=True).items()) + list(inner.named_buffers()):
        if "lora_" in name:
            continue
        shared[name.replace(".base_layer.", ".")] = t
    keys = set(view.state_dict())
    missing = keys - set(shared)
    if missing:
        raise ModelLoadError(f"internal error: the LoRA base view misses {sorted(missing)[:3]}")
    view.load_state_dict({k: v for k, v in shared.items() if k in keys}, assign=True, strict=True)
    # what the state dict does not hold (non-persistent buffers such as rotary inv_freq, plain
    # tensor attributes): from the same module of the policy
    theirs = dict(inner.named_modules())
    for name, mod in view.named_modules():
        src = theirs.get(f"{name}.base_layer") or theirs.get(name)
        for key, buf in list(mod._buffers.items()):
            if buf is not None and buf.is_meta:
                assert src is not None  # (the view has the policy's architecture: every module has its own)
                mod._buffers[key] = src._buffers[key]
        for key, val in list(vars(mod).items()):
            if torch.is_tensor(val) and val.is_meta:
                setattr(mod, key, getattr(src, key))
    leftover = [n for n, t in list(view.named_parameters()) + list(view.named_buffers()) if t.is_meta]
    if leftover:
        raise ModelLoadError(f"internal error: the LoRA base view has unset tensors {leftover[:3]}")
    if getattr(inner.config, "tie_word_embeddings", False):
        view.tie_weights()
    view.generation_config = inner.generation_config
    return view.eval().requires_grad_(False)
