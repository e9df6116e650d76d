"""ppo.lr_warmup_steps: a linear learning-rate ramp counted by the optimizer itself."""

from types import SimpleNamespace

import pytest
import torch

from oppo.config import ConfigError, PPOConfig, load_config
from oppo.learner.local import UpdateSettings, train_minibatches
from oppo.trainer import Trainer
from validated import load_valid


def _run(opt, model, cfg, n_minibatches: int) -> list[float]:
    """Take n optimizer steps through the learner's own loop; the learning rate of each."""
    used = []
    step = opt.step

    def record_step(*a, **kw):
        used.append(opt.param_groups[0]["lr"])
        return step(*a, **kw)

    opt.step = record_step

    def micro(rows, num_tokens, num_seqs):
        model(torch.ones(len(rows), 2)).sum().backward()
        return {"_frac": 1.0}

    mask = torch.ones(n_minibatches, 3)
    train_minibatches(model, opt, SimpleNamespace(mask=mask), list(torch.arange(n_minibatches).split(1)),
                      UpdateSettings.of(cfg, "actor"), "actor", micro)
    opt.step = step
    return used


def test_ramp_by_hand_and_resume_continues_it():
    cfg = PPOConfig(actor_lr=0.1, lr_warmup_steps=4, micro_batch_size=1, packing="off")  # (a stand-in batch: no tokens)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.actor_lr)
    assert _run(opt, model, cfg, 2) == pytest.approx([0.025, 0.05])
    # a resumed optimizer carries its step count in its state dict: the ramp goes on from step 3
    resumed = torch.optim.AdamW(model.parameters(), lr=cfg.actor_lr)
    resumed.load_state_dict(opt.state_dict())
    assert _run(resumed, model, cfg, 4) == pytest.approx([0.075, 0.1, 0.1, 0.1])
    # without warm-up the learner leaves the rate alone
    plain = torch.optim.AdamW(model.parameters(), lr=0.3)
    assert _run(plain, model, PPOConfig(actor_lr=0.1, micro_batch_size=1, packing="off"), 2) == [0.3, 0.3]


def test_trainer_ramps_actor_and_critic(tiny_models, tiny_prompts, tmp_path):
    cfg = load_config(None, [
        f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
        f"data.prompts={tiny_prompts}", "placement.threads=1", "ppo.batch_size=8", "ppo.minibatch_size=4",
        "ppo.micro_batch_size=4", "generation.max_new_tokens=6", "overlap.mode=sequential",
        "ppo.lr_warmup_steps=6", "ppo.actor_lr=3e-4", "ppo.critic_lr=6e-4",
        f"run.out_dir={tmp_path}", "log.progress=false", "run.samples=0"])
    t = Trainer.from_config(cfg, progress=False)
    try:
        t.run_step()  # two minibatches: two optimizer steps each
        assert t.roles.learner.actor_opt.param_groups[0]["lr"] == pytest.approx(3e-4 * 2 / 6)
        assert t.roles.learner.critic_opt.param_groups[0]["lr"] == pytest.approx(6e-4 * 2 / 6)
    finally:
        t.close()
    with pytest.raises(ConfigError, match="lr_warmup_steps"):
        load_valid(None, ["ppo.lr_warmup_steps=-1"])
