"""Loading the four roles' models from paths, or making objects ready as a load would.

Every role is an ordinary Hugging Face model:

- policy and reference: ``AutoModelForCausalLM``;
- reward: ``AutoModelForSequenceClassification`` with one label;
- critic: ``AutoModelForSequenceClassification`` with one label, i.e. a causal-LM backbone with a
  scalar value head read at every position (initialised from the reward model, as OpenRLHF and
  the OPPO paper's peers do, or from the policy with a fresh head). It saves and loads with
  ``save_pretrained``/``from_pretrained`` like any other model.
"""

from __future__ import annotations

import torch

from .checks import check_scorer_config, not_a_classifier
from .errors import ModelLoadError
from .paths import from_pretrained, load_model_config
from .verify import verify_model


def load_causal_lm(path: str, role: str, device: torch.device, dtype: torch.dtype, trust_remote_code=False):
    from transformers import AutoModelForCausalLM

    model = from_pretrained(AutoModelForCausalLM, path, role, dtype=dtype, trust_remote_code=trust_remote_code)
    model = model.to(device)
    verify_model(model, role)
    return model


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
        model = from_pretrained(AutoModelForSequenceClassification, path, "reward", dtype=dtype, num_labels=1)
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
        model = from_pretrained(AutoModelForSequenceClassification, path, "critic", dtype=dtype, num_labels=1)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.config.pad_token_id = pad_token_id
    model = model.to(device)
    verify_model(model, "critic", pad_token_id)
    return model



def is_causal_lm_checkpoint(path: str) -> bool:
    """Whether the checkpoint at ``path`` was saved as a causal LM, not a sequence classifier."""
    return bool(not_a_classifier(getattr(load_model_config(path, "reward"), "architectures", None)))



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
