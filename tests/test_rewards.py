"""oppo.rewards: the built-in reward functions, composite rewards (reward.terms) and the GSM8K
recipes. The rules are checked on hand-written responses; the composite's sum and per-term metrics
on one step of tiny models (sequential, and streamed to two reward model scorers)."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import yaml

import oppo
from oppo.config import ConfigError
from oppo.rewards import (CompositeReward, boxed_format, format_reward, gold_answer, gsm8k_format, is_correct,
                          length_penalty, math_accuracy, parse_terms, think_format)

RECIPES = Path(oppo.__file__).parent / "recipes"
TINY = ["placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=2", "ppo.micro_batch_size=2",
        "generation.max_new_tokens=6", "log.progress=false", "run.samples=0", "run.steps=1"]


# ---------------------------------------------------------------------- math_accuracy (math-verify)

@pytest.mark.parametrize("gold, want", [
    ("Natalia sold 48/2 = 24 clips in May.\nAltogether 48+24 = 72 clips.\n#### 72", "72"),  # GSM8K's solution
    ("#### 1,234", "1234"),  # thousands separators dropped
    ("  \\frac{1}{2} ", "\\frac{1}{2}"),  # no ####: the whole answer
    (42, "42"),
])
def test_gold_answer_reads_gsm8k_final_line(gold, want):
    assert gold_answer(gold) == want


@pytest.mark.parametrize("response, gold, right", [
    ("So the answer is \\boxed{72}.", "... #### 72", True),
    ("48 + 24 = 72\n#### 72", "72", True),  # GSM8K's own layout
    ("The total is 72 clips.", "72", True),  # no box: the last number
    ("Half of it: \\boxed{0.5}", "\\frac{1}{2}", True),  # equal values in other notations
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("It costs \\boxed{1,000} dollars.", "#### 1000", True),
    ("\\boxed{71}", "72", False),
    ("\\boxed{72} or maybe 73", "73", False),  # the boxed answer counts, not a later number
    ("I do not know.", "72", False),  # no answer at all
])
def test_math_verify_equivalence(response, gold, right):
    assert is_correct(response, gold) is right


def test_math_accuracy_scores_a_batch_and_checks_the_column():
    assert math_accuracy(["q1", "q2"], ["\\boxed{3}", "4"], answer=["#### 3", "5"]) == [1.0, 0.0]
    assert math_accuracy(["q"], ["\\boxed{3}"], ["3"], split="train") == [1.0]  # other columns are ignored
    with pytest.raises(ValueError, match="1 gold answers for 2 responses"):
        math_accuracy(["q1", "q2"], ["1", "2"], answer=["1"])


def test_math_accuracy_names_the_extra_when_math_verify_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # (import fails)
    with pytest.raises(ImportError, match=r'pip install "oppo\[math\]"'):
        math_accuracy(["q"], ["1"], answer=["1"])


def test_math_accuracy_in_a_thread_has_no_signal_timeout():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:  # math-verify's own timeout would raise outside the main thread
        assert pool.submit(math_accuracy, ["q"], ["\\boxed{2}"], ["2"]).result() == [1.0]


# ---------------------------------------------------------------------- format and length

def test_format_presets_and_regex():
    r = ["<think>add them</think> The answer is \\boxed{7}.", "7", "#### 1,250", "<think>no answer</think>",
         "<think>a</think> b <think>c</think> d", "\\boxed{ }"]
    assert boxed_format([], r) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert gsm8k_format([], r) == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert think_format([], r) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # one think block, then a non-empty answer
    assert format_reward([], r, pattern=r"^\d+$", reward=0.5, penalty=-1) == [-1, 0.5, -1, -1, -1, -1]
    with pytest.raises(ValueError, match="neither one of"):
        format_reward([], r, pattern="(")


def test_length_penalty_hard_and_soft():
    words = ["w " * n for n in (5, 6, 8, 10, 11)]
    assert length_penalty([], words, max_length=10) == [0.0, 0.0, 0.0, 0.0, -1.0]  # hard: -1 past the limit
    # DAPO's soft overlong punishment, L_max 10, L_cache 4: 0 up to 6, then (6 - n) / 4, -1 past 10
    assert length_penalty([], words, max_length=10, buffer=4) == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert length_penalty([], ["abcd", "abcdef"], max_length=5, unit="chars") == [0.0, -1.0]


def test_length_penalty_counts_tokens(tiny_models):
    tok = str(tiny_models["policy"])  # a word-level tokenizer: one token a word
    assert length_penalty([], ["the film was good", "a day"], max_length=3, unit="tokens", tokenizer=tok) == [-1.0, 0.0]


@pytest.mark.parametrize("kwargs, match", [
    ({}, "needs max_length"), ({"max_length": 0}, "needs max_length"), ({"max_length": 4, "buffer": 5}, "buffer"),
    ({"max_length": 4, "unit": "lines"}, "unit"), ({"max_length": 4, "unit": "tokens"}, "needs tokenizer"),
])
def test_length_penalty_refuses_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        length_penalty([], ["a"], **kwargs)


# ---------------------------------------------------------------------- reward.terms: validation

def _config_error(terms, *more: str) -> str:
    with pytest.raises(ConfigError) as e:
        oppo.config.validate(oppo.load_config(overrides=[f"reward.terms={json.dumps(terms)}", *more]))
    return str(e.value)


@pytest.mark.parametrize("terms, match", [
    ([{"path": "rm", "wieght": 1}], "unknown key 'wieght'. Did you mean 'weight'"),
    ([{"path": "rm", "weight": "high"}], r"reward.terms\[0\].weight must be a finite number"),
    ([{"path": "rm", "weight": True}], "weight must be a finite number"),
    ([{"weight": 1.0}], "needs exactly one of path .* got neither"),
    ([{"path": "rm", "function": "m:f"}], "not both"),
    ([{"function": "no_such_builtin"}], "must look like 'package.module:function' or be a built-in"),
    ([{"function": "length_penalty", "kwargs": {"max_lenght": 3}}], "'max_lenght' is not a setting of length_penalty"),
    ([{"function": "length_penalty"}], "term 'length_penalty': length_penalty needs max_length"),
    ([{"path": "rm", "kwargs": {"a": 1}}], "a reward model term takes no kwargs"),
    ([{"path": "a/rm"}, {"path": "b/rm"}], "two terms are named 'rm'"),
    ([{"path": "rm", "name": "My RM"}], "must be lower-case letters"),
    (["rm"], r"reward.terms\[0\] must be a mapping"),
])
def test_terms_are_validated_before_anything_loads(terms, match, nothing_loads):
    assert re.search(match, _config_error(terms)), match


def test_terms_exclude_path_and_function_and_two_models_on_ray():
    assert "not both" in _config_error([{"path": "rm"}], "reward.path=other")
    assert "one reward model" in _config_error([{"path": "a"}, {"path": "b"}], "placement.name=ray")


def test_terms_names_weights_and_scorer_roles():
    terms = parse_terms([{"path": "models/Helpful-RM"}, {"path": "x/safety", "weight": -0.5},
                         {"function": "math_accuracy", "weight": 2}, {"function": "mine:score", "name": "judge2"}])
    assert [(t.name, t.weight, t.role) for t in terms] == [
        ("helpful_rm", 1.0, "reward"), ("safety", -0.5, "reward_safety"), ("math_accuracy", 2.0, ""),
        ("judge2", 1.0, "")]
    assert terms[2].function == "oppo.rewards:math_accuracy"  # a built-in by its bare name
    cfg = oppo.load_config(overrides=["reward.function=math_accuracy"])  # the one-term case, by name too
    assert cfg.reward.function == "math_accuracy"


def test_composite_is_the_weighted_sum_with_a_mean_per_term():
    terms = parse_terms([{"path": "rm", "weight": 0.5}, {"function": "m:f", "name": "f", "weight": -2.0}])
    comp = CompositeReward(terms, {"f": lambda p, r, **kw: [float(len(x)) for x in r]})
    total, stats = comp(["p", "q"], ["ab", "abcd"], {"reward": [1.0, -3.0]}, step=0)
    assert total == [0.5 * 1.0 - 2.0 * 2, 0.5 * -3.0 - 2.0 * 4]
    assert stats == {"reward/rm/mean": -1.0, "reward/f/mean": 3.0}


def test_a_term_returning_a_tensor_is_refused_with_the_fix(tmp_path, monkeypatch):
    from oppo.scoring.composite import composite_functions
    from oppo.scoring.streaming import RewardFunctionError

    (tmp_path / "tensor_rewards.py").write_text(
        "import torch\ndef score(prompts, responses):\n    return torch.ones(len(responses))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = oppo.load_config(overrides=['reward.terms=[{function: "tensor_rewards:score"}]'])
    _, fns = composite_functions(cfg.reward)
    with pytest.raises(RewardFunctionError, match=r"term 'score'.* returned a Tensor .* scores.tolist\(\)"):
        fns["score"](["p"], ["r"], step=0)


# ---------------------------------------------------------------------- reward.terms: a step of training

def _step(overrides: list[str]) -> dict[str, float]:
    trainer = oppo.Trainer.from_config(oppo.load_config(overrides=[*TINY, *overrides]), progress=False)
    try:
        return trainer.run_step()
    finally:
        trainer.close()


def test_composite_step_logs_each_term_and_trains_on_the_sum(tiny_models, tiny_prompts, tmp_path):
    terms = [{"path": str(tiny_models["reward"]), "name": "rm"},
             {"function": "format_reward", "weight": 0.5, "kwargs": {"pattern": "good|bad"}, "name": "fmt"}]
    m = _step([f"policy.path={tiny_models['policy']}", f"data.prompts={tiny_prompts}", "overlap.mode=sequential",
               f"reward.terms={json.dumps(terms)}", f"run.out_dir={tmp_path / 'run'}"])
    assert {"reward/rm/mean", "reward/fmt/mean"} <= set(m)
    assert m["reward/fmt/mean"] in (0.0, 0.25, 0.5, 0.75, 1.0)  # 4 responses, each 0 or 1
    assert m["reward/mean"] == pytest.approx(m["reward/rm/mean"] + 0.5 * m["reward/fmt/mean"], abs=1e-6)


def test_two_reward_models_stream_to_their_own_scorers(tiny_models, tiny_prompts, tmp_path):
    # the same model twice: the second term's scorer (reward_rm2) must give the first's scores
    rm = str(tiny_models["reward"])
    terms = [{"path": rm, "name": "rm"}, {"path": rm, "name": "rm2", "weight": -2.0}]
    m = _step([f"policy.path={tiny_models['policy']}", f"data.prompts={tiny_prompts}", "overlap.mode=intra",
               "placement.local.scorer_process=false", f"reward.terms={json.dumps(terms)}", f"run.out_dir={tmp_path / 'r'}"])
    assert m["overlap/streaming"] == 1.0 and m["memory/reward_rm2_kv_peak_mb"] > 0  # streamed to both
    assert m["reward/rm2/mean"] == pytest.approx(m["reward/rm/mean"], abs=1e-5)
    assert m["reward/mean"] == pytest.approx(-m["reward/rm/mean"], abs=1e-5)


# ---------------------------------------------------------------------- the GSM8K recipes

def _kwargs_support() -> bool:
    """Whether reward functions get data set columns by their parameters' names (math_accuracy's
    ``answer``): helper change 'objects', merged separately."""
    import importlib.util

    return importlib.util.find_spec("oppo.scoring.reward_fn") is not None


@pytest.mark.parametrize("name", ["gsm8k_ppo", "gsm8k_grpo"])
def test_gsm8k_recipe_trains_a_step_on_stand_ins(name, tiny_models, tmp_path):
    path = RECIPES / f"{name}.yaml"
    head = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert any("openai/gsm8k" in line for line in head) and any("GB" in line for line in head)
    raw = yaml.safe_load(path.read_text())
    # stand-ins: the tiny policy (with a chat template) and its tokenizer for the length term, a tiny
    # GSM8K-shaped file; every other setting is the recipe's
    policy = tmp_path / "policy"
    import shutil

    shutil.copytree(tiny_models["policy"], policy)
    tok_cfg = policy / "tokenizer_config.json"
    tok_cfg.write_text(json.dumps({**json.loads(tok_cfg.read_text()),
                                   "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    terms = raw["reward"]["terms"]
    for t in terms:
        if "tokenizer" in t.get("kwargs", {}):
            t["kwargs"]["tokenizer"] = str(policy)
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in [
        ("the film was good", "it was\n#### 3"), ("a day", "#### 1,000"), ("i liked the book", "#### 7"),
        ("we hated it but", "#### 0")]))
    cfg = oppo.load_config(path, [f"policy.path={policy}", f"data.prompts={data}", f"reward.terms={json.dumps(terms)}",
                                  "ppo.batch_size=8", "ppo.minibatch_size=8", "ppo.micro_batch_size=4",
                                  "generation.max_new_tokens=6", "data.max_prompt_tokens=16", "placement.threads=1",
                                  "overlap.mode=sequential", "run.steps=1", "run.samples=0", "log.progress=false",
                                  f"run.out_dir={tmp_path / 'run'}"])
    assert cfg.algo.name == name.split("_")[1] and cfg.data.field == "question"
    if not _kwargs_support():
        pytest.skip("math_accuracy reads the data set's answer column: reward functions get columns by "
                    "parameter name once the change that passes them (scoring/reward_fn.py) is merged")
    trainer = oppo.Trainer.from_config(cfg, progress=False)
    try:
        m = trainer.run_step()
    finally:
        trainer.close()
    assert {"reward/math_accuracy/mean", "reward/boxed_format/mean", "reward/length_penalty/mean"} <= set(m)
    assert math.isfinite(m["reward/mean"]) and math.isfinite(m["loss/policy"])


def test_reward_path_and_function_are_one_term_composites():
    """``reward.path`` / ``reward.function`` are a composite of one term (``scoring.composite.one_term``):
    their scores pass through unchanged (no sum is taken) and no term mean is reported."""
    from oppo.scoring.composite import one_term

    model = one_term(path="my-rm")
    assert model.model_roles == ("reward",)
    assert model(["p"] * 2, ["a", "b"], {"reward": [-0.0, 0.25]}) == ([-0.0, 0.25], {})
    fn = one_term(function="m:f", fn=lambda prompts, responses, **kw: [float(len(r)) for r in responses])
    assert fn.model_roles == () and fn(["p"], ["abc"], {}, step=0) == ([3.0], {})
    assert isinstance(model, CompositeReward) and isinstance(fn, CompositeReward)


def test_a_term_in_a_file_named_after_it_is_not_shadowed_by_its_module(monkeypatch):
    """A built-in term defined in ``rewards/<name>.py`` as ``<name>``: once that module is imported,
    the package attribute ``oppo.rewards.<name>`` is the module, so resolving ``oppo.rewards:<name>``
    by attribute would hand the scorer a module. It resolves through the registry instead."""
    import types

    import oppo.rewards as rewards_pkg
    from oppo.models import load_function
    from oppo.parts import REWARD_TERMS
    from oppo.rewards import RewardTermSpec, function_spec

    def constant(prompts, responses, **_):
        return [1.0] * len(responses)

    module = types.ModuleType("oppo.rewards.constant")
    module.constant = constant
    monkeypatch.setattr(rewards_pkg, "constant", module, raising=False)  # what `import oppo.rewards.constant` does
    REWARD_TERMS.register(RewardTermSpec("constant", "always 1", constant))
    try:
        fn = load_function(function_spec("constant"))
        assert fn is constant and fn(["p"], ["r", "s"]) == [1.0, 1.0]
        with pytest.raises(oppo.models.ModelLoadError, match="no reward term 'nope'.*registered"):
            load_function("oppo.rewards:nope")
    finally:
        REWARD_TERMS.unregister("constant")
