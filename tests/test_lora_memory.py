"""LoRA (peft) and gradient checkpointing: what they promise, checked."""

import pytest
import torch

from oppo.checkpoint import latest_checkpoint
from oppo.config import load_config
from oppo.run import train
from oppo.trainer import Trainer


def _cfg(tiny_models, tiny_prompts, tmp_path, *extra):
    return load_config(None, [
        f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
        f"data.prompts={tiny_prompts}", "placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=2",
        "ppo.micro_batch_size=2", "generation.max_new_tokens=10", "overlap.mode=sequential",
        f"run.out_dir={tmp_path}", "log.progress=false", "run.samples=0", "ppo.actor_lr=1e-2", *extra])


def test_gradient_checkpointing_recomputes_and_changes_nothing(tiny_models, tiny_prompts, tmp_path):
    weights, forwards = {}, {}
    for gc in (False, True):
        t = Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path / str(gc), f"policy.gradient_checkpointing={gc}"),
                    progress=False)
        try:
            calls = []
            mlp = t.roles.policy.model.layers[0].mlp  # inside the checkpointed layer: runs again in backward
            h = mlp.register_forward_pre_hook(lambda m, a: calls.append(torch.is_grad_enabled()))
            t.run_step()
            h.remove()
            forwards[gc] = sum(calls)  # forwards with grad on: training, and the recomputation in backward
            weights[gc] = {n: p.detach().clone() for n, p in t.roles.policy.named_parameters()}
        finally:
            t.close()
    assert forwards[True] > forwards[False] > 0, forwards
    for n, w in weights[False].items():
        torch.testing.assert_close(weights[True][n], w, atol=1e-6, rtol=1e-5)


def test_lora_trains_adapters_and_shares_the_base_with_the_reference(tiny_models, tiny_prompts, tmp_path):
    t = Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path, "lora.r=4", "lora.alpha=8"), progress=False)
    try:
        inner = t.roles.policy.get_base_model()
        base = {n: p for n, p in inner.named_parameters() if "lora_" not in n}
        adapters = {n: p for n, p in inner.named_parameters() if "lora_" in n}
        assert adapters and all(p.requires_grad for p in adapters.values())
        assert not any(p.requires_grad for p in base.values())
        opt_params = {id(p) for g in t.roles.learner.actor_opt.param_groups for p in g["params"]}
        assert opt_params == {id(p) for p in adapters.values()}, "only the adapters train"
        # the reference is the base model: the same tensors, no copy
        ref = dict(t.roles.reference.named_parameters())
        for n, p in base.items():
            assert ref[n.replace(".base_layer.", ".")].data_ptr() == p.data_ptr(), n
        b0 = {n: p.detach().clone() for n, p in base.items()}
        a0 = {n: p.detach().clone() for n, p in adapters.items()}
        m = None
        for _ in range(2):
            m = t.run_step()
        assert m["kl/mean"] != 0.0, "the adapted policy moved away from the base reference"
        assert all(torch.equal(p, b0[n]) for n, p in base.items()), "base weights frozen"
        assert any(not torch.equal(p, a0[n]) for n, p in adapters.items()), "adapters trained"
    finally:
        t.close()


def test_lora_checkpoint_is_an_adapter_and_resumes(tiny_models, tiny_prompts, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    train(_cfg(tiny_models, tiny_prompts, out, "lora.r=4", "run.steps=1"), progress=False)
    ckpt = latest_checkpoint(out)
    assert (ckpt / "policy" / "adapter_config.json").is_file()
    assert not (ckpt / "policy" / "model.safetensors").exists(), "the adapter only, not the full weights"
    base = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    loaded = PeftModel.from_pretrained(base, ckpt / "policy").eval()
    t = Trainer.from_config(_cfg(tiny_models, tiny_prompts, out, "lora.r=4", "run.steps=2"), progress=False)
    try:
        from oppo.checkpoint import load_checkpoint

        x = torch.tensor([[3, 4, 5, 6, 7]])
        before = t.roles.policy(x).logits
        load_checkpoint(t, ckpt)
        after = t.roles.policy(x).logits
        with torch.no_grad():
            want = loaded(x).logits
        assert (before - want).abs().max() > 1e-4, "the checkpoint's adapter differs from a fresh one"
        torch.testing.assert_close(after, want, atol=1e-5, rtol=1e-5)
    finally:
        t.close()


def test_kv_budget_stops_a_step_with_the_fix(tiny_models, tiny_prompts, tmp_path):
    from oppo.rollout.eager.backend import KVBudgetError

    t = Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path, "generation.kv_budget_mb=0.01"), progress=False)
    try:
        with pytest.raises(KVBudgetError) as info:
            t.run_step()
        msg = str(info.value)
        assert "generation.kv_budget_mb=0.01" in msg and "ppo.batch_size" in msg and "max_new_tokens" in msg
    finally:
        t.close()


def test_kv_peak_is_reported_per_step_and_within_budget(tiny_models, tiny_prompts, tmp_path):
    t = Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path, "generation.kv_budget_mb=64"), progress=False)
    try:
        m = t.run_step()
        # 4 rows, at most ~16 columns, 2 layers x (k, v) x 2 kv heads x 8 dims x 4 bytes per column
        assert 0 < m["memory/actor_kv_peak_mb"] < 64 and m["memory/host_rss_peak_mb"] > 0
    finally:
        t.close()


def test_lora_reference_of_a_tied_model_shares_its_head(tmp_path):
    """A policy whose output head is tied to its embedding (the built-in task's, SmolLM2's): the
    LoRA reference view holds both under their names, as the same tensor as the policy's."""
    from conftest import make_models

    from oppo.models import apply_lora, base_view

    from transformers import AutoModelForCausalLM

    path = make_models(tmp_path, tie=True)["policy"]
    policy = apply_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), 4, 8.0, 0.0, [])
    view = base_view(policy)
    inner = policy.get_base_model()
    assert view.lm_head.weight is view.model.embed_tokens.weight
    assert view.model.embed_tokens.weight is inner.model.embed_tokens.weight
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad(), policy.disable_adapter():
        torch.testing.assert_close(view(ids).logits, policy(ids).logits)
