"""Checks that read no weights: a scorer's config (a causal backbone with one label), a model given
as an object, every scorer role at once, and the context a prompt and its response need."""

from __future__ import annotations

from pathlib import Path

from .arch import text_config, context_length, is_causal_architecture
from .errors import ModelLoadError
from .lora import is_peft
from . import paths as model_paths
from .paths import said_where, load_model_config, looks_local
from .tokenizers import check_tokenizer_match


def check_scorer_config(config, path: str, role: str, require_one_label: bool,
                        architectures: list[str] | None = None, new_head: bool = False) -> None:
    """Before loading weights: a reward/critic model must be a causal (decoder-only) backbone with
    a one-label head. ``require_one_label``: the reward model must already have it; a critic
    may start from a causal-LM checkpoint (a fresh one-label head is created). ``architectures``:
    the model's class names where its config does not say (an object not loaded from a directory).
    ``new_head``: a causal LM is accepted as the reward model too (``reward.new_head``)."""
    if not is_causal_architecture(config):
        raise ModelLoadError(
            f"The {role} model {said_where(path)} is a {getattr(config, 'model_type', '?')} model, not a decoder-only "
            f"(causal) one. oppo reads the {role} at the last token (reward) or every token (critic) of a causal "
            f"backbone with a KV cache; an encoder's pooled classifier cannot be read that way. Use a causal-LM-based "
            f"{role} model (e.g. a Llama/Qwen/Mistral/GPT-2 ...ForSequenceClassification with num_labels=1)"
            + (", or reward.function for a text scorer." if role == "reward" else "."))
    archs = architectures or getattr(config, "architectures", None) or []
    is_classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    if new_head and not_a_classifier(archs):  # a fresh one-label head replaces the LM head (reward.new_head)
        return
    if require_one_label and (why := not_a_classifier(archs)):
        raise ModelLoadError(f"The {role} model {said_where(path)} {why}")
    n = getattr(config, "num_labels", 1)
    if (require_one_label or is_classifier) and n != 1:
        raise ModelLoadError(f"The {role} model {said_where(path)} has {n} labels; PPO needs a scalar "
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
            check_tokenizer_match(policy_tok, path, role, getattr(text_config(cfg), "vocab_size", None))
        except ModelLoadError as e:
            problems.append(str(e))
    if problems:
        raise ModelLoadError(problems[0] if len(problems) == 1 else
                             f"{len(problems)} problems with the scorer models:\n- " + "\n- ".join(problems))



def _embedding_rows(model) -> int | None:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(emb, "num_embeddings", None)
    return int(rows) if rows is not None else getattr(text_config(model.config), "vocab_size", None)



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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt")


def dir_problems(role: str, key: str, path: str, hub_names: list[tuple[str, str]],
                 new_head: bool = False) -> list[str]:
    """A model directory's problems found without loading it: a directory with ``config.json``
    (:func:`~oppo.models.paths.model_dir_config`), the policy's with its tokenizer, a reward model
    with one label (``new_head``: a causal LM is a reward model too, ``reward.new_head``). A path
    that is not local is a hub name: appended to ``hub_names`` for the hub's check."""
    if not looks_local(path):
        hub_names.append((key, path))
        return []
    conf, problem = model_paths.model_dir_config(path, f"{key}={path!r}")  # (the one rule for a model path)
    if problem is not None:
        return [problem]
    assert conf is not None  # (a directory with a config.json read)
    p = Path(path).expanduser()
    out = []
    if role == "policy" and not any((p / f).is_file() for f in TOKENIZER_FILES):
        out.append(f"{key}={path!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES[:2])}, ...); "
                   f"save it beside the model with tokenizer.save_pretrained(dir).")
    if role == "reward" and (why := not_a_classifier(conf.get("architectures"))):
        if not new_head:
            out.append(f"{key}={path!r} {why}")
    elif role == "reward":
        labels = len(conf["id2label"]) if isinstance(conf.get("id2label"), dict) else conf.get("num_labels")
        if isinstance(labels, int) and labels != 1:
            out.append(f"{key}={path!r} has {labels} labels; PPO needs a scalar reward "
                       f"(AutoModelForSequenceClassification with num_labels=1).")
    return out


def device_problems(devices: dict[str, str]) -> list[str]:
    """Setting -> device asked for (``policy.device``, ...): CUDA asked for where there is none."""
    asked = {key: dev for key, dev in devices.items() if dev.startswith("cuda")}
    if not asked:
        return []
    import torch

    if torch.cuda.is_available():
        return []
    return [f"{key}={dev!r} but CUDA is not available here; use cpu or auto." for key, dev in asked.items()]
