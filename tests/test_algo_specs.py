"""Tests for oppo.algo's specs and registry: each algorithm's file is its one source of truth
(defaults, needs, Config settings), the config and ``get_algorithm`` agree with it, and a new
algorithm needs only its own file (and a line in the registry)."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from oppo.algo import losses as lo
from oppo.algo import masks as mk
from oppo.algo import ALGORITHMS, SPECS, AlgorithmSpec, algorithm_settings, build_algorithm, get_algorithm, get_spec
from oppo.algo.core import KL_PLACEMENTS, SHARED_SETTINGS
from oppo.config import AlgoConfig, Config, help_text, load_config

from algo_conformance import check_algorithm
from validated import load_valid

# ppo.batch_size 8 is a whole number of groups for every default group size
SIZES = ["ppo.batch_size=8", "ppo.minibatch_size=4", "ppo.micro_batch_size=4"]


@pytest.mark.parametrize("name", ALGORITHMS)
def test_spec_is_complete_and_lives_in_its_own_file(name):
    spec = SPECS[name]
    assert spec.name == name and spec.help
    assert importlib.import_module(f"oppo.algo.{name}").SPEC is spec  # one file per algorithm
    est = spec.estimator
    assert dataclasses.is_dataclass(est) and est.__dataclass_params__.frozen and callable(est)
    assert isinstance(est.needs_critic, bool) and isinstance(est.min_group_size, int) and est.min_group_size >= 1
    for f in dataclasses.fields(est):  # every own setting has a default
        assert f.default is not dataclasses.MISSING, f"{name}: {f.name} has no default"
    assert spec.group_size >= spec.min_group_size
    assert spec.kl_placement in KL_PLACEMENTS and spec.kl_coef >= 0
    assert {spec.reward_kl_estimator, spec.loss_kl_estimator} <= set(lo.KL_KINDS)
    settings = algorithm_settings(name)
    assert tuple(settings)[:len(SHARED_SETTINGS)] == SHARED_SETTINGS
    # the Config gives only the algorithm's own settings, and names each one once
    cfg = load_config(None, [f"algo.name={name}", *SIZES])
    own = spec.from_config(cfg)
    assert set(own) <= set(settings) - set(SHARED_SETTINGS)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_algorithm_passes_the_conformance_checks(name):
    check_algorithm(get_spec(name))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_get_algorithm_defaults_are_the_spec(name):
    spec, algo = SPECS[name], get_algorithm(name)
    assert algo.name == name and algo.estimator == spec.estimator()
    assert algo.group_size == spec.group_size == algorithm_settings(name)["group_size"]
    assert algo.kl.placement == spec.kl_placement and algo.kl.estimator == spec.kl_estimator
    assert algo.kl.coef == spec.kl_coef and algo.kl.max_value is None
    assert algo.needs_critic == spec.needs_critic
    # an estimator not named follows the placement, as ppo.kl_estimator=auto does
    for placement in KL_PLACEMENTS:
        assert get_algorithm(name, kl_placement=placement).kl.estimator == spec.kl_estimator_for(placement)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_config_defaults_are_the_spec(name):
    spec = SPECS[name]
    cfg = load_config(None, [f"algo.name={name}", *SIZES])
    assert cfg.algo_spec is spec
    assert (cfg.group_size, cfg.kl_placement, cfg.kl_estimator, cfg.needs_critic) == (
        spec.group_size, spec.kl_placement, spec.kl_estimator, spec.needs_critic)
    other = "loss" if spec.kl_placement == "reward" else "reward"
    moved = load_config(None, [f"algo.name={name}", f"algo.kl_placement={other}", *SIZES])
    assert moved.kl_estimator == spec.kl_estimator_for(other)


def test_defaults_unchanged():
    """The values the config derived by name before the specs (config.py and trainer.py at
    commit c0953eb), and the Algorithm trainer.build_algorithm built from them."""
    was = {"ppo": (1, "reward", "k1", True), "grpo": (4, "loss", "k3", False),
           "rloo": (4, "reward", "k1", False), "reinforce_pp": (1, "reward", "k1", False)}
    for name, (G, placement, estimator, critic) in was.items():
        cfg = load_config(None, [f"algo.name={name}", *SIZES])
        derived = (cfg.group_size, cfg.kl_placement, cfg.kl_estimator, cfg.needs_critic)
        assert derived == (G, placement, estimator, critic)
        beta = 0.04 if name == "grpo" else 0.05  # changed on purpose: GRPO's own beta (every one's was 0.05)
        settings = dict(group_size=G, kl_coef=beta, kl_estimator=estimator, kl_placement=placement)
        own = {"ppo": dict(gamma=1.0, lam=0.95, whiten=True), "reinforce_pp": dict(gamma=1.0),
               "grpo": dict(std_normalize=True), "rloo": {}}[name]
        assert build_algorithm(cfg) == get_algorithm(name, **settings, **own)
    cfg = load_config(None, ["algo.name=grpo", "algo.grpo.std_normalize=false", "ppo.kl_coef=0.1", "algo.group_size=2",
                             "algo.kl_placement=reward", *SIZES])
    assert build_algorithm(cfg) == get_algorithm("grpo", group_size=2, kl_coef=0.1, kl_estimator="k1",
                                                 kl_placement="reward", std_normalize=False)
    cfg = load_config(None, ["ppo.gamma=0.9", "ppo.lam=0.5", "ppo.whiten_advantages=false", "ppo.kl_estimator=k2"])
    assert build_algorithm(cfg) == get_algorithm("ppo", kl_estimator="k2", gamma=0.9, lam=0.5, whiten=False)


def test_config_choices_and_help_come_from_the_specs():
    field = {f.name: f for f in dataclasses.fields(AlgoConfig)}["name"]
    assert field.metadata["choices"] == ALGORITHMS
    text = help_text()
    for spec in SPECS.values():
        assert f"{spec.name} ({spec.help})" in text or f"{spec.name}: {spec.help}" in text
    assert "4 for grpo, rloo" in text and "loss for grpo" in text


def test_unknown_algorithm_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown algorithm 'ppo2'; valid: ppo, grpo, rloo, reinforce_pp"):
        get_spec("ppo2")


def test_importing_the_config_does_not_import_torch():
    """config.py reads the specs; `oppo train --help` and config errors should not wait for torch."""
    code = "import sys, oppo.config, oppo.algo; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- a new algorithm


@dataclass(frozen=True)
class BatchMeanBaseline:
    """REINFORCE with a batch-mean baseline: each response's sequence reward minus the batch's
    mean, on every token; optionally divided by the batch's std."""

    whiten: bool = False
    needs_critic: ClassVar[bool] = False
    min_group_size: ClassVar[int] = 1

    def __call__(self, rewards, mask, values, group_ids):
        from oppo.algo import advantages as adv

        seq = mk.masked_sum(rewards, mask, dim=1)  # [B]
        a = seq - seq.mean()  # [B]
        if self.whiten:
            a = a / (a.std() + 1e-8)
        return adv.broadcast_to_tokens(a, mask), None, {}


MEAN_BASELINE = AlgorithmSpec(name="mean_baseline", help="REINFORCE with a batch-mean baseline",
                              estimator=BatchMeanBaseline, group_size=2, kl_placement="reward", kl_coef=0.1,
                              from_config=lambda cfg: dict(whiten=cfg.ppo.whiten_advantages))


def test_a_new_algorithm_is_its_spec(monkeypatch):
    """Everything above is what a file ``oppo/algo/mean_baseline.py`` would hold; registering it
    is its line in ``algorithms.SPECS`` (here patched in). The config's defaults and
    ``build_algorithm`` then follow. (``algo.name``'s choices are read from SPECS when config.py
    is imported, so this test sets the name on a Config rather than through load_config.)"""
    monkeypatch.setitem(SPECS, MEAN_BASELINE.name, MEAN_BASELINE)
    assert algorithm_settings("mean_baseline") == dict(group_size=2, kl_coef=0.1, kl_estimator="k1",
                                                       kl_placement="reward", kl_max=None, whiten=False)
    cfg = Config()
    cfg.algo.name, cfg.ppo.whiten_advantages = "mean_baseline", False
    assert (cfg.group_size, cfg.kl_placement, cfg.kl_estimator, cfg.needs_critic) == (2, "reward", "k1", False)
    assert build_algorithm(cfg).kl.coef == cfg.kl_coef == 0.1  # ppo.kl_coef empty: the spec's beta
    cfg.ppo.kl_coef = 0.05
    algo = build_algorithm(cfg)
    assert algo.estimator == BatchMeanBaseline(whiten=False) and algo.kl.coef == cfg.kl_coef == 0.05
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.float64)  # [B, T]
    logp = torch.full((4, 3), -1.0, dtype=torch.float64)  # [B, T]
    ref = logp.clone()
    ref[0, 0] = -3.0  # k1 = 2 on row 0's first token: R_0 = 1 - 0.05 * 2 = 0.9
    res = algo.advantages(torch.tensor([1.0, 0.0, 2.0, 1.0], dtype=torch.float64), mask, logp, ref)
    # R = (0.9, 0, 2, 1), mean 0.975 -> A = (-0.075, -0.975, 1.025, 0.025) on each row's tokens
    want = torch.tensor([[-0.075, -0.075, 0], [-0.975, 0, 0], [1.025, 1.025, 1.025], [0.025, 0.025, 0]],
                        dtype=torch.float64)
    torch.testing.assert_close(res.advantages, want)
    assert res.returns is None and not algo.needs_critic
    assert get_algorithm("mean_baseline", whiten=True).estimator.whiten
    monkeypatch.undo()
    with pytest.raises(ValueError, match="unknown algorithm 'mean_baseline'"):
        get_algorithm("mean_baseline")


def test_the_registry_refuses_a_taken_name_and_reads_entry_points(monkeypatch, tmp_path):
    from oppo.algo import algorithms, register, unregister

    with pytest.raises(ValueError, match="'ppo' is already registered"):
        register(dataclasses.replace(SPECS["ppo"]))
    assert register(SPECS["ppo"]) is SPECS["ppo"]  # the same spec again: a no-op

    class EntryPoint:
        def __init__(self, name, load):
            self.name, self.load = name, load

    def broken():
        raise ImportError("no module named mean_baseline_plugin")

    eps = [EntryPoint("mean_baseline", lambda: MEAN_BASELINE), EntryPoint("broken_algo", broken)]
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: eps if group == "oppo.algorithms" else [])
    monkeypatch.setattr(algorithms.REGISTRY, "loaded", False)
    monkeypatch.setattr(algorithms.REGISTRY, "broken", {})
    try:
        assert "mean_baseline" in ALGORITHMS and ALGORITHMS[-1] == "mean_baseline"  # read live
        with pytest.raises(ValueError, match="broken_algo.*its plugin failed to load: ImportError"):
            get_spec("broken_algo")
        p = tmp_path / "run.yaml"
        p.write_text("algo:\n  name: mean_baseline\n  mean_baseline:\n    whiten: true\nppo:\n  batch_size: 8\n"
                     "  minibatch_size: 4\n  micro_batch_size: 4\n")
        with pytest.raises(ValueError, match="algo.mean_baseline.whiten: algo.name=mean_baseline reads it from"):
            load_valid(p)  # its from_config reads whiten from ppo.whiten_advantages
    finally:
        unregister("mean_baseline")
