"""The whole step on Ray: a Trainer whose scorers are Ray actors and whose learner is a data-parallel
group of 2 Ray ranks, wired as the trainer will wire them, trains the sequential loop's run step
for step (DESIGN.md: with no inter-step overlap, a run matches ``sequential``)."""

import pytest
import torch

ray = pytest.importorskip("ray")

from oppo.config import load_config  # noqa: E402
from oppo.placement.cluster import start_local_cluster  # noqa: E402
from oppo.placement.dp import DPLearnerGroup, learner_spec  # noqa: E402
from oppo.placement.ray_scorer import RayScorerWorker  # noqa: E402
from oppo.placement.specs import scorer_specs  # noqa: E402
from oppo.trainer import Trainer  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_local(request):
    """A local Ray cluster of two nodes of 1 CPU each, started once per test session (the Ray test
    modules share it: a start costs ~25 s on 2 busy cores) and shut down at its end."""
    if not ray.is_initialized():
        request.config.add_cleanup(start_local_cluster(nodes=2, cpus_per_node=1))


def _cfg(tiny_models, tiny_prompts, out, *extra):
    return load_config(None, [
        f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
        f"data.prompts={tiny_prompts}", "run.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=2",
        "ppo.micro_batch_size=1", "generation.max_new_tokens=12", "overlap.chunk_size=4",
        f"run.out_dir={out}", "log.progress=false", *extra])


def _record(t: Trainer, m: dict) -> dict:
    exp = t.last_result.exp
    return {"m": m, "ids": exp.ids.clone(), "scores": exp.scores.clone(), "ref": exp.ref_logprobs.clone(),
            "values": exp.values.clone()}


def on_ray(t: Trainer, world: int = 2) -> DPLearnerGroup:
    """Move a built Trainer's scorers and learner onto Ray (what ``run.backend=ray`` will do)."""
    specs = scorer_specs(t.paths, t.pad_id, t.compute_dtype, reward_model=t.reward_model is not None,
                         critic=t.critic is not None, device="cpu")
    t.worker.close()
    t.worker = RayScorerWorker(specs, t.tracer, temperature=t.cfg.generation.temperature, num_cpus=0.5)
    spec = learner_spec(t.cfg, t.paths, t.pad_id, t.compute_dtype, t.algorithm, t.learner.recompute_old,
                        device="cpu")
    group = DPLearnerGroup(spec, world, num_cpus=0.5, rollout=t.rollout_policy, critic_scorer=t.worker)
    t.learner = group
    return group


@pytest.mark.slow
def test_trainer_with_ray_scorers_and_dp_learner_equals_sequential(ray_local, tiny_models, tiny_prompts, tmp_path):
    steps = 3
    seq = Trainer(_cfg(tiny_models, tiny_prompts, tmp_path / "s", "overlap.mode=sequential"), progress=False)
    try:
        want = [_record(seq, seq.run_step()) for _ in range(steps)]
        want_policy = {k: v.clone() for k, v in seq.policy.state_dict().items()}
    finally:
        seq.close()

    t = Trainer(_cfg(tiny_models, tiny_prompts, tmp_path / "r", "overlap.mode=intra",
                     "overlap.critic_on_worker=false"), progress=False)
    group = on_ray(t)
    try:
        got = []
        for _ in range(steps):
            m = t.run_step()
            assert m["time/weight_sync"] >= 0.0
            assert m["memory/critic_kv_peak_mb"] > 0
            got.append(_record(t, m))
        for x, y in zip(want, got):
            assert torch.equal(x["ids"], y["ids"]), "same responses"
            torch.testing.assert_close(y["scores"], x["scores"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(y["ref"], x["ref"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(y["values"], x["values"], atol=1e-5, rtol=1e-5)
            for k in ("reward/mean", "loss/value", "kl/mean", "loss/policy", "grad_norm/actor"):
                assert y["m"][k] == pytest.approx(x["m"][k], abs=1e-4, rel=1e-3), k
        state = group.actor_state()
        for k, v in want_policy.items():
            torch.testing.assert_close(state[k], v, atol=1e-5, rtol=1e-4, msg=k)
        assert {s.worker for s in t.tracer.spans} >= {"actor", "scorer"}, "the Ray scorer's spans join the trace"
    finally:
        group.close()
        t.close()
