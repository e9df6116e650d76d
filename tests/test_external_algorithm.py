"""An algorithm added from outside oppo's source: a GSPO-like one (Zheng et al. 2025, "Group
Sequence Policy Optimization"), defined and registered in this file alone.

GSPO keeps GRPO's group-normalised advantages and no critic, and replaces the per-token PPO ratio
by one ratio per sequence, ``s_i = exp(mean over its response tokens of (logp - old_logp))``,
clipped and multiplied by the sequence's advantage. Here it is registered (``register``), listed by
``--help`` with its settings, checked by the conformance checks every algorithm passes, and trained
through ``oppo.Trainer`` in every overlap mode its spec allows.
"""

from __future__ import annotations

import re
import math
from dataclasses import dataclass

import pytest
import torch

from oppo import modes
from oppo.algo import AlgorithmSpec, register, unregister
from oppo.algo.grpo import GroupNormalized
from oppo.algo.masks import masked_mean, stat

from algo_conformance import check_algorithm
from validated import load_valid

CALLS: list[int] = []  # rows each call of the loss saw (the trainer's runs must go through it)


@dataclass(frozen=True)
class SequenceRatioLoss:
    """GSPO: one importance ratio per sequence (geometric mean of its token ratios), clipped."""

    clip_low: float = 3e-4
    clip_high: float = 4e-4

    def __post_init__(self) -> None:
        if not (0 < self.clip_low < 1 and 0 < self.clip_high):
            raise ValueError(f"clip_low must be in (0, 1) and clip_high > 0, got {self.clip_low}, {self.clip_high}")

    def __call__(self, logprobs, old_logprobs, advantages, mask, *, is_weights, clip_eps, clip_eps_high, dual_clip,
                 loss_agg, num_tokens, num_seqs):
        CALLS.append(mask.shape[0])
        log_ratio = masked_mean(logprobs - old_logprobs, mask, dim=1)  # [B]
        ratio = torch.exp(log_ratio)  # [B]
        adv = masked_mean(advantages, mask, dim=1).to(ratio.dtype)  # [B] (the sequence's, on each token)
        unclipped = -adv * ratio  # [B]
        clipped = -adv * ratio.clamp(1 - self.clip_low, 1 + self.clip_high)  # [B]
        per_seq = torch.maximum(unclipped, clipped)  # [B]
        if is_weights is not None:  # off-policy tokens: the sequence's weight is their geometric mean
            per_seq = per_seq * torch.exp(masked_mean(torch.log(is_weights.detach().clamp(min=1e-30)), mask, dim=1))
        n = num_seqs if num_seqs is not None else mask.shape[0]
        loss = per_seq.sum() / n
        has = (mask.sum(1) > 0).to(ratio.dtype)  # [B]
        stats = {"clipfrac": stat(masked_mean((clipped > unclipped).to(ratio.dtype), has)),
                 "approx_kl": stat(masked_mean(0.5 * log_ratio.detach() ** 2, has)),
                 "ratio_mean": stat(masked_mean(ratio.detach(), has))}
        return loss, stats


def _checks(own, cfg) -> list[str]:
    if cfg.ppo.dual_clip is not None:
        return ["algo.name=gspo_test clips the sequence ratio with algo.gspo_test.clip_low/clip_high; ppo.dual_clip "
                "does not apply to it: leave ppo.dual_clip empty."]
    return []


SPEC = AlgorithmSpec(name="gspo_test", help="GSPO: sequence-level importance ratio, group-normalised advantages",
                     estimator=GroupNormalized, policy_loss=SequenceRatioLoss, group_size=2, kl_placement="loss",
                     kl_coef=0.0, checks=_checks)


@pytest.fixture
def gspo():
    register(SPEC)  # the one registration line
    CALLS.clear()
    yield SPEC
    unregister(SPEC.name)


def test_registered_it_is_a_choice_with_its_settings_in_the_help(gspo):
    from oppo.config import ConfigError, help_text, load_config

    text = help_text()
    assert re.search(r"\[ppo\|grpo\|rloo\|reinforce_pp\|(\w+\|)*gspo_test\]", text)  # (after every built-in)
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("gspo_test:"))
    assert "sequence-level importance ratio" in line and "No critic" in line and "GSPO: one importance ratio" in line
    assert ("its settings: algo.gspo_test.std_normalize=True, algo.gspo_test.eps=1e-06, "
            "algo.gspo_test.clip_low=0.0003, algo.gspo_test.clip_high=0.0004") in text
    assert "algo.gspo_test.clip_high = 0.0004" in text  # its section, typed like every part's
    cfg = load_config(None, ["algo.name=gspo_test", "algo.gspo_test.clip_high=0.001"])
    from oppo.algo import build_algorithm

    algo = build_algorithm(cfg)
    assert algo.policy_loss == SequenceRatioLoss(clip_high=0.001) and not algo.needs_critic and algo.group_size == 2
    for bad, says in ((["algo.gspo_test.clip=0.1"], "Unknown setting 'algo.gspo_test.clip'"),
                      (["algo.gspo_test.clip_low=2"], "clip_low"), (["algo.gspo_test.clip_low=abc"], "clip_low"),
                      (["algo.settings={clip_low: 0.1}"], "algo.<algo.name>.clip_low=0.1"),
                      (["ppo.dual_clip=3"], "leave ppo.dual_clip empty")):
        with pytest.raises(ConfigError, match=says):
            load_valid(None, ["algo.name=gspo_test", *bad])


def test_unregistered_it_is_refused():
    from oppo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="gspo_test"):
        load_valid(None, ["algo.name=gspo_test"])


def test_it_passes_the_conformance_checks(gspo):
    check_algorithm(gspo)


def test_the_sequence_ratio_by_hand(gspo):
    """Row 0: log-ratios (0.2, 0.4) -> s = exp(0.3) = 1.3499, A = 1 -> clipped at 1 + 4e-4: -1.0004.
    Row 1: one token, log-ratio -0.1 -> s = 0.9048, A = -2 -> max(1.8097, 2 * 0.9997) = 1.9994.
    Loss = (-1.0004 + 1.9994) / 2 = 0.4995; both clipped."""
    loss_fn = gspo.build().policy_loss
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    old = torch.zeros(2, 2)
    lp = torch.tensor([[0.2, 0.4], [-0.1, 7.0]], requires_grad=True)  # 7.0: padding, ignored
    adv = torch.tensor([[1.0, 1.0], [-2.0, 0.0]])
    loss, st = loss_fn(lp, old, adv, mask, is_weights=None, clip_eps=0.2, clip_eps_high=None, dual_clip=None,
                       loss_agg="token_mean", num_tokens=3, num_seqs=2)
    assert loss.item() == pytest.approx((-(1 + 4e-4) + 2 * (1 - 3e-4)) / 2, abs=1e-6)
    assert st["clipfrac"].item() == 1.0 and st["ratio_mean"].item() == pytest.approx((math.exp(0.3) + math.exp(-0.1)) / 2)
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(2, 2))  # both clipped: no gradient


def _trainer(models, prompts, out, mode, *more):
    from oppo.config import load_config
    from oppo.trainer import Trainer

    extra = {"inter": ["overlap.delta=1", "overlap.max_lag=1"], "oppo": ["overlap.delta=1", "overlap.max_lag=1"],
             "pipeline": ["overlap.delta=1", "overlap.max_lag=1"]}.get(mode, [])
    cfg = load_config(None, [f"policy.path={models['policy']}", f"reward.path={models['reward']}",
                             f"data.prompts={prompts}", f"run.out_dir={out}", "algo.name=gspo_test",
                             "algo.gspo_test.clip_low=0.2", "algo.gspo_test.clip_high=0.2", "placement.threads=1",
                             "ppo.batch_size=4", "ppo.minibatch_size=4", "ppo.micro_batch_size=2",
                             "ppo.actor_lr=1e-3", "generation.max_new_tokens=6", "overlap.chunk_size=3",
                             "log.progress=false", f"overlap.mode={mode}", *extra, *more])
    return Trainer.from_config(cfg, progress=False)


def _train(models, prompts, out, mode, *more, steps=2):
    t = _trainer(models, prompts, out, mode, *more)
    try:
        before = [p.detach().clone() for p in t.roles.policy.parameters()]
        assert t.roles.critic is None and isinstance(t.roles.algorithm.policy_loss, SequenceRatioLoss)
        metrics = [t.run_step() for _ in range(steps)]
        moved = any(not torch.equal(a, p) for a, p in zip(before, t.roles.policy.parameters()))
    finally:
        t.close()
    assert CALLS, f"{mode}: the algorithm's loss was never called"
    for m in metrics:
        assert math.isfinite(m["loss/policy"]) and "loss/value" not in m, mode
    assert moved, f"{mode}: two steps of training left the policy unchanged"


ALLOWED = SPEC.modes or modes.NAMES


@pytest.mark.parametrize("mode", ["sequential", "oppo"])
def test_it_trains_through_the_trainer(gspo, tiny_models, tiny_prompts, tmp_path, mode):
    assert mode in ALLOWED
    _train(tiny_models, tiny_prompts, tmp_path, mode, "placement.local.scorer_process=false")


def test_it_trains_in_the_other_modes(gspo, tiny_models, tiny_prompts, tmp_path):
    """The scorer runs in a thread in these runs: the algorithm lives with the controller and the
    learner either way (the scorer never sees it), and a scorer process costs seconds to start."""
    for mode in [m for m in ALLOWED if m not in ("sequential", "oppo")]:
        CALLS.clear()
        _train(tiny_models, tiny_prompts, tmp_path / mode, mode, "placement.local.scorer_process=false",
               steps=1 if mode == "pipeline" else 2)


@pytest.mark.ray
def test_it_trains_on_ray_learner_ranks(gspo, ray_local, tiny_models, tiny_prompts, tmp_path):
    """placement.name=ray, 2 learner ranks, whose processes never imported this file: the ranks
    train with this file's loss (its code travels with the algorithm: ``cluster.ship_plugins``), so
    their update is the one local learner's step for step (data-parallel replicas are the same
    update); two minibatches, so that the second one's ratios are not 1. PPO's token loss on the
    ranks would show: its ``approx_kl`` (mean of squared token log-ratios) is ~10x the sequence
    ratio's here, its ``loss/policy`` ~1% away."""
    small = ("ppo.minibatch_size=2", "ppo.micro_batch_size=1")
    runs = []
    for place in (("placement.local.scorer_process=false",),
                  ("placement.name=ray", "learner.replicate.ranks=2", "learner.replicate.cpus=0.5",
                   "placement.ray.scorer_cpus=0.5")):
        t = _trainer(tiny_models, tiny_prompts, tmp_path / place[0], "sequential", *small, *place)
        try:
            runs.append([(t.run_step(), t.last_result.exp.ids.clone()) for _ in range(2)])
            if len(runs) == 2:
                assert type(t.roles.learner).__name__ == "LearnerGroup"
        finally:
            t.close()
    for step, ((want, ids), (got, got_ids)) in enumerate(zip(*runs)):
        assert torch.equal(got_ids, ids), step
        assert want["ppo/approx_kl"] > 0, "the ratios moved: the sequence and token losses differ"
        for k in ("loss/policy", "ppo/clipfrac", "ppo/approx_kl", "reward/mean"):
            assert got[k] == pytest.approx(want[k], abs=1e-8, rel=1e-3), (step, k)
