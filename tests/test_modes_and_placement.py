"""One mode table drives config, controller and planner; placement settings live in ``placement.*``
(the old ``overlap.*`` / ``run.threads`` names are refused by hand and read from saved configs)."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from oppo import modes
from oppo.checkpoint import CONFIG_FILE, checkpoint_settings, settings_mismatches
from oppo.config import MOVED, MODES, Config, ConfigError, from_dict, load_config, to_dict, upgrade_settings
from oppo.control.stages import OverlapPolicy
from oppo.plan import sim
from validated import load_valid

# --------------------------------------------------------------------------- the mode table


@pytest.mark.parametrize("mode", modes.TABLE, ids=lambda m: m.name)
def test_every_mode_reads_the_table(mode):
    cfg = load_config(None, [f"overlap.mode={mode.name}"])
    flags = (mode.streams, mode.carries, mode.in_flight)
    assert (cfg.streams, cfg.carries, cfg.in_flight) == flags
    policy = OverlapPolicy.of(cfg.overlap)
    assert (policy.streams, policy.carries, policy.in_flight) == flags
    assert mode.help in dataclasses.fields(cfg.overlap)[0].metadata["help"]


def test_the_planner_and_the_config_share_the_table():
    assert MODES == modes.NAMES == sim.ALL_MODES
    assert set(sim.STREAMING) == {m.name for m in modes.TABLE if m.streams}
    assert set(sim.CARRYING) == {m.name for m in modes.TABLE if m.carries}
    assert set(sim.IN_FLIGHT) == {m.name for m in modes.TABLE if m.in_flight}
    # the planner's default comparison leaves the in-flight mode out (the OPPO paper's four)
    assert sim.MODES == ("sequential", "intra", "inter", "oppo")
    with pytest.raises(ValueError, match="unknown mode 'fast'; one of sequential, intra"):
        modes.get("fast")


def test_known_modes_keep_their_behaviour():
    """The table's rows, written out once more (a change to the table must be meant)."""
    rows = {m.name: (m.streams, m.carries, m.in_flight) for m in modes.TABLE}
    assert rows == {"sequential": (False, False, False), "intra": (True, False, False),
                    "inter": (False, True, False), "oppo": (True, True, False), "pipeline": (True, True, True)}


# --------------------------------------------------------------------------- placement settings


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_an_old_name_on_the_command_line_names_the_new_one(old, new):
    old, new = old.format(learner="replicate"), new.format(learner="replicate")  # (a learner engine's ranks: the
    # chosen engine's section)
    special = {"lora_sync": "merged", "learner": "replicate", "address": "auto", "weight_sync": "object_store",
               "spread": "true", "name": "ray", "backend": "eager"}
    leaf_name = new.rsplit(".", 1)[1]
    value = special.get(leaf_name) or ("true" if new.endswith(("process", "worker", "normalize")) else "1")
    extra = ["placement.name=ray"] if ".ray." in new else []
    with pytest.raises(ConfigError, match=f"{old} is now {new}"):
        load_valid(None, [f"{old}={value}", *extra])
    section, leaf = _at(to_dict(load_config(None, [f"{new}={value}", *extra])), new)
    assert str(section[leaf]).lower() in (value, f"{value}.0")


def _at(d: dict, key: str) -> tuple[dict, str]:
    """(the dict holding ``key``'s value, its last part): ``key`` may name a section within a section
    (``rollout.vllm.lora_sync``)."""
    *sections, leaf = key.split(".")
    for name in sections:
        d = d[name]
    return d, leaf


def test_an_old_name_in_a_yaml_file_names_the_new_one(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("overlap:\n  mode: intra\n  scorer_process: false\n")
    with pytest.raises(ConfigError, match=rf"overlap.scorer_process is now placement.local.scorer_process.*{p.name}|"
                                          rf"{p.name}.*overlap.scorer_process is now placement.local.scorer_process"):
        load_valid(p)
    p.write_text("run:\n  threads: 2\n")
    with pytest.raises(ConfigError, match="run.threads is now placement.threads"):
        load_valid(p)
    p.write_text("placement:\n  local:\n    scorer_process: false\n  threads: 2\n")
    cfg = load_config(p)
    assert cfg.placement.local.scorer_process is False and cfg.placement.threads == 2
    p.write_text("placement:\n  backend: ray\n  learner_workers: 2\n")
    with pytest.raises(ConfigError, match="placement.backend is now placement.name(.|\n)*placement.learner_workers is "
                                          "now learner.replicate.ranks"):
        load_valid(p)


def _old_saved(cfg: Config) -> dict:
    """``to_dict(cfg)`` as an oppo from before the move saved it (placement keys under overlap / run)."""
    d = to_dict(cfg)
    for old, new in MOVED.items():  # (two old names of one setting: the older one, listed first)
        (os_, ok), (ns, nk) = old.split(".", 1), _at(d, new.format(learner=cfg.placement.learner))
        if nk in ns and "." not in ok:
            d[os_][ok] = ns.pop(nk)
    return d


def test_a_saved_config_from_before_issue_44_reads_the_engines_ranks_and_the_placements_name():
    """placement.backend was the placement's name; a learner engine's ranks were placement.ray's."""
    old = {"placement": {"backend": "ray", "learner": "fsdp2", "ray": {"learner_workers": 2, "learner_cpus": 0.5,
                                                                      "spread": True, "scorer_cpus": 0.5}},
           "ppo": {"minibatch_size": 16, "micro_batch_size": 8}}
    cfg = from_dict(old)
    assert cfg.placement.name == "ray" and cfg.placement.ray.scorer_cpus == 0.5
    assert (cfg.learner["fsdp2"].ranks, cfg.learner["fsdp2"].cpus, cfg.learner["fsdp2"].spread) == (2, 0.5, True)
    assert cfg.learner["replicate"].ranks == 1 and old["placement"]["ray"]["learner_workers"] == 2  # (unchanged)


def test_a_saved_config_with_old_names_loads_with_the_new_ones(tmp_path):
    cfg = load_config(None, ["placement.local.critic_on_worker=false", "placement.actor_threads=2",
                             "placement.scorer_threads=3", "placement.local.scorer_process=false", "placement.threads=4"])
    old = _old_saved(cfg)
    assert "critic_on_worker" in old["overlap"] and "critic_on_worker" not in old["placement"]
    assert from_dict(old) == cfg
    assert upgrade_settings(old) == to_dict(cfg) and "scorer_process" in old["overlap"]  # (old is unchanged)
    # a checkpoint written before the move: its settings read under the new names, compared as equal
    ckpt = tmp_path / "checkpoints" / "step_2"
    ckpt.mkdir(parents=True)
    (ckpt / CONFIG_FILE).write_text(yaml.safe_dump(old, sort_keys=False))
    saved = checkpoint_settings(ckpt)
    assert saved == to_dict(cfg)
    assert settings_mismatches(old, to_dict(cfg)) == []
    # placement may change on resume; what is trained may not
    other = load_config(None, ["placement.threads=1", "placement.local.critic_on_worker=true", "ppo.actor_lr=1e-3"])
    assert [k for k, _, _ in settings_mismatches(old, to_dict(other))] == ["ppo.actor_lr"]


@pytest.mark.parametrize("overrides, on_policy", [
    (["overlap.mode=sequential"], True), (["overlap.mode=intra"], True),
    (["overlap.mode=inter", "overlap.delta=0"], True), (["overlap.mode=oppo", "overlap.delta_max=0"], True),
    (["overlap.mode=oppo"], False), (["overlap.mode=inter", "overlap.delta=2"], False),
    (["overlap.mode=pipeline", "overlap.delta=0"], False),
])
def test_the_start_line_says_whether_tokens_may_be_off_policy(overrides, on_policy):
    from oppo.run import policy_line

    cfg = load_config(None, overrides)
    line = policy_line(cfg.overlap, cfg.ppo)
    assert "\n" not in line
    assert line.startswith("on-policy:" if on_policy else "may train off-policy tokens:"), line
    assert "overlap.mode=sequential ppo.epochs=4" in line  # how to get TRL's behaviour


def test_generation_engine_is_now_generation_backend(tmp_path):
    """generation.engine picked the rollout backend ("engine" is the learner's word): given by hand it
    is refused naming generation.backend; a saved config (a checkpoint's, a run's) reads it as that."""
    with pytest.raises(ConfigError, match="generation.engine is now generation.backend .*placement.learner"):
        load_valid(None, ["generation.engine=eager"])
    p = tmp_path / "run.yaml"
    p.write_text("generation:\n  engine: eager\n")
    with pytest.raises(ConfigError, match="generation.engine is now generation.backend"):
        load_valid(p)
    old = {"generation": {"engine": "vllm", "top_k": 0}}
    assert upgrade_settings(old)["generation"] == {"backend": "vllm", "top_k": 0} and "engine" in old["generation"]
    saved = {"generation": {"engine": "static"}}  # (vllm would ask for vLLM installed: from_dict validates)
    assert from_dict(saved).generation.backend == "static" and not hasattr(from_dict(saved).generation, "engine")
    ckpt = tmp_path / "checkpoints" / "step_1"
    ckpt.mkdir(parents=True)
    (ckpt / CONFIG_FILE).write_text(yaml.safe_dump(saved, sort_keys=False))
    assert checkpoint_settings(ckpt)["generation"]["backend"] == "static"
    # a run saved with the static backend resumes with another (the same math, other machinery)
    assert not settings_mismatches(checkpoint_settings(ckpt), to_dict(load_config(None, ["generation.backend=eager"])))
