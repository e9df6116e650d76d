"""Tests for oppo.algo: hand-computed cases, slow obviously-correct loops as oracles, garbage at
masked positions, group permutation invariance, and exact expected gradients of the KL losses."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from oppo.algo import advantages as av
from oppo.algo import losses as lo
from oppo.algo import masks as mk
from oppo.algo import ALGORITHMS, Algorithm, KLPenalty, algorithm_settings, get_algorithm
from oppo.algo.core import consecutive_group_ids
from oppo.algo.grpo import GroupNormalized
from oppo.algo.ppo import GAE

DT = torch.float64


def _close(a, b, tol=1e-9):
    a = torch.as_tensor(a, dtype=DT)
    b = torch.as_tensor(b, dtype=DT)
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _mask_from_lengths(lengths, T):
    lengths = torch.as_tensor(lengths)
    return (torch.arange(T)[None, :] < lengths[:, None]).to(DT)  # [B, T]


def _random_batch(gen, B=6, T=7, min_len=0):
    lengths = torch.randint(min_len, T + 1, (B,), generator=gen)
    lengths[0] = T
    return lengths, _mask_from_lengths(lengths, T)


def _garble(x, mask, gen, scale=1e6):
    junk = torch.randn(x.shape, generator=gen, dtype=x.dtype) * scale
    return torch.where(mask.bool(), x, junk)


# ---------------------------------------------------------------------------
# slow oracles: one group at a time, with python's statistics module
# ---------------------------------------------------------------------------


def _groups_of(ids):
    out: dict[int, list[int]] = {}
    for i, g in enumerate(ids):
        out.setdefault(int(g), []).append(i)
    return out


def _grpo_oracle(scores, ids, std_normalize, eps):
    s = [float(x) for x in scores]
    out = [0.0] * len(s)
    for rows in _groups_of(ids).values():
        vals = [s[i] for i in rows]
        if len(set(vals)) == 1:
            continue  # no signal: 0
        mean = statistics.fmean(vals)
        std = statistics.stdev(vals)  # unbiased, len >= 2 here
        for i in rows:
            out[i] = (s[i] - mean) / (std + eps) if std_normalize else s[i] - mean
    return torch.tensor(out, dtype=DT)


def _rloo_oracle(scores, ids):
    s = [float(x) for x in scores]
    out = [0.0] * len(s)
    for rows in _groups_of(ids).values():
        for i in rows:
            others = [s[j] for j in rows if j != i]
            out[i] = s[i] - sum(others) / len(others)
    return torch.tensor(out, dtype=DT)


def _returns_oracle(rewards, lengths, gamma):
    B, T = rewards.shape
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(int(lengths[b])):
            out[b][t] = sum(gamma ** (u - t) * float(rewards[b, u]) for u in range(t, int(lengths[b])))
    return torch.tensor(out, dtype=DT)


def _random_groups(rng, n_groups, min_size=1, max_size=5):
    """Shuffled rows with random labels; group sizes in [min_size, max_size]."""
    labels = rng.sample(range(1000), n_groups)
    ids = [g for g in labels for _ in range(rng.randint(min_size, max_size))]
    rng.shuffle(ids)
    return torch.tensor(ids)


# ---------------------------------------------------------------------------
# GRPO
# ---------------------------------------------------------------------------


def test_grpo_by_hand():
    scores = torch.tensor([[1.0, 2.0, 3.0, 2.0], [0.0, 0.0, 0.0, 4.0], [5.0, 5.0, 5.0, 5.0]], dtype=DT)
    a, st = av.grpo_advantages(scores, eps=0.0)
    # group 0: mean 2, squared deviations 1+0+1+0 = 2, unbiased var 2/3 -> (s - 2) / sqrt(2/3)
    # group 1: mean 1, deviations -1,-1,-1,3, var (1+1+1+9)/3 = 4, std 2 -> -0.5,-0.5,-0.5,1.5
    # group 2: all equal -> exactly 0
    r = 1 / math.sqrt(2 / 3)
    _close(a, [[-r, 0.0, r, 0.0], [-0.5, -0.5, -0.5, 1.5], [0.0, 0.0, 0.0, 0.0]])
    _close(st["group/zero_std_frac"], 1 / 3)  # one group of three
    _close(st["adv/abs_mean"], (2 * r + 3.0) / 12)
    for v in st.values():
        assert v.dim() == 0 and not v.requires_grad
    # eps goes next to the std: group 1 with eps 1 -> deviations / 3
    a, _ = av.grpo_advantages(scores, eps=1.0)
    _close(a[1], [-1 / 3, -1 / 3, -1 / 3, 1.0])
    # Dr. GRPO (no std): plain deviations from the group mean
    a, _ = av.grpo_advantages(scores, std_normalize=False)
    _close(a, [[-1.0, 0.0, 1.0, 0.0], [-1.0, -1.0, -1.0, 3.0], [0.0, 0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="eps"):
        av.grpo_advantages(scores, eps=-1.0)


def test_grpo_equal_scores_give_exactly_zero_and_group_of_one_is_zero():
    # 0.1 three times: sum / 3 != 0.1 in floating point, so a plain (s - mean) / (std + eps)
    # would give rounding noise / eps; the rule is exactly 0
    s = torch.tensor([[0.1, 0.1, 0.1]], dtype=torch.float32)
    for std_normalize in (True, False):
        a, st = av.grpo_advantages(s, std_normalize=std_normalize)
        assert torch.equal(a, torch.zeros_like(a))
        assert st["group/zero_std_frac"].item() == 1.0
        a, _ = av.rloo_advantages(s)
        assert torch.equal(a, torch.zeros_like(a))
    a, _ = av.grpo_advantages(torch.tensor([[3.0], [-2.0]]))  # G = 1: no group to compare with
    assert torch.equal(a, torch.zeros(2, 1))


@pytest.mark.parametrize("std_normalize", [True, False])
def test_grpo_matches_oracle_with_labels_in_any_order(std_normalize):
    rng = random.Random(3 + std_normalize)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        ids = _random_groups(rng, n_groups=rng.randint(1, 6))
        s = torch.randn(len(ids), generator=gen, dtype=DT)
        s[: len(ids) // 3] = 1.0  # some ties, maybe whole equal groups
        a, _ = av.grpo_advantages(s, ids, std_normalize, eps=1e-6)
        _close(a, _grpo_oracle(s, ids, std_normalize, 1e-6))


def test_grouped_shape_equals_labelled_shape():
    gen = torch.Generator().manual_seed(4)
    s = torch.randn(5, 3, generator=gen, dtype=DT)
    ids = consecutive_group_ids(15, 3)
    assert ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    for fn in (av.grpo_advantages, av.rloo_advantages):
        a2, _ = fn(s)
        a1, _ = fn(s.reshape(-1), ids)
        assert a2.shape == (5, 3) and a1.shape == (15,)
        _close(a2.reshape(-1), a1)
    with pytest.raises(ValueError, match="group_ids"):
        av.grpo_advantages(s.reshape(-1))  # [B] without ids
    with pytest.raises(ValueError, match=r"\[B\]"):
        av.rloo_advantages(s, ids)  # [n, G] with ids
    with pytest.raises(ValueError, match="whole number of groups"):
        consecutive_group_ids(7, 2)


@pytest.mark.parametrize("fn", ["grpo", "grpo_no_std", "rloo"])
def test_group_permutation_and_relabelling_invariance(fn):
    f = {
        "grpo": lambda s, i: av.grpo_advantages(s, i)[0],
        "grpo_no_std": lambda s, i: av.grpo_advantages(s, i, std_normalize=False)[0],
        "rloo": lambda s, i: av.rloo_advantages(s, i)[0],
    }[fn]
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    for _ in range(5):
        ids = _random_groups(rng, n_groups=4, min_size=2)
        s = torch.randn(len(ids), generator=gen, dtype=DT)
        base = f(s, ids)
        perm = torch.randperm(len(ids), generator=gen)
        _close(f(s[perm], ids[perm]), base[perm], tol=1e-12)  # rows travel with their group
        relabel = {int(g): rng.randint(-10**6, 10**6) * 7 + k for k, g in enumerate(ids.unique())}
        _close(f(s, torch.tensor([relabel[int(g)] for g in ids])), base, tol=0)  # ids are only labels


def test_grpo_advantages_have_zero_mean_in_each_group():
    gen = torch.Generator().manual_seed(6)
    s = torch.randn(8, 4, generator=gen, dtype=DT)
    a, _ = av.grpo_advantages(s, eps=0.0)
    _close(a.mean(1), torch.zeros(8))
    _close(a.std(1), torch.ones(8))  # and unit (unbiased) std


# ---------------------------------------------------------------------------
# RLOO
# ---------------------------------------------------------------------------


def test_rloo_by_hand():
    scores = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 4.0]], dtype=DT)
    a, st = av.rloo_advantages(scores)
    # group 0: 1 - (2+3)/2 = -1.5 ; 2 - (1+3)/2 = 0 ; 3 - (1+2)/2 = 1.5
    # group 1: 0 - (0+4)/2 = -2 (twice) ; 4 - (0+0)/2 = 4
    _close(a, [[-1.5, 0.0, 1.5], [-2.0, -2.0, 4.0]])
    _close(st["group/zero_std_frac"], 0.0)
    # = G/(G-1) * (s - mean): 1.5 * (1 - 2) = -1.5 ; 1.5 * (0 - 4/3) = -2
    _close(a, 1.5 * (scores - scores.mean(1, keepdim=True)))


def test_rloo_matches_oracle():
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    for _ in range(5):
        ids = _random_groups(rng, n_groups=rng.randint(1, 6), min_size=2)
        s = torch.randn(len(ids), generator=gen, dtype=DT)
        a, _ = av.rloo_advantages(s, ids)
        _close(a, _rloo_oracle(s, ids))


def test_rloo_group_of_one_raises():
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        av.rloo_advantages(torch.tensor([[1.0], [2.0]]))
    with pytest.raises(ValueError, match="group_size >= 2"):
        av.rloo_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1]))  # one lone row


# ---------------------------------------------------------------------------
# broadcast, return-to-go, REINFORCE++
# ---------------------------------------------------------------------------


def test_broadcast_to_tokens():
    m = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]], dtype=DT)
    out = av.broadcast_to_tokens(torch.tensor([2.0, 5.0, float("nan")], dtype=DT), m)
    assert torch.isnan(out[2]).all()  # a NaN advantage is not hidden on real tokens
    _close(out[:2], [[2.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    out = av.broadcast_to_tokens(torch.tensor([2.0, float("inf"), -1.0], dtype=DT), m.bool())
    _close(out, [[2.0, 2.0, 0.0], [0.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])  # row 1 is all padding


def test_discounted_returns_by_hand_and_oracle():
    r = torch.tensor([[1.0, 2.0, 3.0, 777.0]], dtype=DT)
    m = torch.tensor([[1, 1, 1, 0]], dtype=DT)
    # gamma 0.5: G2 = 3 ; G1 = 2 + 0.5*3 = 3.5 ; G0 = 1 + 0.5*3.5 = 2.75 ; pad 0
    _close(av.discounted_returns(r, m, 0.5), [[2.75, 3.5, 3.0, 0.0]])
    _close(av.discounted_returns(r, m, 1.0), [[6.0, 5.0, 3.0, 0.0]])
    gen = torch.Generator().manual_seed(8)
    for gamma in (1.0, 0.9, 0.0):
        lengths, mask = _random_batch(gen, B=6, T=7)
        rewards = torch.randn(6, 7, generator=gen, dtype=DT)
        out = av.discounted_returns(_garble(rewards, mask, gen), mask, gamma)
        _close(out, _returns_oracle(rewards, lengths, gamma))


def test_reinforce_pp_by_hand():
    # scores +1 / -1 at the last token, no KL: returns are +1 on every token of row 0 and -1 on
    # row 1 (gamma 1); mean 0, unbiased var over 5 tokens = 5/4 -> advantage = returns / sqrt(1.25)
    m = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=DT)
    rewards, _ = av.kl_shaped_rewards(torch.tensor([1.0, -1.0], dtype=DT), torch.zeros(2, 3, dtype=DT),
                                      torch.zeros(2, 3, dtype=DT), m, kl_coef=0.1)
    _close(rewards, [[0.0, 0.0, 1.0], [0.0, -1.0, 0.0]])
    a, ret, st = av.reinforce_pp_advantages(rewards, m, gamma=1.0)
    _close(ret, [[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    # token mean (3 - 2) / 5 = 0.2, deviations 0.8 (x3), -1.2 (x2): var (3*0.64 + 2*1.44)/4 = 1.2
    s = math.sqrt(1.2 + 1e-8)
    _close(a, [[0.8 / s, 0.8 / s, 0.8 / s], [-1.2 / s, -1.2 / s, 0.0]])
    _close(st["returns/mean"], 0.2)


def test_reinforce_pp_is_whitened_oracle_returns():
    gen = torch.Generator().manual_seed(9)
    lengths, mask = _random_batch(gen, B=5, T=6, min_len=1)
    rewards = torch.randn(5, 6, generator=gen, dtype=DT)
    a, ret, _ = av.reinforce_pp_advantages(_garble(rewards, mask, gen), mask, gamma=0.95)
    oracle = _returns_oracle(rewards, lengths, 0.95)
    _close(ret, oracle)
    flat = oracle[mask.bool()]
    _close(a[mask.bool()], (flat - flat.mean()) / torch.sqrt(flat.var() + 1e-8))
    assert torch.all(a[mask == 0] == 0)


# ---------------------------------------------------------------------------
# KL as a loss
# ---------------------------------------------------------------------------


def test_kl_loss_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.9]], dtype=DT))
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.1]], dtype=DT))
    m = torch.tensor([[1, 1, 0]], dtype=DT)  # third token is padding
    d = math.log(2)  # token 0: log 0.5 - log 0.25 ; token 1: d = 0
    # k1 = (ln 2 + 0) / 2 = 0.346574 ; k2 = (0.5 ln^2 2) / 2 = 0.120113
    # k3 = (e^-ln2 + ln2 - 1) / 2 = (0.5 + 0.693147 - 1) / 2 = 0.096574
    for kind, want in (("k1", d / 2), ("k2", 0.25 * d * d), ("k3", (0.5 + d - 1) / 2)):
        loss, st = lo.kl_loss(logp, ref, m, kind)
        _close(loss, want)
        _close(st["kl/loss_mean"], want)
    # max_value clamps per token: k1 token 0 ln2 -> 0.5 ; mean (0.5 + 0) / 2
    _close(lo.kl_loss(logp, ref, m, "k1", max_value=0.5)[0], 0.25)
    # is_weights multiply per token, stats stay unweighted: k1 * [3, 1] -> 3 ln2 / 2
    loss, st = lo.kl_loss(logp, ref, m, "k1", is_weights=torch.tensor([[3.0, 1.0, 9.0]], dtype=DT))
    _close(loss, 1.5 * d)
    _close(st["kl/loss_mean"], d / 2)
    # aggregation as the policy loss: seq_mean_token_sum over 2 "sequences" -> ln2 / 2
    _close(lo.kl_loss(logp, ref, m, "k1", loss_agg="seq_mean_token_sum", num_seqs=2)[0], d / 2)
    ref_g = ref.clone().requires_grad_(True)
    lo.kl_loss(logp.clone().requires_grad_(True), ref_g, m, "k3")[0].backward()
    assert ref_g.grad is None  # the reference is a constant
    with pytest.raises(ValueError, match="kl kind"):
        lo.kl_loss(logp, ref, m, "k9")
    with pytest.raises(ValueError, match="max_value"):
        lo.kl_loss(logp, ref, m, "k3", max_value=0.0)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_loss_expected_gradient_is_exact(kind):
    """Differentiating the estimator on tokens sampled from pi (sampling not differentiated):
    the exact expectation over a small vocabulary, written as kl_loss with weights pi (one row
    whose "tokens" are the vocabulary, token sum), against autograd of the exact divergences."""
    gen = torch.Generator().manual_seed(10)
    theta = torch.randn(6, generator=gen, dtype=DT, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6, generator=gen, dtype=DT), 0)
    logp = torch.log_softmax(theta, 0)
    p = logp.exp().detach()
    loss, _ = lo.kl_loss(logp[None], ref[None], torch.ones(1, 6, dtype=DT), kind, is_weights=p[None],
                         loss_agg="seq_mean_token_sum")
    (g,) = torch.autograd.grad(loss, theta)
    theta2 = theta.detach().clone().requires_grad_(True)
    lp2 = torch.log_softmax(theta2, 0)
    reverse = (lp2.exp() * (lp2 - ref)).sum()  # KL(pi || ref)
    forward = (ref.exp() * (ref - lp2)).sum()  # KL(ref || pi)
    target = {"k1": 0.0 * reverse, "k2": reverse, "k3": forward}[kind]
    (want,) = torch.autograd.grad(target, theta2) if kind != "k1" else (torch.zeros(6, dtype=DT),)
    _close(g, want, tol=1e-12)
    # and the loss value itself is the right divergence for the unbiased ones
    if kind == "k3":
        _close(loss, (p * (logp.detach() - ref)).sum())  # E_pi[k3] = KL(pi || ref)


def test_kl_loss_garbage_and_split_invariance():
    gen = torch.Generator().manual_seed(11)
    lengths, mask = _random_batch(gen, B=6, T=7)
    lp = -torch.rand(6, 7, generator=gen, dtype=DT) * 2
    ref = -torch.rand(6, 7, generator=gen, dtype=DT) * 2
    w = torch.rand(6, 7, generator=gen, dtype=DT) + 0.5

    def run(lp_, ref_, w_, rows, **kw):
        p = lp_.clone().requires_grad_(True)
        loss, st = lo.kl_loss(p[rows], ref_[rows], mask[rows], "k3", is_weights=w_[rows], **kw)
        loss.backward()
        return loss.detach(), st, p.grad

    full = torch.arange(6)
    lc, sc, gc = run(lp, ref, w, full)
    ld, sd, gd = run(_garble(lp, mask, gen, 50.0), _garble(ref, mask, gen, 50.0), _garble(w, mask, gen), full)
    _close(lc, ld)
    _close(sc["kl/loss_mean"], sd["kl/loss_mean"])
    _close(gc, gd)
    assert torch.isfinite(gd).all() and torch.all(gd[mask == 0] == 0)
    # micro-batches with the global token count add up to the full loss and gradient
    total, grad = 0.0, torch.zeros(6, 7, dtype=DT)
    for rows in (torch.tensor([0, 3]), torch.tensor([1]), torch.tensor([2, 4, 5])):
        l, _, g = run(lp, ref, w, rows, num_tokens=mask.sum())
        total, grad = total + l, grad + g
    _close(total, lc)
    _close(grad, gc)


# ---------------------------------------------------------------------------
# Algorithm objects
# ---------------------------------------------------------------------------


def _batch(seed, B=8, T=6):
    gen = torch.Generator().manual_seed(seed)
    _, mask = _random_batch(gen, B=B, T=T, min_len=1)
    d = {k: torch.randn(B, T, generator=gen, dtype=DT) * 0.3 for k in ("logp", "ref", "values")}
    d["logp"], d["ref"] = d["logp"] - 1.0, d["ref"] - 1.0
    return gen, mask, d, torch.randn(B, generator=gen, dtype=DT)


def test_get_algorithm_names_settings_and_flags():
    with pytest.raises(ValueError, match="unknown algorithm 'ppo2'; valid: ppo, grpo, rloo, reinforce_pp"):
        get_algorithm("ppo2")
    with pytest.raises(ValueError, match="no setting.*lam.*its settings are"):
        get_algorithm("grpo", lam=0.9)
    assert ALGORITHMS[:4] == ("ppo", "grpo", "rloo", "reinforce_pp")  # (the built-ins first; more may follow)
    assert algorithm_settings("grpo")["kl_estimator"] == "k3"
    flags = {n: (get_algorithm(n).needs_critic, get_algorithm(n).kl_in_reward, get_algorithm(n).kl_in_loss)
             for n in ALGORITHMS}
    assert flags == {"ppo": (True, True, False), "grpo": (False, False, True),
                     "rloo": (False, True, False), "reinforce_pp": (False, True, False)}
    assert get_algorithm("grpo", kl_coef=0.0).needs_reference is False
    assert get_algorithm("grpo", kl_coef=0.0).kl_in_loss is False
    assert get_algorithm("ppo", kl_placement="loss", kl_estimator="k2").kl_in_loss  # KL placement is free
    for name in ("grpo", "rloo"):
        with pytest.raises(ValueError, match="group_size >= 2"):
            get_algorithm(name, group_size=1)
    for bad in (dict(kl_placement="both"), dict(kl_estimator="k4"), dict(kl_coef=-0.1), dict(gamma=1.5),
                dict(kl_max=10.0), dict(group_size=0), dict(group_size=True), dict(kl_coef=float("nan"))):
        with pytest.raises(ValueError):
            get_algorithm("ppo", **bad)
    with pytest.raises(ValueError, match="eps"):
        get_algorithm("grpo", eps=-1.0)
    a = get_algorithm("grpo", group_size=2)
    with pytest.raises(Exception):
        a.group_size = 3  # type: ignore[misc]  # frozen


def test_ppo_algorithm_is_the_learner_composition():
    """Bit-for-bit what learner.compute_advantages does today (the lead can swap it in)."""
    _, mask, d, scores = _batch(12)
    for whiten in (True, False):
        algo = get_algorithm("ppo", kl_coef=0.05, kl_estimator="k1", gamma=1.0, lam=0.95, whiten=whiten)
        res = algo.advantages(scores, mask, d["logp"], d["ref"], d["values"])
        rewards, kl = av.kl_shaped_rewards(scores, d["logp"], d["ref"], mask, 0.05, "k1")
        a, ret = av.gae(rewards, d["values"], mask, 1.0, 0.95)
        assert torch.equal(res.rewards, rewards) and torch.equal(res.kl, kl)
        assert torch.equal(res.advantages, av.masked_whiten(a, mask) if whiten else a)
        assert torch.equal(res.returns, ret)
    with pytest.raises(ValueError, match="critic"):
        algo.advantages(scores, mask, d["logp"], d["ref"])  # no values


def test_grpo_algorithm_by_hand_kl_in_loss():
    algo = get_algorithm("grpo", group_size=2, kl_coef=0.5, eps=0.0)
    m = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]], dtype=DT)
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.3], [0.5, 0.5], [0.5, 0.5]], dtype=DT))
    ref = torch.log(torch.tensor([[0.25, 0.5], [0.5, 0.9], [0.5, 0.5], [0.5, 0.5]], dtype=DT))
    res = algo.advantages(torch.tensor([1.0, 0.0, 2.0, 2.0], dtype=DT), m, logp, ref)
    # the KL is in the loss, so the sequence rewards are the scores: group (1, 0) -> mean 0.5,
    # unbiased std sqrt(0.5) -> +-0.5/0.70711 = +-0.70711 on each row's tokens; group (2, 2) -> 0
    r = 0.5 / math.sqrt(0.5)
    _close(res.advantages, [[r, r], [-r, 0.0], [0.0, 0.0], [0.0, 0.0]])
    _close(res.rewards, [[0.0, 1.0], [0.0, 0.0], [0.0, 2.0], [0.0, 2.0]])  # no KL in them
    assert res.returns is None
    _close(res.kl[0], [0.5 + math.log(2) - 1, 0.0])  # k3 per token, for metrics
    _close(res.stats["group/zero_std_frac"], 0.5)
    # the loss term: 0.5 * k3 token mean = 0.5 * (0.193147 + 0 + 0 ...) / 7 tokens
    extra, st = algo.actor_loss_extra(logp, ref, m)
    _close(extra, 0.5 * (0.5 + math.log(2) - 1) / 7)
    assert "kl/loss_mean" in st
    # without reference log-probs the advantages still work (KL in the loss only)
    assert torch.equal(algo.advantages(torch.tensor([1.0, 0.0, 2.0, 2.0], dtype=DT), m).advantages,
                       res.advantages)
    with pytest.raises(ValueError, match="ref_logprobs"):
        algo.actor_loss_extra(logp, None, m)


def test_rloo_algorithm_by_hand_kl_in_sequence_reward():
    algo = get_algorithm("rloo", group_size=2, kl_coef=0.1, kl_estimator="k1")
    m = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=DT)
    logp = torch.tensor([[-1.0, -1.0, 5.0], [-1.0, -1.0, -1.0]], dtype=DT)
    ref = torch.tensor([[-2.0, -3.0, 0.0], [-1.0, -1.5, -1.0]], dtype=DT)
    res = algo.advantages(torch.tensor([1.0, 1.0], dtype=DT), m, logp, ref)
    # k1 sums: row 0: (1 + 2) = 3 -> R0 = 1 - 0.1*3 = 0.7 ; row 1: 0 + 0.5 + 0 -> R1 = 0.95
    # leave-one-out: A0 = 0.7 - 0.95 = -0.25 ; A1 = +0.25, on every response token
    _close(res.advantages, [[-0.25, -0.25, 0.0], [0.25, 0.25, 0.25]])
    _close(mk.masked_sum(res.rewards, m, dim=1), [0.7, 0.95])
    extra, st = algo.actor_loss_extra(logp, ref, m)
    assert extra.item() == 0.0 and st == {}


def test_reinforce_pp_algorithm_is_the_composition():
    _, mask, d, scores = _batch(13)
    algo = get_algorithm("reinforce_pp", kl_coef=0.02, kl_estimator="k2", gamma=0.99)
    res = algo.advantages(scores, mask, d["logp"], d["ref"])
    rewards, _ = av.kl_shaped_rewards(scores, d["logp"], d["ref"], mask, 0.02, "k2")
    a, _, _ = av.reinforce_pp_advantages(rewards, mask, 0.99)
    assert torch.equal(res.advantages, a) and res.returns is None
    with pytest.raises(ValueError, match="logprobs and ref_logprobs"):
        algo.advantages(scores, mask)


def test_algorithm_group_ids_default_and_explicit():
    _, mask, d, scores = _batch(14)
    algo = get_algorithm("grpo", group_size=4, kl_coef=0.0)
    a = algo.advantages(scores, mask).advantages
    ids = torch.tensor([9, 9, 9, 9, 2, 2, 2, 2])
    _close(algo.advantages(scores, mask, group_ids=ids).advantages, a, tol=0)
    with pytest.raises(ValueError, match="whole number of groups"):
        get_algorithm("grpo", group_size=3).advantages(scores, mask)


@pytest.mark.parametrize("name", ALGORITHMS)
@pytest.mark.parametrize("placement", ["reward", "loss"])
def test_algorithm_garbage_invariance(name, placement):
    gen, mask, clean, scores = _batch(15)
    dirty = {k: _garble(v, mask, gen) for k, v in clean.items()}
    algo = get_algorithm(name, group_size=2, kl_placement=placement, kl_coef=0.1)
    rc = algo.advantages(scores, mask, clean["logp"], clean["ref"], clean["values"])
    rd = algo.advantages(scores, mask, dirty["logp"], dirty["ref"], dirty["values"])
    for f in ("advantages", "returns", "rewards", "kl"):
        c, x = getattr(rc, f), getattr(rd, f)
        assert (c is None) == (x is None)
        if c is not None:
            assert torch.isfinite(x).all()
            _close(c, x)
            assert torch.all(x[mask == 0] == 0)
    assert rc.stats.keys() == rd.stats.keys()
    for k in rc.stats:
        _close(rc.stats[k], rd.stats[k])
    # the loss term too, with its gradient
    def extra(dd):
        p = dd["logp"].clone().requires_grad_(True)
        e, _ = algo.actor_loss_extra(p, dd["ref"], mask)
        if e.requires_grad:
            e.backward()
        return e.detach(), p.grad
    (ec, gc), (ed, gd) = extra(clean), extra(dirty)
    _close(ec, ed)
    assert (gc is None) == (gd is None) == (placement == "reward")
    if gc is not None:
        _close(gc, gd)
        assert torch.all(gd[mask == 0] == 0)


def test_parts_compose_without_get_algorithm():
    algo = Algorithm("my_ppo", GAE(gamma=0.9, lam=1.0, whiten=False), KLPenalty(0.1, "k3", "loss", 10.0))
    assert algo.needs_critic and algo.kl_in_loss and not algo.kl_in_reward
    assert Algorithm("g", GroupNormalized(), group_size=2).needs_reference is False
