"""Model FLOPs and the measured peak (``oppo.perf``), against hand-computed counts."""

from __future__ import annotations

import pytest
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


def test_spec_peak_by_device_name():
    """The vendor's dense bf16 figure by name, the specific names before the general ones; none
    where the table has no entry, on CPU, or in float32 (TF32 or not is the run's choice)."""
    from oppo.perf import spec_peak_flops

    bf16 = torch.bfloat16
    assert spec_peak_flops("cuda", bf16, name="NVIDIA H100 80GB HBM3") == 989e12  # the SXM part
    assert spec_peak_flops("cuda", bf16, name="NVIDIA H100 PCIe") == 756e12
    assert spec_peak_flops("cuda", bf16, name="NVIDIA H200") == 989e12
    assert spec_peak_flops("cuda", bf16, name="NVIDIA H200 NVL") == 835e12
    assert spec_peak_flops("cuda", torch.float16, name="NVIDIA A100-SXM4-80GB") == 312e12
    assert spec_peak_flops("cuda", bf16, name="NVIDIA L40S") == 362e12
    assert spec_peak_flops("cuda", bf16, name="NVIDIA L4") == 121e12
    assert spec_peak_flops("cuda", bf16, name="Some Future GPU") is None
    assert spec_peak_flops("cuda", torch.float32, name="NVIDIA H200") is None
    assert spec_peak_flops("cpu", bf16) is None


def test_train_flops_count_the_old_logprob_recompute_where_the_window_holds_it():
    """``utilisation``: the actor's old-log-prob forward is in train MFU when the loop timed it
    inside time/train (sequential: ``time/old_logprobs``), over the rows it recomputed: every row
    under ``recompute_old``, else the rows holding an off-policy token."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from oppo.control.step_metrics import recomputed_lengths, utilisation

    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    # 3 rows: prompts of 2, 1, 2 tokens and responses of 2, 3, 1; row 1 holds a token of version 4
    valid = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])  # [B, P+T], P = 2
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])  # [B, T]
    versions = torch.tensor([[5, 5, 0], [4, 5, 5], [5, 0, 0]])
    exp = SimpleNamespace(valid=valid, mask=mask, versions=versions)
    assert recomputed_lengths(exp, recompute_all=True) == [4, 4, 3]
    assert recomputed_lengths(exp, recompute_all=False) == [4]  # row 1 only
    lengths = [4, 4, 3]
    settings = SimpleNamespace(ppo=SimpleNamespace(epochs=2))
    roles = SimpleNamespace(actor_flops=lambda lengths: forward_flops(model, lengths), critic_flops=None,
                            device=torch.device("cpu"), compute_dtype=torch.float32, settings=settings,
                            recompute_old=True)  # (api.roles.RoleHandles' fields that utilisation reads)
    import dataclasses

    from oppo.api.roles import RoleHandles

    assert set(vars(roles)) <= {f.name for f in dataclasses.fields(RoleHandles)}  # the stand-in reads real fields
    run, result = SimpleNamespace(roles=roles), SimpleNamespace(exp=exp)
    rollout = SimpleNamespace(decode_steps=None)
    update = 3 * 2 * forward_flops(model, lengths)
    plain = utilisation(run, result, {"time/train": 1.0}, rollout)  # an overlapped loop: recompute in time/score
    assert plain["perf/train_tflops"] * 1e12 == pytest.approx(update)
    seq = utilisation(run, result, {"time/train": 1.0, "time/old_logprobs": 0.1}, rollout)
    assert seq["perf/train_tflops"] * 1e12 == pytest.approx(update + forward_flops(model, lengths))
    peak = peak_flops("cpu", torch.float32, torch.get_num_threads())
    assert seq["perf/train_mfu"] == pytest.approx(seq["perf/train_tflops"] * 1e12 / peak)
    assert "perf/train_mfu_spec" not in seq and "perf/peak_spec_tflops" not in seq  # CPU: no spec peak
