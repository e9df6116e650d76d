"""Activation recomputation: marked once on the layers, switched on for training forwards only."""

from __future__ import annotations

from .lora import is_peft


def enable_gradient_checkpointing(model) -> None:
    """Mark the model's decoder layers for activation recomputation (non-reentrant). They only
    checkpoint inside :func:`checkpointing` (training forwards): oppo keeps every model in eval
    mode, and a checkpointing layer in training mode would drop the KV cache of decoding."""
    inner = model.get_base_model() if is_peft(model) else model
    kwargs = {"use_reentrant": False}
    if hasattr(inner, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        inner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    inner.eval()



class checkpointing:
    """Context: the gradient-checkpointed layers of ``model`` recompute activations in backward
    (their ``training`` flag only; dropout modules stay in eval mode)."""

    def __init__(self, model, enabled: bool = True):
        self.layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True] \
            if enabled and model is not None else []

    def __enter__(self):
        for m in self.layers:
            m.training = True
        return self

    def __exit__(self, *exc):
        for m in self.layers:
            m.training = False
        return False
