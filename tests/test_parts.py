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
    assert dataclasses.is_dataclass(cfg.learner["fsdp2"]) and cfg.learner["fsdp2"].ranks == 1
    with pytest.raises(ConfigError, match=r"learner.fsdp2.ranks must be >= 1, got 0"):
        load_valid(None, ["placement.name=ray", "placement.learner=fsdp2", "learner.fsdp2.ranks=0"])


def test_a_part_whose_settings_are_no_dataclass_is_refused():
    from oppo.placements import PlacementSpec

    spec = PlacementSpec("odd", "settings not a dataclass", decide=None, build=None, settings=dict)  # type: ignore
    with pytest.raises(ValueError, match=r"placement 'odd': settings must be a dataclass"):
        parts.PLACEMENTS.register(spec)


def test_the_built_in_reward_terms_come_from_the_registry():
    from oppo import rewards

    # every name of the registry, in its order (a new built-in joins without editing this test)
    assert tuple(rewards.BUILTINS) == parts.REWARD_TERMS.names()
    assert {"math_accuracy", "format_reward", "boxed_format", "gsm8k_format", "think_format", "length_penalty",
            "vader_sentiment", "afinn_sentiment"} <= set(rewards.BUILTINS)
    assert rewards.length_penalty is parts.REWARD_TERMS.get("length_penalty").function
    assert rewards.BUILTIN_FUNCTIONS["math_accuracy"] is rewards.math_accuracy


# Conformance of the parts that test_conformance.py (the role Protocols) and the algorithms' own tests
# (tests/test_algo_specs.py, tests/test_algo_math.py, parametrized by the registry) do not drive: every
# built-in placement and reward term, read from the registries, so a new built-in runs here with no edit.
with parts.PLACEMENTS.built_ins_only():
    BUILT_IN_PLACEMENTS = parts.PLACEMENTS.names()
with parts.REWARD_TERMS.built_ins_only():
    BUILT_IN_TERMS = parts.REWARD_TERMS.names()


@pytest.mark.parametrize("name", BUILT_IN_PLACEMENTS)
def test_a_built_in_placement_decides_from_its_defaults(name):
    """Its defaults are valid settings, and ``decide`` gives a Placement that says where every role
    runs, whatever the run's facts; a local one builds in this process, a remote one says where."""
    from oppo import placements
    from oppo.api.placement import Placement
    from oppo.config import load_config, validate

    cfg = load_config(None, [f"placement.name={name}"])
    validate(cfg)
    spec = placements.of(cfg.placement)
    assert spec.name == name and spec.help and callable(spec.decide) and callable(spec.build)
    for critic in (True, False):
        facts = placements.Facts(needs_critic=critic, scorers_on_cpu=True, computes_in_master=True)
        placed = spec.decide(cfg, placements.own(cfg.placement), facts)
        assert isinstance(placed, Placement)
        assert placed.threads.full >= 1


@pytest.mark.parametrize("name", BUILT_IN_TERMS)
def test_a_built_in_reward_term_scores_a_batch_by_its_bare_name(name):
    """A term named bare resolves to the registered function; the function takes (prompts, responses)
    and gives one finite float a response, for a batch of two with the keywords its signature asks for
    (columns: given as the data would; settings: their defaults)."""
    import inspect
    import math

    from oppo.models import load_function
    from oppo.rewards import function_spec

    spec = parts.REWARD_TERMS.get(name)
    assert spec.help and load_function(function_spec(name), "reward.function") is spec.function
    params = inspect.signature(spec.function).parameters
    asked: dict = {n: ["42", "7"] for n, p in list(params.items())[2:]
                   if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty}
    if "max_length" in params:  # (length_penalty's setting, which a term's kwargs must give)
        asked["max_length"] = 8
    scores = spec.function(["What is 6 * 7?", "Say something kind."], ["The answer is \\boxed{42}.", "You did great!"],
                           **asked)
    assert len(scores) == 2 and all(isinstance(s, float) and math.isfinite(s) for s in scores), scores
