"""No training or scoring forward has a query position that attends to no key (issue 26).

On an H100 a 1B policy's overlapped runs got NaN gradients in actor and critic at a finite loss:
left-padded prompts under a padding mask gave fully masked query rows (log-sum-exp -inf), and
the default fused kernel's backward writes NaN into ``grad_q`` on such rows (``lse_kernel``
stands in for it on CPU). ``forward.full_hidden`` now runs every row packed to the left under
the causal mask alone. These tests fail with the old forward (the first one shows the stand-in
catches it).
"""

from __future__ import annotations

import pytest
import torch

import lse_kernel
from oppo.models import backbone_and_head
from oppo.forward import full_hidden, sequence_batch
from oppo.scoring.streaming import response_outputs

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11], [12], [13, 14]]
RESPONSES = [[4, 5, 6, 7], [8], [9, 10], [11, 12, 13, 14, 15, 16]]


def _load(path, kind, attn, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForCausalLM if kind == "policy" else AutoModelForSequenceClassification
    model = cls.from_pretrained(path, dtype=dtype, num_labels=1) if kind != "policy" else \
        cls.from_pretrained(path, dtype=dtype)
    model.set_attn_implementation(attn)
    return model


def _nonfinite_grads(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]


def _actor_loss(model, ids, valid, P, rmask):
    backbone, head = backbone_and_head(model)
    logp = head(full_hidden(backbone, ids, valid)[:, P - 1:-1]).float().log_softmax(-1)  # [R, T, V]
    return (logp.gather(-1, ids[:, P:, None]).squeeze(-1) * rmask).sum()


def test_stand_in_kernel_poisons_a_left_padded_backward(tiny_models):
    """The old layout (left pads under a padding mask) through the stand-in kernel: NaN gradients
    with a finite loss, as on the H100. Guards against a stand-in that cannot fail."""
    model = _load(tiny_models["policy"], "policy", lse_kernel.register())
    ids, valid, P, rmask = sequence_batch(PROMPTS, RESPONSES, 0, torch.device("cpu"))
    backbone, head = backbone_and_head(model)
    pos = (valid.cumsum(1) - 1).clamp(min=0)
    hidden = backbone(input_ids=ids, attention_mask=valid, position_ids=pos, use_cache=False).last_hidden_state
    loss = (head(hidden[:, P - 1:-1]).log_softmax(-1).gather(-1, ids[:, P:, None]).squeeze(-1) * rmask).sum()
    assert torch.isfinite(loss)
    loss.backward()
    assert _nonfinite_grads(model), "the stand-in kernel should poison a fully masked row's backward"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["policy", "critic"])
def test_training_backward_is_finite_with_the_kernel(tiny_models, kind, dtype):
    """The actor's log-probs and the critic's values, forward and backward, through the
    stand-in kernel: no row below the log-sum-exp floor, every gradient finite."""
    model = _load(tiny_models["policy" if kind == "policy" else "reward"], kind, lse_kernel.register(), dtype)
    ids, valid, P, rmask = sequence_batch(PROMPTS, RESPONSES, 0, torch.device("cpu"))
    before = lse_kernel.LOW_LSE_ROWS[0]
    if kind == "policy":
        loss = _actor_loss(model, ids, valid, P, rmask)
    else:
        loss = (response_outputs("critic", model, ids, valid, P).float() * rmask).pow(2).sum()
    loss.backward()
    assert lse_kernel.LOW_LSE_ROWS[0] == before, "a query row attended to no key in a training forward"
    assert not _nonfinite_grads(model)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_forward_equals_each_row_alone(tiny_models, attn):
    """The packed forward gives each real position the hidden state of that row's unpadded
    forward (so log-probs, values and scores are unchanged), with each attention implementation."""
    model = _load(tiny_models["policy"], "policy", attn)
    ids, valid, P, _ = sequence_batch(PROMPTS, RESPONSES, 0, torch.device("cpu"))
    backbone, _ = backbone_and_head(model)
    with torch.no_grad():
        hidden = full_hidden(backbone, ids, valid)  # [R, L, H]
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
            alone = backbone(input_ids=torch.tensor([p + r])).last_hidden_state[0]  # [n, H]
            real = valid[i].bool()
            torch.testing.assert_close(hidden[i, real], alone, atol=1e-5, rtol=1e-4)
            assert torch.isfinite(hidden[i]).all()


def test_oppo_mode_at_lr0_keeps_weights_with_the_kernel(tiny_models, tiny_prompts, tmp_path):
    """The schedule that failed on the H100, on CPU in bf16: oppo mode with carried rows, actor and
    critic at learning rate 0, every model through the stand-in kernel. The weights stay
    bit-identical (with the old forward they turned NaN at the first update)."""
    from oppo.config import load_config
    from oppo.trainer import Trainer

    cfg = load_config(None, [
        f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
        f"data.prompts={tiny_prompts}", f"run.out_dir={tmp_path}", "placement.threads=1", "log.progress=false",
        "ppo.batch_size=4", "ppo.minibatch_size=2", "ppo.micro_batch_size=2", "generation.max_new_tokens=12",
        "overlap.mode=oppo", "overlap.delta=2", "overlap.max_lag=1", "overlap.chunk_size=4",
        "placement.local.scorer_process=false", "policy.dtype=bfloat16", "ppo.actor_lr=0", "ppo.critic_lr=0"])
    t = Trainer.from_config(cfg, progress=False)
    try:
        name = lse_kernel.register()
        trained = [m for m in (t.roles.policy, t.roles.critic) if m is not None]
        for m in {id(m): m for m in trained + [t.roles.reference, t.roles.rollout_policy,
                                               t.roles.scoring_critic, t.roles.reward_model]
                  if m is not None}.values():
            m.set_attn_implementation(name)
        start = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in trained]
        carried = 0.0
        for _ in range(3):
            metrics = t.run_step()
            carried += metrics.get("overlap/carried", 0.0)
        assert carried > 0, "no row was carried: the schedule under test did not happen"
        for m, before in zip(trained, start):
            for n, p in m.named_parameters():
                assert torch.equal(p.detach(), before[n]), f"{n} changed at learning rate 0"
    finally:
        t.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("width", [64, 192, 200])
def test_training_backward_is_finite_on_cuda(tiny_models, width):
    """On the GPU with its default attention kernel (cuDNN SDPA on H100/H200 with torch 2.11-2.13):
    left-padded rows whose widths are 64 mod 128 (the bug's condition) and one that is not, bf16."""
    model = _load(tiny_models["policy"], "policy", "sdpa", torch.bfloat16).cuda()
    prompts = [[3] * (width - 8), [4] * 5]  # the second row: width - 13 left pads
    ids, valid, P, rmask = sequence_batch(prompts, [[5] * 8, [6] * 8], 0, torch.device("cuda"))
    assert ids.shape[1] == width
    _actor_loss(model, ids, valid, P, rmask).backward()
    assert not _nonfinite_grads(model)
