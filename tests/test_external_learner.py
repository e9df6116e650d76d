"""Learner engines registered from outside oppo (this file alone): ``counting`` wraps the local
learner and counts its updates; ``recording`` runs on Ray, the built-in learner group with an update
strategy of this file's (replicas that count their updates across the ranks). Each is listed in the
config's help with its settings, its checks and where it runs are enforced before any model loads,
and ``oppo.Trainer`` trains through it."""

from dataclasses import dataclass

import pytest

from oppo.parts import setting
from oppo.config import ConfigError, help_text, load_config
from oppo.learner import registry
from oppo.trainer import Trainer
from validated import load_valid


class CountingLearner:
    """The local learner, counting the updates it runs (every other call passes through)."""

    def __init__(self, inner):
        self.inner, self.updates = inner, 0

    def update(self, exp, step, critic=True):
        self.updates += 1
        return self.inner.update(exp, step, critic)

    def __getattr__(self, name):  # old_logprobs, minibatches, weights_out, checkpoints, the models
        return getattr(self.inner, name)


BUILT: list[CountingLearner] = []


def _build(req: registry.LocalRequest) -> CountingLearner:
    BUILT.append(CountingLearner(req.learner))
    return BUILT[-1]


@dataclass
class CountingSettings:
    every: int = setting(1, "Count every n-th update (a test engine's own setting).")


def _checks(own: CountingSettings, cfg) -> list[str]:
    n = own.every
    return [] if n >= 1 else [f"learner.counting.every={n}: count every n >= 1 updates."]


class RecordingReplicas:
    """An update strategy of its own for the built-in Ray learner group: the built-in replicas
    (``dp.Replicated``, composed), and each update's stats add ``test/updates_all_ranks``, the
    updates this strategy ran summed over the ranks (a collective): 2 per step on 2 ranks, seen by
    the controller only if every rank ran this class."""

    name = "recording"
    sharded = False

    def __init__(self):
        from oppo.learner.dp import Replicated

        self.inner, self.updates = Replicated(), 0

    def build(self, spec, world, mesh_device):
        return self.inner.build(spec, world, mesh_device)

    def update(self, learner, exp, step, rank, world, critic):
        import torch
        import torch.distributed as dist

        stats = self.inner.update(learner, exp, step, rank, world, critic)
        self.updates += 1
        n = torch.tensor([float(self.updates)])
        dist.all_reduce(n)
        return {**stats, "test/updates_all_ranks": n.item()}

    def old_logprobs(self, learner, exp, version, rank, world):
        return self.inner.old_logprobs(learner, exp, version, rank, world)

    def model_state(self, model):
        return self.inner.model_state(model)

    def optim_state(self, model, opt):
        return self.inner.optim_state(model, opt)

    def load_state(self, model, opt, weights, optim):
        self.inner.load_state(model, opt, weights, optim)


def _build_remote(req: registry.RemoteRequest):
    from oppo.learner.group import LearnerGroup

    return LearnerGroup(req.spec, req.world, RecordingReplicas(), num_cpus=req.num_cpus, num_gpus=req.num_gpus,
                        threads=req.threads, placement=req.placement, critic_scorer=req.critic_scorer,
                        tracer=req.tracer, home=req.home)


@pytest.fixture(scope="module", autouse=True)
def counting_engine():
    registry.register(registry.EngineSpec(
        "counting", "the local learner, counting its updates (a test's engine)", build_local=_build,
        checks=_checks, settings=CountingSettings))
    registry.register(registry.EngineSpec(
        "recording", "Ray replicas counting their updates (a test's engine)", build_remote=_build_remote,
        settings=registry.Ranks))
    yield
    registry.unregister("counting")
    registry.unregister("recording")


def _cfg(tiny_models, tiny_prompts, tmp_path, *extra):
    return load_config(None, [
        f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
        f"data.prompts={tiny_prompts}", "placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=4",
        "ppo.micro_batch_size=4", "generation.max_new_tokens=6", "overlap.chunk_size=4",
        f"run.out_dir={tmp_path}", "log.progress=false", "run.samples=0", *extra])


def test_the_engine_is_in_the_help_with_its_settings_and_its_checks_run_before_models_load():
    help_ = help_text()
    assert "counting: the local learner, counting its updates (a test's engine) (runs in this process). " \
           "Its settings: learner.counting.* (read under placement.learner=counting only)." in help_
    assert "learner.counting: (the settings of placement.learner=counting)" in help_
    assert "learner.counting.every = 1" in help_
    with pytest.raises(ConfigError, match=r"learner.counting.every=0: count every n >= 1 updates"):
        load_valid(None, ["placement.learner=counting", "learner.counting.every=0"])
    with pytest.raises(ConfigError, match=r"placement.learner=counting runs in this process, not under placement.name=ray: set "
                                             r"placement.name=local, or placement.learner=replicate or fsdp2 or recording"):
        load_valid(None, ["placement.learner=counting", "placement.name=ray"])
    assert "recording: Ray replicas counting their updates (a test's engine) (runs on Ray ranks). Its settings: " \
           "learner.recording.* (read under placement.learner=recording only)." in help_
    with pytest.raises(ConfigError, match=r"placement.learner=recording runs on Ray ranks, not under placement.name=local: "
                                             r"set placement.name=ray"):
        load_valid(None, ["placement.learner=recording"])
    with pytest.raises(ConfigError, match=r"placement.learner='nope' is not one of replicate, fsdp2, (\w+, )*counting, recording"):
        load_valid(None, ["placement.learner=nope"])


def test_the_code_of_the_engines_parts_goes_to_ray_actors_by_value_where_no_installed_package_has_it():
    """This file is no installed package: Ray actors get its code by value (``cluster.ship_plugins``);
    oppo's and an installed package's (here pytest's) they import."""
    import sys

    from oppo.parts import modules_by_value, part_modules

    assert set(part_modules(registry.get("recording"))) == {"oppo.learner.registry", "builtins", __name__}
    registry.register(registry.EngineSpec("installed", "an installed package's builder", build_local=pytest.approx))
    try:
        shipped = modules_by_value()
    finally:
        registry.unregister("installed")
    assert sys.modules[__name__] in shipped
    assert not [m for m in shipped if m.__name__.partition(".")[0] in ("oppo", "_pytest", "builtins")], shipped


@pytest.mark.parametrize("mode", ["sequential", "oppo"])
def test_the_trainer_trains_through_the_registered_engine(tiny_models, tiny_prompts, tmp_path, mode):
    BUILT.clear()
    t = Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path, f"overlap.mode={mode}", "placement.learner=counting"),
                progress=False)
    try:
        assert len(BUILT) == 1
        w0 = t.roles.policy.lm_head.weight.detach().clone()
        for _ in range(2):
            m = t.run_step()
            assert m["loss/policy"] == m["loss/policy"]
        assert BUILT[0].updates == 2, "every update went through the registered engine"
        assert not t.roles.policy.lm_head.weight.equal(w0), "the policy trained"
    finally:
        t.close()


@pytest.mark.ray
def test_the_trainer_trains_on_ray_through_a_registered_engine_and_strategy(ray_local, tiny_models, tiny_prompts,
                                                                             tmp_path):
    """``recording`` on 2 Ray ranks: its strategy, a class of this file, is built in every rank
    (whose process never imported this file) and runs each update there."""
    from oppo.learner.group import LearnerGroup

    t = Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path, "overlap.mode=sequential", "placement.name=ray",
                     "placement.learner=recording", "learner.recording.ranks=2",
                     "learner.recording.cpus=0.5", "placement.ray.scorer_cpus=0.5", "ppo.micro_batch_size=2"),
                progress=False)
    try:
        assert isinstance(t.roles.learner, LearnerGroup) and isinstance(t.roles.learner.strategy, RecordingReplicas)
        w0 = t.roles.rollout_policy.lm_head.weight.detach().clone()
        for step in range(2):
            m = t.run_step()
            assert m["test/updates_all_ranks"] == 2 * (step + 1), "each rank ran the strategy's update, once a step"
            assert m["loss/policy"] == m["loss/policy"]
        assert not t.roles.rollout_policy.lm_head.weight.equal(w0), "rank 0's trained policy reached the engine"
    finally:
        t.close()
