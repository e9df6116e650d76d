"""The whole step on Ray: a Trainer whose scorers are Ray actors and whose learner is a data-parallel
group of 2 Ray ranks, wired as the trainer will wire them, trains the sequential loop's run step
for step (with no inter-step overlap, a run matches ``sequential``)."""

import pytest
import torch

ray = pytest.importorskip("ray")

from oppo.config import load_config  # noqa: E402
from oppo.trainer import Trainer  # noqa: E402

pytestmark = pytest.mark.ray


def _cfg(tiny_models, tiny_prompts, out, *extra):
    return load_config(None, [
        f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
        f"data.prompts={tiny_prompts}", "placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=2",
        "ppo.micro_batch_size=1", "generation.max_new_tokens=12", "overlap.chunk_size=4",
        f"run.out_dir={out}", "log.progress=false", *extra])


def _record(t: Trainer, m: dict) -> dict:
    exp = t.last_result.exp
    return {"m": m, "ids": exp.ids.clone(), "scores": exp.scores.clone(), "ref": exp.ref_logprobs.clone(),
            "values": exp.values.clone()}


@pytest.mark.slow
def test_ray_backend_equals_sequential_and_resumes_on_another_worker_count(ray_local, tiny_models, tiny_prompts,
                                                                           tmp_path):
    """placement.name=ray, 2 learner ranks, streaming scorers on a Ray actor: the sequential
    loop's run step for step; its checkpoint resumes in one local process, equal to training on."""
    from oppo.checkpoint import load_checkpoint, save_checkpoint

    steps = 3
    seq = Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path / "s", "overlap.mode=sequential"), progress=False)
    try:
        want = [_record(seq, seq.run_step()) for _ in range(steps + 1)]
    finally:
        seq.close()

    t = Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path / "r", "overlap.mode=intra", "placement.name=ray",
                     "learner.replicate.ranks=2", "learner.replicate.cpus=0.5", "placement.ray.scorer_cpus=0.5"),
                progress=False)
    try:
        assert type(t.roles.learner).__name__ == "LearnerGroup" and not t.roles.learner.strategy.sharded and type(t.roles.scorer).__name__ == "RayScorerWorker"
        got = []
        for _ in range(steps):
            m = t.run_step()
            assert m["time/weight_sync"] >= 0.0
            got.append(_record(t, m))
        ckpt = save_checkpoint(t, tmp_path / "r")
        assert {s.lane for s in t.tracer.spans} >= {"actor", "scorer"}, "the Ray scorer's spans join the trace"
    finally:
        t.close()
    for x, y in zip(want, got):
        assert torch.equal(x["ids"], y["ids"]), "same responses"
        torch.testing.assert_close(y["scores"], x["scores"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y["ref"], x["ref"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y["values"], x["values"], atol=1e-5, rtol=1e-5)
        for k in ("reward/mean", "loss/value", "kl/mean", "loss/policy", "grad_norm/actor"):
            assert y["m"][k] == pytest.approx(x["m"][k], abs=1e-4, rel=1e-3), k
    # the 2-rank checkpoint resumes in one local learner (intra mode, local scorer process) and trains
    # the sequential run's next step
    local = Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path / "r", "overlap.mode=intra"), progress=False)
    try:
        load_checkpoint(local, ckpt)
        assert local.step == steps
        y = _record(local, local.run_step())
    finally:
        local.close()
    x = want[steps]
    assert torch.equal(x["ids"], y["ids"])
    for k in ("reward/mean", "loss/value", "kl/mean", "loss/policy"):
        assert y["m"][k] == pytest.approx(x["m"][k], abs=1e-4, rel=1e-3), k


@pytest.mark.slow
def test_ray_pipeline_loads_weights_in_flight(ray_local, tiny_models, tiny_prompts, tmp_path):
    """overlap.mode=pipeline on Ray: the learner group trains in the background while the engine
    decodes; rank 0's weights reach the engine at the end of each step, every rank's training span
    joins the trace, and no token is older than max_lag + 1 versions."""
    t = Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path / "p", "overlap.mode=pipeline", "placement.name=ray",
                     "learner.replicate.cpus=0.5", "placement.ray.scorer_cpus=0.5", "generation.max_new_tokens=32",
                     "overlap.delta=2", "overlap.refill=true", "overlap.max_lag=1", "run.steps=10"), progress=False)
    try:
        early, inflight = 0, 0
        for step in range(3):
            m = t.run_step()
            inflight += m["pipeline/inflight_tokens"]
            assert m["time/weight_sync"] > 0
            for r in t.last_result.exp.rollouts:
                assert all(step - 2 <= v <= step for v in r.versions), (step, r.versions)
                early += any(v < r.start_version for v in r.versions)
        rank0 = t.roles.learner.actor_state()
        for name, p in t.roles.rollout_policy.named_parameters():
            assert torch.equal(p, rank0[name]), name
        assert {"learner0", "scorer", "actor"} <= {s.lane for s in t.tracer.spans}
    finally:
        t.close()
    assert inflight > 0 and early > 0, "decoding went on while the learner trained"


@pytest.mark.slow
def test_a_killed_ray_actor_stops_the_run_by_role_and_the_resume_is_exact(ray_local, tiny_models, tiny_prompts,
                                                                           tmp_path, monkeypatch):
    """The scorer actor dies mid-step (after generation, before scoring) at step 3: the run stops
    with an error naming the role and rank, the checkpoint of step 2 is intact, and --resume trains
    steps 2 and 3 as an uninterrupted run does: the same prompts, once each, the same figures."""
    from oppo.checkpoint import latest_checkpoint
    from oppo.metrics import read_metrics
    from oppo.run import train

    def lengths(run_dir):
        import json

        return [json.loads(line) for line in (run_dir / "lengths.jsonl").read_text().splitlines()]

    common = ("overlap.mode=sequential", "run.steps=4", "run.save_every=2")
    oracle = train(_cfg(tiny_models, tiny_prompts, tmp_path / "oracle", *common), progress=False)

    cfg = _cfg(tiny_models, tiny_prompts, tmp_path / "killed", *common, "placement.name=ray",
               "learner.replicate.cpus=0.5", "placement.ray.scorer_cpus=0.5")
    from oppo.control import stages

    score = stages.score

    def dying_score(run, batch, texts, step):
        if step == 3:
            ray.kill(run.roles.scorer.actors[0])
        return score(run, batch, texts, step)

    monkeypatch.setattr(stages, "score", dying_score)
    with pytest.raises(RuntimeError, match=r"scorer actor \(role=reward\+reference\+critic, rank=0\) died"):
        train(cfg, progress=False)
    run_dir = tmp_path / "killed"
    assert latest_checkpoint(run_dir).name == "step_000002", "the last checkpoint is intact and nothing newer"
    monkeypatch.setattr(stages, "score", score)
    train(cfg, resume="auto", progress=False)
    want, got = read_metrics(oracle), read_metrics(run_dir)
    assert [m["step"] for m in got] == [0, 1, 2, 3]
    for x, y in zip(want, got):
        for k in ("reward/mean", "kl/mean", "loss/policy", "loss/value"):
            assert y[k] == pytest.approx(x[k], abs=1e-4, rel=1e-3), (x["step"], k)
    assert [r["prompt_index"] for r in lengths(run_dir)] == [r["prompt_index"] for r in lengths(oracle)], \
        "every prompt trained once, in the uninterrupted order"
