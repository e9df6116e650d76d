"""The trainer from Python, without the CLI, as the README shows it."""

from __future__ import annotations

import subprocess
import sys

import pytest

import oppo
from conftest import TINY_PROMPTS

TINY = ["placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=2", "ppo.micro_batch_size=2",
        "generation.max_new_tokens=6", "overlap.mode=sequential", "log.progress=false", "run.samples=0"]


def test_import_is_light():
    code = "import sys, oppo; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_exports():
    for name in oppo.__all__:
        assert getattr(oppo, name) is not None, name
    with pytest.raises(AttributeError):
        oppo.no_such_name  # noqa: B018


def test_build_step_read_metrics(tiny_models, tiny_prompts, tmp_path):
    cfg = oppo.load_config(overrides=[*TINY, f"policy.path={tiny_models['policy']}",
                                      f"reward.path={tiny_models['reward']}", f"data.prompts={tiny_prompts}",
                                      "run.steps=2", f"run.out_dir={tmp_path / 'run'}"])
    trainer = oppo.Trainer.from_config(cfg)
    try:
        for _ in range(2):
            metrics = trainer.run_step()
        assert trainer.step == 2
        assert {"reward/mean", "kl/mean", "loss/policy", "time/step"} <= set(metrics)
    finally:
        trainer.close()

    run_dir = oppo.train(cfg, progress=False)
    assert [m["step"] for m in oppo.read_metrics(run_dir)] == [0, 1]
    assert oppo.latest_checkpoint(run_dir).name == "step_000002"
    assert "run directory" in oppo.run_summary(run_dir)
    with pytest.raises(oppo.PreflightError, match="already holds a run"):
        oppo.train(cfg)  # the same directory again: refused, before loading anything


# --------------------------------------------------------------------------- objects in place of paths

ANSWERS = {t: len(t.split()) for t in TINY_PROMPTS}  # a column: each prompt's word count


def _objects(tiny_models):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(tiny_models["policy"]),
            AutoTokenizer.from_pretrained(tiny_models["policy"]),
            AutoModelForSequenceClassification.from_pretrained(tiny_models["reward"]))


def test_model_objects_and_a_dataset_train_a_step(tiny_models):
    datasets = pytest.importorskip("datasets")
    policy, tok, rm = _objects(tiny_models)
    ds = datasets.Dataset.from_dict({"prompt": list(TINY_PROMPTS)})
    cfg = oppo.load_config(overrides=TINY)  # no policy.path: the built-in task's presets, dropped for policy=
    assert cfg.ppo.actor_lr == 1e-4
    with oppo.Trainer.from_config(cfg, policy=policy, tokenizer=tok, reward_model=rm, prompts=ds, progress=False) as trainer:
        metrics = trainer.run_step()
        assert trainer.roles.policy is policy and trainer.roles.reward_model is rm  # trained / scored in place
        assert trainer.roles.critic is not None and trainer.roles.critic is not rm  # (from the reward model: a copy)
    assert "reward/mean" in metrics and trainer.step == 1
    assert trainer.cfg.ppo.actor_lr == oppo.Config().ppo.actor_lr  # as on the CLI with policy.path set
    assert trainer.cfg.policy.path == "<object: LlamaForCausalLM>"
    assert trainer.cfg.reward.path == "<object: LlamaForSequenceClassification>"
    assert trainer.cfg.data.prompts.startswith("<object: Dataset of 8 rows")
    assert cfg.policy.path is None and cfg.ppo.actor_lr == 1e-4  # the caller's Config is unchanged


def test_reward_fn_in_config_with_columns_carried_and_resumed(tiny_models, tmp_path):
    """cfg.reward.function = a callable asking for a column, list-of-dict prompts, oppo.train in
    inter mode with sequences carried across steps and a checkpoint: every call gets each row's own
    record; a resume goes on with the same objects and refuses without them."""
    policy, tok, _ = _objects(tiny_models)
    calls = []

    def score(prompts, responses, answer, raw_prompts):
        assert answer == [ANSWERS[p] for p in raw_prompts] and raw_prompts == prompts  # (no chat template)
        calls.append(len(answer))
        return [float(a) for a in answer]

    data = [{"prompt": t, "answer": n} for t, n in ANSWERS.items()]
    cfg = oppo.load_config(overrides=[*TINY, "overlap.mode=inter", "overlap.delta=4", "generation.max_new_tokens=12",
                                      "run.steps=2", "run.save_every=1", f"run.out_dir={tmp_path / 'run'}"])
    cfg.reward.function, cfg.data.prompts = score, data
    run_dir = oppo.train(cfg, progress=False, policy=policy, tokenizer=tok)
    assert calls and any(m["overlap/carried"] > 0 for m in oppo.read_metrics(run_dir)), "nothing was carried"
    text = (run_dir / "config.yaml").read_text()
    assert "function: <object: test_python_api.score>" in text or "<object: " in text.split("function:")[1]
    assert "# reward.function: given from Python as an object" in text
    cfg.run.steps = 3
    with pytest.raises(oppo.PreflightError, match=r"reward.function was given as an object.*reward_fn=") as info:
        oppo.train(oppo.load_config(overrides=[*TINY, f"policy.path={tiny_models['policy']}",
                                               f"reward.path={tiny_models['reward']}", f"data.prompts={tiny_prompts_path(tmp_path)}",
                                               "overlap.mode=inter", "overlap.delta=4", "generation.max_new_tokens=12",
                                               "run.steps=3", f"run.out_dir={run_dir}"]), resume="auto")
    assert "data.prompts was given as an object" in str(info.value)
    with pytest.raises(ValueError,  # (oppo.models.ModelLoadError)
                       match="a policy object is trained in place: load it again"):
        oppo.train(cfg, resume="auto", progress=False, policy=policy, tokenizer=tok)  # trained: not the initial one
    calls.clear()
    policy, tok, _ = _objects(tiny_models)  # the objects as they were at the start: goes on
    oppo.train(cfg, resume="auto", progress=False, policy=policy, tokenizer=tok)
    assert calls and [m["step"] for m in oppo.read_metrics(run_dir)] == [0, 1, 2]


def tiny_prompts_path(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(f'{{"prompt": "{t}"}}\n' for t in TINY_PROMPTS))
    return p


def test_bad_objects_get_the_cli_checks(tiny_models, nothing_loads):
    datasets = pytest.importorskip("datasets")
    policy, tok, rm = _objects(tiny_models)
    cfg = oppo.load_config(overrides=TINY)
    # the reward model must be a one-label sequence classifier (the words of the reward.path check)
    with pytest.raises(oppo.PreflightError, match=r"reward_model=.*is a LlamaForCausalLM: this is not a sequence "
                                                  r"classifier"):
        oppo.Trainer.from_config(cfg, policy=policy, tokenizer=tok, reward_model=policy, prompts=["a day"])
    with pytest.raises(oppo.PreflightError, match="give its tokenizer too"):
        oppo.Trainer.from_config(cfg, policy=policy, reward_model=rm, prompts=["a day"])
    with pytest.raises(oppo.PreflightError, match=r"no column 'prompt' \(it has text\); set data.field"):
        oppo.Trainer.from_config(cfg, policy=policy, tokenizer=tok, reward_model=rm,
                     prompts=datasets.Dataset.from_dict({"text": ["a day"]}))
    with pytest.raises(oppo.PreflightError, match=r"prompts\[1\] has no key 'prompt'"):
        oppo.Trainer.from_config(cfg, policy=policy, tokenizer=tok, reward_model=rm, prompts=[{"prompt": "a"}, {"q": "b"}])
    with pytest.raises(oppo.PreflightError, match="cannot be called as fn\\(prompts, responses\\)"):
        oppo.Trainer.from_config(cfg, policy=policy, tokenizer=tok, reward_fn=lambda texts: [0.0], prompts=["a day"])
    small = type(policy)(type(policy.config)(**{**policy.config.to_dict(), "vocab_size": 5}))
    with pytest.raises(oppo.PreflightError, match="has 5 token embeddings but the policy's tokenizer has"):
        oppo.Trainer.from_config(cfg, policy=policy, tokenizer=tok, reference=small, reward_model=rm, prompts=["a day"])
    with pytest.raises(oppo.ConfigError, match=r"policy= was given and policy.path is set too"):
        oppo.Trainer.from_config(oppo.load_config(overrides=[*TINY, f"policy.path={tiny_models['policy']}",
                                                 f"reward.path={tiny_models['reward']}"]), policy=policy)


def test_reward_columns_checked_before_models_load(tiny_models, tmp_path, nothing_loads):
    cfg = oppo.load_config(overrides=[*TINY, f"run.out_dir={tmp_path / 'run'}"])

    def score(prompts, responses, answer, *, level=0):
        return [0.0] * len(prompts)

    data = [{"prompt": "a day", "id": 1}]
    with pytest.raises(oppo.PreflightError) as info:
        oppo.train(cfg, reward_fn=score, prompts=data)
    assert "asks for the column 'answer', which the prompt set does not have (it has: prompt, id" in str(info.value)
    # a list given as an override is not a hub name
    with pytest.raises(oppo.PreflightError, match="looks like a list of prompts"):
        oppo.train(oppo.load_config(overrides=[*TINY, f"policy.path={tiny_models['policy']}",
                                               f"reward.path={tiny_models['reward']}", "data.prompts=[a day, the book]",
                                               f"run.out_dir={tmp_path / 'run2'}"]))


def test_reward_functions_get_what_they_ask_for():
    from oppo.scoring.reward_fn import call_reward, missing_columns, wants

    ctx = {"answer": [1, 2], "id": ["a", "b"], "raw_prompts": ["p", "q"], "formatted_prompts": ["P", "Q"]}
    assert call_reward(lambda prompts, responses: [len(prompts)] * 2, ["P", "Q"], ["x", "y"], ctx) == [2, 2]
    assert call_reward(lambda p, r, answer, *, id=None: list(zip(answer, id)), ["P", "Q"], ["x", "y"], ctx) == [
        (1, "a"), (2, "b")]
    assert call_reward(lambda p, r, level=7: [level], ["P"], ["x"], ctx) == [7]  # not a column: its default
    assert call_reward(lambda p, r, **kw: sorted(kw), ["P"], ["x"], ctx) == sorted(ctx)

    class Judge:  # a callable object
        def __call__(self, prompts, responses, raw_prompts):
            return raw_prompts

    assert call_reward(Judge(), ["P", "Q"], ["x", "y"], ctx) == ["p", "q"]
    assert wants(lambda p, r, answer, level=1: 0).required == ("answer",)
    assert not wants(lambda texts: 0).positional_ok
    line = missing_columns("reward.function", lambda p, r, answer: 0, ["prompt", "id"])
    assert "asks for the column 'answer'" in line and "it has: prompt, id" in line


def test_models_for_other_processes_are_saved_once(tiny_models, tmp_path, capsys):
    """placement.name=ray: the Ray actors load every model from a directory, so each model
    object is saved there (the policy with its tokenizer), and said so."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from oppo.setup.inputs import save_for_elsewhere, split_inputs

    policy, tok, rm = _objects(tiny_models)
    cfg = oppo.load_config(overrides=[*TINY, "placement.name=ray"])
    cfg, inputs = split_inputs(cfg, policy=policy, tokenizer=tok, reward_model=rm, save_dir=tmp_path / "inputs")
    saved = save_for_elsewhere(cfg, inputs)
    assert saved == {"policy": str(tmp_path / "inputs" / "policy"), "reward": str(tmp_path / "inputs" / "reward")}
    assert save_for_elsewhere(cfg, inputs) == saved  # once
    assert "the policy given as an object is saved to" in capsys.readouterr().err
    assert (tmp_path / "inputs" / "policy" / "tokenizer.json").is_file()
    assert isinstance(AutoModelForCausalLM.from_pretrained(saved["policy"]), type(policy))
    assert isinstance(AutoModelForSequenceClassification.from_pretrained(saved["reward"]), type(rm))
    local = oppo.load_config(overrides=TINY)
    assert save_for_elsewhere(*split_inputs(local, policy=policy, tokenizer=tok)) == {}  # local roles: nothing saved


def test_a_spec_reward_function_asking_for_a_missing_column(tiny_models, tmp_path, monkeypatch, nothing_loads):
    """reward.function=module:function (the CLI's way) gets the same column check, from the prompt
    file's first record, before anything loads."""
    (tmp_path / "colscore.py").write_text("def score(prompts, responses, answer):\n    return [0.0] * len(prompts)\n")
    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a day", "id": 1}\n')
    cfg = oppo.load_config(overrides=[*TINY, f"policy.path={tiny_models['policy']}", "reward.function=colscore:score",
                                      f"data.prompts={prompts}", f"run.out_dir={tmp_path / 'run'}"])
    with pytest.raises(oppo.PreflightError, match=r"reward.function: colscore.score asks for the column 'answer', "
                                                  r"which the prompt set does not have \(it has: prompt, id"):
        oppo.train(cfg)


def test_one_object_for_two_roles_is_refused_by_name(tiny_models, nothing_loads):
    """critic=rm with reward_model=rm, or reference=policy, is refused before anything loads, naming
    both keywords and the fix (it failed with a raw PyTorch error naming no input)."""
    policy, tok, rm = _objects(tiny_models)
    cfg = oppo.load_config(overrides=TINY)
    with pytest.raises(oppo.PreflightError) as info:
        oppo.Trainer.from_config(cfg, policy=policy, tokenizer=tok, reward_model=rm, critic=rm, prompts=["a day"])
    msg = str(info.value)
    assert "critic= and reward_model= are the same object (LlamaForSequenceClassification)" in msg
    assert "Leave critic= out" in msg
    with pytest.raises(oppo.PreflightError, match=r"policy= and reference= are the same object \(LlamaForCausalLM\)"
                                                  r": the policy trains in place.*Leave reference= out"):
        oppo.train(cfg, policy=policy, tokenizer=tok, reference=policy, reward_model=rm, prompts=["a day"])


def test_train_prints_the_runs_summary(tiny_models, tiny_prompts, tmp_path, capsys):
    """oppo.train closes with the summary `oppo train` prints (done: N steps, the run directory)."""
    cfg = oppo.load_config(overrides=[*TINY, f"policy.path={tiny_models['policy']}",
                                      f"reward.path={tiny_models['reward']}", f"data.prompts={tiny_prompts}",
                                      "run.steps=1", "run.save_final=none", f"run.out_dir={tmp_path / 'run'}"])
    run_dir = oppo.train(cfg)
    out = capsys.readouterr().out
    assert out.startswith("done: 1 steps (0-0) in ") and f"run directory: {run_dir}" in out


def test_callables_as_reward_terms_train_and_are_recorded_as_objects(tiny_models, tiny_prompts, tmp_path):
    """cfg.reward.terms takes callables from Python (with kwargs and a data set column), as
    reward.function does: each term's metric, the weighted sum, config.yaml recording the callable as
    an <object: ...> marker, and the same config without the callable refused before anything loads."""
    seen = []

    def words(prompts, responses, answer, scale=1.0):
        seen.append(list(answer))
        return [scale * len(r.split()) for r in responses]

    class Constant:  # a callable object, not a function
        def __call__(self, prompts, responses):
            return [0.5] * len(responses)

    data = [{"prompt": t, "answer": n} for t, n in ANSWERS.items()]
    cfg = oppo.load_config(overrides=[*TINY, f"policy.path={tiny_models['policy']}", "run.steps=1",
                                      f"reward.path={tiny_models['reward']}", f"run.out_dir={tmp_path / 'run'}"])
    cfg.data.prompts, cfg.reward.path = data, None
    cfg.reward.terms = [{"path": str(tiny_models["reward"]), "name": "rm"},
                        {"function": words, "weight": 0.5, "kwargs": {"scale": 2.0}},
                        {"function": Constant(), "weight": -1.0, "name": "const"}]
    run_dir = oppo.train(cfg, progress=False)
    m = oppo.read_metrics(run_dir)[0]
    assert seen and all(a in ANSWERS.values() for a in seen[0])  # the column reached the callable
    assert m["reward/const/mean"] == 0.5 and m["reward/words/mean"] >= 0
    assert m["reward/mean"] == pytest.approx(m["reward/rm/mean"] + 0.5 * m["reward/words/mean"] - 0.5, abs=1e-5)
    import yaml

    text = (run_dir / "config.yaml").read_text()
    saved = yaml.safe_load(text)["reward"]["terms"]
    assert saved[1]["function"].startswith("<object: ") and saved[1]["function"].endswith("words>")
    assert saved[1]["name"] == "words" and saved[2]["function"].endswith("Constant>")
    assert "# reward.terms term 'words': given from Python as a callable" in text
    assert callable(cfg.reward.terms[1]["function"])  # the caller's Config is unchanged
    # the recorded config (markers) without the callables: refused by name, before any model loads
    recorded = oppo.load_config(run_dir / "config.yaml", ["run.steps=2", f"run.out_dir={tmp_path / 'again'}"])
    with pytest.raises(oppo.PreflightError, match=r"term 'words'\) is '<object: .*words>': a callable the run was "
                                                  r"given from Python, and none is given now"):
        oppo.Trainer.from_config(recorded, progress=False, prompts=data)
    # a callable that cannot be a reward function: the same check as reward_fn=, before loading
    cfg.reward.terms = [{"function": lambda prompts: [0.0] * len(prompts)}]
    cfg.run.out_dir = str(tmp_path / "bad")
    with pytest.raises(oppo.PreflightError, match=r"reward.terms\[0\].function: .*cannot be called as fn\(prompts, "
                                                  r"responses\)"):
        oppo.Trainer.from_config(cfg, progress=False)


def test_a_renamed_public_name_says_its_new_one():
    """``oppo.plan_run`` (the release before) fails naming ``oppo.start_run``; no alias keeps it."""
    import oppo

    with pytest.raises(AttributeError, match=r"oppo.plan_run is now oppo.start_run"):
        oppo.plan_run  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        oppo.nope  # noqa: B018
    assert oppo.start_run.__name__ == "start_run"
