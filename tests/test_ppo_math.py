"""Tests for the PPO maths (oppo.algo.masks, losses, advantages): hand-computed cases, a slow GAE oracle, padding
invariance (garbage at masked positions), and split invariance of the loss
aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from oppo.algo import advantages as av
from oppo.algo import losses as lo
from oppo.algo import masks as mk

DT = torch.float64


def _close(a, b, tol=1e-6):
    a = torch.as_tensor(a, dtype=DT)
    b = torch.as_tensor(b, dtype=DT)
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _mask_from_lengths(lengths, T):
    lengths = torch.as_tensor(lengths)
    return (torch.arange(T)[None, :] < lengths[:, None]).to(DT)  # [B, T]


def _random_batch(gen, B=6, T=7, min_len=0):
    lengths = torch.randint(min_len, T + 1, (B,), generator=gen)
    lengths[0] = T  # at least one full row
    mask = _mask_from_lengths(lengths, T)
    return lengths, mask


def _garble(x, mask, gen, scale=1e6):
    """x with every masked position replaced by large random junk."""
    junk = torch.randn(x.shape, generator=gen, dtype=x.dtype) * scale
    return torch.where(mask.bool(), x, junk)


# ---------------------------------------------------------------------------
# masked reductions
# ---------------------------------------------------------------------------


def test_masked_reductions_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, -7.0, 55.0, 66.0]], dtype=DT)
    m = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=DT)
    # sum = 1 + 2 + 3 + 4 = 10 ; mean = 10 / 4
    _close(mk.masked_sum(x, m), 10.0)
    _close(mk.masked_mean(x, m), 2.5)
    _close(mk.masked_sum(x, m, dim=1), [6.0, 4.0])
    _close(mk.masked_mean(x, m, dim=1), [2.0, 4.0])
    # values {1,2,3,4}: mean 2.5, squared deviations 2.25+0.25+0.25+2.25 = 5
    # biased var 5/4 = 1.25, unbiased 5/3
    _close(mk.masked_var(x, m, unbiased=False), 1.25)
    _close(mk.masked_var(x, m), 5.0 / 3.0)
    # bool masks behave the same
    _close(mk.masked_mean(x, m.bool()), 2.5)


def test_masked_mean_empty_mask_is_zero_not_nan():
    x = torch.randn(2, 3, dtype=DT)
    m = torch.zeros(2, 3, dtype=DT)
    assert mk.masked_mean(x, m).item() == 0.0
    assert torch.equal(mk.masked_mean(x, m, dim=1), torch.zeros(2, dtype=DT))
    m2 = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=DT)
    _close(mk.masked_mean(x, m2, dim=1), [(x[0, 0] + x[0, 1]) / 2, 0.0])
    assert mk.masked_var(x, m).item() == 0.0


def test_masked_whiten_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0, 1234.0]], dtype=DT)
    m = torch.tensor([[1, 1, 1, 0]], dtype=DT)
    # mean 2, unbiased var ((1)+(0)+(1))/2 = 1 -> (x - 2) / 1, pad -> 0
    _close(av.masked_whiten(x, m), [[-1.0, 0.0, 1.0, 0.0]])
    # shift_mean=False adds the mean back: std is 1 so x itself
    _close(av.masked_whiten(x, m, shift_mean=False), [[1.0, 2.0, 3.0, 0.0]])


def test_masked_whiten_moments():
    gen = torch.Generator().manual_seed(0)
    _, m = _random_batch(gen, B=5, T=9, min_len=1)
    x = torch.randn(5, 9, generator=gen, dtype=DT) * 3 + 7
    w = av.masked_whiten(x, m)
    _close(mk.masked_mean(w, m), 0.0)
    _close(mk.masked_var(w, m), 1.0, tol=1e-6)
    assert torch.all(w[m == 0] == 0)


# ---------------------------------------------------------------------------
# KL estimators and reward shaping
# ---------------------------------------------------------------------------


def test_kl_estimates_by_hand():
    logp = torch.tensor([math.log(0.5)], dtype=DT)
    ref = torch.tensor([math.log(0.25)], dtype=DT)
    d = math.log(2.0)  # logp - ref = 0.693147...
    _close(lo.kl_estimate(logp, ref, "k1"), [d])
    _close(lo.kl_estimate(logp, ref, "k2"), [0.5 * d * d])  # 0.240227
    # k3 = exp(ref - logp) - (ref - logp) - 1 = 0.5 + 0.693147 - 1 = 0.193147
    _close(lo.kl_estimate(logp, ref, "k3"), [0.5 + d - 1.0])
    _close(lo.kl_estimate(logp, ref, "k3"), [0.1931471805599453])
    _close(lo.kl_estimate(ref, logp, "abs"), [d])
    _close(lo.kl_estimate(logp, ref), [d])  # default is k1


def test_k3_and_k2_nonnegative_and_zero_on_equal():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(1000, generator=gen, dtype=DT) * 5
    b = torch.randn(1000, generator=gen, dtype=DT) * 5
    for kind in ("k2", "k3", "abs"):
        assert torch.all(lo.kl_estimate(a, b, kind) >= 0)
        assert torch.all(lo.kl_estimate(a, a, kind) == 0)


def test_kl_estimators_monte_carlo():
    gen = torch.Generator().manual_seed(1234)
    p = torch.softmax(torch.randn(6, generator=gen, dtype=DT), 0)
    q = torch.softmax(torch.randn(6, generator=gen, dtype=DT), 0)
    true_kl = (p * (p.log() - q.log())).sum().item()
    x = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    logp, logq = p.log()[x], q.log()[x]
    k1 = lo.kl_estimate(logp, logq, "k1").mean().item()
    k3 = lo.kl_estimate(logp, logq, "k3").mean().item()
    assert abs(k1 - true_kl) < 0.02 + 0.05 * true_kl
    assert abs(k3 - true_kl) < 0.02 + 0.05 * true_kl


def test_kl_invalid_kind():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="k3"):
        lo.kl_estimate(x, x, "k4")
    with pytest.raises(ValueError):
        av.kl_shaped_rewards(torch.zeros(1), x[None], x[None], torch.ones(1, 2), 0.1, kl_kind="nope")


def test_kl_shaped_rewards_by_hand():
    ref = torch.zeros(3, 3, dtype=DT)
    logp = torch.tensor([[0.1, 0.2, -0.1], [0.5, 9.0, 9.0], [3.0, 3.0, 3.0]], dtype=DT)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=DT)
    scores = torch.tensor([1.0, 2.0, 5.0], dtype=DT)
    rewards, kl = av.kl_shaped_rewards(scores, logp, ref, mask, kl_coef=0.1)
    # row 0: -0.1*[0.1, 0.2, -0.1] = [-0.01, -0.02, 0.01], score at index 2 -> 1.01
    # row 1: -0.1*0.5 = -0.05, score at index 0 -> 1.95; padding 0
    # row 2: empty -> no score, all zeros
    _close(rewards, [[-0.01, -0.02, 1.01], [1.95, 0.0, 0.0], [0.0, 0.0, 0.0]])
    _close(kl, [[0.1, 0.2, -0.1], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])


# ---------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------


def test_gae_by_hand():
    J = 1e6  # junk in padding
    rewards = torch.tensor([[0.0, 0.0, 1.0, J], [0.5, -1.0, J, J]], dtype=DT)
    values = torch.tensor([[0.5, 0.6, 0.7, J], [1.0, 2.0, J, J]], dtype=DT)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=DT)
    adv, ret = av.gae(rewards, values, mask, gamma=1.0, lam=0.95)
    # row 0 (gamma=1, lam=0.95), bootstrap after t=2 is 0:
    #   d2 = 1 + 0 - 0.7 = 0.3            A2 = 0.3
    #   d1 = 0 + 0.7 - 0.6 = 0.1          A1 = 0.1 + 0.95*0.3   = 0.385
    #   d0 = 0 + 0.6 - 0.5 = 0.1          A0 = 0.1 + 0.95*0.385 = 0.46575
    #   returns = A + V = [0.96575, 0.985, 1.0]
    # row 1:
    #   d1 = -1 + 0 - 2 = -3              A1 = -3
    #   d0 = 0.5 + 2 - 1 = 1.5            A0 = 1.5 + 0.95*(-3) = -1.35
    #   returns = [-0.35, -1.0]
    _close(adv, [[0.46575, 0.385, 0.3, 0.0], [-1.35, -3.0, 0.0, 0.0]])
    _close(ret, [[0.96575, 0.985, 1.0, 0.0], [-0.35, -1.0, 0.0, 0.0]])


def _gae_oracle(rewards, values, lengths, gamma, lam):
    B, T = rewards.shape
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        L = int(lengths[b])
        r = [float(v) for v in rewards[b, :L]]
        v = [float(x) for x in values[b, :L]]
        running = 0.0
        for t in reversed(range(L)):
            next_v = v[t + 1] if t + 1 < L else 0.0  # terminal: bootstrap 0
            delta = r[t] + gamma * next_v - v[t]
            running = delta + gamma * lam * running
            adv[b][t] = running
            ret[b][t] = running + v[t]
    return torch.tensor(adv, dtype=DT), torch.tensor(ret, dtype=DT)


@pytest.mark.parametrize("gamma", [1.0, 0.99, 0.9])
@pytest.mark.parametrize("lam", [1.0, 0.95, 0.5, 0.0])
def test_gae_matches_oracle(gamma, lam):
    gen = torch.Generator().manual_seed(int(gamma * 1000 + lam * 100))
    for _ in range(3):
        lengths, mask = _random_batch(gen, B=7, T=8)
        rewards = _garble(torch.randn(7, 8, generator=gen, dtype=DT), mask, gen)
        values = _garble(torch.randn(7, 8, generator=gen, dtype=DT), mask, gen)
        adv, ret = av.gae(rewards, values, mask, gamma=gamma, lam=lam)
        adv_o, ret_o = _gae_oracle(rewards, values, lengths, gamma, lam)
        _close(adv, adv_o, tol=1e-9)
        _close(ret, ret_o, tol=1e-9)


def test_gae_special_cases():
    gen = torch.Generator().manual_seed(5)
    _, mask = _random_batch(gen, B=5, T=6, min_len=1)
    r = torch.randn(5, 6, generator=gen, dtype=DT) * mask
    v = torch.randn(5, 6, generator=gen, dtype=DT) * mask
    # lam = 1, gamma = 1: returns are the reward-to-go (Monte Carlo)
    _, ret = av.gae(r, v, mask, gamma=1.0, lam=1.0)
    rtg = torch.flip(torch.cumsum(torch.flip(r, [1]), 1), [1]) * mask
    _close(ret, rtg, tol=1e-9)
    # lam = 0: advantage is the one-step TD error
    adv, _ = av.gae(r, v, mask, gamma=0.9, lam=0.0)
    v_next = torch.cat([v[:, 1:], torch.zeros(5, 1, dtype=DT)], 1)
    _close(adv, (r + 0.9 * v_next - v) * mask, tol=1e-9)


# ---------------------------------------------------------------------------
# policy loss
# ---------------------------------------------------------------------------


def _two_tokens(r0, r1):
    logp = torch.log(torch.tensor([[r0, r1]], dtype=DT))
    old = torch.zeros(1, 2, dtype=DT)
    return logp, old


def test_policy_loss_clipped_by_hand():
    # token 0: ratio 1.5, A=+1: max(-1.5, -1.2) = -1.2 (clipped at 1.2)
    # token 1: ratio 0.5, A=-1: max( 0.5,  0.8) =  0.8 (clipped at 0.8)
    # loss = (-1.2 + 0.8) / 2 = -0.2, clipfrac = 1
    logp, old = _two_tokens(1.5, 0.5)
    adv = torch.tensor([[1.0, -1.0]], dtype=DT)
    mask = torch.ones(1, 2, dtype=DT)
    loss, st = lo.policy_loss(logp, old, adv, mask, clip_eps=0.2)
    _close(loss, -0.2)
    _close(st["clipfrac"], 1.0)
    _close(st["ratio_mean"], 1.0)
    _close(st["ratio_max"], 1.5)
    # approx_kl = mean(0.5*log(1.5)^2, 0.5*log(0.5)^2) = (0.082201 + 0.240227)/2
    _close(st["approx_kl"], 0.25 * (math.log(1.5) ** 2 + math.log(0.5) ** 2))
    for v in st.values():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad

    # token 0: ratio 0.5, A=+1: max(-0.5, -0.8) = -0.5 (unclipped)
    # token 1: ratio 1.5, A=-1: max( 1.5,  1.2) =  1.5 (unclipped)
    # loss = (-0.5 + 1.5) / 2 = 0.5, clipfrac = 0
    logp, old = _two_tokens(0.5, 1.5)
    loss, st = lo.policy_loss(logp, old, adv, mask, clip_eps=0.2)
    _close(loss, 0.5)
    _close(st["clipfrac"], 0.0)


def test_policy_loss_clip_high_dual_clip_and_is_weights():
    mask = torch.ones(1, 2, dtype=DT)
    # asymmetric clip: ratio 1.5, A=+1 -> -1.28 with clip_eps_high 0.28;
    # ratio 0.5, A=+1 -> max(-0.5, -0.8) = -0.5 ; mean = -0.89
    logp, old = _two_tokens(1.5, 0.5)
    adv = torch.tensor([[1.0, 1.0]], dtype=DT)
    loss, _ = lo.policy_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    _close(loss, (-1.28 - 0.5) / 2)

    # dual clip: ratio 5, A=-1 -> max(5, 1.2) = 5, capped at -A*3 = 3
    # ratio 1, A=-1 -> 1 (cap 3 not binding); mean = (3 + 1) / 2 = 2
    logp, old = _two_tokens(5.0, 1.0)
    adv = torch.tensor([[-1.0, -1.0]], dtype=DT)
    loss, st = lo.policy_loss(logp, old, adv, mask, dual_clip=3.0)
    _close(loss, 2.0)
    _close(st["dual_clipfrac"], 0.5)
    loss_nodual, _ = lo.policy_loss(logp, old, adv, mask)
    _close(loss_nodual, 3.0)  # (5 + 1) / 2
    with pytest.raises(ValueError):
        lo.policy_loss(logp, old, adv, mask, dual_clip=1.0)

    # is_weights multiply the per-token loss: [-1.2, 0.8] * [2, 0.5] -> mean(-2.4, 0.4) = -1.0
    logp, old = _two_tokens(1.5, 0.5)
    logp.requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0]], dtype=DT)
    w = torch.tensor([[2.0, 0.5]], dtype=DT, requires_grad=True)
    loss, _ = lo.policy_loss(logp, old, adv, mask, is_weights=w)
    _close(loss, -1.0)
    loss.backward()
    assert w.grad is None  # weights are treated as constants


def test_policy_loss_on_policy_is_minus_mean_advantage():
    gen = torch.Generator().manual_seed(7)
    _, mask = _random_batch(gen, B=5, T=6, min_len=1)
    logp = (-torch.rand(5, 6, generator=gen, dtype=DT) * 3).requires_grad_(True)
    adv = torch.randn(5, 6, generator=gen, dtype=DT)
    loss, st = lo.policy_loss(logp, logp.detach(), adv, mask)
    _close(loss, -mk.masked_mean(adv, mask))
    _close(st["clipfrac"], 0.0)
    _close(st["approx_kl"], 0.0)
    _close(st["ratio_mean"], 1.0)
    _close(st["ratio_max"], 1.0)
    # gradient of the on-policy surrogate is -A * mask / num_tokens
    loss.backward()
    _close(logp.grad, -adv * mask / mask.sum())


# ---------------------------------------------------------------------------
# value loss
# ---------------------------------------------------------------------------


def test_value_loss_by_hand():
    v = torch.tensor([[1.5, 1.1]], dtype=DT)
    old = torch.tensor([[1.0, 1.0]], dtype=DT)
    ret = torch.tensor([[2.0, 2.0]], dtype=DT)
    mask = torch.ones(1, 2, dtype=DT)
    # token 0: unclipped (1.5-2)^2 = 0.25, clipped v = 1.2 -> (1.2-2)^2 = 0.64 -> 0.5*0.64 = 0.32
    # token 1: v inside the clip range -> 0.5*(1.1-2)^2 = 0.405
    # loss = (0.32 + 0.405) / 2 = 0.3625 ; vf_clipfrac = 1/2 ; values_mean = 1.3
    loss, st = lo.value_loss(v, old, ret, mask, clip_eps=0.2)
    _close(loss, 0.3625)
    _close(st["vf_clipfrac"], 0.5)
    _close(st["values_mean"], 1.3)
    # unclipped: 0.5 * (0.25 + 0.81) / 2 = 0.265
    loss, st = lo.value_loss(v, old, ret, mask, clip_eps=None)
    _close(loss, 0.265)
    _close(st["vf_clipfrac"], 0.0)


# ---------------------------------------------------------------------------
# aggregation and split invariance
# ---------------------------------------------------------------------------


def test_aggregate_by_hand_and_invalid():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0]], dtype=DT)
    m = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=DT)
    _close(lo.aggregate(x, m, "token_mean"), 10.0 / 4)  # (1+2+3+4)/4
    _close(lo.aggregate(x, m, "token_mean", num_tokens=8), 10.0 / 8)
    _close(lo.aggregate(x, m, "seq_mean_token_mean"), (2.0 + 4.0) / 2)
    _close(lo.aggregate(x, m, "seq_mean_token_mean", num_seqs=4), (2.0 + 4.0) / 4)
    _close(lo.aggregate(x, m, "seq_mean_token_sum"), (6.0 + 4.0) / 2)
    with pytest.raises(ValueError, match="token_mean"):
        lo.aggregate(x, m, "sum")
    with pytest.raises(ValueError):
        lo.policy_loss(x, x, x, m, loss_agg="bogus")
    with pytest.raises(ValueError):
        lo.value_loss(x, x, x, m, loss_agg="bogus")


def _random_partition(gen, B):
    perm = torch.randperm(B, generator=gen)
    parts, i = [], 0
    while i < B:
        k = int(torch.randint(1, B - i + 1, (1,), generator=gen))
        parts.append(perm[i : i + k])
        i += k
    return parts


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("which", ["policy", "value"])
def test_split_invariance(loss_agg, which):
    seed = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"].index(loss_agg) * 2 + (which == "value")
    gen = torch.Generator().manual_seed(seed)
    B, T = 8, 6
    lengths, mask = _random_batch(gen, B=B, T=T)
    lengths[1] = 0  # an empty row, too
    mask = _mask_from_lengths(lengths, T)
    x = torch.randn(B, T, generator=gen, dtype=DT) * 0.3
    old = torch.randn(B, T, generator=gen, dtype=DT) * 0.3
    other = torch.randn(B, T, generator=gen, dtype=DT)  # advantages / returns

    def loss_fn(p, idx, **kw):
        if which == "policy":
            return lo.policy_loss(p[idx], old[idx], other[idx], mask[idx], loss_agg=loss_agg, **kw)[0]
        return lo.value_loss(p[idx], old[idx], other[idx], mask[idx], clip_eps=0.2, loss_agg=loss_agg, **kw)[0]

    full_p = x.clone().requires_grad_(True)
    full = loss_fn(full_p, torch.arange(B))
    full.backward()

    num_tokens, num_seqs = mask.sum(), B
    for _ in range(5):
        p = x.clone().requires_grad_(True)
        total = torch.zeros((), dtype=DT)
        for idx in _random_partition(gen, B):
            part = loss_fn(p, idx, num_tokens=num_tokens, num_seqs=num_seqs)
            part.backward()
            total = total + part.detach()
        _close(total, full, tol=1e-10)
        _close(p.grad, full_p.grad, tol=1e-10)


# ---------------------------------------------------------------------------
# garbage at masked positions changes nothing
# ---------------------------------------------------------------------------


def _check_same(clean_out, dirty_out):
    """Outputs agree everywhere (masked positions are 0 in both) and are finite."""
    assert torch.isfinite(dirty_out).all()
    _close(clean_out, dirty_out, tol=1e-10)


def _clean_and_dirty(seed, B=6, T=7):
    gen = torch.Generator().manual_seed(seed)
    _, mask = _random_batch(gen, B=B, T=T)
    clean = {k: torch.randn(B, T, generator=gen, dtype=DT) * 0.5 for k in ("a", "b", "c", "d")}
    dirty = {k: _garble(v, mask, gen) for k, v in clean.items()}
    scores = torch.randn(B, generator=gen, dtype=DT)
    return mask, clean, dirty, scores


def test_garbage_invariance_gae_rewards_whiten():
    mask, clean, dirty, scores = _clean_and_dirty(99)
    out_c = av.gae(clean["a"], clean["b"], mask, gamma=0.99, lam=0.9)
    out_d = av.gae(dirty["a"], dirty["b"], mask, gamma=0.99, lam=0.9)
    for c, d in zip(out_c, out_d):
        _check_same(c, d)
    for kind in lo.KL_KINDS:
        out_c = av.kl_shaped_rewards(scores, clean["a"], clean["b"], mask, 0.05, kind)
        out_d = av.kl_shaped_rewards(scores, dirty["a"], dirty["b"], mask, 0.05, kind)
        for c, d in zip(out_c, out_d):
            _check_same(c, d)
    for shift in (True, False):
        _check_same(av.masked_whiten(clean["a"], mask, shift), av.masked_whiten(dirty["a"], mask, shift))
    _check_same(
        lo.explained_variance(clean["a"], clean["b"], mask),
        lo.explained_variance(dirty["a"], dirty["b"], mask),
    )


def _loss_value_stats_grad(fn, d, **kw):
    p = d["a"].clone().requires_grad_(True)
    loss, stats = fn(p, d, **kw)
    loss.backward()
    return loss.detach(), stats, p.grad


@pytest.mark.parametrize(
    "which, kw",
    [
        ("policy", {}),
        ("policy", {"dual_clip": 3.0}),
        ("policy", {"loss_agg": "seq_mean_token_mean"}),
        ("value", {}),
        ("value", {"clip_eps": None}),
    ],
)
def test_garbage_invariance_losses(which, kw):
    mask, clean, dirty, _ = _clean_and_dirty(100)

    def fn(p, d, **kw):
        if which == "policy":
            return lo.policy_loss(p, d["b"], d["c"], mask, is_weights=d["d"].abs(), **kw)
        return lo.value_loss(p, d["b"], d["c"], mask, **kw)

    lc, sc, gc = _loss_value_stats_grad(fn, clean, **kw)
    ld, sd, gd = _loss_value_stats_grad(fn, dirty, **kw)
    _check_same(lc, ld)
    assert sc.keys() == sd.keys()
    for k in sc:
        _check_same(sc[k], sd[k])
    _check_same(gc, gd)  # including an exactly-zero gradient at masked positions
    assert torch.all(gd[mask == 0] == 0)


# ---------------------------------------------------------------------------
# logits utilities, diagnostics, eos penalty
# ---------------------------------------------------------------------------


def test_entropy_from_logits():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 11, generator=gen, dtype=DT) * 4
    p = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True)
    direct = -(p * torch.log(p)).sum(-1)  # H = -sum p log p
    _close(lo.entropy_from_logits(logits), direct, tol=1e-10)
    # uniform over V -> log V; -inf entries are excluded from the support
    _close(lo.entropy_from_logits(torch.zeros(4, 7)), torch.full((4,), math.log(7)))
    banned = torch.tensor([0.0, 0.0, float("-inf"), float("-inf")])
    _close(lo.entropy_from_logits(banned), math.log(2))
    # stable for huge logits in float32: compare with float64 on the same
    # (already rounded) float32 values, shifted back down exactly
    big = logits.float() + 1e4
    _close(lo.entropy_from_logits(big), lo.entropy_from_logits(big.double() - 1e4), tol=1e-5)
    # bf16 input is computed in float32
    assert lo.entropy_from_logits(logits.to(torch.bfloat16)).dtype == torch.float32


def test_logprobs_from_logits():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5, 13, generator=gen, dtype=DT)
    tokens = torch.randint(0, 13, (3, 5), generator=gen)
    for temp in (1.0, 0.7):
        z = logits / temp
        expected = z.gather(-1, tokens[..., None]).squeeze(-1) - torch.logsumexp(z, -1)
        _close(lo.logprobs_from_logits(logits, tokens, temperature=temp), expected, tol=1e-10)
    lb = logits.to(torch.bfloat16)
    out = lo.logprobs_from_logits(lb, tokens, temperature=0.7)
    assert out.dtype == torch.float32 and out.shape == (3, 5)
    ref = lo.logprobs_from_logits(lb.double(), tokens, temperature=0.7)
    _close(out, ref, tol=1e-5)
    with pytest.raises(ValueError):
        lo.logprobs_from_logits(logits, tokens, temperature=0.0)


def test_explained_variance():
    gen = torch.Generator().manual_seed(8)
    _, mask = _random_batch(gen, B=4, T=5, min_len=1)
    ret = torch.randn(4, 5, generator=gen, dtype=DT)
    _close(lo.explained_variance(ret, ret, mask), 1.0)
    # a constant prediction equal to mean(R) explains nothing: EV = 0
    const = torch.full_like(ret, mk.masked_mean(ret, mask).item())
    _close(lo.explained_variance(const, ret, mask), 0.0, tol=1e-10)
    assert torch.isnan(lo.explained_variance(ret, torch.ones_like(ret), mask))
    assert lo.explained_variance(ret, ret, mask).dim() == 0


def test_missing_eos_penalty():
    scores = torch.tensor([1.0, 2.0, 3.0])
    ended = torch.tensor([True, False, True])
    _close(av.missing_eos_penalty(scores, ended, 1.5), [1.0, 0.5, 3.0])
    assert av.missing_eos_penalty(scores, ended, None) is scores
    assert av.missing_eos_penalty(scores, ended, 0.0) is scores
    _close(scores, [1.0, 2.0, 3.0])  # not modified in place
