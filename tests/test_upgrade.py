"""Checkpoints that cross releases (docs/checkpoints.md).

- real checkpoints of previous releases (``tests/fixtures/releases/<sha>/<mode>``, written by those
  releases with ``make.py``) resume with this one for 2 more steps in every overlap mode: no
  error, every step once in the metrics, and (mode oppo, the format change's release) the
  resumed steps' rewards equal those of a second resume of the same checkpoint;
- a changed default is not a changed setting: a resume takes the checkpoint's value where the
  user does not set it, and refuses one the user sets otherwise with advice that works;
- the overlap controller's saved state: format 1 upgraded to 2 on load (mid-trial too), a format
  this release cannot read refused before any model loads, with advice that passes the preflight.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

import oppo
from oppo.config import CHANGED_DEFAULTS, Config, load_config, resumed_config, to_dict, user_set
from oppo.checkpoint.formats import FormatError, upgraded
from oppo.setup.preflight import PreflightError
from oppo.run import start_run
from oppo.scheduler.tuner import OverlapTuner, check_format

RELEASES = Path(__file__).parent / "fixtures" / "releases"
PREVIOUS = "bde14cf"  # the release before the overlap controller's format 2 and micro_batch_tokens=-1
CURRENT = "1212ebf"  # the release before this one


def _make():
    spec = importlib.util.spec_from_file_location("releases_make", RELEASES / "make.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MAKE = _make()


def _copy(sha: str, mode: str, root: Path) -> str:
    """A copy of a release's run of ``mode`` with the models and prompts it names (relative paths)
    under ``root``; returns the run directory, relative to ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("models", "prompts.jsonl"):
        if not (root / name).exists():
            (shutil.copytree if (RELEASES / name).is_dir() else shutil.copy)(RELEASES / name, root / name)
    shutil.copytree(RELEASES / sha / mode, root / sha / mode)
    return f"{sha}/{mode}"


def _steps(run: Path) -> dict[int, tuple[float, float]]:
    """{step: (mean reward, mean response length)} from a run's metrics; a step written twice fails."""
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    numbers = [s["step"] for s in steps if "reward/mean" in s]
    assert len(numbers) == len(set(numbers)), f"a step trained twice: {numbers}"
    return {s["step"]: (s["reward/mean"], s["response_length/mean"]) for s in steps if "reward/mean" in s}


def _resume(root: Path, run: str, mode: str, monkeypatch, extra=()) -> dict[int, tuple[float, float]]:
    monkeypatch.chdir(root)
    cfg = load_config(None, MAKE.settings(mode, run, 4) + list(extra))
    oppo.train(cfg, resume=run, progress=False)
    return _steps(root / run)


@pytest.mark.parametrize("sha", [PREVIOUS, CURRENT])
@pytest.mark.parametrize("mode", MAKE.MODES)
def test_previous_release_resumes(sha, mode, tmp_path, monkeypatch, capsys):
    """Resumed with its own settings and today's defaults, as the user who started it types them."""
    run = _copy(sha, mode, tmp_path / "a")
    rewards = _resume(tmp_path / "a", run, mode, monkeypatch)
    assert sorted(rewards) == [0, 1, 2, 3]
    if sha == PREVIOUS:  # its default of ppo.micro_batch_tokens was 0: the run goes on with it, and says so
        assert "resuming with ppo.micro_batch_tokens=0" in capsys.readouterr().err
        saved = sorted((tmp_path / "a" / run / "checkpoints").iterdir())[-1] / "config.yaml"
        assert "micro_batch_tokens: 0" in saved.read_text()  # (the next resume compares the same value)
        if mode == "oppo":  # an uninterrupted run of this release from the same checkpoint: the same steps
            again = _resume(tmp_path / "b", _copy(sha, mode, tmp_path / "b"), mode, monkeypatch)
            for s in (2, 3):  # the same tokens; scores within floating-point tolerance (streamed chunks' timing)
                assert again[s][1] == rewards[s][1]
                assert again[s][0] == pytest.approx(rewards[s][0], rel=1e-5, abs=1e-6)


def test_set_default_refused_with_advice_that_works(tmp_path, monkeypatch):
    """A value the user sets is the user's: one other than the checkpoint's is refused (before any
    model loads), and the setting the message names lets the resume through."""
    run = _copy(PREVIOUS, "oppo", tmp_path)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, MAKE.settings("oppo", run, 4) + ["ppo.micro_batch_tokens=-1"])
    with pytest.raises(PreflightError) as e:
        start_run(cfg, resume=run)
    said = str(e.value)
    assert "ppo.micro_batch_tokens is 0 in the checkpoint, -1 now" in said
    fix = said.split("resume with its settings (")[1].split(")")[0].split()
    assert fix == ["ppo.micro_batch_tokens=0"]
    plan = start_run(load_config(None, MAKE.settings("oppo", run, 4) + fix), resume=run)
    assert plan.checkpoint is not None and plan.start_step == 2


def test_resumed_config_takes_changed_defaults_only_where_unset():
    saved = to_dict(Config())
    saved["ppo"]["micro_batch_tokens"] = 0
    del saved["overlap"]["delta_rule"]  # saved before the setting existed: that run ran the paper's rule
    cfg = load_config(None, ["run.steps=4"])
    out, lines = resumed_config(cfg, saved)
    assert (out.ppo.micro_batch_tokens, out.overlap.delta_rule) == (0, "reward_slope")
    assert cfg.ppo.micro_batch_tokens == -1 and len(lines) == 2  # (the given settings are not changed)
    mine = load_config(None, ["ppo.micro_batch_tokens=-1"])
    out, lines = resumed_config(mine, saved)
    assert out.ppo.micro_batch_tokens == -1 and [line.split("=")[0] for line in lines] == ["overlap.delta_rule"]
    built = Config()  # built in code: a value other than the default is the user's
    built.ppo.micro_batch_tokens = 64
    assert user_set(built, "ppo.micro_batch_tokens") and not user_set(built, "overlap.delta_rule")
    assert resumed_config(built, saved)[0].ppo.micro_batch_tokens == 64
    for c in CHANGED_DEFAULTS:  # the table's "now" is today's default
        section, leaf = c.key.split(".")
        assert getattr(getattr(Config(), section), leaf) == c.now, c.key


def _v1_state(sha: str = PREVIOUS) -> dict:
    state = json.loads((RELEASES / sha / "oppo" / "checkpoints" / "step_000002" / "state.json").read_text())
    return state["tuner"]


def _tuner(in_flight: bool = False, deltas=(0, 1, 2), chunks=(4, 0)) -> OverlapTuner:
    return OverlapTuner(deltas, chunks, trial_steps=2, retune_every=50, margin=0.05, max_stale_share=0.5,
                        in_flight=in_flight)


def test_tuner_state_format_1_upgraded():
    """The saved /1 state of a real run, and one caught mid-trial: the incumbent and counts carry
    over, the trial is dropped (measured afresh), and the tuner goes on deciding."""
    v1 = _v1_state()
    assert v1["format"] == "oppo.overlap_tuner/1"
    t = OverlapTuner(v1["config"]["deltas"], v1["config"]["chunks"], trial_steps=2, retune_every=50)
    t.load_state_dict(v1)
    assert (t.incumbent.delta, t.incumbent.chunk, t.step, t.phase) == (2, 16, 2, "measure") and len(t._costs) == 1
    mid = {**v1, "config": _tuner()._config(), "incumbent": [0, 4], "cost": 1e-3, "base_stale": 0.0, "phase": "up",
           "trial": [1, 4], "plan": [["chunk", 0, 0]], "challenger": [[1, 4], 0.1, 0.0], "costs": [1e-3],
           "stale": [0.1], "held": [], "warm": 0, "ran": [1, 4], "rounds": 1}
    t = _tuner()
    t.load_state_dict(mid)
    assert (t.phase, t.trial, t.current().delta) == ("measure", None, 0)
    said = []
    for _ in range(8):  # a warm-up, the incumbent measured again, then a round of trials that save nothing
        t.record(1.0, 1000.0)
        said += t.take_decisions()
    assert "measured Delta 0, chunk 4" in said[0] and t.phase == "hold" and t.incumbent == t.current()
    assert sum("kept Delta 0, chunk 4" in line for line in said) == 2
    assert t.state_dict()["format"] == "oppo.overlap_tuner/2"


def test_tuner_unreadable_format_refused_before_models_load(tmp_path, monkeypatch):
    """A newer format (or an unknown one): the resume is refused by the preflight, naming the
    release to use and a new run from the checkpoint's weights, which passes the preflight."""
    with pytest.raises(FormatError, match="newer oppo"):
        check_format({**_v1_state(), "format": "oppo.overlap_tuner/3"})
    with pytest.raises(FormatError, match="another overlap.delta_rule"):
        check_format({"config": {}})
    with pytest.raises(FormatError, match="older than this oppo reads"):
        upgraded("x", {}, 1, 3, {2: dict})
    run = _copy(CURRENT, "oppo", tmp_path)
    state = tmp_path / run / "checkpoints" / "step_000002" / "state.json"
    d = json.loads(state.read_text())
    d["tuner"]["format"] = "oppo.overlap_tuner/3"
    state.write_text(json.dumps(d))  # (state.json is not in the manifest: it marks the checkpoint complete)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PreflightError) as e:
        start_run(load_config(None, MAKE.settings("oppo", run, 4)), resume=run)
    said = str(e.value)
    assert "format 3, written by a newer oppo" in said
    advice = said.split("start a new run from its weights (")[1].split(",")[0]
    assert advice.startswith("policy.path=")
    fresh = MAKE.settings("oppo", "fresh", 1) + [advice]
    assert start_run(load_config(None, fresh)).checkpoint is None


def test_a_built_in_task_run_whose_models_were_rebuilt_is_told_what_to_do(tmp_path, monkeypatch):
    """A run of the built-in task made by the previous release trained against that release's build of
    the task's models; this release builds them anew (``PREPARE_VERSION``), so a resume is refused, and
    the message says why and what to do (not "restore the files": oppo replaced them itself)."""
    import json
    from types import SimpleNamespace

    from oppo.checkpoint import MODELS_FILE, check_models
    from oppo.config import Config
    from oppo.models import ModelLoadError

    monkeypatch.setenv("OPPO_HOME", str(tmp_path / "home"))
    reward = str(tmp_path / "home" / "positive" / "reward")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / MODELS_FILE).write_text(json.dumps({"reward": {"path": reward, "fingerprint": "w1:aaaa"}}))
    trainer = SimpleNamespace(cfg=Config(), fingerprints={"reward": {"path": reward, "fingerprint": "w1:bbbb"}})
    with pytest.raises(ModelLoadError, match="built-in task's, which this release of oppo builds anew.*"
                                             "run.allow_changed_models=true"):
        check_models(trainer, ckpt)
    mine = str(tmp_path / "mine" / "reward")  # a user's own model that changed: restore it
    (ckpt / MODELS_FILE).write_text(json.dumps({"reward": {"path": mine, "fingerprint": "w1:aaaa"}}))
    trainer.fingerprints = {"reward": {"path": mine, "fingerprint": "w1:bbbb"}}
    with pytest.raises(ModelLoadError, match="Restore the original files at that path"):
        check_models(trainer, ckpt)


def test_the_checkpoint_reads_the_task_cache_where_the_task_keeps_it(tmp_path, monkeypatch):
    """``checkpoint._builtin_task`` reads the built-in task's cache by the rule of
    ``task.prepare.default_home`` (inlined: the task imports the checkpoint module); the two agree."""
    from oppo.checkpoint.store import _builtin_task
    from oppo.task.prepare import default_home

    for home in (str(tmp_path / "h"), None):
        if home is None:
            monkeypatch.delenv("OPPO_HOME", raising=False)
        else:
            monkeypatch.setenv("OPPO_HOME", home)
        inside = str(default_home() / "positive" / "reward")
        assert _builtin_task([("reward", inside, inside)])
        assert not _builtin_task([("reward", str(tmp_path / "elsewhere"), str(tmp_path / "elsewhere"))])


def test_scheduler_state_of_another_format_refused_with_advice(tmp_path, monkeypatch):
    """The scheduler's saved state in a format this release does not read: refused by the resume's
    checks before any model loads, saying which release to use and how to go on (it said only
    'unknown scheduler state format')."""
    from oppo.scheduler.admission import Scheduler, check_state_format

    check_state_format({"format": 1})  # (this release's)
    with pytest.raises(FormatError, match="newer oppo"):
        check_state_format({"format": 2})
    with pytest.raises(FormatError, match="older than this oppo reads"):
        check_state_format({})
    with pytest.raises(FormatError, match="newer oppo"):
        Scheduler(4, 0, 0).load_state_dict({"format": 2})
    run = _copy(CURRENT, "sequential", tmp_path)
    state = tmp_path / run / "checkpoints" / "step_000002" / "state.json"
    d = json.loads(state.read_text())
    d["scheduler"]["format"] = 2
    state.write_text(json.dumps(d))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PreflightError) as e:
        start_run(load_config(None, MAKE.settings("sequential", run, 4)), resume=run)
    said = str(e.value)
    assert "scheduler state is in format 2, written by a newer oppo" in said and "policy.path=" in said


@pytest.mark.parametrize("old, new", [("placement.ray.rollout_workers", "placement.ray.rollout_replicas"),
                                      ("placement.rollout_workers", "placement.ray.rollout_replicas"),
                                      ("learner.fsdp2.workers", "learner.fsdp2.ranks"),
                                      ("learner.replicate.workers", "learner.replicate.ranks"),
                                      ("placement.ray.learner_workers", "learner.replicate.ranks")])
def test_a_worker_key_by_hand_is_refused_naming_the_new_one(old, new, tmp_path):
    """"worker" names the scorer worker alone: Ray's rollout copies are replicas, a learner engine's
    ranks its ranks. The old keys given by hand (an override, a YAML file) are refused, the new one named."""
    from oppo.config import ConfigError

    with pytest.raises(ConfigError, match=rf"{old} is now {new}\b.*Rename it to {new}\."):
        load_config(None, [f"{old}=2"])
    p = tmp_path / "run.yaml"
    *sections, leaf = old.split(".")
    text, indent = "", ""
    for s in sections:
        text, indent = f"{text}{indent}{s}:\n", indent + "  "
    p.write_text(f"{text}{indent}{leaf}: 2\n")
    with pytest.raises(ConfigError, match=rf"{old} is now {new}\b"):
        load_config(p)


def test_a_saved_config_with_worker_keys_resumes_under_the_new_ones(tmp_path):
    """A checkpoint's config.yaml of the release before (learner.<engine>.workers,
    placement.ray.rollout_workers) and of the one before that (placement.learner_workers) reads with
    the values under learner.<engine>.ranks and placement.ray.rollout_replicas, and compares equal to
    today's same settings; the saved dict is unchanged."""
    import yaml

    from oppo.checkpoint import checkpoint_settings, settings_mismatches
    from oppo.config import from_dict, upgrade_settings

    saved = yaml.safe_load((RELEASES / CURRENT / "oppo" / "checkpoints" / "step_000002" / "config.yaml").read_text())
    saved["learner"]["fsdp2"]["workers"] = 3
    saved["placement"]["ray"]["rollout_workers"] = 2
    up = upgrade_settings(saved)
    assert up["learner"]["fsdp2"] == {"ranks": 3, "cpus": 1.0, "gpus": 0.0, "spread": False}
    assert up["learner"]["replicate"]["ranks"] == 1 and "workers" not in up["learner"]["replicate"]
    assert up["placement"]["ray"]["rollout_replicas"] == 2 and "rollout_workers" not in up["placement"]["ray"]
    assert saved["learner"]["fsdp2"]["workers"] == 3 and "rollout_workers" in saved["placement"]["ray"]
    cfg = from_dict({k: saved[k] for k in ("learner", "placement")})  # (the whole dict: its algo.settings={}
    assert (cfg.learner["fsdp2"].ranks, cfg.placement.ray.rollout_replicas) == (3, 2)  # reads as algo.ppo, refused)
    today = load_config(None, ["learner.fsdp2.ranks=3", "placement.ray.rollout_replicas=2"])
    assert (today.learner["fsdp2"].ranks, today.placement.ray.rollout_replicas) == (3, 2)
    ckpt = tmp_path / "checkpoints" / "step_2"
    ckpt.mkdir(parents=True)
    (ckpt / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    assert checkpoint_settings(ckpt)["learner"]["fsdp2"]["ranks"] == 3
    older = yaml.safe_load((RELEASES / PREVIOUS / "oppo" / "checkpoints" / "step_000002" / "config.yaml").read_text())
    older["placement"]["learner_workers"], older["placement"]["rollout_workers"] = 4, 1
    older["placement"]["learner"] = "fsdp2"
    cfg = from_dict({"placement": older["placement"]})
    assert (cfg.learner["fsdp2"].ranks, cfg.placement.ray.rollout_replicas) == (4, 1)
    now = to_dict(load_config(None, ["placement.learner=fsdp2", "learner.fsdp2.ranks=4",
                                     "placement.ray.rollout_replicas=1"]))
    assert not [k for k, _, _ in settings_mismatches(older, now) if "rank" in k or "replica" in k]


def test_an_engine_whose_own_setting_is_named_workers_keeps_it():
    """``learner.{learner}.workers`` moves only a key that is no setting today: an engine of one's own
    with a field named ``workers`` keeps it, by hand and in a saved config."""
    from dataclasses import dataclass

    from oppo.config import from_dict, upgrade_settings
    from oppo.learner import registry
    from oppo.parts import setting

    @dataclass
    class Own:
        workers: int = setting(1, "Threads of one's own.")

    spec = registry.EngineSpec("ownworkers", "test engine", build_local=lambda request: None, settings=Own)
    registry.register(spec)
    try:
        assert load_config(None, ["learner.ownworkers.workers=3"]).learner["ownworkers"].workers == 3
        saved = {"learner": {"ownworkers": {"workers": 3}, "replicate": {"workers": 2}}}
        assert upgrade_settings(saved)["learner"] == {"ownworkers": {"workers": 3}, "replicate": {"ranks": 2}}
        assert from_dict(saved).learner["ownworkers"].workers == 3
    finally:
        registry.unregister("ownworkers")
