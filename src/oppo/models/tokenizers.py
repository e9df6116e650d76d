"""The policy's tokenizer (from its directory or given as an object), the ids that end a response,
and the rule that every scorer reads the policy's token ids."""

from __future__ import annotations

import warnings
from pathlib import Path

from ..marker import is_marker
from .errors import ModelLoadError
from .paths import said_where, check_model_path, looks_local


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



def tokenizer_from_object(tok):
    """The policy's tokenizer given as an object, ready as :func:`load_tokenizer` makes one (a
    copy: left padding, EOS as pad where it has none, without changing the user's)."""
    import copy

    if not hasattr(tok, "get_vocab") or not callable(tok):
        raise ModelLoadError(f"tokenizer= must be a Hugging Face tokenizer (AutoTokenizer.from_pretrained), got "
                             f"{type(tok).__name__}.")
    return _ready_for_generation(copy.deepcopy(tok), "The tokenizer given as an object")



def check_tokenizer_match(policy_tok, path: str, role: str, vocab_size: int | None = None) -> None:
    """A reward/critic/reference model must read the policy's token ids: same vocabulary.

    ``path``'s own tokenizer, when it has one, must map every token to the same id as the
    policy's; ``vocab_size`` (the model's embedding rows) must cover every policy id.
    """
    from transformers import AutoTokenizer

    n = len(policy_tok)
    if vocab_size is not None and vocab_size < n:
        raise ModelLoadError(
            f"The {role} model {said_where(path)} has {vocab_size} token embeddings but the policy's tokenizer has {n} "
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
