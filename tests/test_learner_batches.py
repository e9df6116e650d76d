"""How the learner cuts a batch: minibatches listed micro-batch after micro-batch (packed: of balanced
token counts; unpacked: longest first), how a micro-batch is laid out, and what it pads."""

from __future__ import annotations

import torch

import pytest

from oppo.config import ConfigError, PPOConfig, load_config
from oppo.learner.batch import Experience, MicroBatching, micro_batches, padding_stats
from oppo.learner.local import Learner
from oppo.forward import sequence_batch
from validated import load_valid


def _learner(**ppo) -> Learner:
    return Learner(torch.nn.Linear(2, 2), None, PPOConfig(**ppo), temperature=1.0, seed=3)


def test_minibatches_keep_their_rows_and_put_the_longest_first():
    lr = _learner(batch_size=8, minibatch_size=4, micro_batch_size=2, epochs=2, packing="off")
    lengths = torch.tensor([5, 1, 7, 3, 9, 2, 8, 4])
    plain, ordered = lr.minibatches(8, step=2), lr.minibatches(8, step=2, lengths=lengths)  # host lists
    plain, ordered = [torch.tensor(m) for m in plain], [torch.tensor(m) for m in ordered]
    assert len(plain) == len(ordered) == 4  # 2 epochs x 2 minibatches
    for a, b in zip(plain, ordered):
        assert sorted(a.tolist()) == sorted(b.tolist())  # the same rows: the same loss
        assert lengths[b].tolist() == sorted(lengths[b].tolist(), reverse=True)


def test_packed_minibatches_are_runs_of_balanced_micro_batches():
    """Packed (the default): a minibatch lists its micro-batches one after another, each a run of
    it, with similar token counts (within the longest row of each other), the same rows as drawn."""
    cfg = PPOConfig(batch_size=16, minibatch_size=16, micro_batch_size=4)
    lr = Learner(torch.nn.Linear(2, 2), None, cfg, temperature=1.0, seed=3)
    lengths = torch.tensor([120, 64, 60, 33, 31, 30, 12, 11, 11, 10, 3, 2, 40, 41, 7, 9])
    (plain,), (mb,) = lr.minibatches(16, step=1), lr.minibatches(16, step=1, lengths=lengths)
    plain, mb = torch.tensor(plain), torch.tensor(mb)
    assert sorted(plain.tolist()) == sorted(mb.tolist())
    cuts = micro_batches(None, mb, MicroBatching.of(cfg), lengths.tolist())
    assert torch.equal(torch.cat(cuts), mb) and len(cuts) == 4  # runs, minibatch / micro_batch_size of them
    loads = [int(lengths[c].sum()) for c in cuts]
    assert max(loads) - min(loads) <= 120 and loads == sorted(loads, reverse=True)
    # a token budget: more micro-batches, none of several rows over it
    tight = PPOConfig(batch_size=16, minibatch_size=16, micro_batch_size=4, micro_batch_tokens=100)
    cuts = micro_batches(None, mb, MicroBatching.of(tight), lengths.tolist())
    assert len(cuts) > 4 and all(len(c) == 1 or int(lengths[c].sum()) <= 100 for c in cuts)


def test_rank_of_balances_micro_batches_in_order_of_decreasing_tokens():
    from oppo.learner.batch import rank_of

    assert [rank_of(j, 2) for j in range(6)] == [0, 1, 1, 0, 0, 1]
    assert [rank_of(j, 3) for j in range(6)] == [0, 1, 2, 2, 1, 0]


def test_padding_stats_counts_rows_times_width():
    # prompts of 2, 3 and 1 tokens, responses of 4, 1 and 2 tokens: rows of 6, 4 and 3 real tokens
    ids, valid, P, rmask = sequence_batch([[5, 6], [5, 6, 7], [8]], [[1, 2, 3, 4], [1], [2, 3]], 0,
                                          torch.device("cpu"))
    exp = Experience(rollouts=[], ids=ids, valid=valid, P=P, mask=rmask.float(), versions=rmask.long(),
                     behaviour_logprobs=rmask.float(), old_logprobs=rmask.float(), is_weights=rmask.float())
    # packed left, a micro-batch is as wide as its longest row: [0, 1] 2 x 6 = 12 for 10 real; [2] 3 for 3
    stats = padding_stats(exp, [torch.tensor([0, 1, 2])], MicroBatching.of(PPOConfig(micro_batch_size=2, packing="off")))
    assert stats["perf/train_tokens"] == 13
    assert abs(stats["perf/train_padded_frac"] - (1 - 13 / 15)) < 1e-9
    # packed: two micro-batches ([0] alone, [1, 2] of 7 tokens), one row each at this attention cost
    from oppo.forward import LayoutRule

    stats = padding_stats(exp, [torch.tensor([0, 1, 2])], MicroBatching.of(PPOConfig(micro_batch_size=2)),
                          LayoutRule(True, 1e-3))
    assert stats == {"perf/train_tokens": 13.0, "perf/train_padded_frac": 0.0}


def test_micro_slices_lay_whole_sequences_out():
    from oppo.forward import LayoutRule
    from oppo.learner.batch import micro_slices

    ids, valid, P, rmask = sequence_batch([[5, 6], [5, 6, 7], [8]], [[1, 2, 3, 4], [1], [2, 3]], 0,
                                          torch.device("cpu"))
    exp = Experience(rollouts=[], ids=ids, valid=valid, P=P, mask=rmask.float(), versions=rmask.long(),
                     behaviour_logprobs=rmask.float(), old_logprobs=rmask.float(), is_weights=rmask.float())
    rows = torch.tensor([1, 2])
    padded = micro_slices(exp, rows, LayoutRule(False))  # one a row, its real tokens at columns 0..n-1
    ids_, pos = padded.layout.lay_out(padded.source, padded.first, 0)
    # padding at its row's last real position (never past the model's limit, nor past the real ones)
    assert ids_.tolist() == [[5, 6, 7, 1], [8, 2, 3, 0]] and pos.tolist() == [[0, 1, 2, 3], [0, 1, 2, 2]]
    assert padded.tokens.tolist() == [1, 2, 3]  # response tokens, row after row
    assert padded.pre.tolist() == [2, 4, 5]  # the flat position predicting each: prompt length - 1 + t
    assert padded.dest.tolist() == [0, 2, 3] and (padded.b, padded.T) == (2, 2)  # their [b, T] places
    packed = micro_slices(exp, rows, LayoutRule(True))  # end to end in one row, positions restarting
    ids_, pos = packed.layout.lay_out(packed.source, packed.first, 0)
    assert ids_.tolist() == [[5, 6, 7, 1, 8, 2, 3]] and pos.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert packed.pre.tolist() == [2, 4, 5] and packed.tokens.tolist() == [1, 2, 3]


def _rows(lengths):
    """An Experience of one-token prompts and responses of ``lengths``, longest first."""
    ids, valid, P, rmask = sequence_batch([[5]] * len(lengths), [[1] * n for n in lengths], 0, torch.device("cpu"))
    return Experience(rollouts=[], ids=ids, valid=valid, P=P, mask=rmask.float(), versions=rmask.long(),
                      behaviour_logprobs=rmask.float(), old_logprobs=rmask.float(), is_weights=rmask.float())


def test_token_budget_cuts_long_rows_few_and_short_rows_many():
    exp = _rows([40, 38, 10, 9, 9, 8, 2, 1])  # rows of 1 prompt token + these responses
    mb = torch.arange(8)
    cfg = PPOConfig(batch_size=8, minibatch_size=8, micro_batch_size=8, micro_batch_tokens=80, packing="off")
    cuts = [c.tolist() for c in micro_batches(exp, mb, MicroBatching.of(cfg))]
    # [0, 1] would be 2 x 41 = 82 > 80: row 0 alone; [1, 2]: 2 x 39 = 78 (a third: 117); [3..7]: 5 x 10 = 50
    assert cuts == [[0], [1, 2], [3, 4, 5, 6, 7]]
    assert sum(cuts, []) == mb.tolist()  # every row once, in order
    # the row cap still holds; a row wider than the budget goes alone
    small = PPOConfig(batch_size=8, minibatch_size=8, micro_batch_size=2, micro_batch_tokens=30, packing="off")
    assert [c.tolist() for c in micro_batches(exp, mb, MicroBatching.of(small))] == [[0], [1], [2, 3], [4, 5], [6, 7]]
    # padding: less than with rows only
    rows_only = padding_stats(exp, [mb], MicroBatching.of(PPOConfig(batch_size=8, minibatch_size=8, micro_batch_size=4,
                                                                 packing="off")))
    budget = padding_stats(exp, [mb], MicroBatching.of(cfg))
    assert budget["perf/train_padded_frac"] < rows_only["perf/train_padded_frac"]


def test_padding_cap_keeps_every_micro_batch_under_it():
    """ppo.micro_batch_padding: a row that would push its micro-batch past the padded share starts
    the next one, so the update computes at most that share of padding (the issue's 10%)."""
    lengths = [120, 64, 60, 33, 31, 30, 12, 11, 11, 10, 3, 2]  # a long tail, longest first
    exp = _rows(lengths)
    mb = torch.arange(len(lengths))
    rows_only = PPOConfig(batch_size=12, minibatch_size=12, micro_batch_size=4, packing="off")
    capped = PPOConfig(batch_size=12, minibatch_size=12, micro_batch_size=4, micro_batch_padding=0.1, packing="off")
    cuts = [c.tolist() for c in micro_batches(exp, mb, MicroBatching.of(capped))]
    assert sum(cuts, []) == mb.tolist()  # every row once, in order
    real = [n + 1 for n in lengths]  # (each row: one prompt token + its response)
    for c in cuts:
        assert len(c) <= 4 and 1 - sum(real[i] for i in c) / (len(c) * max(real[i] for i in c)) <= 0.1, c
    before = padding_stats(exp, [mb], MicroBatching.of(rows_only))["perf/train_padded_frac"]
    after = padding_stats(exp, [mb], MicroBatching.of(capped))["perf/train_padded_frac"]
    assert before > 0.1 >= after
    with pytest.raises(ConfigError, match="micro_batch_padding"):
        load_valid(None, ["ppo.micro_batch_padding=1.5"])


def test_a_model_that_cannot_pack_is_named_once_and_runs_padded(tiny_models):
    """A backbone whose attention ignores restarting position ids (here: one that drops them)
    would let a packed sequence see the one before it: the probe forward finds it, auto warns once
    and runs padded (exact), on stops with the fix, off never probes."""
    import warnings

    from oppo.forward import LayoutRule, full_hidden, layout_rule
    from oppo.models import backbone_and_head, load_causal_lm

    inner = backbone_and_head(load_causal_lm(str(tiny_models["policy"]), "policy", torch.device("cpu"),
                                             torch.float32))[0]

    class NoPositions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids, position_ids=None, use_cache=False):
            return self.inner(input_ids=input_ids, use_cache=use_cache)

    blind = NoPositions()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert layout_rule(blind) == layout_rule(blind) == LayoutRule(False)
    assert len(caught) == 1 and "cannot run packed rows" in str(caught[0].message)
    with pytest.raises(ValueError, match="ppo.packing=auto"):
        layout_rule(blind, "on")
    assert layout_rule(blind, "off") == LayoutRule(False) and layout_rule(inner).packed
    ids, valid, _, _ = sequence_batch([[5, 6], [7]], [[8, 9, 10], [11]], 0, torch.device("cpu"))
    with torch.no_grad():  # padded, it is exact: the same hidden states as the model that packs
        torch.testing.assert_close(full_hidden(blind, ids, valid), full_hidden(inner, ids, valid))


def test_varlen_rows_of_a_fixed_ladder_give_the_same_gradient(tiny_models):
    """Variable-length attention with shapes on the ladder (the GPU's default): each micro-batch one
    row as wide as the token ladder says (padding a segment of its own), cut by the token budget:
    the minibatch's loss and gradient equal those of one sequence a row, unpadded."""
    import copy

    from oppo.forward import LayoutRule, layout_rule
    from oppo.learner.batch import micro_groups, micro_slices
    from oppo.models import backbone_and_head, load_causal_lm

    policy = load_causal_lm(str(tiny_models["policy"]), "policy", torch.device("cpu"), torch.float32)
    lengths = [23, 3, 17, 9, 30, 5, 12, 2]
    exp = _rows(lengths)
    w = torch.randn(exp.mask.shape, generator=torch.Generator().manual_seed(0))  # [B, T] per-token weights
    cfg = PPOConfig(batch_size=8, minibatch_size=8, micro_batch_size=8, micro_batch_tokens=48, shape_buckets="on")
    assert layout_rule(backbone_and_head(policy)[0], "auto", "on").varlen
    out = {}
    for name, plan in (("alone", LayoutRule(False)), ("varlen", LayoutRule(True, buckets=True, varlen=True))):
        model = copy.deepcopy(policy).requires_grad_(True)
        lr = Learner(model, None, cfg, temperature=1.0, seed=0)
        groups = micro_groups(exp, list(range(8)), lr.micro) if name == "varlen" else [[i] for i in range(8)]
        total = 0.0
        for g in groups:
            mb = micro_slices(exp, g, plan, lr.micro)
            if name == "varlen":
                n = sum(exp.valid[g].sum(1).tolist())
                assert mb.layout.rows == 1 and mb.layout.varlen and n <= mb.layout.width <= 48  # (a rung, or the budget)
            lp, _ = lr._actor_logprobs(mb)  # [b, T]
            loss = (lp * w[g][:, :mb.T] * exp.mask[g][:, :mb.T]).sum()
            loss.backward()
            total += loss.item()
        out[name] = (total, [p.grad.clone() for p in model.parameters()])
    assert abs(out["alone"][0] - out["varlen"][0]) <= 1e-4 * max(1.0, abs(out["alone"][0]))
    for a, b in zip(out["alone"][1], out["varlen"][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
