"""A learner engine registered from outside oppo (this file alone): it wraps the local learner and
counts its updates. It is listed in the config's help with its settings, its checks and where it
runs are enforced before any model loads, and ``oppo.Trainer`` trains through it."""

import pytest

from oppo.config import ConfigError, help_text, load_config
from oppo.learner import registry
from oppo.trainer import Trainer


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


def _problems(cfg) -> list[str]:
    n = cfg.placement.ray.learner_workers
    return [] if n == 1 else [f"placement.ray.learner_workers={n}: the counting learner is one learner; set it to 1."]


@pytest.fixture(scope="module", autouse=True)
def counting_engine():
    registry.register(registry.Engine(
        "counting", "the local learner, counting its updates (a test's engine)", build_local=_build,
        problems=_problems, settings=(("placement.ray.learner_workers", "must be 1"),)))
    yield
    registry.unregister("counting")


def _cfg(tiny_models, tiny_prompts, tmp_path, *extra):
    return load_config(None, [
        f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
        f"data.prompts={tiny_prompts}", "placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=4",
        "ppo.micro_batch_size=4", "generation.max_new_tokens=6", "overlap.chunk_size=4",
        f"run.out_dir={tmp_path}", "log.progress=false", "run.samples=0",
        "placement.learner=counting", *extra])


def test_the_engine_is_in_the_help_with_its_settings_and_its_checks_run_before_models_load():
    help_ = help_text()
    assert "counting: the local learner, counting its updates (a test's engine) (runs in this process; " \
           "settings: placement.ray.learner_workers: must be 1)." in help_
    with pytest.raises(ConfigError, match=r"placement.ray.learner_workers=2: the counting learner is one learner"):
        load_config(None, ["placement.learner=counting", "placement.ray.learner_workers=2"])
    with pytest.raises(ConfigError, match=r"placement.learner=counting runs in this process, not under placement.backend=ray: set "
                                             r"placement.backend=local, or placement.learner=replicate or fsdp2"):
        load_config(None, ["placement.learner=counting", "placement.backend=ray"])
    with pytest.raises(ConfigError, match=r"placement.learner='nope' is not one of replicate, fsdp2, counting"):
        load_config(None, ["placement.learner=nope"])


@pytest.mark.parametrize("mode", ["sequential", "oppo"])
def test_the_trainer_trains_through_the_registered_engine(tiny_models, tiny_prompts, tmp_path, mode):
    BUILT.clear()
    t = Trainer(_cfg(tiny_models, tiny_prompts, tmp_path, f"overlap.mode={mode}"), progress=False)
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
