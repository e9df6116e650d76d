"""A rollout backend defined outside oppo (here, in this file alone) and registered at run time
(``rollout.registry.register``), with a setting of its own: the :class:`~oppo.api.protocols.RolloutBackend`
Protocol and one :class:`~oppo.rollout.registry.BackendSpec` are all a backend needs to be.

:class:`Delegating` subclasses nothing and exposes the Protocol's members only (generated from it; no
``__getattr__``): it samples with a private eager ``EagerBackend``. Its spec declares
:class:`PlugSettings` (``rollout.testplug.note``), a check of it, and its build; the config, ``--help``
and the trainer find them through the registry alone. The RolloutBackend conformance suite runs against
it (``tests/test_conformance.py``: ``ROLLOUTS["plugin"]`` builds it through the registry), and here the
Trainer runs every overlap mode (the fixture's spec runs in no Ray replica, so every local one) with
``generation.backend=testplug``, and, declared able to (``in_replicas``), in a Ray rollout replica; in ``sequential`` and ``oppo`` its metrics and tokens equal
``generation.backend=eager``'s (``tests/test_golden.py``'s configurations). The trainer has read one
member beyond the Protocol (``peak_cache_bytes``, until the Protocol's ``take_stats`` replaces it):
:class:`Reporting` adds it for the mode runs, and ``test_trainer_needs_nothing_beyond_the_protocol``
trains with the Protocol's members alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from oppo.api.protocols import RolloutBackend
from oppo.rollout import registry
from validated import load_valid

NAME = "testplug"


def protocol_members(proto) -> set[str]:
    """The members a runtime-checkable Protocol declares (methods, properties, attributes)."""
    import typing

    return set(getattr(proto, "__protocol_attrs__", None) or typing._get_protocol_attrs(proto))


def _forward(name: str, proto):
    """One member of ``proto`` passed to ``self._inner``: a method as a method, anything else (an
    attribute, a property) as a property that reads and writes through."""
    import inspect

    if inspect.isfunction(inspect.getattr_static(proto, name, None)):
        def method(self, *args, **kwargs):
            return getattr(self._inner, name)(*args, **kwargs)
        method.__name__ = name
        return method
    return property(lambda self: getattr(self._inner, name), lambda self, v: setattr(self._inner, name, v))


class Delegating:
    """A RolloutBackend in name only: it subclasses nothing and has the Protocol's members and no
    other (generated from the Protocol, so it follows it as it changes), each passed to an eager
    engine it owns. Whatever the trainer needs beyond the Protocol fails with it."""

    def __init__(self, inner):
        self._inner = inner


for _name in protocol_members(RolloutBackend):
    setattr(Delegating, _name, _forward(_name, RolloutBackend))


class Reporting(Delegating):
    """:class:`Delegating` plus the one member the trainer has read beyond the Protocol: the KV-cache
    peak of the step (``control.step_metrics.memory`` read and reset ``peak_cache_bytes``)."""

    @property
    def peak_cache_bytes(self) -> int:
        return self._inner.peak_cache_bytes

    @peak_cache_bytes.setter
    def peak_cache_bytes(self, v: int) -> None:
        self._inner.peak_cache_bytes = v


@dataclass
class PlugSettings:
    """The plugin's own settings: the config's ``rollout.testplug.*``."""

    note: str = registry.setting("plain", "A word the backend is built with (recorded with each build).")


def _checks(own: PlugSettings, cfg) -> list[str]:
    return [] if own.note.strip() else ["rollout.testplug.note is empty; give it a word, e.g. rollout.testplug.note=plain."]


@dataclass
class Builds:
    """The plugin's ``build``: what it was asked for, in order; ``cls``: what it builds."""

    cls: type = Reporting
    requests: list = field(default_factory=list)

    def __call__(self, req: registry.BuildRequest) -> Delegating:
        from oppo.rollout.eager.backend import EagerBackend

        self.requests.append(req)
        s = req.settings
        assert s.kind == NAME and req.model is not None and isinstance(req.own, PlugSettings)
        return self.cls(EagerBackend(req.model, s.stop_ids, s.pad_id, s.max_new_tokens, s.temperature, s.top_k,
                                      s.top_p, seed=s.seed))


@pytest.fixture
def testplug():
    """The plugin registered for one test (then gone); yields its ``build`` (its record of builds)."""
    builds = Builds()
    registry.register(registry.BackendSpec(NAME, "a test's backend: oppo's eager backend behind the Protocol", builds,
                                       in_replicas=False, settings=PlugSettings, checks=_checks))
    try:
        yield builds
    finally:
        registry.unregister(NAME)


def test_registered_plugin_is_a_choice_with_its_settings_then_gone(testplug, tiny_models, capsys):
    from oppo.cli import main
    from oppo.config import ConfigError, help_text, load_config
    from oppo.rollout.registry import BackendSettings
    from transformers import AutoModelForCausalLM

    assert {n for n in dir(Delegating) if not n.startswith("_")} == protocol_members(RolloutBackend)
    assert NAME in registry.choices()
    cfg = load_config(None, [f"generation.backend={NAME}", f"rollout.{NAME}.note=hello"])  # any registered name
    assert cfg.rollout[NAME] == PlugSettings("hello")
    with pytest.raises(ConfigError, match=f"rollout.{NAME}.note is empty"):  # its own check, asked by validate
        load_valid(None, [f"generation.backend={NAME}", f"rollout.{NAME}.note=' '"])
    # listed in `oppo train --help` with its settings, their defaults and help
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    shown = capsys.readouterr().out
    assert help_text() in shown
    assert f"{NAME}: a test's backend" in shown and f"rollout.{NAME}:" in shown
    assert f"rollout.{NAME}.note = 'plain'" in shown and "A word the backend is built with" in shown
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.BackendSpec(NAME, "another", testplug))
    model = AutoModelForCausalLM.from_pretrained(tiny_models["policy"]).eval()
    b = registry.build(registry.BuildRequest(BackendSettings((1,), 0, 4, kind=NAME, backend=PlugSettings()), model))
    assert isinstance(b, RolloutBackend) and isinstance(b, Delegating) and len(testplug.requests) == 1
    b.close()
    registry.unregister(NAME)
    with pytest.raises(KeyError, match=NAME):
        registry.get(NAME)
    with pytest.raises(ConfigError):
        load_valid(None, [f"generation.backend={NAME}"])
    with pytest.raises(ConfigError, match=f"Unknown setting 'rollout.{NAME}.note'"):
        load_valid(None, [f"rollout.{NAME}.note=hello"])
    assert f"rollout.{NAME}" not in help_text()


# ---------------------------------------------------------------- in the trainer, every mode

MODES = {"sequential": 2, "intra": 2, "inter": 3, "oppo": 3, "pipeline": 1}
"""Steps per mode: inter and oppo carry sequences from their second step on."""


def _run(models, prompts, out, engine: str, mode: str, steps: int):
    from oppo.config import load_config
    from oppo.trainer import Trainer

    from test_golden import BASE, CASES, KEYS

    cfg = load_config(None, [f"policy.path={models['policy']}", f"reward.path={models['reward']}",
                             f"data.prompts={prompts}", f"run.out_dir={out}", *BASE, *CASES[mode][0],
                             f"generation.backend={engine}", *([f"rollout.{NAME}.note={mode}"] if engine == NAME else [])])
    rows = []
    with Trainer.from_config(cfg, progress=False) as t:
        if engine == NAME:
            assert isinstance(t.roles.rollout, Delegating), "the trainer samples with the plugin"
        for _ in range(steps):
            m = t.run_step()
            rows.append({"ids": t.last_result.exp.ids.tolist(), "metrics": {k: m[k] for k in KEYS if k in m},
                         "all": m})
    return rows


EXACT = ("sequential", "oppo")
"""Modes also run with ``generation.backend=eager``: the plugin must change nothing the trainer computes."""


@pytest.mark.parametrize("mode", list(MODES))
def test_trainer_runs_every_mode_on_the_plugin(testplug, tiny_models, tiny_prompts, tmp_path, mode):
    got = _run(tiny_models, tiny_prompts, tmp_path / "plug", NAME, mode, MODES[mode])
    assert len(testplug.requests) == 1, "the trainer built its backend through the registry, once"
    req = testplug.requests[0]
    assert req.settings.kind == NAME and req.settings.max_new_tokens == 16
    assert req.own == PlugSettings(mode), "the run's rollout.testplug.note reached the backend's build"
    for step, r in enumerate(got):
        m = r["all"]
        for k in ("loss/policy", "loss/value", "reward/mean", "kl/mean"):
            assert math.isfinite(m[k]), (mode, step, k, m[k])
        assert len(r["ids"]) == 4
    if mode in ("inter", "oppo"):
        assert any(r["metrics"]["overlap/carried"] > 0 for r in got), "no sequence carried: the mode's path untested"
    if mode not in EXACT:
        return
    # same seed, the same engine underneath: the same tokens and metrics as the eager backend
    want = _run(tiny_models, tiny_prompts, tmp_path / "eager", "eager", mode, MODES[mode])
    for step, (g, w) in enumerate(zip(got, want)):
        assert g["ids"] == w["ids"], f"{mode} step {step}: other tokens"
        assert set(g["metrics"]) == set(w["metrics"])
        for k, v in w["metrics"].items():
            assert g["metrics"][k] == pytest.approx(v, abs=1e-6, rel=1e-6), f"{mode} step {step}: {k}"


@pytest.mark.xfail(not hasattr(RolloutBackend, "take_stats"), raises=AttributeError, strict=True,
                   reason="src problem: control/step_metrics.py memory() reads and resets rollout.peak_cache_bytes, "
                          "which the RolloutBackend Protocol does not declare (the Protocol's take_stats, on its way "
                          "in, replaces it)")
def test_trainer_needs_nothing_beyond_the_protocol(testplug, tiny_models, tiny_prompts, tmp_path):
    """The backend with the Protocol's members only trains a step."""
    testplug.cls = Delegating
    rows = _run(tiny_models, tiny_prompts, tmp_path, NAME, "sequential", 1)
    assert math.isfinite(rows[0]["all"]["loss/policy"])


@pytest.mark.ray
def test_it_runs_in_a_ray_rollout_replica(ray_local, tiny_models, tiny_prompts, tmp_path):
    """The plugin declared able to run in replicas (``in_replicas=True``): with
    ``placement.ray.rollout_replicas=1`` the replica, whose process never imported this file, builds it
    from the spec the controller sends (its code travels with it: ``cluster.ship_plugins``) and
    samples every step with it, streaming its chunks to the scorer actor (``oppo`` mode)."""
    import os

    ray = pytest.importorskip("ray")
    from oppo.config import load_config
    from oppo.trainer import Trainer

    registry.register(registry.BackendSpec(NAME, "a test's backend: oppo's eager backend behind the Protocol", Builds(),
                                       settings=PlugSettings, checks=_checks))
    try:
        cfg = load_config(None, [
            f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
            f"data.prompts={tiny_prompts}", f"run.out_dir={tmp_path}", "placement.threads=1", "ppo.batch_size=4",
            "ppo.minibatch_size=4", "ppo.micro_batch_size=2", "generation.max_new_tokens=6", "overlap.chunk_size=3",
            "log.progress=false", "overlap.mode=oppo", f"generation.backend={NAME}", "placement.name=ray",
            "placement.ray.rollout_replicas=1", "learner.replicate.cpus=0.25", "placement.ray.scorer_cpus=0.25",
            "placement.ray.rollout_cpus=0.25"])
        with Trainer.from_config(cfg, progress=False) as t:
            replica = t.roles.rollout.replicas[0]
            built = ray.get(replica.__ray_call__.remote(lambda host: (type(host.backend).__qualname__, os.getpid())))
            assert built[0] == "Reporting" and built[1] != os.getpid(), "the replica built the plugin's backend"
            for _ in range(2):
                m = t.run_step()
                assert math.isfinite(m["loss/policy"]) and len(t.last_result.exp.rollouts) == 4
            assert "rollout0" in {s.lane for s in t.tracer.spans}, "the replica sampled"
            assert t.roles.rollout.chunks_sent > 0, "the replica streamed its chunks to the scorer actor"
    finally:
        registry.unregister(NAME)
