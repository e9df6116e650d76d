"""The chunked head (``forward.head_logprobs``) against the plain full-logits path."""

from __future__ import annotations

import pytest
import torch

from oppo.models import LogitsHead
from oppo.algo.losses import entropy_from_logits, logprobs_from_logits
from oppo.forward import head_logprobs

B, T, H, V = 3, 5, 16, 40


def _run(head, h, tok, fused: bool, entropy: bool, temperature=1.3, dtype=torch.float32):
    """(log-probs, entropy, grads of hidden and of every head parameter) for a random upstream gradient."""
    g = torch.Generator().manual_seed(1)
    gl, ge = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    h = h.detach().clone().requires_grad_()
    for p in head.parameters():
        p.grad = None
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        if fused:  # chunks of 4 tokens: several chunks, the last one short
            lp, ent = head_logprobs(head, h, tok, temperature, entropy=entropy, chunk_bytes=4 * V * 4)
        else:
            logits = head(h).float()
            lp = logprobs_from_logits(logits, tok, temperature)
            ent = entropy_from_logits(logits / temperature) if entropy else None
    loss = (lp * gl).sum() + ((ent * ge).sum() if entropy else 0)
    loss.backward()
    return [lp.detach(), None if ent is None else ent.detach(), h.grad] + [p.grad for p in head.parameters()]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.7])
def test_fused_equals_plain_fp32(bias, entropy, scale):
    torch.manual_seed(0)
    head = LogitsHead(torch.nn.Linear(H, V, bias=bias), None, scale)
    h, tok = torch.randn(B, T, H), torch.randint(0, V, (B, T))
    for a, b in zip(_run(head, h, tok, True, entropy), _run(head, h, tok, False, entropy)):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


def test_fused_bf16_within_rounding_of_plain():
    """Under bf16 autocast both run the head's matmul in bf16 and the softmax in fp32."""
    torch.manual_seed(0)
    head = LogitsHead(torch.nn.Linear(H, V), None, 1.0)
    h, tok = torch.randn(B, T, H), torch.randint(0, V, (B, T))
    fused, plain = (_run(head, h, tok, f, True, dtype=torch.bfloat16) for f in (True, False))
    for a, b in zip(fused, plain):
        scale = float(b.abs().max())
        assert (a.float() - b.float()).abs().max() <= 1e-2 * max(scale, 1.0)


def test_fused_saves_no_full_logits():
    """The forward keeps no [B*T, V] tensor for the backward (only hidden, weights, per-token stats)."""
    torch.manual_seed(0)
    b, t, v = 8, 32, 64  # B*T*V well above the weight's V*H and the hidden's B*T*H
    head = LogitsHead(torch.nn.Linear(H, v), None, 1.0)
    h = torch.randn(b, t, H, requires_grad=True)
    tok = torch.randint(0, v, (b, t))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        lp, ent = head_logprobs(head, h, tok, entropy=True, chunk_bytes=16 * v * 4)
    assert saved and max(saved) <= max(b * t * H, v * H) < b * t * v
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(h.grad).all()


def test_softcapped_head_takes_the_plain_path():
    torch.manual_seed(0)
    head = LogitsHead(torch.nn.Linear(H, V), 5.0, 1.0)
    h, tok = torch.randn(B, T, H), torch.randint(0, V, (B, T))
    lp, ent = head_logprobs(head, h, tok, 1.0, entropy=True)
    logits = head(h).float()
    torch.testing.assert_close(lp, logprobs_from_logits(logits, tok))
    torch.testing.assert_close(ent, entropy_from_logits(logits))


def test_entropy_not_in_the_loss_forms_no_backward_term(monkeypatch):
    """``entropy_grad=False`` (ppo.entropy_coef=0): the entropy comes back as a statistic, and the
    fused backward gets no gradient for it (None), so it forms no entropy term; the log-probs'
    gradients are those of the plain path."""
    from oppo.forward import _HeadLogprobs

    seen = []
    backward = _HeadLogprobs.backward
    monkeypatch.setattr(_HeadLogprobs, "backward",
                        staticmethod(lambda ctx, g_lp, g_ent: (seen.append(g_ent), backward(ctx, g_lp, g_ent))[1]))
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V)
    h, tok = torch.randn(B, T, H, requires_grad=True), torch.randint(0, V, (B, T))
    lp, ent = head_logprobs(head, h, tok, 1.3, entropy=True, entropy_grad=False)
    assert ent is not None and not ent.requires_grad
    lp.sum().backward()
    assert seen == [None]
    want = torch.autograd.grad(logprobs_from_logits(head(h).float(), tok, 1.3).sum(), h)[0]
    torch.testing.assert_close(h.grad, want, atol=1e-5, rtol=1e-5)
