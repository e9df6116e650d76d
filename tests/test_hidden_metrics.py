"""Metrics that hid what happened, and settings that never arrived:

- the off-policy importance weights were reported after ``ppo.is_truncate``'s cap only (so they
  saturated at it) and nothing counted the truncated ones;
- a Config gave every algorithm ``ppo.kl_coef``'s 0.05, GRPO's own 0.04 never arrived;
- the dual clip of ``algo.losses.policy_loss`` could not be set from a config.
"""

from __future__ import annotations

import math

import pytest
import torch

from oppo.algo import build_algorithm
from oppo.checkpoint import settings_mismatches
from oppo.config import Config, ConfigError, PPOConfig, load_config, to_dict
from oppo.forward import LayoutRule
from oppo.learner.batch import Experience, OldLogprobSettings, old_logprob_targets, set_old_logprobs
from oppo.learner.local import Learner
from oppo.learner.offpolicy import staleness_stats
from validated import load_valid

L = math.log


# --------------------------------------------------------------------------- (a) importance weights


def _carried_batch(sampler: list[float], versions: list[int]) -> Experience:
    """One row: a one-token prompt, a response of len(sampler) tokens with these sampler
    probabilities and policy versions, and one masked position after it."""
    T = len(sampler) + 1
    mask = torch.tensor([[1.0] * len(sampler) + [0.0]])  # [1, T]
    lp = torch.tensor([[L(p) for p in sampler] + [0.0]])  # [1, T]
    return Experience(rollouts=[], ids=torch.arange(1, T + 2)[None], valid=torch.ones(1, T + 1, dtype=torch.long),
                      P=1, mask=mask, versions=torch.tensor([versions + [0]]), behaviour_logprobs=lp,
                      old_logprobs=lp.clone(), is_weights=torch.ones_like(lp), policy_logprobs=lp.clone())


def _weights_at_step_1(pi_k: list[float], sampler: list[float], versions: list[int], is_truncate) -> dict:
    exp = _carried_batch(sampler, versions)
    redo, off = old_logprob_targets(exp, version=1, recompute_all=False)
    rows = redo.any(1).nonzero().squeeze(1)
    new = torch.tensor([[L(p) for p in pi_k] + [0.0]])  # pi_k's log-probs (the training forward's)
    exp = set_old_logprobs(exp, rows, new, redo, off, OldLogprobSettings.of(PPOConfig(is_truncate=is_truncate)))
    return staleness_stats(exp, step=1, seq_lags=[1])


def test_raw_importance_weights_and_the_truncated_share_are_reported():
    # tokens 0, 1 sampled by version 0 (off-policy at step 1), token 2 by version 1:
    # raw w = pi_k / pi_v = [0.6 / 0.2, 0.2 / 0.4] = [3, 0.5]; capped at 2: [2, 0.5]
    # applied: mean 1.25, max 2 (the cap); raw: mean 1.75, max 3; truncated: 1 of the 2 off-policy tokens
    m = _weights_at_step_1([0.6, 0.2, 0.5], [0.2, 0.4, 0.5], [0, 0, 1], is_truncate=2.0)
    assert m["overlap/is_weight_mean"] == pytest.approx(1.25) and m["overlap/is_weight_max"] == pytest.approx(2.0)
    assert m["overlap/is_weight_raw_mean"] == pytest.approx(1.75)
    assert m["overlap/is_weight_raw_max"] == pytest.approx(3.0)
    assert m["overlap/is_truncated_frac"] == pytest.approx(0.5)


def test_raw_weights_without_truncation_or_stale_tokens():
    m = _weights_at_step_1([0.6, 0.2, 0.5], [0.2, 0.4, 0.5], [0, 0, 1], is_truncate=None)  # no cap: raw = applied
    assert m["overlap/is_weight_raw_max"] == pytest.approx(m["overlap/is_weight_max"]) == pytest.approx(3.0)
    assert m["overlap/is_truncated_frac"] == 0.0
    fresh = _weights_at_step_1([0.6, 0.2], [0.2, 0.4], [1, 1], is_truncate=2.0)  # nothing off-policy
    assert (fresh["overlap/is_weight_raw_mean"], fresh["overlap/is_weight_raw_max"],
            fresh["overlap/is_truncated_frac"]) == (1.0, 1.0, 0.0)


# --------------------------------------------------------------------------- (b) the algorithm's KL coefficient


@pytest.mark.parametrize("overrides, beta", [
    (["algo.name=grpo"], 0.04),  # GRPO's own default (DeepSeekMath's beta): was 0.05
    (["algo.name=ppo"], 0.05),
    (["algo.name=rloo"], 0.05),
    (["algo.name=grpo", "ppo.kl_coef=0.1"], 0.1),  # set explicitly: the user's
    (["algo.name=grpo", "ppo.kl_coef=0"], 0.0),  # an explicit 0 is not "unset"
])
def test_a_config_run_gets_its_algorithm_kl_coef(overrides, beta):
    cfg = load_config(None, overrides)
    assert cfg.kl_coef == beta and build_algorithm(cfg).kl.coef == beta
    res = build_algorithm(cfg).advantages(torch.ones(4), torch.ones(4, 2), torch.zeros(4, 2), torch.zeros(4, 2),
                                          torch.zeros(4, 2) if cfg.needs_critic else None)
    assert float(res.stats["kl/coef"]) == beta  # the value in effect, as a metric


def test_kl_coef_help_lists_the_defaults():
    import dataclasses

    help_ = next(f for f in dataclasses.fields(PPOConfig) if f.name == "kl_coef").metadata["help"]
    assert "0.04 for grpo" in help_ and "0.05 for ppo" in help_


@pytest.mark.parametrize("value", ["-1", "inf", "nan"])
def test_a_bad_kl_coef_is_refused(value):
    with pytest.raises(ConfigError, match="ppo.kl_coef"):
        load_valid(None, [f"ppo.kl_coef={value}"])


def test_resume_compares_the_kl_coef_in_effect():
    def saved(name, beta):
        cfg = Config()
        cfg.algo.name, cfg.ppo.kl_coef = name, beta
        return to_dict(cfg)

    assert settings_mismatches(saved("grpo", 0.04), saved("grpo", None)) == []  # the same beta
    assert settings_mismatches(saved("ppo", 0.05), saved("ppo", None)) == []  # a checkpoint from before
    assert settings_mismatches(saved("grpo", 0.05), saved("grpo", None)) == [("ppo.kl_coef", 0.05, 0.04)]


# --------------------------------------------------------------------------- (c) the dual clip


def _micro_step_stats(ppo: PPOConfig) -> dict:
    """One actor micro-step on one row of two response tokens with advantage -1 and ratio 5:
    pg = max(-A r, -A clip(r, 0.8, 1.2)) = max(5, 1.2) = 5; with a dual clip c = 3, min(5, -A c) = 3."""
    exp = _carried_batch([0.1, 0.1], [0, 0])
    exp.advantages = torch.full((1, 3), -1.0)
    theta = torch.nn.Parameter(torch.full((1, 2), L(5.0)))  # log ratio
    lrn = Learner(torch.nn.Linear(2, 2), None, ppo, temperature=1.0, seed=0)
    lrn._actor_logprobs = lambda mb: (exp.old_logprobs[:, :2] + theta, torch.zeros(1, 2))  # no model forward
    lrn.layout_rule = lambda: LayoutRule(False)  # (no model to lay the rows out for)
    return lrn._actor_micro_step(exp, torch.tensor([0]), num_tokens=torch.tensor(2.0), num_seqs=1)


def test_dual_clip_from_the_config_reaches_the_loss():
    cfg = load_config(None, ["ppo.dual_clip=3"])
    assert cfg.ppo.dual_clip == 3.0
    on, off = _micro_step_stats(cfg.ppo), _micro_step_stats(load_config(None, []).ppo)
    assert off["loss/policy"] == pytest.approx(5.0) and "ppo/dual_clipfrac" not in off
    assert on["loss/policy"] == pytest.approx(3.0) and on["ppo/dual_clipfrac"] == pytest.approx(1.0)


@pytest.mark.parametrize("value", ["1", "0.5", "-3", "inf", "nan"])
def test_a_bad_dual_clip_is_refused_at_validation(value):
    with pytest.raises(ConfigError, match="ppo.dual_clip must be a finite number > 1"):
        load_valid(None, [f"ppo.dual_clip={value}"])


def test_policy_loss_refuses_a_nan_dual_clip():
    from oppo.algo import losses as lo

    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="dual_clip"):
        lo.policy_loss(x, x, x, torch.ones(1, 2), dual_clip=float("nan"))
