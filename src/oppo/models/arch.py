"""What a model's config says of its architecture: decoder-only or not, windowed attention, how
many positions it reads."""

from __future__ import annotations

def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config



def is_causal_architecture(config) -> bool:
    """A decoder-only model type that ``AutoModelForCausalLM`` knows (not an encoder such as
    BERT or DeBERTa, whose sequence-classification head pools instead of reading the last token)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = text_config(config)
    if getattr(cfg, "is_encoder_decoder", False):
        return False
    encoders = {"bert", "roberta", "deberta", "deberta-v2", "distilbert", "albert", "electra", "xlm-roberta",
                "camembert", "ernie", "modernbert", "mpnet", "xlm", "funnel", "longformer", "big_bird"}
    return cfg.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and cfg.model_type not in encoders



def uses_sliding_window(model_or_config) -> bool:
    """Whether any attention layer of the model is windowed (Mistral, Gemma 2/3, Qwen2 with
    ``use_sliding_window``): its mask counts KV-cache columns, so cache holes shift the window."""
    cfg = text_config(getattr(model_or_config, "config", model_or_config))
    if getattr(cfg, "sliding_window", None) is None:
        return False
    types_ = getattr(cfg, "layer_types", None)
    return types_ is None or "sliding_attention" in types_


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Where a Hugging Face config keeps the longest sequence the model reads (GPT-2: n_positions)."""



def context_length(config) -> tuple[int, str] | None:
    """(the most positions the model reads, the config key saying so), or None where it names none."""
    cfg = text_config(config)
    for key in CONTEXT_KEYS:
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value, key
    return None
