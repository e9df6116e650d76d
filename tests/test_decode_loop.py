"""The decode loop's tensor forms against their obvious per-row loops."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from oppo.rollout.eager.backend import EagerBackend


def _forced_by_rows(engine, logits):
    """The per-row loop ``EagerBackend._forced`` replaced (two small kernels per row per step)."""
    if all(r.target_length is None for r in engine.rows):
        return logits
    logits = logits.clone()
    for i, row in enumerate(engine.rows):
        if row.target_length is None:
            continue
        if len(row.response_ids) + 1 >= row.target_length:
            logits[i] = float("-inf")
            logits[i, engine.eos_id] = 0.0
        else:
            logits[i, list(engine.eos_ids)] = float("-inf")
    return logits


def test_forced_lengths_as_tensor_ops_equal_the_row_loop():
    rng = random.Random(0)
    for _ in range(200):
        R, V = rng.randint(1, 9), 12
        engine = EagerBackend.__new__(EagerBackend)  # only the attributes _forced reads
        engine.eos_ids = frozenset(rng.sample(range(V), rng.randint(1, 3)))
        engine.eos_id = min(engine.eos_ids)
        engine._eos_index = {}
        engine.rows = [SimpleNamespace(target_length=rng.choice([None, 1, 2, 3, 5]),
                                       response_ids=[0] * rng.randint(0, 4)) for _ in range(R)]
        logits = torch.randn(R, V)
        assert torch.equal(EagerBackend._forced(engine, logits), _forced_by_rows(engine, logits))
