"""What every registered algorithm must do, checked without models (``check_algorithm``): run by
tests/test_algo_specs.py for each built-in algorithm and by tests/test_external_algorithm.py for
one registered from outside oppo.

On a small random batch, with a linear "policy" over random features:
- advantages finite, 0 at padding; the policy loss (plus the KL term) finite, with its stats;
- on-policy (old = current log-probs) the ratio is 1 and nothing is clipped;
- the gradient reaches the weights, finite and non-zero; an AdamW step at lr=0 leaves every weight
  bit-identical;
- garbage at padded positions changes neither the loss nor the gradient;
- cutting the batch in two micro-batches with the batch's denominators gives the batch's loss.
"""

from __future__ import annotations

import torch

from oppo.algo import AlgorithmSpec

B_GROUPS, T, V, H = 3, 5, 7, 4


def _batch(G: int, gen: torch.Generator):
    B = B_GROUPS * G
    lengths = torch.randint(1, T + 1, (B,), generator=gen)  # [B]
    lengths[0] = T
    mask = (torch.arange(T)[None] < lengths[:, None]).double()  # [B, T] right-padded
    feats = torch.randn(B, T, H, generator=gen, dtype=torch.float64)  # [B, T, H]
    tokens = torch.randint(0, V, (B, T), generator=gen)  # [B, T]
    scores = torch.randn(B, generator=gen, dtype=torch.float64)  # [B]
    values = torch.randn(B, T, generator=gen, dtype=torch.float64)  # [B, T]
    return mask, feats, tokens, scores, values


def _logprobs(policy: torch.nn.Linear, feats, tokens):
    return torch.log_softmax(policy(feats), -1).gather(-1, tokens[..., None]).squeeze(-1)  # [B, T]


def _loss(algo, logprobs, old, adv, ref, mask, is_w, rows=None, num_tokens=None, num_seqs=None):
    r = slice(None) if rows is None else rows
    kw = dict(clip_eps=0.2, clip_eps_high=None, dual_clip=None, loss_agg="token_mean",
              num_tokens=num_tokens if num_tokens is not None else mask.sum(),
              num_seqs=num_seqs if num_seqs is not None else mask.shape[0])
    pl, stats = algo.policy_loss(logprobs[r], old[r], adv[r], mask[r], is_weights=is_w[r], **kw)
    extra, _ = algo.actor_loss_extra(logprobs[r], ref[r], mask[r], is_weights=is_w[r], loss_agg="token_mean",
                                     num_tokens=kw["num_tokens"], num_seqs=kw["num_seqs"])
    return pl + extra, stats


def check_algorithm(spec: AlgorithmSpec, seed: int = 0) -> None:
    """Raise AssertionError where ``spec``'s algorithm (its defaults, KL on) breaks a rule above."""
    gen = torch.Generator().manual_seed(seed)
    algo = spec.build(kl_coef=0.1)
    G = algo.group_size
    mask, feats, tokens, scores, values = _batch(G, gen)
    policy = torch.nn.Linear(H, V).double()
    with torch.no_grad():
        old = _logprobs(policy, feats, tokens)  # [B, T]  on-policy: pi_old = pi
        ref = old - 0.1 * torch.rand(old.shape, generator=gen, dtype=torch.float64)  # [B, T]
        res = algo.advantages(scores, mask, old, ref, values if algo.needs_critic else None)
    adv = res.advantages
    assert torch.isfinite(adv).all() and torch.all(adv[mask == 0] == 0), f"{spec.name}: advantages"
    assert adv.abs().sum() > 0, f"{spec.name}: every advantage is 0 on random scores"
    is_w = torch.ones_like(old)

    logprobs = _logprobs(policy, feats, tokens)
    loss, stats = _loss(algo, logprobs, old, adv, ref, mask, is_w)
    assert loss.dim() == 0 and torch.isfinite(loss), f"{spec.name}: loss {loss}"
    assert {"clipfrac", "approx_kl", "ratio_mean"} <= set(stats), f"{spec.name}: stats {sorted(stats)}"
    assert stats["ratio_mean"].item() == 1.0 and stats["clipfrac"].item() == 0.0, f"{spec.name}: on-policy ratio"

    loss.backward()
    grads = [p.grad.clone() for p in policy.parameters()]
    assert all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads), \
        f"{spec.name}: no gradient reaches the weights"
    before = [p.detach().clone() for p in policy.parameters()]
    torch.optim.AdamW(policy.parameters(), lr=0.0).step()
    assert all(torch.equal(a, p) for a, p in zip(before, policy.parameters())), f"{spec.name}: lr=0 moved a weight"

    # garbage at padded positions: same loss, same gradient
    junk = lambda x: torch.where(mask > 0, x, torch.full_like(x, 1e4))  # noqa: E731
    policy.zero_grad()
    lp = _logprobs(policy, feats, tokens)
    dirty, _ = _loss(algo, torch.where(mask > 0, lp, lp.detach() * 0 + 50.0), junk(old), junk(adv), junk(ref), mask,
                     junk(is_w))
    dirty.backward()
    torch.testing.assert_close(dirty, loss, msg=f"{spec.name}: garbage at padding changed the loss")
    for g, d in zip(grads, (p.grad for p in policy.parameters())):
        torch.testing.assert_close(d, g, msg=f"{spec.name}: garbage at padding changed the gradient")

    # two micro-batches with the batch's denominators add up to the batch's loss
    with torch.no_grad():
        lp = _logprobs(policy, feats, tokens) + 0.05 * torch.randn(old.shape, generator=gen, dtype=torch.float64)
        whole, _ = _loss(algo, lp, old, adv, ref, mask, is_w)
        half = mask.shape[0] // 2
        parts = sum(_loss(algo, lp, old, adv, ref, mask, is_w, rows=r, num_tokens=mask.sum(),
                          num_seqs=mask.shape[0])[0] for r in (slice(0, half), slice(half, None)))
    torch.testing.assert_close(parts, whole, msg=f"{spec.name}: micro-batches do not add up to the batch")
