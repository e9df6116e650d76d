"""Model FLOPs and the measured peak (``oppo.perf``), against hand-computed counts."""

from __future__ import annotations

import torch

from oppo.perf import forward_flops, matmul_params, peak_flops


def test_forward_flops_of_a_tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    # per layer: q 32x32, k and v 32x16 each (2 kv heads of 8), o 32x32, mlp 3 x 32x64; head 50x32
    per_layer = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64
    n = 2 * per_layer + 50 * 32
    assert matmul_params(model) == n
    # two sequences of 3 and 1 tokens: 4 tokens; contexts 1+2+3 and 1; attention width 4 heads x 8
    assert forward_flops(model, [3, 1]) == 2 * n * 4 + 4 * 2 * 32 * (6 + 1)


def test_matmul_params_count_gpt2_conv1d():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                       bos_token_id=0, eos_token_id=0))
    # per layer, GPT-2's Conv1D projections: c_attn 32x96, attn c_proj 32x32, c_fc 32x128, mlp c_proj 128x32;
    # the head (tied to the embedding) 100x32; the position and token embeddings are lookups
    assert matmul_params(model) == 2 * (32 * 96 + 32 * 32 + 32 * 128 + 128 * 32) + 100 * 32


def test_matmul_params_count_the_routed_share_of_fused_experts():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=50, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    model = MixtralForCausalLM(cfg)
    # per layer: attention q, o 32x32, k, v 16x32; router 4x32; experts gate_up 4x32x32 and down 4x32x16,
    # of which a token runs 2 of 4; head 50x32
    per_layer = 2 * 32 * 32 + 2 * 16 * 32 + 4 * 32 + (4 * 32 * 32 + 4 * 32 * 16) * 2 // 4
    assert matmul_params(model) == 2 * per_layer + 50 * 32


def test_peak_flops_is_measured_and_cached():
    p = peak_flops("cpu", torch.float32)
    assert 1e8 < p < 1e14  # a CPU core does between 0.1 GFLOP/s and 100 TFLOP/s
    assert peak_flops("cpu", torch.float32) == p  # cached: measured once per process
