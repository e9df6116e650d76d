"""The one part shape and registry (``oppo.parts``): every kind is a :class:`~oppo.parts.Registry`,
its built-ins named by module path, each checked with ``checks(own, cfg)``."""

import dataclasses

import pytest

from oppo import parts
from oppo.config import Config, ConfigError, load_config
from validated import load_valid


KINDS = [parts.BACKENDS, parts.LEARNERS, parts.ALGORITHMS, parts.PLACEMENTS, parts.REWARD_TERMS]


@pytest.mark.parametrize("registry", KINDS, ids=lambda r: r.noun)
def test_every_kind_lists_its_built_ins_first_and_each_has_the_one_shape(registry):
    from importlib import import_module

    built_in = [getattr(import_module(m), a) for m, _, a in (ref.partition(":") for ref in registry.built_in)]
    names = registry.names()
    assert [registry.get(n) for n in names[:len(built_in)]] == built_in
    for spec in built_in:
        assert isinstance(getattr(spec, "help", getattr(spec, "summary", None)), str)
        checks = getattr(spec, "checks", None)
        assert checks is None or callable(checks)


def test_an_unknown_part_is_a_key_error_and_a_value_error_naming_the_known_ones():
    with pytest.raises(KeyError, match=r"unknown placement 'nowhere'; valid: local, ray"):
        parts.PLACEMENTS.get("nowhere")
    with pytest.raises(ValueError, match=r"unknown learner engine 'x'; valid: replicate, fsdp2"):
        parts.LEARNERS.get("x")


def test_a_part_with_settings_of_its_own_gets_its_section_in_the_config():
    cfg = Config()
    assert set(cfg.learner) >= {"replicate", "fsdp2"} and set(cfg.placement.by_name) >= {"local", "ray"}
    assert dataclasses.is_dataclass(cfg.learner["fsdp2"]) and cfg.learner["fsdp2"].workers == 1
    with pytest.raises(ConfigError, match=r"learner.fsdp2.workers must be >= 1, got 0"):
        load_valid(None, ["placement.name=ray", "placement.learner=fsdp2", "learner.fsdp2.workers=0"])


def test_a_part_whose_settings_are_no_dataclass_is_refused():
    from oppo.placements import PlacementSpec

    spec = PlacementSpec("odd", "settings not a dataclass", decide=None, build=None, settings=dict)  # type: ignore
    with pytest.raises(ValueError, match=r"placement 'odd': settings must be a dataclass"):
        parts.PLACEMENTS.register(spec)


def test_the_built_in_reward_terms_come_from_the_registry():
    from oppo import rewards

    assert tuple(rewards.BUILTINS) == parts.REWARD_TERMS.names()[:8] == (
        "math_accuracy", "format_reward", "boxed_format", "gsm8k_format", "think_format", "length_penalty",
        "vader_sentiment", "afinn_sentiment")
    assert rewards.length_penalty is parts.REWARD_TERMS.get("length_penalty").function
    assert rewards.BUILTIN_FUNCTIONS["math_accuracy"] is rewards.math_accuracy
