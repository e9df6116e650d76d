"""``algo.actor_loss``: the actor's loss composed from its terms (policy, KL, entropy) and the
importance weights of off-policy tokens, checked against the terms computed apart and by hand."""

import math

import pytest
import torch

from oppo.algo import get_algorithm
from oppo.algo.actor_loss import (ActorLossSettings, ActorTokens, actor_loss, importance_weights,
                                  sampler_ratio_outside_clip)
from oppo.algo.losses import aggregate, kl_loss, policy_loss


def _batch(seed: int = 0, b: int = 3, T: int = 5):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(b, T)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    logprobs = -torch.rand(b, T, generator=g) - 0.1
    tokens = ActorTokens(old_logprobs=logprobs + 0.1 * torch.randn(b, T, generator=g),
                         advantages=torch.randn(b, T, generator=g), mask=mask,
                         is_weights=torch.rand(b, T, generator=g) + 0.5,
                         ref_logprobs=logprobs + 0.2 * torch.randn(b, T, generator=g))
    return logprobs.requires_grad_(), torch.rand(b, T, generator=g), tokens


def test_ppo_loss_is_the_clipped_loss_minus_the_entropy_bonus():
    logprobs, entropy, t = _batch()
    s = ActorLossSettings(clip_eps=0.2, loss_agg="token_mean", entropy_coef=0.01)
    loss, stats = actor_loss(None, logprobs, entropy, t, s, num_tokens=t.mask.sum(), num_seqs=3)
    pl, _ = policy_loss(logprobs, t.old_logprobs, t.advantages, t.mask, clip_eps=0.2, is_weights=t.is_weights,
                        num_tokens=t.mask.sum(), num_seqs=3)
    want = pl - 0.01 * aggregate(entropy, t.mask, "token_mean", t.mask.sum(), 3)
    assert torch.equal(loss, want)
    assert torch.equal(stats["loss/policy"], pl.detach())
    assert set(stats) == {"loss/policy", "ppo/clipfrac", "ppo/approx_kl", "ppo/entropy"}
    assert all(not v.requires_grad for v in stats.values())


def test_kl_in_the_loss_adds_coef_times_the_kl_loss():
    logprobs, entropy, t = _batch(1)
    algo = get_algorithm("grpo")  # KL in the loss, k3, beta 0.04
    s = ActorLossSettings()
    loss, stats = actor_loss(algo, logprobs, entropy, t, s, num_tokens=t.mask.sum(), num_seqs=3)
    pl, _ = policy_loss(logprobs, t.old_logprobs, t.advantages, t.mask, is_weights=t.is_weights,
                        num_tokens=t.mask.sum(), num_seqs=3)
    kl, _ = kl_loss(logprobs, t.ref_logprobs, t.mask, "k3", None, t.is_weights, "token_mean", t.mask.sum(), 3)
    assert torch.equal(loss, pl + 0.04 * kl)
    assert torch.allclose(stats["loss/kl"], 0.04 * kl.detach())
    assert "kl/loss_mean" in stats
    with pytest.raises(ValueError, match="reference log-probs"):
        actor_loss(algo, logprobs, entropy, ActorTokens(t.old_logprobs, t.advantages, t.mask, t.is_weights), s,
                   num_tokens=t.mask.sum(), num_seqs=3)


def test_masked_positions_change_nothing():
    logprobs, entropy, t = _batch(2)
    s = ActorLossSettings(entropy_coef=0.05, dual_clip=3.0)
    junk = (1 - t.mask) * 1e3
    t2 = ActorTokens(t.old_logprobs + junk, t.advantages - junk, t.mask, t.is_weights + junk, t.ref_logprobs + junk)
    a, sa = actor_loss(get_algorithm("grpo"), logprobs, entropy, t, s, num_tokens=t.mask.sum(), num_seqs=3)
    b, sb = actor_loss(get_algorithm("grpo"), logprobs, entropy + junk, t2, s, num_tokens=t.mask.sum(), num_seqs=3)
    assert torch.allclose(a, b) and "ppo/dual_clipfrac" in sa
    assert all(torch.allclose(sa[k], sb[k]) for k in sa)


def test_importance_weights_by_hand():
    # old = log 0.5, sampler = log 0.25: pi_k / pi_v = 2, truncated at 1.5 on the off-policy token only
    old = torch.tensor([[math.log(0.5), math.log(0.5)]])
    sampler = torch.tensor([[math.log(0.25), math.log(0.25)]])
    off = torch.tensor([[True, False]])
    assert torch.allclose(importance_weights(old, sampler, off, None), torch.tensor([[2.0, 1.0]]))
    assert torch.allclose(importance_weights(old, sampler, off, 1.5), torch.tensor([[1.5, 1.0]]))


def test_sampler_ratio_outside_clip_by_hand():
    # ratios 2 (outside 1 +- 0.2), 1.1 (inside), 0.5 (outside; not an on-policy token: left out)
    old = torch.log(torch.tensor([[2.0, 1.1, 0.5]]))
    sampler = torch.zeros(1, 3)
    on = torch.tensor([[True, True, False]])
    assert sampler_ratio_outside_clip(old, sampler, on, 0.2, None)["ppo/sampler_ratio_outside_clip"].item() == 0.5
    assert sampler_ratio_outside_clip(old, sampler, on, 0.2, 1.5)["ppo/sampler_ratio_outside_clip"].item() == 0.0
    assert sampler_ratio_outside_clip(old, sampler, torch.zeros(1, 3, dtype=torch.bool), 0.2, None) == {}
