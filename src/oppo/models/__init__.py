"""The roles' models: loading them (:mod:`.load`), the checks that read no weights (:mod:`.checks`,
:mod:`.paths`, :mod:`.arch`), the probe every loaded model passes (:mod:`.verify`), backbone and
head (:mod:`.heads`), the tokenizer (:mod:`.tokenizers`), reward functions (:mod:`.functions`),
LoRA (:mod:`.lora`), activation recomputation (:mod:`.memory`) and weights of a resume
(:mod:`.weights`). This file only re-exports the names other modules import from ``oppo.models``."""

from .arch import CONTEXT_KEYS, context_length, is_causal_architecture, text_config, uses_sliding_window
from .checks import check_roles, check_scorer_config, context_problem, model_problems, not_a_classifier, object_problems
from .devices import resolve_device, resolve_dtype
from .errors import ModelLoadError
from .functions import load_function, reward_function
from .heads import LogitsHead, backbone_and_head
from .load import (NEW_HEAD_SEED, critic_from_object, is_causal_lm_checkpoint, load_causal_lm, load_critic,
                   load_reward_model, prepare_model, seed_new_head)
from .lora import apply_lora, base_view, is_peft
from .memory import checkpointing, enable_gradient_checkpointing
from .paths import check_model_path, load_model_config, looks_local
from .tokenizers import check_tokenizer_match, load_tokenizer, stop_token_ids, tokenizer_from_object
from .verify import verify_model
from .weights import check_adapter_shapes, load_weights

__all__ = ["CONTEXT_KEYS", "NEW_HEAD_SEED", "LogitsHead", "ModelLoadError", "apply_lora", "backbone_and_head",
           "base_view", "check_adapter_shapes", "check_model_path", "check_roles", "check_scorer_config",
           "check_tokenizer_match", "checkpointing", "context_length", "context_problem", "critic_from_object",
           "enable_gradient_checkpointing", "is_causal_architecture", "is_causal_lm_checkpoint", "is_peft",
           "load_causal_lm", "load_critic", "load_function", "load_model_config", "load_reward_model",
           "load_tokenizer", "load_weights", "looks_local", "model_problems", "not_a_classifier", "object_problems",
           "prepare_model", "reward_function", "resolve_device", "resolve_dtype", "seed_new_head", "stop_token_ids",
           "text_config", "tokenizer_from_object", "uses_sliding_window", "verify_model"]
