"""Bad inputs, through the code a user hits (`Trainer.from_config(load_config(...))`, `oppo train`): each fails
early with a message that names the culprit, or is handled as documented."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import warnings
from pathlib import Path

import pytest

import oppo.setup.load
from conftest import WORDS
from oppo import cli
from oppo.checkpoint import checkpoint_dirs, latest_checkpoint, load_checkpoint, save_checkpoint
from oppo.config import load_config
from oppo.data import DataError, build_prompt_set
from oppo.models import ModelLoadError, load_tokenizer
from oppo.setup.preflight import PreflightError
from oppo.scoring.streaming import RewardFunction
from oppo.trainer import Trainer

TINY = ["ppo.batch_size=2", "ppo.minibatch_size=2", "ppo.micro_batch_size=1", "generation.max_new_tokens=4",
        "overlap.mode=sequential", "placement.threads=1", "log.progress=false", "log.trace=false"]


def make_cfg(tiny_models, tiny_prompts, tmp_path, **settings):
    """A tiny user config: the fixture's policy and reward model unless ``settings`` say otherwise."""
    s = {"policy.path": tiny_models["policy"], "data.prompts": tiny_prompts, "run.out_dir": tmp_path / "run"}
    if "reward.function" not in settings:
        s["reward.path"] = tiny_models["reward"]
    s.update(settings)
    return load_config(None, TINY + [f"{k}={v}" for k, v in s.items() if v is not None])




def _write_tokenizer(d: Path, **special) -> None:
    """Replace the tokenizer in model directory ``d`` by the test vocabulary with only ``special`` tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    for f in d.glob("tokenizer*"):
        f.unlink()
    tk = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + WORDS)},
                                    unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", **special).save_pretrained(d)


def _copy_policy(tiny_models, dst: Path) -> Path:
    shutil.copytree(tiny_models["policy"], dst)
    return dst


def _reward_module(tmp_path, monkeypatch, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


# --------------------------------------------------------------------------- model paths

@pytest.mark.parametrize("role", ["policy", "reward", "critic", "reference"])
def test_missing_model_path_fails_first(tiny_models, tiny_prompts, tmp_path, nothing_loads, role):
    missing = tmp_path / f"no_{role}_here"
    cfg = make_cfg(tiny_models, tiny_prompts, tmp_path, **{f"{role}.path": missing})
    with pytest.raises(ModelLoadError) as info:
        Trainer.from_config(cfg, progress=False)
    msg = str(info.value)
    assert str(missing) in msg and role in msg and "does not exist" in msg


def test_missing_model_path_cli_exit_2(tiny_models, tiny_prompts, tmp_path, nothing_loads, capsys):
    missing = tmp_path / "typo_policy"
    code = cli.main(["train", *TINY, f"policy.path={missing}", f"reward.path={tiny_models['reward']}",
                     f"data.prompts={tiny_prompts}", f"run.out_dir={tmp_path / 'run'}"])
    assert code == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "Traceback" not in err


def test_directory_without_config_json(tiny_models, tiny_prompts, tmp_path, nothing_loads):
    d = tmp_path / "not_a_model"
    d.mkdir()
    (d / "weights.bin").write_bytes(b"\0")
    cfg = make_cfg(tiny_models, tiny_prompts, tmp_path, **{"reward.path": d})
    with pytest.raises(ModelLoadError) as info:
        Trainer.from_config(cfg, progress=False)
    assert str(d) in str(info.value) and "config.json" in str(info.value)


def test_file_instead_of_directory(tiny_models, tiny_prompts, tmp_path, nothing_loads):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\0")
    cfg = make_cfg(tiny_models, tiny_prompts, tmp_path, **{"policy.path": f})
    with pytest.raises(ModelLoadError, match="not a directory"):
        Trainer.from_config(cfg, progress=False)


def test_prompts_required_with_user_models(tiny_models, tmp_path, nothing_loads, capsys):
    code = cli.main(["train", *TINY, f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
                     f"run.out_dir={tmp_path / 'run'}"])
    assert code == 2
    assert "data.prompts" in capsys.readouterr().err


def test_reward_model_with_two_labels(tiny_models, tiny_prompts, tmp_path, monkeypatch):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    d = tmp_path / "two_label_rm"
    tok = AutoTokenizer.from_pretrained(tiny_models["reward"])
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, pad_token_id=tok.pad_token_id, num_labels=2)
    LlamaForSequenceClassification(cfg).save_pretrained(d)
    tok.save_pretrained(d)

    def boom(*a, **k):
        raise AssertionError("the policy loaded before the reward model was checked")

    monkeypatch.setattr(oppo.setup.load, "load_causal_lm", boom)
    with pytest.raises(ModelLoadError) as info:
        Trainer.from_config(make_cfg(tiny_models, tiny_prompts, tmp_path, **{"reward.path": d}), progress=False)
    msg = str(info.value)
    assert str(d) in msg and "2 labels" in msg and "num_labels=1" in msg


def test_a_causal_lm_as_reward_model_is_named_so(tiny_models, tiny_prompts, tmp_path):
    """A causal LM's config has two labels by default: "has 2 labels" hid what was wrong."""
    from oppo.models import check_scorer_config, load_model_config as model_config
    from test_preflight import input_problems

    cfg = make_cfg(tiny_models, tiny_prompts, tmp_path, **{"reward.path": tiny_models["policy"]})
    for msg in (" ".join(input_problems(cfg)), _raised(check_scorer_config, model_config(str(tiny_models["policy"]),
                                                                                          "reward"))):
        assert "this is not a sequence classifier (a reward model is a one-label" in msg, msg
        assert "ForCausalLM" in msg and "labels;" not in msg


def _raised(check, conf) -> str:
    with pytest.raises(ModelLoadError) as info:
        check(conf, "/p", "reward", require_one_label=True)
    return str(info.value)


def test_a_reward_function_returning_a_tensor_names_tolist():
    import torch

    from oppo.models import reward_function

    fn = RewardFunction(reward_function(lambda ps, rs: torch.ones(len(ps)), "mod:fn"), "mod:fn")
    with pytest.raises(Exception, match=r"returned a Tensor of shape \[2\].*scores\.tolist\(\)"):
        fn(["a", "b"], ["x", "y"])
    listed = RewardFunction(reward_function(lambda ps, rs: [torch.tensor(1.0)] * len(ps), "mod:fn"), "mod:fn")
    with pytest.raises(Exception, match=r"tolist"):
        listed(["a"], ["x"])
    assert RewardFunction(reward_function(lambda ps, rs: [0.5] * len(ps), "mod:fn"), "mod:fn")(["a"], ["x"]) == [0.5]


# --------------------------------------------------------------------------- tokenizer

def test_tokenizer_without_eos(tiny_models, tiny_prompts, tmp_path):
    d = _copy_policy(tiny_models, tmp_path / "no_eos")
    _write_tokenizer(d, pad_token="<pad>")
    with pytest.raises(ModelLoadError) as info:
        Trainer.from_config(make_cfg(tiny_models, tiny_prompts, tmp_path, **{"policy.path": d}), progress=False)
    assert str(d) in str(info.value) and "EOS" in str(info.value)


def test_tokenizer_without_pad_falls_back_to_eos(tiny_models, tiny_prompts, tmp_path):
    d = _copy_policy(tiny_models, tmp_path / "no_pad")
    _write_tokenizer(d, eos_token="<eos>")
    with pytest.warns(UserWarning, match="no pad token"):
        tok = load_tokenizer(str(d))
    assert tok.pad_token == tok.eos_token == "<eos>" and tok.padding_side == "left"
    with pytest.warns(UserWarning, match="no pad token"):
        trainer = Trainer.from_config(make_cfg(tiny_models, tiny_prompts, tmp_path, **{"policy.path": d}), progress=False)
    try:
        assert trainer.roles.pad_id == trainer.roles.tokenizer.eos_token_id == tok.eos_token_id
    finally:
        trainer.close()


def test_tokenizer_with_pad_gives_no_warning(tiny_models):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tok = load_tokenizer(str(tiny_models["policy"]))
    assert tok.pad_token == "<pad>" and tok.pad_token_id != tok.eos_token_id


# --------------------------------------------------------------------------- prompts

LONG = "the film was very good and the book was very bad but i liked it"


def test_long_prompt_truncated_or_skipped(tiny_models):
    tok = load_tokenizer(str(tiny_models["policy"]))
    texts = [LONG, "a day", "the story is very"]
    n = len(tok(LONG)["input_ids"])
    assert n > 8
    cfg = load_config(None, ["data.max_prompt_tokens=8"])
    ps = build_prompt_set(texts, tok, cfg.data, seed=0)
    assert ps.truncated == 1 and ps.skipped == 0 and len(ps) == 3
    assert ps.ids[0] == tok(LONG)["input_ids"][-8:]
    cfg = load_config(None, ["data.max_prompt_tokens=8", "data.on_long_prompt=skip"])
    ps = build_prompt_set(texts, tok, cfg.data, seed=0)
    assert ps.truncated == 0 and ps.skipped == 1 and ps.texts == ["a day", "the story is very"]


@pytest.mark.parametrize("mode, truncated, skipped, kept", [("truncate", 1, 0, 3), ("skip", 0, 1, 2)])
def test_long_prompt_counted_by_trainer(tiny_models, tmp_path, mode, truncated, skipped, kept):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in [LONG, "a day", "the book"]))
    cfg = make_cfg(tiny_models, p, tmp_path, **{"data.max_prompt_tokens": 6, "data.on_long_prompt": mode})
    trainer = Trainer.from_config(cfg, progress=False)
    try:
        ps = trainer.roles.prompt_set
        assert (ps.truncated, ps.skipped, len(ps)) == (truncated, skipped, kept)
        assert all(len(ids) <= 6 for ids in ps.ids)
    finally:
        trainer.close()


def test_empty_prompt_set(tiny_models, tmp_path, monkeypatch, capsys):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n")

    def boom(*a, **k):
        raise AssertionError("the policy loaded before the prompt set was checked")

    monkeypatch.setattr(oppo.setup.load, "load_causal_lm", boom)
    # found by the one preflight, a Trainer's too (before, the prompt set's reader raised DataError)
    with pytest.raises(PreflightError, match="empty"):
        Trainer.from_config(make_cfg(tiny_models, p, tmp_path), progress=False)
    code = cli.main(["train", *TINY, f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
                     f"data.prompts={p}", f"run.out_dir={tmp_path / 'run'}"])
    assert code == 2 and "empty" in capsys.readouterr().err


def test_all_prompts_too_long_with_skip(tiny_models, tmp_path):
    p = tmp_path / "long.jsonl"
    p.write_text(json.dumps({"prompt": LONG}) + "\n")
    cfg = make_cfg(tiny_models, p, tmp_path, **{"data.max_prompt_tokens": 4, "data.on_long_prompt": "skip"})
    with pytest.raises(DataError, match="No usable prompt"):
        Trainer.from_config(cfg, progress=False)


# --------------------------------------------------------------------------- reward functions

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), "1.0", None])
def test_reward_function_non_finite(bad):
    fn = RewardFunction(lambda ps, rs: [1.0] + [bad] * (len(ps) - 1), "mod:fn")
    with pytest.raises(ValueError) as info:
        fn(["good prompt", "the culprit"], ["x", "y"])
    msg = str(info.value)
    assert "mod:fn" in msg and "'the culprit'" in msg and "finite" in msg


def test_reward_function_ok_values():
    fn = RewardFunction(lambda ps, rs: (len(r) for r in rs), "mod:fn")  # any iterable, ints fine
    assert fn(["a", "b"], ["xy", "z"]) == [2.0, 1.0]


def test_reward_function_wrong_count():
    fn = RewardFunction(lambda ps, rs: [0.0], "mod:fn")
    with pytest.raises(ValueError) as info:
        fn(["a", "b", "c"], ["x", "y", "z"])
    assert "returned 1 scores for 3" in str(info.value)


def test_nan_reward_end_to_end(tiny_models, tiny_prompts, tmp_path, monkeypatch):
    mod = _reward_module(tmp_path, monkeypatch, "oppo_test_nan_reward",
                         "def bad(prompts, responses):\n    return [float('nan')] * len(prompts)\n")
    trainer = Trainer.from_config(make_cfg(tiny_models, tiny_prompts, tmp_path, **{"reward.function": f"{mod}:bad"}),
                      progress=False)
    try:
        assert trainer.roles.reward_model is None
        with pytest.raises(ValueError) as info:
            trainer.run_step()
    finally:
        trainer.close()
    msg = str(info.value)
    assert f"{mod}:bad" in msg and "nan" in msg
    prompts = [json.loads(line)["prompt"] for line in tiny_prompts.read_text().splitlines()]
    assert any(repr(p) in msg for p in prompts)  # names the prompt


def test_wrong_count_end_to_end(tiny_models, tiny_prompts, tmp_path, monkeypatch):
    mod = _reward_module(tmp_path, monkeypatch, "oppo_test_short_reward",
                         "def short(prompts, responses):\n    return [1.0]\n")
    trainer = Trainer.from_config(make_cfg(tiny_models, tiny_prompts, tmp_path, **{"reward.function": f"{mod}:short"}),
                      progress=False)
    try:
        with pytest.raises(ValueError, match="returned 1 scores for 2"):
            trainer.run_step()
    finally:
        trainer.close()


def test_good_reward_function_end_to_end(tiny_models, tiny_prompts, tmp_path, monkeypatch):
    mod = _reward_module(tmp_path, monkeypatch, "oppo_test_len_reward",
                         "def length(prompts, responses):\n    return [len(r.split()) for r in responses]\n")
    trainer = Trainer.from_config(make_cfg(tiny_models, tiny_prompts, tmp_path, **{"reward.function": f"{mod}:length"}),
                      progress=False)
    try:
        m = trainer.run_step()
    finally:
        trainer.close()
    assert math.isfinite(m["reward/mean"]) and trainer.step == 1


def test_reward_function_that_raises_is_named_with_step_and_batch():
    """Issue 22 item 5: the error names the function, the step and the batch; the user's own
    exception is chained, so its traceback is not lost."""
    def score(prompts, responses):
        raise ConnectionError("scorer at 10.0.0.7 timed out")

    fn = RewardFunction(score, "my_rewards:score")
    with pytest.raises(Exception) as info:
        fn(["p0", "a rather long prompt " * 5], ["x", "y"], step=7, indices=[3, 11])
    msg = str(info.value)
    assert "my_rewards:score" in msg and "ConnectionError" in msg and "timed out" in msg
    assert "at step 7" in msg and "prompts 3, 11" in msg and "'p0'" in msg
    assert "--resume" not in msg  # (the run says what it kept and how to go on: run.recovery_line)
    assert isinstance(info.value.__cause__, ConnectionError)


def test_reward_function_retries_with_exponential_backoff():
    calls, slept = [], []

    def flaky(prompts, responses):  # fails twice, then answers
        calls.append(1)
        if len(calls) <= 2:
            raise TimeoutError("busy")
        return [1.0] * len(prompts)

    fn = RewardFunction(flaky, "mod:flaky", retries=2, backoff_s=0.5, sleep=slept.append)
    assert fn(["a"], ["b"], step=0) == [1.0]
    assert len(calls) == 3 and slept == [0.5, 1.0]
    calls.clear(), slept.clear()
    fn = RewardFunction(flaky, "mod:flaky", retries=1, backoff_s=0.5, sleep=slept.append)
    with pytest.raises(Exception, match=r"tried 2 times: reward.retries=1") as info:
        fn(["a"], ["b"], step=4)
    assert isinstance(info.value.__cause__, TimeoutError) and slept == [0.5]


def test_reward_function_error_keeps_what_the_run_wrote(tiny_models, tiny_prompts, tmp_path, monkeypatch):
    """A reward function that raises at step 2 stops `oppo train` with that error; the metrics of
    steps 0-1, their checkpoint and the trace stay, and the run resumes from the checkpoint."""
    from oppo.run import train

    mod = _reward_module(tmp_path, monkeypatch, "oppo_test_raising_reward",
                         "calls = []\n"
                         "def score(prompts, responses):\n"
                         "    calls.append(1)\n"
                         "    if len(calls) == 3:\n"
                         "        raise KeyError('missing field')\n"
                         "    return [float(len(r)) for r in responses]\n")
    out = tmp_path / "run"
    cfg = make_cfg(tiny_models, tiny_prompts, tmp_path, **{"reward.function": f"{mod}:score", "run.steps": 4,
                                                            "run.save_every": 2, "log.trace": "true",
                                                            "run.out_dir": out})
    with pytest.raises(Exception) as info:
        train(cfg, progress=False)
    assert f"{mod}:score" in str(info.value) and "at step 2" in str(info.value)
    assert isinstance(info.value.__cause__, KeyError)
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert [p.name for p in checkpoint_dirs(out)] == ["step_000002"]
    assert (out / "trace.json").is_file()
    train(cfg, resume="auto", progress=False)  # the function answers again: the run completes
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]


def test_unimportable_reward_module(tiny_models, tiny_prompts, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the policy loaded before the reward function was imported")

    monkeypatch.setattr(oppo.setup.load, "load_causal_lm", boom)
    cfg = make_cfg(tiny_models, tiny_prompts, tmp_path, **{"reward.function": "no_such_module_xyz:score"})
    with pytest.raises(ModelLoadError) as info:
        Trainer.from_config(cfg, progress=False)
    assert "'no_such_module_xyz'" in str(info.value) and "reward.function" in str(info.value)


def test_reward_module_raising_on_import(tiny_models, tiny_prompts, tmp_path, monkeypatch):
    mod = _reward_module(tmp_path, monkeypatch, "oppo_test_broken_import",
                         "import no_such_dependency_xyz\n\ndef f(p, r):\n    return [0.0] * len(p)\n")
    with pytest.raises(ModelLoadError) as info:
        Trainer.from_config(make_cfg(tiny_models, tiny_prompts, tmp_path, **{"reward.function": f"{mod}:f"}), progress=False)
    assert mod in str(info.value)


@pytest.mark.parametrize("body, cause", [("def f(p, r:\n    pass\n", "SyntaxError"),
                                         ("x = undefined_name\n", "NameError")])
def test_reward_module_broken_at_import(tiny_models, tiny_prompts, tmp_path, monkeypatch, capsys, body, cause):
    mod = _reward_module(tmp_path, monkeypatch, f"oppo_test_broken_{cause.lower()}", body)
    with pytest.raises(ModelLoadError) as info:
        Trainer.from_config(make_cfg(tiny_models, tiny_prompts, tmp_path, **{"reward.function": f"{mod}:f"}), progress=False)
    assert mod in str(info.value) and cause in str(info.value)
    code = cli.main(["train", *TINY, f"policy.path={tiny_models['policy']}", f"reward.function={mod}:f",
                     f"data.prompts={tiny_prompts}", f"run.out_dir={tmp_path / 'run'}"])
    assert code == 2 and cause in capsys.readouterr().err


def test_reward_module_without_the_function(tiny_models, tiny_prompts, tmp_path, monkeypatch):
    mod = _reward_module(tmp_path, monkeypatch, "oppo_test_no_fn", "y = 1\n")  # (x = 1: test_entry_validation)
    with pytest.raises(ModelLoadError) as info:
        Trainer.from_config(make_cfg(tiny_models, tiny_prompts, tmp_path, **{"reward.function": f"{mod}:x"}), progress=False)
    assert mod in str(info.value) and "'x'" in str(info.value)


# --------------------------------------------------------------------------- checkpoints

def _digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def test_interrupted_checkpoint_save_keeps_previous(tiny_models, tiny_prompts, tmp_path, monkeypatch):
    import oppo.checkpoint.store

    trainer = Trainer.from_config(make_cfg(tiny_models, tiny_prompts, tmp_path), progress=False)
    run_dir = tmp_path / "run"
    try:
        first = save_checkpoint(trainer, run_dir)
        assert first.name == "step_000000"
        for f in ("state.json", "optim.pt", "rng.pt", "policy/config.json", "critic/config.json"):
            assert (first / f).is_file(), f
        before = _digest(first)

        real_save = oppo.checkpoint.store.torch.save
        calls = []

        def failing_save(obj, f, *a, **k):
            calls.append(f)
            if len(calls) == 2:  # optim.pt is written, then the process "dies" writing rng.pt
                raise KeyboardInterrupt("interrupted mid-save")
            return real_save(obj, f, *a, **k)

        monkeypatch.setattr(oppo.checkpoint.store.torch, "save", failing_save)
        # a later step (a new directory) and the same step again (replacing the existing one)
        for step in (1, 0):
            calls.clear()
            trainer.step = step
            with pytest.raises(KeyboardInterrupt):
                save_checkpoint(trainer, run_dir)
            assert len(calls) == 2
            assert latest_checkpoint(run_dir) == first
            assert checkpoint_dirs(run_dir) == [first]
            assert _digest(first) == before  # intact, byte for byte
            steps = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_")]
            assert steps == [first]  # no half-written step_* directory
        monkeypatch.undo()

        trainer.step = 5
        load_checkpoint(trainer, latest_checkpoint(run_dir))  # the survivor still loads
        assert trainer.step == 0
    finally:
        trainer.close()


def test_non_finite_weights_are_refused_at_load(tiny_models, tmp_path):
    """A checkpoint with NaN weights (saved from a diverged run) is refused with the tensor named,
    not with the verifier's raw ``atol must be >= 0, got nan``."""
    import torch
    from transformers import AutoModelForCausalLM

    from oppo.models import ModelLoadError, load_causal_lm

    model = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path / "nan")
    with pytest.raises(ModelLoadError, match=r"non-finite .*model\.layers\.0\.mlp\.up_proj\.weight"):
        load_causal_lm(str(tmp_path / "nan"), "policy", torch.device("cpu"), torch.float32)


def test_reward_function_returning_none_is_said_so():
    fn = RewardFunction(lambda ps, rs: None, "mod:fn")
    with pytest.raises(ValueError) as info:
        fn(["a", "b"], ["x", "y"])
    msg = str(info.value)
    assert "mod:fn returned None (no return statement?)" in msg and "raised" not in msg


def test_a_failed_run_says_what_it_kept_and_how_to_go_on(tiny_models, tiny_prompts, tmp_path, capsys):
    """A reward function failing at step 0 leaves no run (removed: nothing to resume); failing at
    step 1 of a run given objects, after a checkpoint, names it and the Python call that continues."""
    import oppo
    from oppo.scoring.streaming import RewardFunctionError

    calls = []

    def fails_at_call(n):
        def score(prompts, responses):
            calls.append(1)
            if len(calls) >= n:
                raise RuntimeError("scorer down")
            return [0.0] * len(prompts)
        return score

    out = tmp_path / "run"
    cfg = make_cfg(tiny_models, tiny_prompts, tmp_path, **{"reward.function": "x:y", "run.steps": 3,
                                                          "log.progress": "false"})
    cfg.reward.function = None
    with pytest.raises(RewardFunctionError) as info:
        oppo.train(cfg, reward_fn=fails_at_call(1))
    err = capsys.readouterr().err
    assert "--resume" not in str(info.value) and "--resume" not in err
    assert f"nothing was trained, and what it wrote in {out} was removed" in err and not out.exists()

    calls.clear()
    cfg.run.save_every = 1
    with pytest.raises(RewardFunctionError):
        oppo.train(cfg, reward_fn=fails_at_call(2))
    err = capsys.readouterr().err
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and ckpt.name == "step_000001"
    assert f"the run failed in step 1; its last checkpoint is {ckpt} (step 1)" in err
    assert f"oppo.train(cfg, resume={str(out)!r}, ...) with the same settings and objects" in err
    # the directory records the failure, for whoever finds it later; a resume that goes on removes it
    failure = (out / "failure.txt").read_text().splitlines()
    assert failure[0].startswith("failed at ") and "RewardFunctionError: " in failure[0] and "scorer down" in failure[0]
    assert failure[1].startswith(f"the run failed in step 1; its last checkpoint is {ckpt}")
    calls.clear()
    oppo.train(cfg, resume="auto", reward_fn=fails_at_call(100))  # (the same function: its marker matches)
    assert not (out / "failure.txt").exists() and latest_checkpoint(out).name == "step_000003"


# --------------------------------------------------------------------------- GPT-2: dropout, a short context

def _gpt2(tiny_models, n_positions: int = 64):
    """A tiny GPT-2 (absolute position embeddings, dropout 0.1 as GPT-2's config has it), in train
    mode as a user's freshly built model is, and the tiny tokenizer."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(tiny_models["policy"])
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=n_positions, n_embd=16, n_layer=1, n_head=2,
                                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                       bos_token_id=tok.eos_token_id))
    assert model.training and model.config.resid_pdrop > 0
    return model.train(), tok


def test_gpt2_policy_object_with_dropout_trains(tiny_models, tmp_path):
    """A GPT-2 policy given as an object (train mode, dropout on), the critic made from it: trained,
    not refused as "not causal" because two probe forwards differed by their dropout masks."""
    policy, tok = _gpt2(tiny_models)
    cfg = load_config(None, [*TINY, "run.steps=1", f"run.out_dir={tmp_path / 'run'}"])
    with Trainer.from_config(cfg, progress=False, policy=policy, tokenizer=tok, prompts=["the film was", "a day", "i liked it"],
                 reward_fn=lambda prompts, responses: [float(len(r)) for r in responses]) as trainer:
        metrics = trainer.run_step()
        assert trainer.roles.critic is not None and not trainer.roles.critic.training
        from oppo.setup.load import ByRecord

        (fn,) = trainer.roles.reward.functions.values()  # reward.function: the reward's one term
        assert isinstance(fn, ByRecord)  # (errors name records: the test below)
    assert math.isfinite(metrics["loss/policy"]) and math.isfinite(metrics["loss/value"])


def test_prompts_longer_than_the_context_are_named_before_the_weights_load(tiny_models, tmp_path, monkeypatch):
    """Prompt + response longer than a model's positions (GPT-2's n_positions): one error naming
    the model, the lengths and the settings that fix it, before any weights load; not an IndexError
    from the position embedding mid-step."""
    policy, tok = _gpt2(tiny_models, n_positions=12)
    policy.save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "the film was very good and the book was quite fine"}) + "\n"
                       + json.dumps({"prompt": "a day"}) + "\n")
    loaded = []
    monkeypatch.setattr(oppo.setup.load, "load_causal_lm", lambda *a, **k: loaded.append(a) or 1 / 0)
    cfg = load_config(None, [*TINY, f"policy.path={tmp_path / 'gpt2'}", f"data.prompts={prompts}",
                             "reward.function=oppo.rewards:format_reward", "generation.max_new_tokens=6",
                             "data.max_prompt_tokens=64",  # (empty, the default, would cut it to fit: test_data.py)
                             f"run.out_dir={tmp_path / 'run'}"])
    with pytest.raises(ModelLoadError) as info:
        Trainer.from_config(cfg, progress=False)
    msg = str(info.value)
    assert not loaded
    assert "policy (policy.path)" in msg and "at most 12 positions" in msg and "is 11 tokens" in msg
    assert "generation.max_new_tokens=6 adds 6: 17 positions" in msg
    assert "data.max_prompt_tokens=6" in msg and "generation.max_new_tokens" in msg
    # within the context: it trains (the longest prompt cut to 6 tokens, 6 + 6 = 12)
    monkeypatch.undo()
    cfg = load_config(None, [*TINY, f"policy.path={tmp_path / 'gpt2'}", f"data.prompts={prompts}", "run.steps=1",
                             "reward.function=oppo.rewards:format_reward", "generation.max_new_tokens=6",
                             "data.max_prompt_tokens=6", f"run.out_dir={tmp_path / 'run2'}"])
    with Trainer.from_config(cfg, progress=False) as trainer:
        assert math.isfinite(trainer.run_step()["loss/policy"])


def test_reward_errors_name_the_prompts_records_not_stream_positions(tiny_models):
    """After an epoch the data positions run past the set's end, and a skipped prompt shifts every
    later one: the error names each prompt's record in the data as given (0-based, as the data
    errors do)."""
    from oppo.config import DataConfig
    from oppo.scoring.streaming import RewardFunctionError
    from oppo.setup.load import ByRecord

    tok = load_tokenizer(str(tiny_models["policy"]))
    ps = build_prompt_set(["the film", "", "a day", "i liked it"], tok, DataConfig(shuffle=False), seed=0)
    assert ps.skipped == 1 and len(ps) == 3
    assert ps.record_numbers([0, 1, 2, 3, 5]) == [0, 2, 3, 0, 3]  # (position 5: the second epoch's last)

    def broken(prompts, responses):
        raise KeyError("answer")

    fn = ByRecord(RewardFunction(broken, "mod:broken"), ps)
    with pytest.raises(RewardFunctionError, match=r"at step 4, on a batch of 2 responses to prompts 3, 0 of the "
                                                  r"prompt set \(the first prompt: 'i liked it'\)"):
        fn(["i liked it", "the film"], ["x", "y"], step=4, indices=[5, 3])
