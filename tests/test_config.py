"""Tests for oppo.config: defaults, YAML + overrides, coercion, validation messages, help, CLI."""

from __future__ import annotations

import pytest

from oppo import cli
from oppo.config import TASK_PRESETS, Config, ConfigError, all_keys, from_dict, help_text, load_config, to_dict, validate
from validated import load_valid


def _error(overrides, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_valid(path, overrides)
    return str(info.value)


# --------------------------------------------------------------------------- defaults, file, overrides

def test_defaults_validate():
    cfg = Config()
    validate(cfg)
    assert cfg.uses_builtin_task and cfg.streams and cfg.carries
    # with no models named, the built-in task's preset fills the keys the user did not set
    loaded = load_config()
    assert loaded.ppo.actor_lr == TASK_PRESETS["positive"]["ppo.actor_lr"] != cfg.ppo.actor_lr
    assert load_config(None, ["ppo.actor_lr=3e-6"]).ppo.actor_lr == 3e-6
    # a user's own models never get the preset
    own = load_config(None, ["policy.path=/m", "reward.path=/r"])
    assert own.ppo.actor_lr == cfg.ppo.actor_lr and own.run.steps == cfg.run.steps


def test_round_trip_through_dict():
    cfg = load_config(None, ["ppo.actor_lr=2e-6", "overlap.chunk_candidates=[4, 8]", "data.field=text"])
    assert from_dict(to_dict(cfg)) == cfg


def test_yaml_file_and_overrides(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("ppo:\n  batch_size: 16\n  minibatch_size: 8\n  actor_lr: 3.0e-6\n"
                 "overlap:\n  mode: intra\ndata:\n  field: text\n")
    cfg = load_config(p)
    assert (cfg.ppo.batch_size, cfg.ppo.minibatch_size, cfg.ppo.actor_lr) == (16, 8, 3e-6)
    assert cfg.overlap.mode == "intra" and cfg.data.field == "text"
    assert cfg.ppo.micro_batch_size == 8  # untouched default
    cfg = load_config(p, ["ppo.batch_size=32", "overlap.mode=sequential"])
    assert cfg.ppo.batch_size == 32 and cfg.overlap.mode == "sequential"  # override wins over the file
    assert cfg.ppo.minibatch_size == 8 and cfg.data.field == "text"  # the rest of the file still applies


def _write(p, text):
    p.write_text(text)
    return p


def test_empty_yaml_file_is_defaults(tmp_path):
    assert load_config(_write(tmp_path / "empty.yaml", "")) == load_config()


def test_unknown_key_in_file_names_the_file(tmp_path):
    p = _write(tmp_path / "bad.yaml", "ppo:\n  actor_lrr: 1.0e-6\n")
    msg = _error([], path=p)
    assert "ppo.actor_lrr" in msg and str(p) in msg and "'ppo.actor_lr'" in msg


# --------------------------------------------------------------------------- coercion

def test_int_float_bool_coercion():
    cfg = load_config(None, ["ppo.epochs=3", "ppo.actor_lr=1e-6", "ppo.critic_lr=2.5E-5", "ppo.kl_coef=0",
                             "data.shuffle=false", "log.trace=no", "log.tensorboard=True"])
    assert cfg.ppo.epochs == 3 and type(cfg.ppo.epochs) is int
    assert cfg.ppo.actor_lr == 1e-6 and type(cfg.ppo.actor_lr) is float  # YAML reads '1e-6' as a string
    assert cfg.ppo.critic_lr == 2.5e-5
    assert cfg.ppo.kl_coef == 0.0 and type(cfg.ppo.kl_coef) is float
    assert cfg.data.shuffle is False and cfg.log.trace is False and cfg.log.tensorboard is True


def test_optional_none_and_empty():
    cfg = load_config(None, ["ppo.clip_eps_high=0.3", "ppo.value_clip_eps=", "ppo.is_truncate=None",
                             "generation.max_new_tokens=null"])
    assert cfg.ppo.clip_eps_high == 0.3
    assert cfg.ppo.value_clip_eps is None and cfg.ppo.is_truncate is None and cfg.generation.max_new_tokens is None
    cfg = load_config(None, ["generation.max_new_tokens=12", "reward.judge="])
    assert cfg.generation.max_new_tokens == 12 and cfg.reward.judge is None


def test_list_coercion():
    assert load_config(None, ["overlap.chunk_candidates=[4, 8]"]).overlap.chunk_candidates == [4, 8]
    assert load_config(None, ["overlap.chunk_candidates=2,4,6"]).overlap.chunk_candidates == [2, 4, 6]
    assert load_config(None, ["overlap.chunk_candidates=[16]"]).overlap.chunk_candidates == [16]
    assert "overlap.chunk_candidates" in _error(["overlap.chunk_candidates=[]"])
    assert "overlap.chunk_candidates" in _error(["overlap.chunk_candidates=[4, x]"])


def test_defaults_are_not_shared_between_configs():
    a, b = Config(), Config()
    a.overlap.chunk_candidates.append(64)
    assert b.overlap.chunk_candidates == [16, 0, 8, 32]


def test_text_settings_keep_their_text():
    # YAML would read these as True / 493 / a parse error; a text setting keeps what was typed.
    cfg = load_config(None, ["data.split=on", "data.field=yes", "data.prompts=@prompts.jsonl"])
    assert (cfg.data.split, cfg.data.field, cfg.data.prompts) == ("on", "yes", "@prompts.jsonl")
    cfg = load_config(None, ["policy.path=0755", "reward.function=mod:fn", "data.prompts=p.jsonl"])
    assert cfg.policy.path == "0755" and cfg.reward.function == "mod:fn"
    assert load_config(None, ['data.field="my field"']).data.field == "my field"  # quotes still unquote


def test_empty_required_text_is_an_error():
    msg = _error(["data.field="])
    assert "data.field" in msg and "empty" in msg


@pytest.mark.parametrize("override, expected", [
    ("ppo.batch_size=abc", "expected an integer"),
    ("ppo.batch_size=1.5", "expected an integer"),
    ("ppo.batch_size=true", "expected an integer"),
    ("ppo.actor_lr=fast", "expected a number"),
    ("data.shuffle=maybe", "expected true or false"),
    ("data.field=[a, b]", None),  # text setting: kept as text, no error
])
def test_wrong_type_names_the_key(override, expected):
    key = override.split("=")[0]
    if expected is None:
        load_config(None, [override])
        return
    msg = _error([override])
    assert msg.startswith(key) and expected in msg


def test_unparseable_value_is_a_config_error():
    msg = _error(["ppo.batch_size=[1"])
    assert "ppo.batch_size" in msg and "parse" in msg


def test_override_without_equals():
    assert "section.key=value" in _error(["ppo.batch_size"])


# --------------------------------------------------------------------------- unknown keys

@pytest.mark.parametrize("key, suggestion", [
    ("ppo.actor_lrr", "ppo.actor_lr"),
    ("ppo.lr", "ppo.actor_lr"),
    ("ppo.batchsize", "ppo.batch_size"),
    ("ppoo.batch_size", "ppo.batch_size"),
    ("run.seeds", "run.seed"),
    ("overlap.modes", "overlap.mode"),
])
def test_unknown_key_suggests_closest(key, suggestion):
    msg = _error([f"{key}=1"])
    assert f"Unknown setting '{key}'" in msg
    assert f"Did you mean '{suggestion}'?" in msg
    assert "--help" in msg


def test_unknown_section():
    msg = _error(["optimizer.momentum=0.9"])
    assert "Unknown setting 'optimizer.momentum'" in msg and "--help" in msg
    assert "Did you mean" not in msg  # nothing close: no made-up suggestion
    assert "Unknown setting 'ppo'" in _error(["ppo=1"])
    assert "Unknown setting 'ppo.batch_size.x'" in _error(["ppo.batch_size.x=1"])


def test_unknown_section_in_file(tmp_path):
    msg = _error([], path=_write(tmp_path / "c.yaml", "optimiser:\n  lr: 1\n"))
    assert "optimiser.lr" in msg


# --------------------------------------------------------------------------- validation

def test_invalid_choice_lists_choices():
    msg = _error(["overlap.mode=fast"])
    assert "overlap.mode='fast'" in msg
    for mode in ("sequential", "intra", "inter", "oppo"):
        assert mode in msg
    msg = _error(["data.on_long_prompt=drop"])
    assert "truncate" in msg and "skip" in msg


def test_batch_not_multiple_of_minibatch():
    msg = _error(["ppo.batch_size=10", "ppo.minibatch_size=4", "ppo.micro_batch_size=4"])
    assert "ppo.batch_size=10" in msg and "ppo.minibatch_size=4" in msg
    assert "divisor of 10" in msg  # the fix


def test_minibatch_not_multiple_of_micro_batch():
    msg = _error(["ppo.batch_size=8", "ppo.minibatch_size=4", "ppo.micro_batch_size=3"])
    assert "ppo.minibatch_size=4" in msg and "ppo.micro_batch_size=3" in msg
    assert "divisor of 4" in msg


@pytest.mark.parametrize("key", ["ppo.batch_size", "ppo.minibatch_size", "ppo.micro_batch_size"])
def test_zero_sizes(key):
    assert key in _error([f"{key}=0"])


def test_delta_larger_than_batch_in_carry_modes():
    base = ["ppo.batch_size=4", "ppo.minibatch_size=4", "ppo.micro_batch_size=2"]
    for mode in ("inter", "oppo"):
        msg = _error(base + [f"overlap.mode={mode}", "overlap.delta=5"])
        assert "ppo.batch_size=4" in msg and "overlap.delta" in msg
    # adaptive Delta: its bounds are capped at B (a derived size), so a small batch needs no edits
    assert load_config(None, base + ["overlap.mode=oppo", "overlap.delta_max=6"]).overlap.delta_max == 6
    # modes that never carry ignore Delta
    for mode in ("sequential", "intra"):
        assert load_config(None, base + [f"overlap.mode={mode}", "overlap.delta=5"]).overlap.delta == 5


def test_max_lag_zero_needs_zero_delta():
    msg = _error(["overlap.max_lag=0", "overlap.delta=2"])
    assert "overlap.max_lag=0" in msg and "overlap.delta=0" in msg
    assert "overlap.max_lag" in _error(["overlap.max_lag=0"])  # adaptive Delta with delta_max=8 > 0
    cfg = load_config(None, ["overlap.max_lag=0", "overlap.delta=0"])
    assert cfg.overlap.max_lag == 0
    load_config(None, ["overlap.max_lag=0", "overlap.delta_init=0", "overlap.delta_max=0"])


def test_delta_bounds_must_be_non_negative():
    assert "must be >= 0" in _error(["overlap.delta_min=-1"])


def test_adaptive_delta_bounds_are_capped_at_the_batch(tiny_models, tiny_prompts, tmp_path):
    from oppo.trainer import Trainer

    cfg = load_config(None, [f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
                             f"data.prompts={tiny_prompts}", "ppo.batch_size=4", "ppo.minibatch_size=4",
                             "ppo.micro_batch_size=4", "overlap.mode=inter", "overlap.delta_min=6",
                             "overlap.delta_init=9", "overlap.delta_max=20", f"run.out_dir={tmp_path}",
                             "overlap.delta_rule=reward_slope", "generation.max_new_tokens=8"])  # (256 positions)
    t = Trainer.from_config(cfg, progress=False)
    c = t.loop.scheduler.controller
    assert (c.delta_min, c.delta, c.delta_max) == (4, 4, 4)
    t.close()
    cfg.overlap.delta_rule, cfg.overlap.delta_max = "cost", 3  # the cost rule's levels, within the same caps
    t = Trainer.from_config(cfg, progress=False)
    assert t.loop.tuner.deltas == (3,) and t.loop.scheduler.delta == 3
    t.close()


def test_reward_path_and_function_both_set():
    msg = _error(["reward.path=rm", "reward.function=mod:fn"])
    assert "reward.path" in msg and "reward.function" in msg and "not both" in msg


def test_policy_without_reward():
    msg = _error(["policy.path=some/dir"])
    assert "policy.path" in msg and "reward.path" in msg and "reward.function" in msg
    load_config(None, ["policy.path=some/dir", "reward.path=rm/dir"])
    load_config(None, ["policy.path=some/dir", "reward.function=mod:fn"])


def test_lora_dropout_is_refused_with_the_fix():
    """Issue 22 item 4: every model runs in eval mode, so a LoRA dropout would silently do nothing."""
    msg = _error(["lora.r=4", "lora.dropout=0.1"])
    assert "lora.dropout=0.1" in msg and "eval mode" in msg and "Set lora.dropout=0" in msg
    load_config(None, ["lora.r=4", "lora.dropout=0"])


@pytest.mark.parametrize("override", ["reward.retries=-1", "reward.retry_backoff_s=-0.5"])
def test_reward_retry_settings_are_validated(override):
    assert override.split("=")[0] in _error([override])
    load_config(None, ["reward.retries=3", "reward.retry_backoff_s=0.5"])


@pytest.mark.parametrize("spec", ["nocolon", ":fn", "mod:"])
def test_malformed_reward_function(spec):
    msg = _error([f"reward.function={spec}"])
    assert f"reward.function={spec!r}" in msg and "module:function" in msg


def test_malformed_judge():
    assert "reward.judge" in _error(["reward.judge=nocolon"])


@pytest.mark.parametrize("key", ["policy.device", "reference.device", "critic.device", "reward.device"])
def test_bad_device(key):
    msg = _error([f"{key}=gpu"])
    assert f"{key}='gpu'" in msg and "cuda:N" in msg


def test_good_devices():
    cfg = load_config(None, ["policy.device=cpu", "reward.device=cuda:1", "critic.device=cuda", "reference.device=auto"])
    assert cfg.reward.device == "cuda:1"


@pytest.mark.parametrize("override, key", [
    ("generation.temperature=0", "generation.temperature"),
    ("generation.top_p=0", "generation.top_p"),
    ("generation.top_k=-1", "generation.top_k"),
    ("generation.max_new_tokens=0", "generation.max_new_tokens"),
    ("ppo.clip_eps=1.5", "ppo.clip_eps"),
    ("ppo.kl_coef=-1", "ppo.kl_coef"),
    ("ppo.epochs=0", "ppo.epochs"),
    ("ppo.is_truncate=0.5", "ppo.is_truncate"),
    ("data.max_prompt_tokens=0", "data.max_prompt_tokens"),
    ("run.keep_checkpoints=0", "run.keep_checkpoints"),
    ("overlap.chunk_size=-1", "overlap.chunk_size"),
    ("overlap.delta=-2", "overlap.delta"),
])
def test_other_ranges(override, key):
    assert key in _error([override])


def test_validate_does_not_change_values():
    cfg = Config()
    cfg.ppo.batch_size, cfg.ppo.minibatch_size = 12, 5
    with pytest.raises(ConfigError):
        validate(cfg)
    assert (cfg.ppo.batch_size, cfg.ppo.minibatch_size) == (12, 5)


# --------------------------------------------------------------------------- files

def test_missing_config_file(tmp_path):
    msg = _error([], path=tmp_path / "nope.yaml")
    assert "nope.yaml" in msg and "not found" in msg


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_yaml_not_a_mapping(tmp_path, text):
    p = _write(tmp_path / "list.yaml", text)
    msg = _error([], path=p)
    assert str(p) in msg and "mapping" in msg


def test_invalid_yaml(tmp_path):
    p = _write(tmp_path / "broken.yaml", "ppo: [1,\n")
    msg = _error([], path=p)
    assert str(p) in msg and "not valid YAML" in msg


# --------------------------------------------------------------------------- help and CLI

def test_help_text_lists_every_key():
    text = help_text()
    for key in all_keys():
        assert f"  {key} = " in text, key
    assert "[sequential|intra|inter|oppo|pipeline]" in text  # choices shown
    assert "ppo.actor_lr = 1e-05" in text


def test_cli_train_help(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--config" in out and "--resume" in out
    for key in all_keys():
        assert key in out, key


@pytest.fixture
def no_training(monkeypatch):
    """Fail loudly if anything past validation runs: the built-in task's preparation, the Trainer."""
    import oppo.setup.build
    import oppo.trainer

    def boom(*a, **k):
        raise AssertionError("a model was about to load before the config was validated")

    monkeypatch.setattr(oppo.trainer.Trainer, "__init__", boom)
    monkeypatch.setattr(oppo.setup.build, "prepared_task", boom)


def test_cli_invalid_value_exits_2_before_loading(no_training, capsys):
    assert cli.main(["train", "ppo.batch_size=0"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and "ppo.batch_size" in err


def test_cli_unknown_key_exits_2(no_training, capsys):
    assert cli.main(["train", "ppo.lr=1e-6"]) == 2
    err = capsys.readouterr().err
    assert "ppo.lr" in err and "ppo.actor_lr" in err


def test_cli_missing_config_file_exits_2(no_training, capsys, tmp_path):
    assert cli.main(["train", "--config", str(tmp_path / "x.yaml")]) == 2
    assert "x.yaml" in capsys.readouterr().err


def test_cli_valid_config_reaches_training(monkeypatch, capsys, tmp_path):
    import oppo.run

    seen = {}

    def fake_train(cfg, resume=None):
        seen["cfg"], seen["resume"] = cfg, resume
        return tmp_path

    monkeypatch.setattr(oppo.run, "train", fake_train)
    assert cli.main(["train", "--resume", "auto", "ppo.actor_lr=1e-6", "run.steps=3"]) == 0
    assert seen["cfg"].ppo.actor_lr == 1e-6 and seen["cfg"].run.steps == 3 and seen["resume"] == "auto"
    # (the run's summary is printed by train itself: tests/test_python_api.py, test_train_prints_the_runs_summary)


def test_cli_usage():
    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0
    assert cli.main(["frobnicate"]) == 2


# --------------------------------------------------------------------------- TRL's names, every unknown key

def test_every_unknown_key_is_reported_in_one_run_a_line_each(tmp_path):
    path = _write(tmp_path / "c.yaml", "ppo:\n  vf_coef: 0.1\n  batch_size: 8\ndata:\n  prompt_field: text\n")
    msg = _error(["ppo.num_mini_batches=4", "run.seeds=1", "ppo.minibatch_size=4"], path=path)
    lines = msg.splitlines()
    assert len(lines) == 4, msg
    for key, line in zip(("ppo.vf_coef", "data.prompt_field", "ppo.num_mini_batches", "run.seeds"), lines):
        assert line.startswith(f"Unknown setting '{key}'"), msg
    assert "c.yaml" in lines[0] and "the command line" in lines[2]
    assert "--help" in lines[-1] and "docs/from-trl.md" in lines[-1]


@pytest.mark.parametrize("key, says", [
    ("ppo.num_mini_batches=4", "num_mini_batches=4 is ppo.minibatch_size = ppo.batch_size / 4"),
    ("num_ppo_epochs=4", "num_ppo_epochs=4 is ppo.epochs=4"),
    ("ppo.vf_coef=0.1", "vf_coef=0.1 has no oppo setting"),
    ("generation.response_length=53", "response_length=53 is generation.max_new_tokens=53"),
    ("generation.stop_token=eos", "stop_token=eos has no oppo setting"),
    ("ppo.gradient_accumulation_steps=2", "is ppo.minibatch_size = ppo.micro_batch_size x 2"),
    ("ppo.whiten_rewards=true", "ppo.whiten_advantages"),
    ("ppo.cliprange_value=0.3", "is ppo.value_clip_eps=0.3"),
    ("total_episodes=1000", "run.steps = 1000 / ppo.batch_size"),
])
def test_a_trl_name_gets_its_conversion(key, says):
    msg = _error([key])
    assert says in msg and "Did you mean" not in msg


@pytest.mark.parametrize("key, wrong", [
    ("ppo.vf_coef", "ppo.kl_coef"), ("generation.response_length", "generation.backend"),
    ("generation.stop_token", "generation.top_k"), ("ppo.gradient_accumulation_steps", "ppo.lr_warmup_steps"),
    ("ppo.num_mini_batches", "Did you mean 'ppo.minibatch_size'"),
    ("ppo.whiten_rewards", "Did you mean 'ppo.whiten_advantages'"), ("data.prompt_field", "data.prompts"),
    ("ppo.value_coef", "Did you mean"), ("ppo.whiten_returns", "Did you mean"), ("ppo.clip_eps_low", "Did you mean"),
])
def test_no_hint_names_another_operation(key, wrong):
    assert wrong not in _error([f"{key}=1"])


def test_a_field_name_from_other_trainers_names_data_field():
    assert "Did you mean 'data.field'?" in _error(["data.prompt_field=text"])
    assert "Did you mean 'data.field'?" in _error(["data.prompt_key=text"])


def test_from_trl_doc_holds_the_code_table_and_every_key_exists():
    """docs/from-trl.md's tables are generated from oppo.from_trl (python -m oppo.from_trl
    docs/from-trl.md); each oppo setting the table names is a setting."""
    from pathlib import Path

    from oppo import from_trl

    doc = (Path(__file__).resolve().parents[1] / "docs" / "from-trl.md").read_text()
    assert from_trl.render(doc) == doc, "regenerate: python -m oppo.from_trl docs/from-trl.md"
    for where in from_trl.SECTIONS:
        assert from_trl.markdown_table(where) in doc
    known = set(all_keys())
    for t in from_trl.TABLE:
        assert set(t.keys) <= known, t.name
        assert all(k in t.is_ for k in t.keys), t.name  # the text names the settings it maps to
    asked = ("num_ppo_epochs num_mini_batches per_device_train_batch_size gradient_accumulation_steps kl_coef "
             "cliprange vf_coef cliprange_value gamma lam whiten_rewards response_length temperature "
             "missing_eos_penalty stop_token stop_token_id kl_estimator local_rollout_forward_batch_size "
             "total_episodes num_sample_generations exp_name reward_model_path sft_model_path").split()
    trainer = ("args processing_class model ref_model reward_model train_dataset value_model data_collator "
               "eval_dataset optimizers callbacks peft_config").split()
    assert sorted(t.name for t in from_trl.TABLE if t.where == "PPOConfig") == sorted(asked)
    assert sorted(t.name for t in from_trl.TABLE if t.where == "PPOTrainer") == sorted(trainer)


def test_trl_learning_rate_sets_both_learning_rates():
    """TRL's learning_rate trains the policy and the value model with one optimizer: the message
    gives both oppo settings, with the user's value, not one to pick."""
    for key in ("learning_rate", "ppo.learning_rate"):
        msg = _error([f"{key}=1e-5"])
        assert "TRL's learning_rate=1e-5 is ppo.actor_lr=1e-5 and ppo.critic_lr=1e-5, both" in msg
        assert "Did you mean" not in msg


def test_algorithm_settings_are_its_section_and_old_ones_upgrade():
    """An algorithm's own settings are ``algo.<name>.*`` (typed and coerced like every part's); the
    old ``algo.settings`` mapping and ``algo.std_normalize`` are refused by hand with the new key
    named, and a saved config that holds them (a checkpoint of the release before) is read under the
    new names."""
    from oppo.config import from_dict, to_dict

    cfg = load_config(None, ["algo.name=grpo", "algo.grpo.std_normalize=false", "algo.grpo.eps=1e-4"])
    assert (cfg.algo.grpo.std_normalize, cfg.algo.grpo.eps) == (False, 1e-4)
    assert to_dict(cfg)["algo"]["grpo"] == {"std_normalize": False, "eps": 1e-4}
    with pytest.raises(ConfigError, match="algo.std_normalize is now algo.grpo.std_normalize"):
        load_valid(None, ["algo.name=grpo", "algo.std_normalize=false"])
    with pytest.raises(ConfigError, match=r"algo.settings.*its section, algo.<name>.*Write algo.<algo.name>.eps=0.1"):
        load_valid(None, ["algo.name=grpo", "algo.settings={eps: 0.1}"])
    with pytest.raises(ConfigError, match="algo.grpo.eps"):
        load_valid(None, ["algo.name=grpo", "algo.grpo.eps=abc"])
    old = {"algo": {"name": "grpo", "group_size": 0, "kl_placement": "auto", "std_normalize": False,
                    "settings": {"eps": 0.5}}}
    up = from_dict(old)
    assert (up.algo.grpo.std_normalize, up.algo.grpo.eps) == (False, 0.5)
    assert from_dict(to_dict(cfg)).algo.grpo == cfg.algo.grpo
    # every config.yaml of the release before wrote the empty mapping: read, it sets nothing (ppo has no
    # section); given by hand, the fix is to delete the line
    assert from_dict({"algo": {"name": "ppo", "settings": {}}}).algo.name == "ppo"
    with pytest.raises(ConfigError, match="sets none: delete it"):
        load_valid(None, ["algo.settings={}"])
