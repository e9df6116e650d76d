"""examples/trl_ppo.py, TRL's PPO example script ported to oppo: its TRL arguments become the oppo
settings docs/from-trl.md names, and it trains on tiny local models."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import oppo
from oppo.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def _port():
    spec = importlib.util.spec_from_file_location("trl_ppo", ROOT / "examples" / "trl_ppo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trl_arguments_become_oppo_settings():
    port = _port()
    a = port.parse_args(["--dataset_name", "p.jsonl", "--output_dir", "out", "--sft_model_path", "sft",
                         "--reward_model_path", "rm", "--per_device_train_batch_size", "4",
                         "--gradient_accumulation_steps", "2", "--num_mini_batches", "2", "--total_episodes", "100",
                         "--learning_rate", "1e-6", "--response_length", "20", "--missing_eos_penalty", "1.0",
                         "--cliprange", "0.1", "--vf_coef", "0.5"])
    cfg = oppo.load_config(overrides=port.overrides(a))
    assert (cfg.ppo.batch_size, cfg.ppo.minibatch_size, cfg.ppo.micro_batch_size) == (16, 8, 4)
    assert cfg.run.steps == 7  # ceil(100 episodes / 16 per step)
    assert cfg.ppo.actor_lr == cfg.ppo.critic_lr == 1e-6  # TRL's one optimizer over policy and value
    assert (cfg.policy.path, cfg.reward.path, cfg.critic.path) == ("sft", "rm", None)  # critic from the RM
    assert cfg.ppo.epochs == 4 and cfg.generation.temperature == 0.7 and cfg.ppo.kl_coef == 0.05  # TRL's defaults
    assert cfg.generation.max_new_tokens == 20 and cfg.ppo.clip_eps == 0.1 and cfg.ppo.missing_eos_penalty == 1.0
    said = port.notes(a)
    assert len(said) == 1 and said[0].startswith("TRL's vf_coef=0.5 has no oppo setting")


# the port as a command of its own (clirun: forked from the test's fork server)
_PORT_CLI = ("import runpy, sys; sys.argv = ['examples/trl_ppo.py', *sys.argv[1:]]; "
             f"runpy.run_path({str(ROOT / 'examples' / 'trl_ppo.py')!r}, run_name='__main__')")


def test_port_stops_on_ctrl_c_with_a_checkpoint_and_resumes(tiny_models, tiny_prompts, tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) during a step of the port: as
    ``oppo train``, the step finishes, a checkpoint is written, the exit status is 130 and the last
    line says how to continue, in the port's own command line; ``--resume`` continues from there,
    each step logged once, to the end: the summary, and the model at the top of --output_dir.
    (It is also the test that the port trains: the run and its resume go through it.)"""
    import os
    import signal
    import sys
    import time

    import clirun

    from oppo.checkpoint import latest_checkpoint
    from test_kill_resume import _env, _lines

    out = tmp_path / "run"
    flags = ["--dataset_name", str(tiny_prompts), "--output_dir", str(out), "--sft_model_path",
             str(tiny_models["policy"]), "--reward_model_path", str(tiny_models["reward"]),
             "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--num_ppo_epochs", "1",
             "--response_length", "8", "--oppo", "placement.threads=1", "--oppo", "run.samples=0",
             "--oppo", "log.progress=false"]
    proc = clirun.Popen([sys.executable, "-c", _PORT_CLI, *flags, "--total_episodes", "400000"], env=_env(),
                        start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _lines(out / "lengths.jsonl") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, f"the port ended early: {proc.stderr.read()[-2000:]}"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    ckpt = latest_checkpoint(out)
    assert ckpt is not None, "no checkpoint written on Ctrl-C"
    step = json.loads((ckpt / "state.json").read_text())["step"]
    assert [r["step"] for r in _lines(out / "lengths.jsonl")] == list(range(step))
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"oppo: stopped by SIGINT after {step} of 100000 steps: checkpoint {ckpt}"), last
    assert last.endswith(f"python examples/trl_ppo.py with the same flags and --resume {out}."), last

    done = clirun.run([sys.executable, "-c", _PORT_CLI, *flags, "--total_episodes", str(4 * (step + 1)),
                       "--resume", str(out)], env=_env(), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in _lines(out / "lengths.jsonl")] == list(range(step + 1)), "every step logged once"
    assert f"done: {step + 1} steps" in done.stdout  # oppo train's summary
    assert (out / "model.safetensors").is_file(), "the trained model at the top of --output_dir, as TRL leaves it"


def test_port_errors_name_the_flags_typed():
    """oppo's messages in the port name the TRL flag that set a setting (one set from several flags
    says which), except a setting the user gave with --oppo; the resume command is the port's."""
    port = _port()
    a = port.parse_args(["--dataset_name", "p.jsonl", "--output_dir", "out", "--oppo", "generation.max_new_tokens=9"])
    said = port.in_flags("policy.path='x/y' is not in the cache: give policy.path=/local/dir. ppo.batch_size=8 "
                         "and run.out_dir; generation.max_new_tokens=9; oppo train --resume out (and the same "
                         "settings).", a)
    assert said == ("--sft_model_path 'x/y' is not in the cache: give --sft_model_path /local/dir. ppo.batch_size=8 "
                    "(from --per_device_train_batch_size x --gradient_accumulation_steps x --num_mini_batches) and "
                    "--output_dir; generation.max_new_tokens=9; python examples/trl_ppo.py with the same flags and "
                    "--resume out.")
    assert port.in_flags("ppo.policy.pathology", a) == "ppo.policy.pathology"  # names, not parts of names


# TRL's documented PPO command lines (docs/source/ppo_trainer.md, examples/scripts/ppo/ppo.py and
# ppo_tldr.py, examples/scripts/ppo/README.md), the arguments after the script's name as TRL shows them
TRL_COMMANDS = {
    "docs quick start": """--dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style
        --dataset_train_split descriptiveness --learning_rate 3e-6 --num_ppo_epochs 1 --num_mini_batches 1
        --output_dir models/minimal/ppo --per_device_train_batch_size 64 --gradient_accumulation_steps 1
        --total_episodes 10000 --model_name_or_path EleutherAI/pythia-1b-deduped
        --sft_model_path EleutherAI/pythia-1b-deduped --reward_model_path EleutherAI/pythia-1b-deduped
        --missing_eos_penalty 1.0""",
    "ppo.py": """--dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style
        --dataset_train_split descriptiveness --learning_rate 3e-6
        --output_dir pythia-1b-deduped-descriptiveness-sentiment-trl-style-ppo --per_device_train_batch_size 64
        --gradient_accumulation_steps 1 --total_episodes 10000 --model_name_or_path EleutherAI/pythia-1b-deduped
        --missing_eos_penalty 1.0""",
    "ppo.py, accelerate": """--dataset_name trl-internal-testing/descriptiveness-sentiment-trl-style
        --dataset_train_split descriptiveness --output_dir pythia-1b-deduped-descriptiveness-sentiment-trl-style-ppo
        --num_ppo_epochs 1 --num_mini_batches 1 --learning_rate 3e-6 --per_device_train_batch_size 1
        --gradient_accumulation_steps 16 --total_episodes 10000 --model_name_or_path EleutherAI/pythia-1b-deduped
        --sft_model_path EleutherAI/pythia-1b-deduped --reward_model_path EleutherAI/pythia-1b-deduped
        --local_rollout_forward_batch_size 1 --missing_eos_penalty 1.0""",
    "ppo_tldr.py": """--dataset_name trl-lib/tldr --dataset_test_split validation --learning_rate 3e-6
        --output_dir pythia-1b-deduped-tldr-preference-sft-trl-style-ppo --per_device_train_batch_size 1
        --gradient_accumulation_steps 64 --total_episodes 30000 --model_name_or_path EleutherAI/pythia-1b-deduped
        --sft_model_path cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr
        --reward_model_path cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr --missing_eos_penalty 1.0
        --stop_token eos --response_length 53 --eval_strategy steps --eval_steps 100""",
    "ppo_tldr.py, accelerate": """--dataset_name trl-lib/tldr --dataset_test_split validation
        --output_dir pythia-1b-deduped-tldr-preference-sft-trl-style-ppo --learning_rate 3e-6
        --per_device_train_batch_size 16 --gradient_accumulation_steps 4 --total_episodes 1000000
        --model_name_or_path EleutherAI/pythia-1b-deduped --sft_model_path cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr
        --reward_model_path cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr --local_rollout_forward_batch_size 16
        --missing_eos_penalty 1.0 --stop_token eos --eval_strategy steps --eval_steps 100""",
    "README step 3": """--dataset_name trl-lib/tldr --dataset_test_split validation --output_dir pythia-1b-deduped-tldr-ppo
        --per_device_train_batch_size 1 --gradient_accumulation_steps 64 --total_episodes 30000
        --model_name_or_path EleutherAI/pythia-1b-deduped --sft_model_path pythia-1b-deduped-tldr-sft
        --reward_model_path pythia-1b-deduped-tldr-rm --missing_eos_penalty 1.0 --stop_token eos --response_length 53
        --eval_strategy steps --eval_steps 100""",
    "everyday flags": """--dataset_name trl-lib/tldr --output_dir out --total_episodes 64 --logging_steps 10
        --bf16 False --use_peft --lora_r 8 --lora_dropout 0.05 --trust_remote_code --push_to_hub --dtype float16
        --sft_model_path cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr
        --reward_model_path cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr""",
}


@pytest.fixture(scope="module")
def stand_ins(tiny_models, tmp_path_factory):
    """Local stand-ins for the hub names in TRL's command lines: the tiny causal LM for the Pythia
    base and SFT models, the tiny one-label classifier for the trained reward models, and saved
    DatasetDicts of TRL's splits with a 'prompt' column."""
    import datasets

    from conftest import TINY_PROMPTS

    root = tmp_path_factory.mktemp("trl_stand_ins")
    prompts = datasets.Dataset.from_dict({"prompt": list(TINY_PROMPTS)})
    datasets.DatasetDict({"descriptiveness": prompts}).save_to_disk(root / "descriptiveness")
    datasets.DatasetDict({"train": prompts, "validation": prompts}).save_to_disk(root / "tldr")
    lm, rm = str(tiny_models["policy"]), str(tiny_models["reward"])
    return root, {"trl-internal-testing/descriptiveness-sentiment-trl-style": str(root / "descriptiveness"),
                  "trl-lib/tldr": str(root / "tldr"), "EleutherAI/pythia-1b-deduped": lm,
                  "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr": lm, "pythia-1b-deduped-tldr-sft": lm,
                  "cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr": rm, "pythia-1b-deduped-tldr-rm": rm}


def _argv(command: str, names: dict, out) -> list[str]:
    argv = [names.get(w, w) for w in command.split()]
    argv[argv.index("--output_dir") + 1] = str(out)
    return argv


@pytest.mark.parametrize("name", list(TRL_COMMANDS))
def test_trl_command_lines_become_oppo_settings(name, stand_ins, tmp_path):
    """Every documented command line parses and maps to a valid oppo config: TRL's loop (sequential),
    the reward head TRL would put on a causal LM, TRL's batch sizes and length."""
    root, names = stand_ins
    port = _port()
    a = port.parse_args(_argv(TRL_COMMANDS[name], names, tmp_path / "out"))
    cfg = oppo.load_config(overrides=port.overrides(a))
    assert cfg.overlap.mode == "sequential" and cfg.reward.new_head
    assert cfg.ppo.batch_size == a.per_device_train_batch_size * a.gradient_accumulation_steps * a.num_mini_batches
    assert cfg.run.steps == -(-a.total_episodes // cfg.ppo.batch_size)
    said = port.notes(a)
    assert not any("stop_token" in line for line in said), "--stop_token eos is oppo's own behaviour"
    if "--eval_strategy" in TRL_COMMANDS[name]:
        assert sum("--eval_strategy steps: no oppo setting" in line for line in said) == 1
    if name == "everyday flags":
        assert cfg.policy.trust_remote_code and cfg.lora.r == 8 and cfg.policy.dtype == "auto"
        for flag in ("--logging_steps 10", "--lora_dropout 0.05", "--push_to_hub", "--dtype float16"):
            assert sum(line.startswith(flag) for line in said) == 1, (flag, said)
        assert not any(line.startswith("--bf16") for line in said)  # False: TRL's default, nothing to say


@pytest.mark.parametrize("name", ["docs quick start", "ppo_tldr.py"])
def test_trl_command_lines_train_on_stand_ins(name, stand_ins, tmp_path, capsys):
    """TRL's quick start (a causal LM as the reward model) and its TL;DR command train through the
    port: one step of TRL's batch (``--total_episodes`` cut to one batch; the test's thread count and
    quiet output added), and the trained model is at the top of --output_dir, as TRL leaves it."""
    root, names = stand_ins
    out = tmp_path / "out"
    argv = _argv(TRL_COMMANDS[name], names, out)
    a = _port().parse_args(argv)
    argv[argv.index("--total_episodes") + 1] = str(a.per_device_train_batch_size * a.gradient_accumulation_steps)
    argv += ["--oppo", "placement.threads=1", "--oppo", "run.samples=0", "--oppo", "log.progress=false"]
    if name == "ppo_tldr.py":
        argv[argv.index("--response_length") + 1] = "8"  # (53 tokens of a random tiny model: time only)
    else:
        argv += ["--response_length", "8"]
    assert _port().main(argv) == 0
    cap = capsys.readouterr()
    assert [m["step"] for m in read_metrics(out)] == [0]
    assert "done: 1 steps" in cap.out
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file()
    random_head = "reward.new_head=true puts a fresh one-label head on it"
    assert cap.err.count(random_head) == (1 if name == "docs quick start" else 0)


def test_new_head_is_asked_for_and_the_same_in_every_load(tiny_models):
    """Without reward.new_head a causal LM is refused as the reward model, the message naming the
    setting; with it, every load (another process, a resume) gets the same seeded head."""
    import torch

    from oppo.models import ModelLoadError, load_reward_model

    lm = str(tiny_models["policy"])
    with pytest.raises(ModelLoadError, match="reward.new_head=true puts a fresh"):
        load_reward_model(lm, torch.device("cpu"), torch.float32, 0)
    torch.manual_seed(1)
    a = load_reward_model(lm, torch.device("cpu"), torch.float32, 0, new_head=True)
    torch.manual_seed(2)
    b = load_reward_model(lm, torch.device("cpu"), torch.float32, 0, new_head=True)
    assert a.score.weight.shape[0] == 1 and torch.equal(a.score.weight, b.score.weight)
    assert a.score.weight.abs().sum() > 0


# --------------------------------------------------------------------------- the GSM8K recipes' data step

GSM8K_ROWS = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
              {"question": "What is 10 * 100?", "answer": "#### 1,000"}]


def _export_commands(recipe: str) -> list[str]:
    """The export command lines in a recipe's leading comments."""
    text = (ROOT / "src" / "oppo" / "recipes" / f"{recipe}.yaml").read_text()
    return [line.lstrip("# ").strip() for line in text.splitlines()
            if line.startswith("#") and "examples/gsm8k_export.py" in line and "python " in line]


def _check_export(out: Path) -> None:
    from oppo.rewards import gold_answer

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["answer"] for r in rows] == [r["answer"] for r in GSM8K_ROWS]
    for row, src in zip(rows, GSM8K_ROWS):
        assert row["question"].startswith(src["question"])
        assert row["question"].endswith("put your final answer within \\boxed{}.")  # a backslash, not a backspace
    assert [gold_answer(r["answer"]) for r in rows] == ["7", "1000"]


@pytest.mark.parametrize("recipe", ["gsm8k_ppo", "gsm8k_grpo"])
def test_recipe_export_commands_run_as_written_on_a_local_file(recipe, tmp_path):
    """The recipe's offline export line runs in bash as printed (a parquet file laid out as
    ``hf download openai/gsm8k --repo-type dataset`` leaves it), and writes the file the recipe reads."""
    import shlex
    import subprocess

    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    commands = _export_commands(recipe)
    assert len(commands) == 2, commands
    local = [c for c in commands if ".parquet" in c]
    assert len(local) == 1
    src = tmp_path / "gsm8k" / "main" / "train-00000-of-00001.parquet"
    src.parent.mkdir(parents=True)
    pq.write_table(pyarrow.Table.from_pylist(GSM8K_ROWS), src)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    import os
    import sys

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # python: ours
    r = subprocess.run(["bash", "-c", local[0]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = tmp_path / shlex.split(local[0])[shlex.split(local[0]).index("--out") + 1]
    assert out.name == Path(oppo.load_config(recipe=recipe).data.prompts).name  # the file the recipe reads
    _check_export(out)


def test_export_reads_jsonl_without_datasets_and_the_hub_with_it(tmp_path, monkeypatch):
    """A local JSONL needs nothing installed; a hub name goes through datasets.load_dataset(name,
    'main', split='train') (faked here: no network), and without datasets it is refused with the fix."""
    import sys
    import types

    spec = importlib.util.spec_from_file_location("gsm8k_export", ROOT / "examples" / "gsm8k_export.py")
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    src = tmp_path / "gsm8k.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets fails
    assert export.main([str(src), "--out", str(tmp_path / "a.jsonl")]) == 0
    _check_export(tmp_path / "a.jsonl")
    with pytest.raises(SystemExit, match="needs the 'datasets' package"):
        export.main(["openai/gsm8k", "--out", str(tmp_path / "b.jsonl")])
    calls = []
    fake = types.SimpleNamespace(load_dataset=lambda *a, **k: calls.append((a, k)) or list(GSM8K_ROWS))
    monkeypatch.setitem(sys.modules, "datasets", fake)
    assert export.main(["--out", str(tmp_path / "b.jsonl")]) == 0
    assert calls == [(("openai/gsm8k", "main"), {"split": "train"})]
    _check_export(tmp_path / "b.jsonl")
    def offline(*a, **k):  # datasets without network (issue 53: a raw ConnectionError traceback)
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(SystemExit, match="Could not reach the Hugging Face hub.*hf download openai/gsm8k"):
        export.main(["--out", str(tmp_path / "d.jsonl")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(SystemExit, match="'question' and 'answer'"):
        export.main([str(bad), "--out", str(tmp_path / "c.jsonl")])
