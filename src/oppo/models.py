"""Loading the four roles' models and reading their heads.

Every role is an ordinary Hugging Face model:

- policy and reference: ``AutoModelForCausalLM``;
- reward: ``AutoModelForSequenceClassification`` with one label;
- critic: ``AutoModelForSequenceClassification`` with one label, i.e. a causal-LM backbone with a
  scalar value head read at every position (initialised from the reward model, as OpenRLHF and
  the OPPO paper's peers do, or from the policy with a fresh head). It saves and loads with
  ``save_pretrained``/``from_pretrained`` like any other model.

Streaming needs the backbone's hidden states with a KV cache, then the head applied by us, so
:func:`backbone_and_head` splits a model into the two.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Callable

import torch

from .marker import is_marker


class ModelLoadError(ValueError):
    """A model, tokenizer or function could not be loaded; the message names the fix."""


def resolve_device(spec: str, fallback: str | None = None) -> torch.device:
    if spec == "auto":
        if fallback is not None:
            return torch.device(fallback)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"Device {spec!r} was asked for but CUDA is not available; use cpu.")
    return dev


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec]


def looks_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or os.path.exists(path) or path.count("/") > 1


def _at(path: str) -> str:
    """'at '<path>'' in messages, or 'given as an object' (``inputs.marker``)."""
    return "given as an object" if is_marker(path) else f"at {path!r}"


def check_model_path(path: str, role: str) -> None:
    """Fail early, before anything expensive, on a local path that does not exist."""
    if is_marker(path):
        return  # an object given from Python (inputs.py): checked by model_problems
    if looks_local(path):
        p = Path(path).expanduser()
        if not p.is_dir():
            raise ModelLoadError(f"{role} model path {path!r} does not exist or is not a directory. "
                                 f"Give a directory written by save_pretrained, or a hub name such as 'org/model'.")
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{role} model directory {path!r} has no config.json; it is not a Hugging Face "
                                 f"model directory (save one with model.save_pretrained).")
        try:  # a corrupt one would otherwise be reported by whichever loader reads it first (the tokenizer)
            json.loads((p / "config.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{role} model directory {path!r}: its config.json is not valid JSON ({e}). Write "
                                 f"it again with model.save_pretrained(dir), or restore it from the model's "
                                 f"source.") from None


def _from_pretrained(cls, path: str, role: str, **kw):
    check_model_path(path, role)
    try:
        return cls.from_pretrained(str(Path(path).expanduser()) if looks_local(path) else path, **kw)
    except OSError as e:
        raise ModelLoadError(f"Could not load the {role} model from {path!r}: {e}. Check the path or hub name; "
                             f"without internet only local directories work.") from None


def load_tokenizer(path: str):
    """The policy's tokenizer, left-padded for generation. Falls back to EOS as pad (warning)."""
    from transformers import AutoTokenizer

    check_model_path(path, "policy")
    try:
        tok = AutoTokenizer.from_pretrained(str(Path(path).expanduser()) if looks_local(path) else path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"Could not load a tokenizer from {path!r}: {e}. The policy directory must "
                             f"hold its tokenizer (tokenizer.save_pretrained).") from None
    return _ready_for_generation(tok, f"The tokenizer at {path!r}", " and save it again")


def _ready_for_generation(tok, which: str, fix_tail: str = ""):
    """``tok`` left-padded for generation, EOS as pad where it has none (a warning); ``which`` names
    it in the messages ("The tokenizer at '...'")."""
    if tok.eos_token_id is None:
        raise ModelLoadError(f"{which} has no EOS token; PPO needs one to end responses. "
                             f"Set tokenizer.eos_token{fix_tail}.")
    if tok.pad_token_id is None:
        warnings.warn(f"{which} has no pad token; using EOS ({tok.eos_token!r}) as pad.", stacklevel=3)
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_causal_lm(path: str, role: str, device: torch.device, dtype: torch.dtype, trust_remote_code=False):
    from transformers import AutoModelForCausalLM

    model = _from_pretrained(AutoModelForCausalLM, path, role, dtype=dtype, trust_remote_code=trust_remote_code)
    model = model.to(device)
    verify_model(model, role)
    return model


def load_model_config(path: str, role: str, trust_remote_code: bool = False):
    """A model directory's config only (fast): for the checks that run before any weights load."""
    from transformers import AutoConfig

    check_model_path(path, role)
    try:
        return AutoConfig.from_pretrained(str(Path(path).expanduser()) if looks_local(path) else path,
                                          trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"Could not read the {role} model's config at {path!r}: {e}") from None


def check_scorer_config(config, path: str, role: str, require_one_label: bool,
                        architectures: list[str] | None = None, new_head: bool = False) -> None:
    """Before loading weights: a reward/critic model must be a causal (decoder-only) backbone with
    a one-label head. ``require_one_label``: the reward model must already have it; a critic
    may start from a causal-LM checkpoint (a fresh one-label head is created). ``architectures``:
    the model's class names where its config does not say (an object not loaded from a directory).
    ``new_head``: a causal LM is accepted as the reward model too (``reward.new_head``)."""
    if not is_causal_architecture(config):
        raise ModelLoadError(
            f"The {role} model {_at(path)} is a {getattr(config, 'model_type', '?')} model, not a decoder-only "
            f"(causal) one. oppo reads the {role} at the last token (reward) or every token (critic) of a causal "
            f"backbone with a KV cache; an encoder's pooled classifier cannot be read that way. Use a causal-LM-based "
            f"{role} model (e.g. a Llama/Qwen/Mistral/GPT-2 ...ForSequenceClassification with num_labels=1)"
            + (", or reward.function for a text scorer." if role == "reward" else "."))
    archs = architectures or getattr(config, "architectures", None) or []
    is_classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    if new_head and not_a_classifier(archs):  # a fresh one-label head replaces the LM head (reward.new_head)
        return
    if require_one_label and (why := not_a_classifier(archs)):
        raise ModelLoadError(f"The {role} model {_at(path)} {why}")
    n = getattr(config, "num_labels", 1)
    if (require_one_label or is_classifier) and n != 1:
        raise ModelLoadError(f"The {role} model {_at(path)} has {n} labels; PPO needs a scalar "
                             f"(AutoModelForSequenceClassification with num_labels=1).")


def not_a_classifier(architectures: list[str] | None) -> str:
    """Why a checkpoint saved as ``architectures`` (its config's) cannot be a reward model, or "":
    a causal LM (``...ForCausalLM``, ``...LMHeadModel``) scores tokens, not sequences. Asked before
    the label count, whose message ("has 2 labels", its config's default) would hide that."""
    lm = [a for a in architectures or () if a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))]
    if not lm or any(a.endswith("ForSequenceClassification") for a in architectures or ()):
        return ""
    return (f"is a {lm[0]}: this is not a sequence classifier (a reward model is a one-label "
            f"...ForSequenceClassification, trained on preference pairs, e.g. with TRL's RewardTrainer). Give "
            f"reward.path a reward model, or score text with reward.function=module:function; to try the pipeline "
            f"with it anyway, as TRL's example scripts do, reward.new_head=true puts a fresh (random) one-label "
            f"head on it.")


def reward_function(fn: Callable, name: str) -> Callable:
    """``fn`` (the user's reward function), refusing a return that is a torch tensor, or a list of
    them, with the fix named (``.tolist()``): the scorer wants Python numbers, and a tensor's
    elements are not (numpy arrays and scalars are, and pass)."""

    @functools.wraps(fn)  # (its signature is fn's: scoring.reward_fn reads which inputs fn asks for)
    def checked(prompts, responses, **inputs):
        out = fn(prompts, responses, **inputs)
        if isinstance(out, torch.Tensor) or (isinstance(out, (list, tuple)) and out
                                             and isinstance(out[0], torch.Tensor)):
            shape = f" of shape {list(out.shape)}" if isinstance(out, torch.Tensor) else " of tensors"
            raise TypeError(f"{name} returned a {type(out).__name__}{shape}, not a list of floats; return "
                            f"scores.tolist() (a tensor's elements are not Python numbers).")
        return out

    return checked


def check_roles(policy_tok, reward: str | None = None, critic: str | None = None,
                reference: str | None = None, objects: dict | None = None, policy=None,
                new_head: bool = False) -> None:
    """Every check of the scorer roles that needs no weights, all problems at once: each is a
    causal backbone (reward: with one label) reading the policy's token ids. ``objects``: role ->
    a model given as an object (``inputs.Inputs``), checked in place of its path; ``policy``: the
    policy given as an object (a causal LM with an embedding row for every token)."""
    problems = object_problems(policy_tok, "policy", policy) if policy is not None else []
    objects = objects or {}
    for role, path in (("reward", reward), ("critic", critic), ("reference", reference)):
        model = objects.get(role)
        if not path and model is None:
            continue
        if model is not None:
            problems += object_problems(policy_tok, role, model)
            continue
        assert path is not None
        try:
            cfg = load_model_config(path, role)
            if role == "reference":
                if not is_causal_architecture(cfg):
                    raise ModelLoadError(f"The reference model at {path!r} is a {cfg.model_type} model, not a "
                                         f"causal LM; use the policy's base model (AutoModelForCausalLM).")
            else:
                check_scorer_config(cfg, path, role, require_one_label=role == "reward",
                                    new_head=new_head and role == "reward")
            check_tokenizer_match(policy_tok, path, role, getattr(_text_config(cfg), "vocab_size", None))
        except ModelLoadError as e:
            problems.append(str(e))
    if problems:
        raise ModelLoadError(problems[0] if len(problems) == 1 else
                             f"{len(problems)} problems with the scorer models:\n- " + "\n- ".join(problems))


def _embedding_rows(model) -> int | None:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(emb, "num_embeddings", None)
    return int(rows) if rows is not None else getattr(_text_config(model.config), "vocab_size", None)


def object_problems(policy_tok, role: str, model, key: str | None = None) -> list[str]:
    """:func:`model_problems`, then whether the model reads the policy tokenizer's ids (one
    embedding row for each: what :func:`check_tokenizer_match` checks of a path)."""
    key = key or {"reward": "reward_model"}.get(role, role)
    problems = model_problems(role, key, model)
    if problems:
        return problems
    try:
        check_tokenizer_match(policy_tok, "<object>", role, _embedding_rows(model))
    except ModelLoadError as e:
        return [f"{key}=: {e}"]
    return []


def model_problems(role: str, key: str, model) -> list[str]:
    """Why ``model``, given as an object for ``role`` (``key``: the keyword it came as), cannot be
    used: the checks a path's config gets (:func:`check_scorer_config`), from the object's class
    and config. Loads nothing, runs no forward."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        peft = " (a peft model: give its base model and set lora.r)" if is_peft(model) else ""
        return [f"{key}= must be a Hugging Face model (a transformers PreTrainedModel, e.g. from "
                f"AutoModelFor{'SequenceClassification' if role in ('reward', 'critic') else 'CausalLM'}"
                f".from_pretrained), got {type(model).__name__}{peft}."]
    name = type(model).__name__
    try:
        if role in ("policy", "reference"):
            if not is_causal_architecture(model.config) or not hasattr(model, "get_output_embeddings") \
                    or name.endswith("ForSequenceClassification"):
                return [f"{key}= is a {name}, not a causal LM: the {role} generates text, so it is an "
                        f"AutoModelForCausalLM (a ...ForCausalLM)."]
        else:
            check_scorer_config(model.config, "<object>", role, require_one_label=role == "reward",
                                architectures=[name])
    except ModelLoadError as e:
        return [f"{key}=: {e}"]
    return []


def prepare_model(model, role: str, device: torch.device, dtype: torch.dtype, pad_token_id: int | None = None):
    """A model given as an object, made ready as its loader would make a loaded one: on
    ``device`` in ``dtype`` (in place: the object is the one trained, or scored with), frozen when
    the role is (reference, reward), checked by :func:`verify_model`."""
    model = model.to(device=device, dtype=dtype)
    if role in ("reward", "critic") and model.config.pad_token_id is None:
        model.config.pad_token_id = pad_token_id
    if role in ("reward", "reference"):
        model.eval().requires_grad_(False)
    verify_model(model, role, pad_token_id if role in ("reward", "critic") else None)
    return model


def critic_from_object(model, device: torch.device, dtype: torch.dtype, pad_token_id: int, copy_it: bool):
    """A critic initialised from ``model`` as :func:`load_critic` initialises one from a path: a
    one-label sequence classifier is the critic (a copy when ``copy_it``: the reward model stays
    frozen); a causal LM gives its backbone, under a new one-label value head."""
    import copy

    from transformers import AutoModelForSequenceClassification

    if type(model).__name__.endswith("ForSequenceClassification"):
        critic = copy.deepcopy(model) if copy_it else model
    else:
        config = copy.deepcopy(model.config)
        config.num_labels = 1
        config.architectures = None
        critic = AutoModelForSequenceClassification.from_config(config)
        critic.base_model.load_state_dict(model.base_model.state_dict())
    critic = critic.to(device=device, dtype=dtype).requires_grad_(True)
    critic.config.pad_token_id = pad_token_id
    verify_model(critic, "critic", pad_token_id)
    return critic


def tokenizer_from_object(tok):
    """The policy's tokenizer given as an object, ready as :func:`load_tokenizer` makes one (a
    copy: left padding, EOS as pad where it has none, without changing the user's)."""
    import copy

    if not hasattr(tok, "get_vocab") or not callable(tok):
        raise ModelLoadError(f"tokenizer= must be a Hugging Face tokenizer (AutoTokenizer.from_pretrained), got "
                             f"{type(tok).__name__}.")
    return _ready_for_generation(copy.deepcopy(tok), "The tokenizer given as an object")


def is_causal_lm_checkpoint(path: str) -> bool:
    """Whether the checkpoint at ``path`` was saved as a causal LM, not a sequence classifier."""
    return bool(not_a_classifier(getattr(load_model_config(path, "reward"), "architectures", None)))


NEW_HEAD_SEED = 0
"""Seed of the fresh reward head (``reward.new_head``): every process that loads it, and every
resume, gets the same head, so the reward model's fingerprint and scores agree."""


def seed_new_head(model) -> None:
    """Re-initialise a sequence classifier's one-label head from :data:`NEW_HEAD_SEED` (normal, the
    config's ``initializer_range``; bias zero): Hugging Face draws a missing head from the global
    RNG, which differs between processes."""
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    weight = getattr(head, "weight", None)
    if weight is None:
        raise ModelLoadError(f"reward.new_head: {type(model).__name__} has no 'score' or 'classifier' head to "
                             f"initialise; give a one-label reward model instead.")
    g = torch.Generator().manual_seed(NEW_HEAD_SEED)
    std = float(getattr(model.config, "initializer_range", 0.02) or 0.02)
    with torch.no_grad():
        weight.copy_((torch.randn(tuple(weight.shape), generator=g) * std).to(weight.dtype))
        bias = getattr(head, "bias", None)
        if bias is not None:
            bias.zero_()


def load_reward_model(path: str, device: torch.device, dtype: torch.dtype, pad_token_id: int,
                      new_head: bool = False):
    """A one-label sequence classifier, frozen. ``new_head`` (``reward.new_head``): a causal LM at
    ``path`` gets a fresh one-label head (:func:`seed_new_head`) instead of being refused."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    config = load_model_config(path, "reward")
    check_scorer_config(config, path, "reward", require_one_label=True, new_head=new_head)
    fresh = new_head and bool(not_a_classifier(getattr(config, "architectures", None)))
    verbosity = hf_logging.get_verbosity()
    if fresh:
        hf_logging.set_verbosity_error()  # "newly initialised score head": asked for, and said once by setup
    try:
        model = _from_pretrained(AutoModelForSequenceClassification, path, "reward", dtype=dtype, num_labels=1)
    finally:
        hf_logging.set_verbosity(verbosity)
    if fresh:
        seed_new_head(model)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = pad_token_id
    model = model.to(device).eval().requires_grad_(False)
    verify_model(model, "reward", pad_token_id)
    return model


def load_critic(path: str, device: torch.device, dtype: torch.dtype, pad_token_id: int):
    """A value model: sequence-classification head with one output, read at every position."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    check_scorer_config(load_model_config(path, "critic"), path, "critic", require_one_label=False)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "newly initialised score head" is expected from a causal-LM checkpoint
    try:
        model = _from_pretrained(AutoModelForSequenceClassification, path, "critic", dtype=dtype, num_labels=1)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.config.pad_token_id = pad_token_id
    model = model.to(device)
    verify_model(model, "critic", pad_token_id)
    return model


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


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Where a Hugging Face config keeps the longest sequence the model reads (GPT-2: n_positions)."""


def context_length(config) -> tuple[int, str] | None:
    """(the most positions the model reads, the config key saying so), or None where it names none."""
    cfg = _text_config(config)
    for key in CONTEXT_KEYS:
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value, key
    return None


def context_problem(lengths: list[int], max_new_tokens: int, configs: dict[str, object],
                    texts: list[str] | None = None, default_new: bool = False) -> str:
    """One line when the longest prompt (``lengths``: each prompt's tokens; ``texts``: each prompt,
    to quote the longest) plus ``max_new_tokens``
    is longer than a model reads (``configs``: 'role (setting)' -> its config); "" when all fit.
    Past its positions a model with learned position embeddings (GPT-2, OPT) fails with an
    IndexError in the middle of a step, and one with rotary positions (Llama) is trained on
    positions it never saw, silently: both are refused here, before any weights load."""
    if not lengths:
        return ""
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    n = lengths[longest]
    short = [(found, who) for who, c in configs.items() if (found := context_length(c)) and n + max_new_tokens > found[0]]
    if not short:
        return ""
    limit, key = min(short)[0]
    tight = [who for (lim, _), who in short if lim == limit]
    who = " and ".join(tight) + (" models read" if len(tight) > 1 else " model reads")
    fit = limit - max_new_tokens
    room = limit - n  # (new tokens that fit after the longest prompt)
    fix = (f"set data.max_prompt_tokens={fit} (longer prompts are cut to it; data.on_long_prompt=skip drops them)"
           + (f", or generation.max_new_tokens={room} or lower" if room > 0 else "") if fit > 0 else
           f"set generation.max_new_tokens={room} or lower" if room > 0 else
           f"set generation.max_new_tokens below {limit} and data.max_prompt_tokens to leave room for it")
    quoted = ""
    if texts:
        s = " ".join(str(texts[longest]).split())
        quoted = f" ({s[:40]!r}{'...' if len(s) > 40 else ''})"
    return (f"The {who} at most {limit} positions ({key} in the config), but the longest prompt"
            f"{quoted} is {n} tokens and generation.max_new_tokens={max_new_tokens}"
            f"{' (its default: the setting is empty)' if default_new else ''} adds "
            f"{max_new_tokens}: {n + max_new_tokens} positions. {fix[0].upper()}{fix[1:]}.")


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _logit_processing(model) -> tuple[float | None, float]:
    """(softcap, scale) that the model's forward applies to its logits after lm_head."""
    cfg = _text_config(model.config)
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


def uses_sliding_window(model_or_config) -> bool:
    """Whether any attention layer of the model is windowed (Mistral, Gemma 2/3, Qwen2 with
    ``use_sliding_window``): its mask counts KV-cache columns, so cache holes shift the window."""
    cfg = _text_config(getattr(model_or_config, "config", model_or_config))
    if getattr(cfg, "sliding_window", None) is None:
        return False
    types_ = getattr(cfg, "layer_types", None)
    return types_ is None or "sliding_attention" in types_


def is_causal_architecture(config) -> bool:
    """A decoder-only model type that ``AutoModelForCausalLM`` knows (not an encoder such as
    BERT or DeBERTa, whose sequence-classification head pools instead of reading the last token)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = _text_config(config)
    if getattr(cfg, "is_encoder_decoder", False):
        return False
    encoders = {"bert", "roberta", "deberta", "deberta-v2", "distilbert", "albert", "electra", "xlm-roberta",
                "camembert", "ernie", "modernbert", "mpnet", "xlm", "funnel", "longformer", "big_bird"}
    return cfg.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and cfg.model_type not in encoders


@torch.no_grad()
def verify_model(model, role: str, pad_token_id: int | None = None) -> None:
    """Check on a small probe input that oppo reads ``model`` as Hugging Face's own forward does.

    - causal: the hidden state at a position does not depend on later tokens (a model that
      attends both ways cannot be streamed or scored per token);
    - head: ``head(backbone(x))`` equals ``model(x).logits`` (a causal LM's logits at every
      position; a sequence classifier's score at the last token, which is what HF pools when
      there is no padding).
    Costs one forward of 8 tokens per role. Raises ModelLoadError naming the fix. The probe runs in
    eval mode (a model made or given in train mode would differ by its dropout masks, not by what
    it attends to); the model's mode is restored.
    """
    was_training = model.training
    model.eval()
    try:
        _verify(model, role, pad_token_id)
    finally:
        model.train(was_training)


def _verify(model, role: str, pad_token_id: int | None) -> None:
    params = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]
    finite = torch.stack([torch.isfinite(p).all() for _, p in params]).tolist() if params else []
    bad = [n for (n, _), ok in zip(params, finite) if not ok]
    if bad:
        raise ModelLoadError(
            f"The {role} model ({type(model).__name__}) has non-finite (NaN or inf) weights in {len(bad)} of "
            f"{len(params)} tensors, e.g. {', '.join(bad[:3])}: the checkpoint is corrupt or was saved from a "
            f"diverged run. Load another checkpoint (an earlier one of the run that wrote it).")
    backbone, head = backbone_and_head(model)
    device = next(model.parameters()).device
    vocab = int(_text_config(model.config).vocab_size)
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (1, 8), generator=g)
    if pad_token_id is not None:
        ids[ids == pad_token_id] = (pad_token_id + 1) % vocab
    ids = ids.to(device)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % vocab
    if pad_token_id is not None and int(changed[0, -1]) == pad_token_id:
        changed[0, -1] = (changed[0, -1] + 1) % vocab
    name = type(model).__name__
    h = backbone(input_ids=ids).last_hidden_state.float()
    h2 = backbone(input_ids=changed).last_hidden_state.float()
    scale = h[0, :-1].abs().max().clamp(min=1.0)
    if not torch.allclose(h[0, :-1], h2[0, :-1], atol=1e-3 * float(scale), rtol=0):
        raise ModelLoadError(
            f"The {role} model ({name}) is not causal: its earlier hidden states change when a later token "
            f"changes (an encoder such as BERT or DeBERTa). PPO reads every role token by token, left to right; "
            f"use a decoder-only (causal LM) model for the {role}.")
    ours = head(backbone(input_ids=ids).last_hidden_state).float()  # [1, 8, V] or [1, 8, 1]
    theirs = model(input_ids=ids).logits.float()
    if theirs.dim() == 2:  # sequence classification: HF pools the last token
        ours = ours[:, -1]
    tol = (1e-4 if next(model.parameters()).dtype == torch.float32 else 2e-2) * float(theirs.abs().max().clamp(min=1))
    if ours.shape != theirs.shape or not torch.allclose(ours, theirs, atol=tol, rtol=0):
        gap = (ours - theirs).abs().max().item() if ours.shape == theirs.shape else float("nan")
        raise ModelLoadError(
            f"The {role} model ({name}) post-processes its outputs in a way oppo does not reproduce "
            f"(max gap {gap:.3g} between its forward and oppo's head on a probe input). Training on it would "
            f"use the wrong log-probs; please report the architecture.")


def check_tokenizer_match(policy_tok, path: str, role: str, vocab_size: int | None = None) -> None:
    """A reward/critic/reference model must read the policy's token ids: same vocabulary.

    ``path``'s own tokenizer, when it has one, must map every token to the same id as the
    policy's; ``vocab_size`` (the model's embedding rows) must cover every policy id.
    """
    from transformers import AutoTokenizer

    n = len(policy_tok)
    if vocab_size is not None and vocab_size < n:
        raise ModelLoadError(
            f"The {role} model {_at(path)} has {vocab_size} token embeddings but the policy's tokenizer has {n} "
            f"tokens: it was not trained with the policy's tokenizer. Use a {role} model that shares the policy's "
            f"vocabulary, or (reward) a reward.function that scores the decoded text.")
    p = Path(path).expanduser()
    if is_marker(path) or not looks_local(path) or not any((p / f).is_file() for f in
                                         ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")):
        return  # no tokenizer saved beside the model: the embedding size check above is all we can do
    try:
        other = AutoTokenizer.from_pretrained(str(p))
    except (OSError, ValueError):
        return
    mine, theirs = policy_tok.get_vocab(), other.get_vocab()
    if mine != theirs:
        diff = sorted(set(mine.items()) ^ set(theirs.items()), key=str)[:3]
        raise ModelLoadError(
            f"The {role} model at {path!r} has a different tokenizer from the policy's ({len(theirs)} vs {len(mine)} "
            f"tokens; e.g. {diff}). Its scores would be read from the wrong token ids. Use a {role} model trained "
            f"with the policy's tokenizer, or (reward) a reward.function that scores the decoded text.")


def load_function(spec: str, role: str = "reward.function") -> Callable:
    """Import 'package.module:function'. The current directory is importable, as users expect."""
    if ":" not in spec:
        raise ModelLoadError(f"{role}={spec!r} must look like 'package.module:function'.")
    mod_name, fn_name = spec.split(":", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ModelLoadError(f"{role}: cannot import module {mod_name!r} ({e}). Make it importable "
                             f"(run from its directory or add it to PYTHONPATH).") from None
    except Exception as e:  # the module itself is broken (SyntaxError, NameError, ... at import)
        raise ModelLoadError(f"{role}: importing module {mod_name!r} failed: {type(e).__name__}: {e}") from e
    missing = object()
    fn = getattr(mod, fn_name, missing)
    if fn is missing:
        raise ModelLoadError(f"{role}: module {mod_name!r} has no function {fn_name!r}.")
    if not callable(fn):
        shown = repr(fn) if len(repr(fn)) <= 60 else repr(fn)[:57] + "..."
        raise ModelLoadError(f"{role}: module {mod_name!r} has {fn_name!r}, but it is not callable: it is "
                             f"{shown}, of type {type(fn).__name__}. Point {role} at a function "
                             f"fn(prompts, responses) -> list[float].")
    return fn


def _other_shapes(saved: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> str:
    """The first tensor of ``saved`` whose shape differs from ``own``'s, in words ("k is [..] there
    and [..] here", and how many more); "" when every shared name has the same shape."""
    bad = [(k, list(v.shape), list(own[k].shape)) for k, v in saved.items()
           if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if not bad:
        return ""
    k, there, here = bad[0]
    more = f" (and {len(bad) - 1} more parameters)" if len(bad) > 1 else ""
    return f"{k} is {there} there and {here} here{more}"


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], source) -> None:
    """``model.load_state_dict(state)``, refusing first, in one line, a tensor of another shape
    (``source``: where ``state`` comes from, e.g. a checkpoint's ``policy/``): a resume onto a model
    of another size is otherwise torch's size-mismatch traceback of every parameter."""
    bad = _other_shapes(state, model.state_dict())
    if bad:
        raise ModelLoadError(f"{source} holds weights of another shape than this run's model: {bad}. Resume with "
                             f"the model the run started from (the checkpoint's config.json names its sizes), or "
                             f"start a new run without --resume to train this model.")
    model.load_state_dict(state)


def check_adapter_shapes(model, adapter: dict[str, torch.Tensor], source) -> None:
    """Refuse, in one line, a saved LoRA adapter (``source``: a checkpoint's ``policy/``; ``adapter``:
    its tensors, as ``peft.load_peft_weights`` gives them) whose tensors do not fit ``model``'s: a
    resume onto a base model of another shape is otherwise torch's size-mismatch traceback."""
    # (the saved names lack the adapter's name: peft's "....lora_A.default.weight" is saved as "....lora_A.weight")
    name = getattr(model, "active_adapter", "default")
    own = {k.replace(f".{name}.", ".").replace(f".{name}", ""): v for k, v in model.state_dict().items()}
    bad = _other_shapes(adapter, own)
    if bad:
        raise ModelLoadError(f"the LoRA adapter in {source} does not fit this run's base model: {bad}, so the base "
                             f"model at policy.path has "
                             f"another shape than the one the adapter was trained on. Resume with the base model "
                             f"the run started from, or start a new run without --resume to train this one.")


def stop_token_ids(tokenizer, model) -> tuple[int, ...]:
    """Every id that ends a response: the tokenizer's EOS and each EOS of the model's
    ``generation_config`` (an int or a list: Llama 3 instruct stops on <|eot_id|> and
    <|end_of_text|>, Qwen2 chat on <|im_end|> and <|endoftext|>)."""
    ids = [tokenizer.eos_token_id]
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    if extra is not None:
        ids.extend(extra if isinstance(extra, (list, tuple)) else [extra])
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


# --------------------------------------------------------------------------- LoRA and memory

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
    reference policy. Separate modules, so the reference can score on a worker while the actor
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
