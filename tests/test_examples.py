"""examples/trl_ppo.py, TRL's PPO example script ported to oppo: its TRL arguments become the oppo
settings docs/from-trl.md names, and it trains on tiny local models."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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


def test_port_trains_on_tiny_models(tiny_models, tiny_prompts, tmp_path, capsys):
    out = tmp_path / "run"
    assert _port().main(["--dataset_name", str(tiny_prompts), "--output_dir", str(out),
                         "--sft_model_path", str(tiny_models["policy"]),
                         "--reward_model_path", str(tiny_models["reward"]), "--per_device_train_batch_size", "4",
                         "--total_episodes", "8", "--response_length", "6", "--num_ppo_epochs", "1",
                         "--oppo", "overlap.mode=sequential", "--oppo", "placement.threads=1",
                         "--oppo", "run.samples=0", "--oppo", "log.progress=false",
                         "--oppo", "run.save_final=none"]) == 0
    assert [m["step"] for m in read_metrics(out)] == [0, 1]
    assert "done: 2 steps" in capsys.readouterr().out
