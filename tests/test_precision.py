"""Mixed precision: bf16 compute trains fp32 master weights (checks that fail on bf16 training)."""

import pytest
import torch

from oppo.config import load_config
from oppo.trainer import Trainer
from oppo.weights.precision import copy_weights, master_dtype, serving_copy
from validated import load_valid


def _cfg(tiny_models, tiny_prompts, tmp_path, *extra):
    return load_config(None, [
        f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
        f"data.prompts={tiny_prompts}", "placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=4",
        "ppo.micro_batch_size=2", "generation.max_new_tokens=8", f"run.out_dir={tmp_path}",
        "log.progress=false", "ppo.actor_lr=1e-5", "ppo.critic_lr=1e-5", *extra])


def test_adamw_on_bf16_weights_loses_small_updates():
    """The defect the masters fix, measured: at lr 1e-5 most bf16 weights never move."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256)
    changed = {}
    for dt in (torch.bfloat16, torch.float32):
        w = layer.weight.detach().to(dt).clone().requires_grad_(True)
        opt = torch.optim.AdamW([w], lr=1e-5, weight_decay=0.0)
        start = w.detach().clone()
        for _ in range(10):
            opt.zero_grad()
            (w.float() * torch.randn(256, 256)).sum().backward()
            opt.step()
        changed[dt] = (w.detach() != start).float().mean().item()
    assert changed[torch.float32] > 0.99
    assert changed[torch.bfloat16] < 0.5


def check_mixed_precision_steps(t: Trainer, steps: int = 2) -> dict:
    """Run ``steps`` steps of a bf16 Trainer and check what mixed precision promises; return the
    last metrics. Shared with the GPU test."""
    assert t.roles.compute_dtype == torch.bfloat16
    assert next(t.roles.policy.parameters()).dtype == torch.float32, "actor master weights in fp32"
    assert next(t.roles.critic.parameters()).dtype == torch.float32, "critic master weights in fp32"
    assert next(t.roles.rollout_policy.parameters()).dtype == torch.bfloat16, "the engine decodes in bf16"
    assert next(t.roles.scoring_critic.parameters()).dtype == torch.bfloat16
    assert next(t.roles.reference.parameters()).dtype == torch.bfloat16
    assert t.roles.learner.recompute_old, "auto: bf16 sampler log-probs are recomputed"
    w0 = {n: p.detach().clone() for n, p in t.roles.policy.named_parameters()}
    c0 = {n: p.detach().clone() for n, p in t.roles.critic.named_parameters()}
    m = {}
    for _ in range(steps):
        m = t.run_step()
    for st in t.roles.learner.actor_opt.state.values():  # optimizer state is fp32 too
        assert st["exp_avg"].dtype == torch.float32 and st["exp_avg_sq"].dtype == torch.float32
    # nearly every weight moved at lr 1e-5 (in bf16 most would round away)
    name = next(n for n, p in t.roles.policy.named_parameters() if p.dim() == 2 and "embed" not in n)
    moved = (t.roles.policy.get_parameter(name) != w0[name].to(t.roles.policy.get_parameter(name).device)).float().mean().item()
    assert moved > 0.9, (name, moved)
    cname = next(n for n, p in t.roles.critic.named_parameters() if p.dim() == 2 and "embed" not in n)
    p = t.roles.critic.get_parameter(cname)
    assert (p != c0[cname].to(p.device)).float().mean().item() > 0.9
    # the serving copies hold the masters' current weights, cast
    for (n, p), q in zip(t.roles.policy.named_parameters(), t.roles.rollout_policy.parameters()):
        assert torch.equal(p.detach().to(torch.bfloat16), q), n
    for (n, p), q in zip(t.roles.critic.named_parameters(), t.roles.scoring_critic.parameters()):
        assert torch.equal(p.detach().to(torch.bfloat16), q), n
    # the bf16 sampler against the training forward (tiny random models: a loose bound)
    assert "mismatch/logprob_abs_diff" in m and 0 <= m["mismatch/logprob_abs_diff"] < 0.5
    assert 0 <= m["mismatch/kl"] < 0.5 and 0 < m["mismatch/ess"] <= 1
    assert all(v == v for k, v in m.items() if k.startswith(("loss/", "reward/")))  # no NaN
    return m


@pytest.mark.parametrize("mode", ["sequential", "oppo"])
def test_bf16_trains_fp32_masters(tiny_models, tiny_prompts, tmp_path, mode):
    cfg = _cfg(tiny_models, tiny_prompts, tmp_path, "policy.dtype=bfloat16", f"overlap.mode={mode}",
               "overlap.delta=2", "overlap.max_lag=1", "overlap.chunk_size=4")
    t = Trainer.from_config(cfg, progress=False)
    try:
        check_mixed_precision_steps(t)
    finally:
        t.close()


def test_float32_has_one_model_per_role(tiny_models, tiny_prompts, tmp_path):
    t = Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path, "overlap.mode=sequential"), progress=False)
    try:
        assert t.roles.rollout_policy is t.roles.policy and t.roles.scoring_critic is t.roles.critic
        assert not t.roles.learner.recompute_old, "auto: fp32 sampler log-probs equal the training forward's"
    finally:
        t.close()


def test_serving_copy_and_sync():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    assert master_dtype(torch.bfloat16) == torch.float32 and master_dtype(torch.float32) == torch.float32
    assert serving_copy(m, torch.float32) is m
    c = serving_copy(m, torch.bfloat16)
    assert c is not m and next(c.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        m[0].weight.add_(1.0)
    assert not torch.equal(c[0].weight, m[0].weight.to(torch.bfloat16))
    copy_weights(m, c)
    assert torch.equal(c[0].weight, m[0].weight.to(torch.bfloat16))


def test_serving_copy_keeps_rotary_frequencies_fp32(tiny_models):
    """A bf16 serving copy (engine, reference, critic scorer) keeps its buffers (rotary ``inv_freq``)
    in fp32, as ``from_pretrained(dtype=bfloat16)`` does, across syncs: rounded frequencies put
    sampler, reference and trainer at other positions, more so the longer the sequence."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    c = serving_copy(m, torch.bfloat16)
    copy_weights(m, c)
    bufs = dict(c.named_buffers())
    assert bufs and all(b.dtype == torch.float32 for b in bufs.values())
    assert all(torch.equal(b, bufs[n]) for n, b in m.named_buffers())


def test_float16_is_refused_with_the_fix():
    from oppo.config import ConfigError

    with pytest.raises(ConfigError, match="bfloat16"):
        load_valid(None, ["policy.dtype=float16"])
