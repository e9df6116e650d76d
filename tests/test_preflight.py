"""Checks that need no model run before any model loads (and before `oppo prepare`), and report
every problem at once: `oppo.run.start_run` / `oppo.run.train` with loaders that must not run."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

import oppo.models.hub
import oppo.setup.preflight
import oppo.run
import oppo.task
import oppo.trainer
from oppo import cli
from oppo.config import load_config, to_dict
from oppo.run.dirs import out_dir_problems
from oppo.setup.check import check
from oppo.setup.preflight import PreflightError

TINY = ["ppo.batch_size=2", "ppo.minibatch_size=2", "ppo.micro_batch_size=1", "generation.max_new_tokens=4",
        "overlap.mode=sequential", "placement.threads=1", "log.progress=false"]


@pytest.fixture
def nothing_loads(monkeypatch):
    """The Trainer (which prepares the built-in task and loads every model) must not start."""
    def boom(*a, **k):
        raise AssertionError("the trainer started before the problem was reported")

    monkeypatch.setattr(oppo.trainer.Trainer, "__init__", boom)
    monkeypatch.setattr(oppo.task, "prepare", boom)


def input_problems(cfg, inputs=None) -> list[str]:
    """Every problem the run's one check (``setup.check``) finds, with the run directory's, as a list."""
    try:
        check(cfg, inputs, found=out_dir_problems(cfg.run.out_dir))
    except PreflightError as e:
        return e.problems
    return []


def user_cfg(tiny_models, tiny_prompts, tmp_path, *extra):
    return load_config(None, [*TINY, f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
                              f"data.prompts={tiny_prompts}", f"run.out_dir={tmp_path / 'run'}", *extra])


def test_good_inputs_have_no_problems(tiny_models, tiny_prompts, tmp_path):
    assert input_problems(user_cfg(tiny_models, tiny_prompts, tmp_path)) == []
    assert input_problems(load_config(None, ["data.task=arith"])) == []


def test_all_problems_reported_at_once(tiny_models, tiny_prompts, tmp_path, nothing_loads, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')  # another run lives there
    args = [*TINY, f"policy.path={tmp_path / 'no_policy'}", "reward.function=no_such_module_xyz:score",
            f"data.prompts={tmp_path / 'missing.jsonl'}", f"run.out_dir={run}"]
    with pytest.raises(PreflightError) as info:
        oppo.run.train(load_config(None, args), progress=False)
    problems = info.value.problems
    assert len(problems) == 4, problems
    text = str(info.value)
    assert text.startswith("4 problems, found before loading anything")
    for needle in ("no_policy", "no_such_module_xyz", "missing.jsonl", "already holds a run"):
        assert sum(needle in p for p in problems) == 1, needle
    assert cli.main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "4 problems" in err and "Traceback" not in err
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'  # touched nothing


@pytest.mark.parametrize("content, needle", [("", "is empty"), ("\n  \n", "is empty"),
                                             ('{"text": "hi"}\n', "no field 'prompt'"),
                                             ("not json\n", "not valid JSON")])
def test_prompt_file_checked(tiny_models, tmp_path, content, needle):
    p = tmp_path / "p.jsonl"
    p.write_text(content)
    problems = input_problems(user_cfg(tiny_models, p, tmp_path))
    assert len(problems) == 1 and needle in problems[0] and str(p) in problems[0]


def test_prompt_file_of_unknown_format(tiny_models, tmp_path):
    p = tmp_path / "README.md"
    p.write_text("# not prompts\n")
    (problem,) = input_problems(user_cfg(tiny_models, p, tmp_path))
    assert "cannot tell its format" in problem and ".jsonl" in problem


def test_model_directories_checked(tiny_models, tiny_prompts, tmp_path):
    policy = tmp_path / "policy_without_tokenizer"
    policy.mkdir()
    shutil.copy(tiny_models["policy"] / "config.json", policy)
    reward = tmp_path / "two_label_rm"
    reward.mkdir()
    conf = json.loads((tiny_models["reward"] / "config.json").read_text())
    conf["id2label"] = {"0": "LABEL_0", "1": "LABEL_1"}
    (reward / "config.json").write_text(json.dumps(conf))
    critic = tmp_path / "critic_no_config"
    critic.mkdir()
    problems = input_problems(user_cfg(tiny_models, tiny_prompts, tmp_path, f"policy.path={policy}",
                                       f"reward.path={reward}", f"critic.path={critic}"))
    assert len(problems) == 3, problems
    assert "holds no tokenizer" in problems[0] and "2 labels" in problems[1] and "no config.json" in problems[2]


def test_unknown_builtin_task_before_prepare(tmp_path, nothing_loads):
    with pytest.raises(PreflightError, match="not a built-in task"):
        oppo.run.train(load_config(None, ["data.task=nope", f"run.out_dir={tmp_path / 'r'}"]), progress=False)


@pytest.fixture
def no_network(monkeypatch):
    """A hub endpoint that refuses connections at once (this machine has no network anyway)."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(oppo.models.hub, "_REACHABLE", {})


def test_hub_name_without_network_is_one_line_about_the_network(tiny_models, tiny_prompts, tmp_path, no_network,
                                                                nothing_loads, capsys):
    name = "oppo-test-org/not-cached-model"
    code = cli.main(["train", *TINY, f"policy.path={name}", f"reward.path={tiny_models['reward']}",
                     f"data.prompts={tiny_prompts}", f"run.out_dir={tmp_path / 'run'}"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "no network" in err and "127.0.0.1:9 cannot be reached" in err and name in err
    assert "tokenizer" not in err and "Traceback" not in err
    # the download command huggingface_hub ships (huggingface-cli is gone), and where to put the result
    assert f"hf download {name}" in err and "huggingface-cli" not in err and "policy.path=/local/dir" in err


def test_offline_mode_named(tiny_models, tiny_prompts, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    problems = input_problems(user_cfg(tiny_models, tiny_prompts, tmp_path, "reward.path=oppo-test-org/rm",
                                       "data.prompts=oppo-test-org/some_dataset"))
    assert len(problems) == 2, problems
    assert all("offline mode is on" in p for p in problems)


def test_cached_hub_model_switches_to_offline_mode(tiny_models, tiny_prompts, tmp_path, no_network, monkeypatch):
    """Unreachable hub, model in the local cache: no problem, and loaders read the cache at once."""
    import huggingface_hub.constants as hc

    monkeypatch.setattr(oppo.models.hub, "in_hub_cache", lambda name: True)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(k, "0")  # restored after the test
    assert input_problems(user_cfg(tiny_models, tiny_prompts, tmp_path, "reward.path=oppo-test-org/rm")) == []
    assert hc.HF_HUB_OFFLINE is True and oppo.models.hub.offline_env()


# --------------------------------------------------------------------------- resume, before loading

def _fake_checkpoint(run_dir, cfg, step: int):
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    (ckpt / "state.json").write_text(json.dumps({"step": step}))
    return ckpt


def test_resume_mismatch_and_steps_named_in_user_terms(tiny_models, tiny_prompts, tmp_path, nothing_loads):
    saved = user_cfg(tiny_models, tiny_prompts, tmp_path, "overlap.mode=oppo", "ppo.kl_coef=0.1")
    ckpt = _fake_checkpoint(tmp_path / "run", saved, 4)
    now = user_cfg(tiny_models, tiny_prompts, tmp_path, "run.steps=4", "log.trace=false", "run.save_every=1")
    with pytest.raises(PreflightError) as info:
        oppo.run.train(now, resume="auto")
    mismatch, steps = info.value.problems
    assert "overlap.mode is oppo in the checkpoint, sequential now" in mismatch
    assert "ppo.kl_coef is 0.1 in the checkpoint, 0.05 now" in mismatch
    assert "overlap.mode=oppo ppo.kl_coef=0.1" in mismatch  # the fix
    assert "run.save_every" not in mismatch and "log.trace" not in mismatch  # may change on resume
    assert "run.steps=4" in steps and "step 4" in steps and "run.steps above 4" in steps
    ok = user_cfg(tiny_models, tiny_prompts, tmp_path, "overlap.mode=oppo", "ppo.kl_coef=0.1", "run.steps=5")
    plan = oppo.run.start_run(ok, resume="auto")
    assert plan.checkpoint == ckpt and plan.start_step == 4 and plan.run_dir == tmp_path / "run"
    assert oppo.run.start_run(ok, resume=str(tmp_path / "run")).checkpoint == ckpt  # a run directory works too


def test_resume_without_a_run(tmp_path, nothing_loads):
    cfg = load_config(None, [f"run.out_dir={tmp_path / 'runs' / 'latest'}"])
    with pytest.raises(PreflightError, match="no run to resume"):
        oppo.run.train(cfg, resume="auto")
    cfg = load_config(None, [f"run.out_dir={tmp_path / 'x'}"])
    with pytest.raises(PreflightError, match="no checkpoint under"):
        oppo.run.train(cfg, resume="auto")
    with pytest.raises(PreflightError, match="not a checkpoint"):
        oppo.run.train(cfg, resume=str(tmp_path))
    assert not (tmp_path / "runs").exists() and not (tmp_path / "x").exists()


def test_a_run_still_writing_its_directory_is_not_resumed(tiny_models, tiny_prompts, tmp_path, nothing_loads):
    import fcntl
    import os

    cfg = user_cfg(tiny_models, tiny_prompts, tmp_path, "run.steps=5")
    ckpt = _fake_checkpoint(tmp_path / "run", cfg, 2)
    with open(tmp_path / "run" / oppo.run.LOCK_FILE, "w") as held:  # as a live `oppo train` holds it
        held.write("12345\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(PreflightError, match="pid 12345.* is still writing"):
            oppo.run.start_run(cfg, resume="auto")
    assert oppo.run.start_run(cfg, resume="auto").checkpoint == ckpt  # released (the writer ended or died)
    assert (tmp_path / "run" / oppo.run.LOCK_FILE).read_text() == "12345\n"  # the check wrote nothing
    assert os.path.exists(ckpt / "state.json")


@pytest.fixture
def validations(monkeypatch):
    """How many times the settings are validated: every module's reference to
    ``config.validate.validate`` replaced by one that counts its calls."""
    import sys

    from oppo.config import validate as real

    calls: list[int] = []

    def counted(cfg):
        calls.append(1)
        return real(cfg)

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("oppo") and getattr(mod, "validate", None) is real:
            monkeypatch.setattr(mod, "validate", counted)
    return calls


def test_one_validation_and_one_preflight_per_run(tiny_models, tiny_prompts, tmp_path, validations, monkeypatch):
    """A tiny train validates its settings once and runs the object checks once, whether the Config
    comes from load_config (the CLI's path: it parses, the run's check validates), is built in code,
    or is changed in code after loading: ``setup.check`` is the run's one check, reached from
    ``start_run``, and the Trainer checks nothing again."""
    from oppo.config import Config

    checked: list[int] = []
    real_objects = oppo.setup.preflight.object_problems
    monkeypatch.setattr(oppo.setup.preflight, "object_problems", lambda *a: checked.append(1) or real_objects(*a))
    loaded = user_cfg(tiny_models, tiny_prompts, tmp_path, "run.steps=1", "run.save_final=none", "log.trace=false")
    assert len(validations) == 0  # load_config parses; it does not validate
    oppo.run.train(loaded, progress=False)
    assert (len(validations), len(checked)) == (1, 1)  # once, by the run's one check
    in_code = Config()
    for section, values in to_dict(loaded).items():  # the same settings, set in code
        if section not in ("rollout", "placement", "learner"):
            for k, v in values.items():
                setattr(getattr(in_code, section), k, v)
    in_code.placement.threads = 1
    in_code.run.out_dir = str(tmp_path / "in_code")
    oppo.run.train(in_code, progress=False)
    assert (len(validations), len(checked)) == (2, 2)  # once, by the run's one check
    loaded.run.out_dir = str(tmp_path / "changed")  # changed in code after a run: checked again, once
    oppo.run.train(loaded, progress=False)
    assert (len(validations), len(checked)) == (3, 3)


def test_a_config_changed_in_code_gets_the_cli_message(tiny_models, tiny_prompts, tmp_path, nothing_loads):
    """Loaded, then made invalid in code: the run's one check refuses it before anything loads,
    with the message the command line gives."""
    from oppo.config import ConfigError

    cfg = user_cfg(tiny_models, tiny_prompts, tmp_path)
    cfg.ppo.batch_size = 0
    with pytest.raises(ConfigError) as in_code:
        oppo.run.train(cfg, progress=False)
    with pytest.raises(ConfigError) as loaded:
        cli._train([*TINY, f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
                  f"data.prompts={tiny_prompts}", f"run.out_dir={tmp_path / 'run'}", "ppo.batch_size=0"])
    assert str(in_code.value) == str(loaded.value)


class _Loading(Exception):
    """Raised where the models would begin to load: the test has seen what it needs by then."""


@pytest.mark.parametrize("how", ["cli", "oppo.train", "Trainer"])
def test_each_path_checked_once_per_run(tiny_models, tiny_prompts, tmp_path, monkeypatch, how):
    """One preflight per run, whichever way the run starts (``oppo train``, ``oppo.train(cfg)``,
    ``Trainer.from_config(cfg)`` in code): each model path is checked once, by the one rule for a model path
    (``models.paths.model_dir_config``), and before any model loads; nothing after the preflight
    (``setup.resolve``) checks a path again."""
    import oppo.models.paths
    import oppo.setup.build

    checked: list[str] = []
    rule = oppo.models.paths.model_dir_config
    monkeypatch.setattr(oppo.models.paths, "model_dir_config",
                        lambda path, subject: checked.append(str(path)) or rule(path, subject))
    loading: list[list[str]] = []

    def load_models(*a, **k):
        loading.append(list(checked))
        raise _Loading

    monkeypatch.setattr(oppo.setup.build, "load_models", load_models)
    overrides = [*TINY, f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
                 f"critic.path={tiny_models['reward']}", f"data.prompts={tiny_prompts}",
                 f"run.out_dir={tmp_path / 'run'}"]
    with pytest.raises(_Loading):
        if how == "cli":
            cli.main(["train", *overrides])
        elif how == "oppo.train":
            oppo.run.train(load_config(None, overrides), progress=False)
        else:
            oppo.trainer.Trainer.from_config(load_config(None, overrides), progress=False)
    want = sorted([str(tiny_models["policy"]), str(tiny_models["reward"]), str(tiny_models["reward"])])
    assert loading == [checked] and sorted(checked) == want  # policy.path, reward.path, critic.path: once each


def test_a_checked_record_comes_only_from_the_check(tiny_models, tiny_prompts, tmp_path):
    """``setup.check`` is the one way to a ``Checked`` record, and the Trainer takes nothing else: a
    record built by hand, or a Config passed where the record goes, is refused with the way in."""
    from oppo.setup.check import Checked
    from oppo.setup.inputs import Inputs

    cfg = user_cfg(tiny_models, tiny_prompts, tmp_path)
    checked = check(cfg)
    assert checked.cfg is cfg and checked.backend == cfg.generation.backend
    with pytest.raises(TypeError, match="oppo.setup.check"):
        Checked(cfg, Inputs(), "auto")
    with pytest.raises(TypeError, match="Trainer.from_config"):
        oppo.trainer.Trainer(cfg)
    with pytest.raises(Exception):  # frozen
        checked.cfg = cfg  # type: ignore[misc]


def test_a_tokenizer_object_that_cannot_tokenise_is_one_problem(tiny_models, tiny_prompts, tmp_path):
    """A tokenizer given as an object is checked with the objects, and what is wrong with it is one
    line among the problems (not an error of the check itself)."""
    from oppo.setup.inputs import split_inputs

    cfg, inputs = split_inputs(user_cfg(tiny_models, tiny_prompts, tmp_path), tokenizer=object())
    found = input_problems(cfg, inputs)
    assert found and any("tokenizer" in p for p in found), found
