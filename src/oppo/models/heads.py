"""A model split into its backbone and its head, the head applying the model's own logit
post-processing: streaming reads the backbone's hidden states with a KV cache, then the head."""

from __future__ import annotations

import torch

from .arch import text_config
from .errors import ModelLoadError
from .lora import is_peft


class LogitsHead(torch.nn.Module):
    """A causal LM's output head *with the model's own logit post-processing*, which Hugging Face
    applies inside ``forward`` after ``lm_head``: Gemma 2/3 ``final_logit_softcapping``
    (``tanh(x / c) * c``), Cohere ``logit_scale`` (``x * s``), Granite ``logits_scaling``
    (``x / s``). Skipping them changes every log-prob (``docs/implementation-details.md``).
    :func:`verify_model` checks on a probe input that this head reproduces ``model(...)``, so an
    architecture with post-processing we do not know is refused, not trained on wrong numbers.
    """

    def __init__(self, lm_head: torch.nn.Module, softcap: float | None = None, scale: float = 1.0):
        super().__init__()
        self.lm_head, self.softcap, self.scale = lm_head, softcap, scale

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits



def _logit_processing(model) -> tuple[float | None, float]:
    """(softcap, scale) that the model's forward applies to its logits after lm_head."""
    cfg = text_config(model.config)
    softcap = getattr(cfg, "final_logit_softcapping", None)
    scale = 1.0
    if getattr(model, "logit_scale", None) is not None and not isinstance(model.logit_scale, torch.nn.Module):
        scale *= float(model.logit_scale)  # Cohere keeps it on the model
    if getattr(cfg, "logits_scaling", None) not in (None, 1, 1.0):
        scale /= float(cfg.logits_scaling)  # Granite divides
    return softcap, scale



def backbone_and_head(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Split a CausalLM / SequenceClassification model into (backbone, head).

    The head of a causal LM is a :class:`LogitsHead`: ``lm_head`` plus the model's own logit
    post-processing, so ``head(backbone(...).last_hidden_state)`` equals ``model(...).logits``.
    The pair is cached on the model (a reference to modules it already owns). A peft model is
    read through its underlying transformers model (adapters included).
    """
    cached = getattr(model, "_oppo_backbone_and_head", None)
    if cached is not None:
        return cached
    if is_peft(model):
        base_pair = backbone_and_head(model.get_base_model())
        object.__setattr__(model, "_oppo_backbone_and_head", base_pair)
        return base_pair
    backbone = model.base_model
    if backbone is model:
        raise ModelLoadError(f"{type(model).__name__} has no separate backbone (base_model); unsupported.")
    pair = None
    for name in ("score", "classifier", "v_head"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Module):
            pair = (backbone, head)
            break
    if pair is None:
        head = model.get_output_embeddings()
        if head is None:
            raise ModelLoadError(f"{type(model).__name__}: cannot find its output head (score or lm_head).")
        softcap, scale = _logit_processing(model)
        pair = (backbone, LogitsHead(head, softcap, scale))
    object.__setattr__(model, "_oppo_backbone_and_head", pair)  # not a submodule: no state_dict entry
    return pair
