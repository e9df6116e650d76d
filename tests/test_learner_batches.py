"""How the learner cuts a batch: minibatches ordered by length, and what its micro-batches pad."""

from __future__ import annotations

import torch

import pytest

from oppo.config import ConfigError, PPOConfig, load_config
from oppo.learner.batch import Experience, micro_batches, padding_stats
from oppo.learner.local import Learner
from oppo.forward import sequence_batch


def _learner(**ppo) -> Learner:
    return Learner(torch.nn.Linear(2, 2), None, PPOConfig(**ppo), temperature=1.0, seed=3)


def test_minibatches_keep_their_rows_and_put_the_longest_first():
    lr = _learner(batch_size=8, minibatch_size=4, micro_batch_size=2, epochs=2)
    lengths = torch.tensor([5, 1, 7, 3, 9, 2, 8, 4])
    plain, ordered = lr.minibatches(8, step=2), lr.minibatches(8, step=2, lengths=lengths)
    assert len(plain) == len(ordered) == 4  # 2 epochs x 2 minibatches
    for a, b in zip(plain, ordered):
        assert sorted(a.tolist()) == sorted(b.tolist())  # the same rows: the same loss
        assert lengths[b].tolist() == sorted(lengths[b].tolist(), reverse=True)


def test_padding_stats_counts_rows_times_width():
    # prompts of 2, 3 and 1 tokens, responses of 4, 1 and 2 tokens: rows of 6, 4 and 3 real tokens
    ids, valid, P, rmask = sequence_batch([[5, 6], [5, 6, 7], [8]], [[1, 2, 3, 4], [1], [2, 3]], 0,
                                          torch.device("cpu"))
    exp = Experience(rollouts=[], ids=ids, valid=valid, P=P, mask=rmask.float(), versions=rmask.long(),
                     behaviour_logprobs=rmask.float(), old_logprobs=rmask.float(), is_weights=rmask.float())
    # packed left, a micro-batch is as wide as its longest row: [0, 1] 2 x 6 = 12 for 10 real; [2] 3 for 3
    stats = padding_stats(exp, [torch.tensor([0, 1, 2])], PPOConfig(micro_batch_size=2))
    assert stats["perf/train_tokens"] == 13
    assert abs(stats["perf/train_padded_frac"] - (1 - 13 / 15)) < 1e-9


def test_micro_slices_pack_rows_left():
    from oppo.learner.batch import _micro_slices

    ids, valid, P, rmask = sequence_batch([[5, 6], [5, 6, 7], [8]], [[1, 2, 3, 4], [1], [2, 3]], 0,
                                          torch.device("cpu"))
    exp = Experience(rollouts=[], ids=ids, valid=valid, P=P, mask=rmask.float(), versions=rmask.long(),
                     behaviour_logprobs=rmask.float(), old_logprobs=rmask.float(), is_weights=rmask.float())
    mb = _micro_slices(exp, torch.tensor([1, 2]))
    assert mb.ids.tolist() == [[5, 6, 7, 1], [8, 2, 3, 0]] and mb.valid.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert mb.tokens.tolist() == [[1, 0], [2, 3]]  # response tokens (0: padding past row 1's end)
    assert mb.pre.tolist() == [[2, 3], [0, 1]]  # the column predicting each: prompt length - 1 + t


def _rows(lengths):
    """An Experience of one-token prompts and responses of ``lengths``, longest first."""
    ids, valid, P, rmask = sequence_batch([[5]] * len(lengths), [[1] * n for n in lengths], 0, torch.device("cpu"))
    return Experience(rollouts=[], ids=ids, valid=valid, P=P, mask=rmask.float(), versions=rmask.long(),
                      behaviour_logprobs=rmask.float(), old_logprobs=rmask.float(), is_weights=rmask.float())


def test_token_budget_cuts_long_rows_few_and_short_rows_many():
    exp = _rows([40, 38, 10, 9, 9, 8, 2, 1])  # rows of 1 prompt token + these responses
    mb = torch.arange(8)
    cfg = PPOConfig(batch_size=8, minibatch_size=8, micro_batch_size=8, micro_batch_tokens=80)
    cuts = [c.tolist() for c in micro_batches(exp, mb, cfg)]
    # [0, 1] would be 2 x 41 = 82 > 80: row 0 alone; [1, 2]: 2 x 39 = 78 (a third: 117); [3..7]: 5 x 10 = 50
    assert cuts == [[0], [1, 2], [3, 4, 5, 6, 7]]
    assert sum(cuts, []) == mb.tolist()  # every row once, in order
    # the row cap still holds; a row wider than the budget goes alone
    small = PPOConfig(batch_size=8, minibatch_size=8, micro_batch_size=2, micro_batch_tokens=30)
    assert [c.tolist() for c in micro_batches(exp, mb, small)] == [[0], [1], [2, 3], [4, 5], [6, 7]]
    # padding: less than with rows only
    rows_only = padding_stats(exp, [mb], PPOConfig(batch_size=8, minibatch_size=8, micro_batch_size=4))
    budget = padding_stats(exp, [mb], cfg)
    assert budget["perf/train_padded_frac"] < rows_only["perf/train_padded_frac"]


def test_padding_cap_keeps_every_micro_batch_under_it():
    """ppo.micro_batch_padding: a row that would push its micro-batch past the padded share starts
    the next one, so the update computes at most that share of padding (the issue's 10%)."""
    lengths = [120, 64, 60, 33, 31, 30, 12, 11, 11, 10, 3, 2]  # a long tail, longest first
    exp = _rows(lengths)
    mb = torch.arange(len(lengths))
    rows_only = PPOConfig(batch_size=12, minibatch_size=12, micro_batch_size=4)
    capped = PPOConfig(batch_size=12, minibatch_size=12, micro_batch_size=4, micro_batch_padding=0.1)
    cuts = [c.tolist() for c in micro_batches(exp, mb, capped)]
    assert sum(cuts, []) == mb.tolist()  # every row once, in order
    real = [n + 1 for n in lengths]  # (each row: one prompt token + its response)
    for c in cuts:
        assert len(c) <= 4 and 1 - sum(real[i] for i in c) / (len(c) * max(real[i] for i in c)) <= 0.1, c
    before = padding_stats(exp, [mb], rows_only)["perf/train_padded_frac"]
    after = padding_stats(exp, [mb], capped)["perf/train_padded_frac"]
    assert before > 0.1 >= after
    with pytest.raises(ConfigError, match="micro_batch_padding"):
        load_config(None, ["ppo.micro_batch_padding=1.5"])
