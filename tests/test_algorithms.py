"""Critic-free algorithms end to end: GRPO, RLOO, REINFORCE++ train in sequential and overlapped
modes with no critic anywhere, and groups stay whole."""

import pytest
import torch

from oppo.checkpoint import latest_checkpoint
from oppo.config import ConfigError, load_config
from oppo.run import train
from oppo.trainer import Trainer
from validated import load_valid


def _cfg(tiny_models, tiny_prompts, tmp_path, *extra):
    return load_config(None, [
        f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
        f"data.prompts={tiny_prompts}", "placement.threads=1", "ppo.batch_size=8", "ppo.minibatch_size=4",
        "ppo.micro_batch_size=4", "generation.max_new_tokens=10", "overlap.chunk_size=4",
        f"run.out_dir={tmp_path}", "log.progress=false", "run.samples=0", *extra])


@pytest.mark.parametrize("algo,mode", [("grpo", "sequential"), ("grpo", "oppo"), ("rloo", "inter"),
                                       ("reinforce_pp", "intra")])
def test_critic_free_algorithms_train(tiny_models, tiny_prompts, tmp_path, algo, mode):
    extra = ["overlap.delta=1", "overlap.max_lag=1"] if mode in ("inter", "oppo") else []
    t = Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path, f"algo.name={algo}", f"overlap.mode={mode}", *extra),
                progress=False)
    try:
        assert t.roles.critic is None and t.roles.learner.critic_opt is None, "no critic loaded"
        if t.roles.scorer is not None:
            assert "critic" not in t.roles.scorer.scorers, "no critic scored"
        w0 = t.roles.policy.lm_head.weight.detach().clone()
        G = t.cfg.group_size
        assert G == (4 if algo in ("grpo", "rloo") else 1)
        for _ in range(3):
            m = t.run_step()
            exp = t.last_result.exp
            assert exp.values is None and exp.returns is None
            assert "loss/value" not in m and "value/explained_var" not in m
            assert torch.isfinite(exp.advantages).all() and m["loss/policy"] == m["loss/policy"]
            # whole groups, members adjacent, one prompt per group
            rows = exp.rollouts
            assert len(rows) == 8
            for i in range(0, 8, G):
                grp = rows[i:i + G]
                assert len({r.group for r in grp}) == 1 and len({r.prompt_index for r in grp}) == 1
                if G > 1:  # group baselines: each group's advantages sum to zero at the sequence level
                    seq_adv = exp.advantages[i:i + G, 0]
                    assert abs(seq_adv.sum().item()) < 1e-4
            assert len({r.group for r in rows}) == 8 // G
        if algo == "grpo":
            assert "loss/kl" in m, "GRPO puts the KL in the loss"
        assert not torch.equal(t.roles.policy.lm_head.weight, w0), "the actor trained"
    finally:
        t.close()


def test_grpo_checkpoint_has_no_critic_and_resumes(tiny_models, tiny_prompts, tmp_path):
    out = tmp_path / "run"
    train(_cfg(tiny_models, tiny_prompts, out, "algo.name=grpo", "overlap.mode=sequential", "run.steps=1"),
          progress=False)
    ckpt = latest_checkpoint(out)
    assert (ckpt / "policy").is_dir() and not (ckpt / "critic").exists()
    assert "critic" not in torch.load(ckpt / "optim.pt", weights_only=False)
    train(_cfg(tiny_models, tiny_prompts, out, "algo.name=grpo", "overlap.mode=sequential", "run.steps=2"),
          resume="auto", progress=False)
    assert latest_checkpoint(out).name == "step_000002"


@pytest.mark.parametrize("bad,msg", [
    (["algo.name=rloo", "algo.group_size=1"], "group_size >= 2"),
    (["algo.name=grpo", "ppo.batch_size=6", "ppo.minibatch_size=6", "ppo.micro_batch_size=6"], "multiple of the group size"),
    (["algo.kl_placement=loss", "ppo.kl_estimator=k1"], "k3"),
    (["algo.name=grpo", "overlap.delta=3"], "counts groups"),
])
def test_bad_algorithm_settings(bad, msg):
    with pytest.raises(ConfigError, match=msg):
        load_valid(None, ["ppo.batch_size=8", "ppo.minibatch_size=4", "ppo.micro_batch_size=4", *bad])


@pytest.mark.parametrize("policy", ["carry", "wait"])
def test_partly_finished_groups_carried_or_waited_for(tiny_models, tiny_prompts, tmp_path, policy):
    """Members of a group with their own forced lengths: under carry some finished members wait
    for a sibling across a close; under wait none does, and every group still trains whole."""
    t = Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path, "algo.name=grpo", "algo.group_size=2", "overlap.mode=oppo",
                     "overlap.delta=2", "overlap.max_lag=1", f"overlap.partial_groups={policy}"), progress=False)
    t.length_sampler = lambda i, member: 2 if member == 0 else 2 + (3 * i + 5) % 9  # sibling 2-10 tokens
    try:
        waiting = []
        for _ in range(4):
            m = t.run_step()
            waiting.append(m["overlap/waiting_members"])
            rows = t.last_result.exp.rollouts
            for i in range(0, len(rows), 2):  # whole groups, one prompt each
                assert rows[i].group == rows[i + 1].group and rows[i].prompt_index == rows[i + 1].prompt_index
        if policy == "wait":
            assert waiting == [0] * 4
        else:
            assert max(waiting) > 0
    finally:
        t.close()
