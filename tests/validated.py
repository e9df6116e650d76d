"""Configs read and validated at once, for tests of the validation's messages: ``load_config``
parses, and a run's one check (``setup.check``) validates; these do both, as a run would."""

from oppo.config import from_dict, load_config, validate, with_overrides


def load_valid(*args, **kwargs):
    cfg = load_config(*args, **kwargs)
    validate(cfg)
    return cfg


def with_overrides_valid(*args, **kwargs):
    cfg = with_overrides(*args, **kwargs)
    validate(cfg)
    return cfg


def from_dict_valid(*args, **kwargs):
    cfg = from_dict(*args, **kwargs)
    validate(cfg)
    return cfg
