"""Issue 28, items 5, 10, 11, 13: every entry point (the CLI, ``oppo.train(cfg)``, ``Trainer.from_config(cfg)``)
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
from conftest import make_models
from test_bad_inputs import TINY, make_cfg
from oppo import cli
from oppo.checkpoint import load_checkpoint
from oppo.config import ConfigError, load_config
from oppo.models import ModelLoadError, load_tokenizer
from oppo.setup.preflight import PreflightError
from test_preflight import input_problems
from oppo.scoring.streaming import RewardFunction
from oppo.trainer import Trainer
from validated import load_valid



@pytest.fixture
def nothing_built(nothing_loads, monkeypatch):
    """``nothing_loads``, and no roles built either: validation must come before ``build_roles``."""
    monkeypatch.setattr("oppo.setup.build.build_roles", nothing_loads)
    monkeypatch.setattr("oppo.trainer.build_roles", nothing_loads)


# --------------------------------------------------------------------------- 5: one validation

SET_IN_CODE = [("ppo", "minibatch_size", 3, "minibatch_size"),
               ("overlap", "mode", "bogus", "overlap.mode"),
               ("lora", "dropout", 0.1, "lora.dropout")]


@pytest.mark.parametrize("entry", ["Trainer", "oppo.train"])
@pytest.mark.parametrize("section,name,value,named", SET_IN_CODE)
def test_python_entry_points_validate_settings_made_in_code(tiny_models, tiny_prompts, tmp_path, nothing_built,
                                                            section, name, value, named, entry):
    cfg = make_cfg(tiny_models, tiny_prompts, tmp_path)
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError, match=named):
        Trainer.from_config(cfg, progress=False) if entry == "Trainer" else oppo.train(cfg, progress=False)
    assert not (tmp_path / "run").exists()  # nothing written (no config.yaml with mode: bogus)


# --------------------------------------------------------------------------- 10: the output directory

def _unusable_out_dirs(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    return {"file": f, "under_file": f / "run"}


@pytest.mark.parametrize("which", ["file", "under_file"])
def test_unusable_out_dir_is_a_preflight_problem(tiny_models, tiny_prompts, tmp_path, nothing_built, which):
    out = _unusable_out_dirs(tmp_path)[which]
    cfg = make_cfg(tiny_models, tiny_prompts, tmp_path, **{"run.out_dir": out})
    with pytest.raises(PreflightError) as info:
        oppo.train(cfg, progress=False)
    msg = str(info.value)
    assert "run.out_dir" in msg and str(tmp_path / "a_file") in msg and "a file" in msg


def test_unusable_out_dir_cli_exit_2(tiny_models, tiny_prompts, tmp_path, nothing_built, capsys):
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


@pytest.mark.parametrize("typo,want", [("ppo.learning_rate", ["ppo.actor_lr=1e-5", "ppo.critic_lr=1e-5"]),
                                       ("ppo.lr", ["'ppo.actor_lr'"]), ("ppo.critic_learning_rate", ["'ppo.critic_lr'"])])
def test_unknown_key_suggests_the_learning_rate(typo, want):
    """A typo gets the nearest setting; TRL's learning_rate, which sets both, gets both (issue 45)."""
    with pytest.raises(ConfigError) as info:
        load_valid(None, [f"{typo}=1e-5"])
    assert all(w in str(info.value) for w in want), str(info.value)
