"""Issue 28, items 5, 10, 11, 13: every entry point (the CLI, ``oppo.train(cfg)``, ``Trainer(cfg)``)
validates the same way before any model loads, the output directory included; a resume onto a
model of another shape, a corrupt config.json, a non-callable reward target, numpy rewards and a
mistyped setting each get a clear message. Error paths: each test fails before a model loads."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

import oppo
import oppo.setup
from conftest import make_models
from oppo import cli
from oppo.checkpoint import load_checkpoint
from oppo.config import ConfigError, load_config
from oppo.models import ModelLoadError, load_tokenizer
from oppo.preflight import PreflightError, input_problems
from oppo.scoring import RewardFunction
from oppo.trainer import Trainer

TINY = ["ppo.batch_size=2", "ppo.minibatch_size=2", "ppo.micro_batch_size=1", "generation.max_new_tokens=4",
        "overlap.mode=sequential", "run.threads=1", "log.progress=false", "log.trace=false"]


def make_cfg(tiny_models, tiny_prompts, tmp_path, **settings):
    s = {"policy.path": tiny_models["policy"], "reward.path": tiny_models["reward"], "data.prompts": tiny_prompts,
         "run.out_dir": tmp_path / "run"}
    s.update(settings)
    return load_config(None, TINY + [f"{k}={v}" for k, v in s.items() if v is not None])


@pytest.fixture
def nothing_loads(monkeypatch):
    """Every expensive loader fails loudly: the error under test must come first."""
    def boom(*a, **k):
        raise AssertionError("something was loaded before the bad input was reported")

    for name in ("load_tokenizer", "read_prompts", "load_reward_model", "load_causal_lm", "load_critic",
                 "load_function", "build_roles"):
        if hasattr(oppo.setup, name):
            monkeypatch.setattr(oppo.setup, name, boom)
    monkeypatch.setattr("oppo.trainer.build_roles", boom)


# --------------------------------------------------------------------------- 5: one validation

SET_IN_CODE = [("ppo", "minibatch_size", 3, "minibatch_size"),
               ("overlap", "mode", "bogus", "overlap.mode"),
               ("lora", "dropout", 0.1, "lora.dropout")]


@pytest.mark.parametrize("section,name,value,named", SET_IN_CODE)
def test_trainer_validates_settings_made_in_code(tiny_models, tiny_prompts, tmp_path, nothing_loads,
                                                 section, name, value, named):
    cfg = make_cfg(tiny_models, tiny_prompts, tmp_path)
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError, match=named):
        Trainer(cfg, progress=False)


@pytest.mark.parametrize("section,name,value,named", SET_IN_CODE)
def test_train_validates_settings_made_in_code(tiny_models, tiny_prompts, tmp_path, nothing_loads,
                                               section, name, value, named):
    cfg = make_cfg(tiny_models, tiny_prompts, tmp_path)
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError, match=named):
        oppo.train(cfg, progress=False)
    assert not (tmp_path / "run").exists()  # nothing written (no config.yaml with mode: bogus)


# --------------------------------------------------------------------------- 10: the output directory

def _unusable_out_dirs(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    return {"file": f, "under_file": f / "run"}


@pytest.mark.parametrize("which", ["file", "under_file"])
def test_unusable_out_dir_is_a_preflight_problem(tiny_models, tiny_prompts, tmp_path, nothing_loads, which):
    out = _unusable_out_dirs(tmp_path)[which]
    cfg = make_cfg(tiny_models, tiny_prompts, tmp_path, **{"run.out_dir": out})
    with pytest.raises(PreflightError) as info:
        oppo.train(cfg, progress=False)
    msg = str(info.value)
    assert "run.out_dir" in msg and str(tmp_path / "a_file") in msg and "a file" in msg


def test_unusable_out_dir_cli_exit_2(tiny_models, tiny_prompts, tmp_path, nothing_loads, capsys):
    out = _unusable_out_dirs(tmp_path)["under_file"]
    code = cli.main(["train", *TINY, f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
                     f"data.prompts={tiny_prompts}", f"run.out_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2 and "run.out_dir" in err and "Traceback" not in err


# --------------------------------------------------------------------------- 11: resume onto another shape

class _Stub:
    def __init__(self, models):
        self._models = models

    def models(self):
        return self._models


def test_resume_onto_another_shape_names_parameter_and_shapes(tmp_path):
    from transformers import AutoModelForCausalLM

    small = make_models(tmp_path / "small", hidden=16)
    big = make_models(tmp_path / "big", hidden=32)
    ckpt = tmp_path / "ckpt" / "step_3"
    ckpt.mkdir(parents=True)
    shutil.copytree(small["policy"], ckpt / "policy")
    (ckpt / "state.json").write_text(json.dumps({"step": 3}))
    model = AutoModelForCausalLM.from_pretrained(big["policy"])
    with pytest.raises(ModelLoadError) as info:  # not wrapped: no "earlier checkpoint" advice (same shape there)
        load_checkpoint(_Stub({"policy": model}), ckpt)
    msg = str(info.value)
    assert str(ckpt / "policy") in msg and "model.embed_tokens.weight" in msg
    assert re.search(r"\[\d+, 16\] there and \[\d+, 32\] here", msg) and "without --resume" in msg
    assert len(msg.splitlines()) == 1 and "size mismatch" not in msg


# --------------------------------------------------------------------------- 13: misleading messages

def test_corrupt_policy_config_json_is_named(tiny_models, tiny_prompts, tmp_path):
    d = tmp_path / "policy"
    shutil.copytree(tiny_models["policy"], d)
    (d / "config.json").write_text('{"model_type": "llama", ')
    cfg = make_cfg(tiny_models, tiny_prompts, tmp_path, **{"policy.path": d})
    found = " ".join(input_problems(cfg))
    assert "config.json" in found and "tokenizer" not in found
    with pytest.raises(ModelLoadError) as info:
        load_tokenizer(str(d))
    assert "config.json" in str(info.value) and "tokenizer" not in str(info.value).split(":")[0]


def test_non_callable_reward_target(tiny_models, tiny_prompts, tmp_path, monkeypatch):
    (tmp_path / "oppo_test_not_callable.py").write_text("score = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = make_cfg(tiny_models, tiny_prompts, tmp_path, **{"reward.path": None,
                                                           "reward.function": "oppo_test_not_callable:score"})
    msg = " ".join(input_problems(cfg))
    assert "not callable" in msg and "int" in msg and "has no function" not in msg


def test_numpy_rewards_are_numbers():
    fn = RewardFunction(lambda ps, rs: [np.float32(0.5), np.int64(2)], "mod:fn")
    assert fn(["a", "b"], ["x", "y"]) == [0.5, 2.0]
    with pytest.raises(ValueError, match="finite"):
        RewardFunction(lambda ps, rs: [np.float32("nan")], "mod:fn")(["a"], ["x"])


@pytest.mark.parametrize("typo,want", [("ppo.learning_rate", "ppo.actor_lr"), ("ppo.lr", "ppo.actor_lr"),
                                       ("ppo.critic_learning_rate", "ppo.critic_lr")])
def test_unknown_key_suggests_the_learning_rate(typo, want):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{typo}=1e-5"])
    assert f"'{want}'" in str(info.value)
