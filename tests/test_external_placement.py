"""A placement registered from outside oppo (this file alone): every role in this process and the
scorers inline in the controller's thread in every mode (no worker), with a setting of its own.
It is listed in the config's help with its section, its checks run before any model loads, and
``oppo.Trainer`` trains under it in a sequential and an overlapped mode."""

from dataclasses import dataclass

import pytest

from oppo import placements
from oppo.config import ConfigError, help_text, load_config, to_dict
from oppo.placements import local
from oppo.parts import setting
from oppo.scoring.inline import InlineScorer
from oppo.trainer import Trainer
from validated import load_valid


@dataclass
class InlineSettings:
    decode_threads: int = setting(0, "torch threads while the actor decodes (0: placement.threads').")


def _decide(cfg, own: InlineSettings, facts):
    from oppo.api.placement import Placement, ThreadBudget

    full = cfg.placement.threads or 1
    return Placement(scorer="inline", critic_trains_on="learner" if facts.needs_critic else "none",
                     learner="local", rollout="local", rollout_streams_itself=False,
                     threads=ThreadBudget(full, own.decode_threads or full, full))


def _checks(own: InlineSettings, cfg) -> list[str]:
    return [] if own.decode_threads >= 0 else [
        f"placement.inline.decode_threads must be >= 0 (0: placement.threads'), got {own.decode_threads}."]


SPEC = placements.PlacementSpec(
    "inline", "every role in this process, the scorers inline in every mode (a test's placement)",
    decide=_decide, build=lambda models, placement, own: local.build(models, placement, None),
    settings=InlineSettings, checks=_checks)


@pytest.fixture(scope="module", autouse=True)
def inline_placement():
    placements.register(SPEC)
    yield
    placements.unregister("inline")


def test_the_placement_is_in_the_help_with_its_section_and_its_checks_run_before_models_load():
    help_ = help_text()
    assert "inline: every role in this process, the scorers inline in every mode (a test's placement). " \
           "Its settings: placement.inline.* (read under placement.name=inline only)." in help_
    assert "placement.inline: (the settings of placement.name=inline)" in help_
    assert "placement.inline.decode_threads = 0" in help_
    with pytest.raises(ConfigError, match=r"placement.inline.decode_threads must be >= 0"):
        load_valid(None, ["placement.name=inline", "placement.inline.decode_threads=-1"])
    cfg = load_config(None, ["placement.name=inline", "placement.inline.decode_threads=2"])
    assert to_dict(cfg)["placement"]["inline"] == {"decode_threads": 2}
    with pytest.raises(ConfigError, match=r"placement.name='nowhere' is not one of local, ray, (\w+, )*inline"):
        load_valid(None, ["placement.name=nowhere"])


@pytest.mark.parametrize("mode", ["sequential", "oppo"])
def test_the_trainer_trains_under_the_registered_placement(tiny_models, tiny_prompts, tmp_path, mode):
    cfg = load_config(None, [
        f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
        f"data.prompts={tiny_prompts}", "placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=4",
        "ppo.micro_batch_size=4", "generation.max_new_tokens=6", "overlap.chunk_size=4",
        f"run.out_dir={tmp_path}", "log.progress=false", "run.samples=0", f"overlap.mode={mode}",
        "placement.name=inline", "placement.inline.decode_threads=1"])
    t = Trainer.from_config(cfg, progress=False)
    try:
        assert isinstance(t.roles.scorer, InlineScorer) and t.roles.placement.scorer == "inline"
        w0 = t.roles.policy.lm_head.weight.detach().clone()
        for _ in range(2):
            m = t.run_step()
            assert m["loss/policy"] == m["loss/policy"] and "reward/mean" in m
        assert not t.roles.policy.lm_head.weight.equal(w0), "the policy trained"
    finally:
        t.close()
