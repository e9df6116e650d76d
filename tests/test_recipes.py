"""The shipped recipes (src/oppo/recipes/*.yaml): each loads, is listed with its description, and
trains one step with its own settings, its models and prompts swapped for tiny local stand-ins
(the real ones are hub names this machine cannot download)."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import pytest
import yaml

import oppo
from oppo import cli, recipes
from oppo.config import ConfigError

NAMES = recipes.names()
MODEL_KEYS = ("policy.path", "reference.path", "critic.path", "reward.path")
# recipes whose stand-ins need more than tiny models and a prompt column (a data set's answer
# column, a tokenizer named in a reward term's arguments): each is trained one step on stand-ins
# in the test file named here
TRAINED_ELSEWHERE = {"gsm8k_ppo": "tests/test_rewards.py", "gsm8k_grpo": "tests/test_rewards.py"}
# recipes whose data set's prompt column holds conversations (lists of messages: TRL's conversational format)
CONVERSATIONAL = {"hh": "trl-lib/hh-rlhf-helpful-base"}


def test_there_are_recipes_and_each_says_what_it_is():
    assert {"tldr", "hh"} <= set(NAMES)
    for name in NAMES:
        text = recipes.find(name).read_text()
        assert text.startswith("#") and recipes.description(name), name
        head = "\n".join(l for l in text.splitlines() if l.startswith("#"))
        assert "GB" in head and "estimate" in head, f"{name}: the leading comments name the GPU memory it was sized for"


def test_listing_names_every_yaml_in_the_folder(tmp_path, monkeypatch, capsys):
    for p in recipes.DIR.glob("*.yaml"):
        shutil.copy(p, tmp_path / p.name)
    (tmp_path / "extra.yaml").write_text("# An extra recipe, for this test.\nppo:\n  epochs: 2\n")
    monkeypatch.setattr(recipes, "DIR", tmp_path)
    assert cli.main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in [*NAMES, "extra"]:
        assert any(l.split()[:1] == [name] and recipes.description(name) in l for l in lines), (name, lines)
    assert cli.main(["train", "--recipe", "list"]) == 0
    assert "extra" in capsys.readouterr().out
    assert oppo.load_config(recipe="extra").ppo.epochs == 2


def test_unknown_recipe_is_one_line_naming_the_known_ones(capsys, nothing_loads):
    assert cli.main(["train", "--recipe", "nope", "run.steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'nope'" in err[0]
    assert all(name in err[0] for name in NAMES)


def test_config_file_and_overrides_apply_on_top_of_the_recipe(tmp_path):
    user = tmp_path / "mine.yaml"
    user.write_text("ppo:\n  epochs: 2\n  actor_lr: 1.0e-6\n")
    cfg = oppo.load_config(user, ["ppo.actor_lr=2e-6"], recipe="tldr")
    assert cfg.policy.path == "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr"  # from the recipe
    assert cfg.generation.max_new_tokens == 53
    assert cfg.ppo.epochs == 2 and cfg.ppo.actor_lr == 2e-6  # the file over the recipe, the command line over both
    with pytest.raises(ConfigError, match="ppo.epochs"):
        oppo.config.validate(oppo.load_config(overrides=["ppo.epochs=0"], recipe="tldr"))  # the recipe's settings are validated too


def _stand_ins(name: str, tiny_models, tmp_path) -> list[str]:
    """Overrides that point the recipe's models and prompts at tiny local ones, and shrink the step;
    every other setting stays the recipe's, but the overlap mode: sequential needs no scorer process
    (0.3 s a step here, against 9-11 s with the child process's start-up), and the modes are
    tested against each other elsewhere."""
    raw = yaml.safe_load(recipes.find(name).read_text()) or {}
    cfg = oppo.load_config(recipe=name)
    policy = tiny_models["policy"]
    if cfg.data.chat_template:  # the tiny tokenizer has none: give a copy one
        policy = tmp_path / "policy"
        shutil.copytree(tiny_models["policy"], policy)
        tok_cfg = policy / "tokenizer_config.json"
        data = json.loads(tok_cfg.read_text())
        data["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        tok_cfg.write_text(json.dumps(data))
    tiny = {"policy.path": policy, "reference.path": policy, "critic.path": tiny_models["reward"],
            "reward.path": tiny_models["reward"]}
    set_keys = {f"{s}.{k}" for s, v in raw.items() if isinstance(v, dict) for k in v}
    out = [f"{k}={tiny[k]}" for k in MODEL_KEYS if k in set_keys or k == "policy.path"]
    prompts = tmp_path / "prompts.jsonl"
    texts = ("the film was", "i liked the book", "a day", "we hated it but")
    if name in CONVERSATIONAL:  # the recipe's data set holds conversations: so do its stand-in's prompts
        rows = [[{"role": "user", "content": t}, {"role": "assistant", "content": "good"},
                 {"role": "user", "content": "and then"}] for t in texts]
    else:
        rows = list(texts)
    prompts.write_text("".join(json.dumps({cfg.data.field: r}) + "\n" for r in rows))
    g = cfg.group_size
    batch = 2 * g if g > 1 else 4
    out += [f"data.prompts={prompts}", f"ppo.batch_size={batch}", f"ppo.minibatch_size={batch}",
            f"ppo.micro_batch_size={min(batch, 4)}", "generation.max_new_tokens=6", "ppo.epochs=1",
            "placement.threads=1", "overlap.mode=sequential", "run.steps=1", "run.samples=0", "log.progress=false",
            f"run.out_dir={tmp_path / 'run'}", "data.max_prompt_tokens=16"]
    return out


@pytest.mark.parametrize("name", NAMES)
def test_recipe_trains_a_step_on_stand_ins(name, tiny_models, tmp_path):
    if name in TRAINED_ELSEWHERE:
        other = Path(__file__).resolve().parents[1] / TRAINED_ELSEWHERE[name]
        assert other.is_file() and f'"{name}"' in other.read_text(), f"{name}: no test trains it"
        assert oppo.load_config(recipe=name).policy.path  # it loads; the other file trains it
        return
    overrides = _stand_ins(name, tiny_models, tmp_path)
    cfg = oppo.load_config(overrides=overrides, recipe=name)
    recipe = oppo.load_config(recipe=name)
    # the recipe's own choices survive: algorithm, mode, sampling, loss settings
    for key in ("algo.name", "generation.temperature", "ppo.kl_coef", "ppo.missing_eos_penalty",
                "reward.function", "data.field", "data.chat_template"):
        section, leaf = key.split(".")
        assert getattr(getattr(cfg, section), leaf) == getattr(getattr(recipe, section), leaf), key
    t0 = time.perf_counter()
    trainer = oppo.Trainer.from_config(cfg, progress=False)
    try:
        metrics = trainer.run_step()
        if name in CONVERSATIONAL:
            assert recipe.data.prompts == CONVERSATIONAL[name]
            ps = trainer.roles.prompt_set  # every turn went through the chat template
            assert ps.templated and all(t.count(" ") >= 3 and "and then" in t for t in ps.texts)
    finally:
        trainer.close()
    print(f"recipe {name}: load + 1 step {time.perf_counter() - t0:.1f}s")
    assert trainer.step == 1
    assert math.isfinite(metrics["reward/mean"]) and math.isfinite(metrics["loss/policy"])


def test_print_config_prints_the_resolved_settings_as_a_config_file(tmp_path, capsys, nothing_loads):
    """--print-config: the recipe, then --config, then the overrides, as a YAML file that --config
    takes back to the same settings; nothing is trained."""
    user = tmp_path / "mine.yaml"
    user.write_text("ppo:\n  epochs: 2\n")
    assert cli.main(["train", "--recipe", "tldr", "--config", str(user), "ppo.actor_lr=2e-6", "--print-config"]) == 0
    printed = capsys.readouterr().out
    d = yaml.safe_load(printed)
    assert d["policy"]["path"] == "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr"  # the recipe
    assert d["ppo"]["epochs"] == 2 and d["ppo"]["actor_lr"] == 2e-6  # the file, the command line
    assert d["generation"]["max_new_tokens"] == 53
    again = tmp_path / "printed.yaml"
    again.write_text(printed)
    from oppo.config import to_dict

    assert to_dict(oppo.load_config(again)) == to_dict(oppo.load_config(user, ["ppo.actor_lr=2e-6"], recipe="tldr"))
    assert not (tmp_path / "runs").exists()


def test_recipe_help_shows_the_recipes_values(capsys):
    """oppo train --recipe X --help: each setting with the recipe's value, marked where it is not the
    default; without --recipe, the defaults, unmarked."""
    recipe = oppo.load_config(recipe="hh")
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--recipe", "hh", "--help"])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    line = next(l for l in lines if l.strip().startswith("policy.path ="))
    assert repr(recipe.policy.path) in line and "<- recipe 'hh'" in line and "default: None" in line
    line = next(l for l in lines if l.strip().startswith("ppo.epochs ="))
    assert f"= {recipe.ppo.epochs}" in line and "<- recipe 'hh'" in line
    line = next(l for l in lines if l.strip().startswith("ppo.clip_eps ="))  # not set by the recipe
    assert "<-" not in line
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    plain = capsys.readouterr().out
    assert "<- recipe" not in plain and "policy.path = (empty)" in plain
