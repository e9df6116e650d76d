"""Padded attention heads (``oppo.rollout.vllm.heads``): the padded model is the same function.

Checked with Hugging Face's own Llama and Qwen2 (no vLLM needed): a model with heads of 48 and its
padded copy (heads of 64, rotary base and query scale rewritten) give the same logits. The vLLM
engine serving a padded model is tested in ``test_vllm.py``."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from oppo.rollout.vllm.heads import HeadPadding, ServedCheckpoint

SUPPORTED = [32, 64, 80, 96, 112, 128]  # vLLM 0.32's CPU attention (a subset)


def _model(kind: str, path):
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  max_position_embeddings=64)
    if kind == "llama":
        m = LlamaForCausalLM(LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=True))
    else:  # grouped-query attention and q/k/v biases
        m = Qwen2ForCausalLM(Qwen2Config(**common, num_key_value_heads=1))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # biases nonzero too
    m.save_pretrained(path)
    return m.eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_padded_heads_compute_the_same_logits(tmp_path, kind):
    model = _model(kind, tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    pad = HeadPadding.plan(config, SUPPORTED)
    assert pad is not None and (pad.old, pad.new) == (48, 64)
    ServedCheckpoint(pad).write(tmp_path / "src", tmp_path / "padded")
    padded = AutoModelForCausalLM.from_pretrained(tmp_path / "padded", dtype=torch.float32).eval()
    assert padded.config.head_dim == 64
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model(ids).logits, padded(ids).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # and the weights a weight load sends are padded the same way as the checkpoint
    loaded = dict(ServedCheckpoint(pad).weights(model.named_parameters()))
    for name, w in padded.named_parameters():
        torch.testing.assert_close(loaded[name], w, atol=0, rtol=0)


def test_only_exact_paddings_are_planned():
    base = dict(model_type="llama", hidden_size=96, num_attention_heads=2)
    assert HeadPadding.plan(dict(base, hidden_size=128), SUPPORTED) is None  # 64: supported already
    assert HeadPadding.plan(dict(base, model_type="gemma2"), SUPPORTED) is None  # not a padded architecture
    assert HeadPadding.plan(dict(base, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), SUPPORTED) is None
    assert HeadPadding.plan(dict(base, partial_rotary_factor=0.5), SUPPORTED) is None
    assert HeadPadding.plan(dict(base, hidden_size=1026), SUPPORTED) is None  # 513: odd, and no larger size
    assert HeadPadding.plan(dict(base, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                        "partial_rotary_factor": 0.5}), SUPPORTED) is None
    plan = HeadPadding.plan(dict(base, rope_parameters={"rope_type": "default", "rope_theta": 1e4}), SUPPORTED)
    assert plan.config(dict(base, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))[
        "rope_parameters"]["rope_theta"] == pytest.approx(1e4 ** (64 / 48))


def test_a_tied_head_is_served_untied_and_sent_at_every_load(tmp_path):
    """Tied embeddings (vLLM's CPU backend would keep a reloaded tied head stale): the engine's
    copy has a head of its own, equal to the embedding, and every weight load sends it."""
    model = _model("llama", tmp_path / "src")
    assert model.config.tie_word_embeddings
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    served = ServedCheckpoint.plan(config, SUPPORTED)
    assert served.untie and served.padding is not None
    served.write(tmp_path / "src", tmp_path / "served")
    untied = AutoModelForCausalLM.from_pretrained(tmp_path / "served", dtype=torch.float32).eval()
    assert not untied.config.tie_word_embeddings
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.5)  # an update of the tied weight
        sent = dict(served.weights(model.named_parameters()))  # (a tied module names its weight once)
        assert torch.equal(sent["lm_head.weight"], model.model.embed_tokens.weight)
        for name, w in untied.named_parameters():
            w.copy_(sent[name])
        torch.testing.assert_close(untied(ids).logits, model(ids).logits, atol=2e-5, rtol=1e-4)
    untouched = dict(served.weights([("model.norm.weight", model.model.norm.weight)]))
    assert list(untouched) == ["model.norm.weight"], "a partial load without the embedding leaves the head"
    assert ServedCheckpoint.plan(dict(config, tie_word_embeddings=False, head_dim=64), SUPPORTED) is None


@pytest.mark.parametrize("top_level", [None, 5e5])
def test_a_rope_block_without_its_base_gets_the_base_the_model_uses(top_level):
    """``rope_parameters`` without ``rope_theta``: transformers takes the top-level ``rope_theta``,
    else 10000; the padded config must carry that base raised to D/d, in the block too (a block
    left without it would get the unpadded default: wrong frequencies)."""
    base = dict(model_type="llama", hidden_size=96, num_attention_heads=2, rope_parameters={"rope_type": "default"})
    if top_level is not None:
        base["rope_theta"] = top_level
    plan = HeadPadding.plan(base, SUPPORTED)
    out = plan.config(base)
    want = (top_level or 1e4) ** (64 / 48)
    assert out["rope_parameters"]["rope_theta"] == pytest.approx(want)
    assert LlamaConfig(**out).rope_parameters["rope_theta"] == pytest.approx(want)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_padded_adapter_is_the_adapter_of_the_padded_model(tmp_path, kind):
    """LoRA served as an adapter on padded heads (``rollout.vllm.lora_sync=adapter``): padding each adapter
    tensor as :meth:`HeadPadding.adapter_weight` does gives the padded model's adapter, i.e.
    ``pad(W) + s pad_B(B) pad_A(A) == pad(W + s B A)`` for every adapted projection, and the
    padded model with the padded adapter computes the same logits as the original with its own."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    model = _model(kind, tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    pad = HeadPadding.plan(config, SUPPORTED)
    assert pad is not None
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    adapter = get_peft_model_state_dict(peft)
    scale = 8 / 4
    inner = peft.get_base_model()
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        a_name = next(k for k in adapter if f"layers.0.self_attn.{proj}.lora_A" in k)
        b_name = a_name.replace("lora_A", "lora_B")
        layer = inner.model.layers[0].self_attn.__getattr__(proj)
        w = layer.base_layer.weight.detach()
        a, b = pad.adapter_weight(a_name, adapter[a_name]), pad.adapter_weight(b_name, adapter[b_name])
        merged = w + scale * adapter[b_name] @ adapter[a_name]
        name = f"model.layers.0.self_attn.{proj}.weight"
        torch.testing.assert_close(pad.weight(name, w) + scale * b @ a, pad.weight(name, merged), atol=1e-6, rtol=0)
    # the whole padded model with the padded adapter: the same logits as the original policy
    ids = torch.randint(0, 64, (2, 12), generator=g)
    with torch.no_grad():
        want = peft(ids).logits
    served = ServedCheckpoint(pad, False)
    base_state = {k.replace(".base_layer.", "."): v for k, v in inner.state_dict().items() if "lora_" not in k}
    padded = AutoModelForCausalLM.from_config(type(model.config)(**served.config(config))).eval()
    padded.load_state_dict(served.state(base_state), strict=False)
    if kind == "llama":
        padded.tie_weights()
    ppeft = get_peft_model(padded, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(ppeft, {k: pad.adapter_weight(k, v) for k, v in adapter.items()})
    with torch.no_grad():
        torch.testing.assert_close(ppeft(ids).logits, want, atol=1e-4, rtol=1e-4)
