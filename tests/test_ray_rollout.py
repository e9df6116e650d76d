"""Rollout replicas on Ray (placement.ray.rollout_replicas): the policy's engines in Ray actors that
stream their chunks straight to the scorer actor.

One replica samples what the local engine samples, so a run with one rollout replica trains the
local run's batches step for step; with two replicas the B + Delta sequences are shared, the
streamed scores equal one-shot scoring of the same sequences, and a dead replica is named."""

import pytest
import torch

ray = pytest.importorskip("ray")

from oppo.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from oppo.scoring.streaming import score_full  # noqa: E402
from oppo.trainer import Trainer  # noqa: E402
from test_ray_trainer import _cfg  # noqa: E402  (the same tiny run as the other Ray trainer tests)

pytestmark = pytest.mark.ray


RAY = ("placement.name=ray", "learner.replicate.cpus=0.25", "placement.ray.scorer_cpus=0.25",
       "placement.ray.rollout_cpus=0.25")


@pytest.mark.slow
def test_one_rollout_replica_trains_the_local_run(ray_local, tiny_models, tiny_prompts, tmp_path):
    steps = 3
    want = []
    with Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path / "l", "overlap.mode=oppo", "overlap.delta=2"),
                 progress=False) as t:
        for _ in range(steps):
            m = t.run_step()
            want.append((t.last_result.exp.ids.clone(), m))
    with Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path / "r", "overlap.mode=oppo", "overlap.delta=2",
                      "placement.ray.rollout_replicas=1", *RAY), progress=False) as t:
        assert type(t.roles.rollout).__name__ == "RayRolloutGroup" and t.roles.placement.rollout_streams_itself
        for ids, m_local in want:
            m = t.run_step()
            assert torch.equal(t.last_result.exp.ids, ids), "the same responses"
            for k in ("reward/mean", "kl/mean", "loss/policy", "loss/value"):
                assert m[k] == pytest.approx(m_local[k], abs=1e-4, rel=1e-3), k
        assert "rollout0" in {s.lane for s in t.tracer.spans}, "the replica's spans join the trace"


@pytest.mark.slow
def test_two_rollout_replicas_share_the_batch_and_stream_to_the_scorers(ray_local, tiny_models, tiny_prompts, tmp_path):
    cfg = _cfg(tiny_models, tiny_prompts, tmp_path / "r2", "overlap.mode=oppo", "overlap.delta=2",
               "placement.ray.rollout_replicas=2", *RAY)
    t = Trainer.from_config(cfg, progress=False)
    try:
        for step in range(3):
            m = t.run_step()
            exp = t.last_result.exp
            assert len(exp.rollouts) == 4 and m["reward/mean"] == m["reward/mean"]
            prompts = [r.prompt_ids for r in exp.rollouts]
            responses = [r.response_ids for r in exp.rollouts]
            # streamed from two rollout actors through the scorer actor = one-shot scoring here
            # (the frozen models; the critic trains on the learner rank, so only at step 0)
            one_shot = score_full("reward", t.roles.reward_model, prompts, responses, t.roles.pad_id)
            torch.testing.assert_close(exp.scores, torch.tensor([o.score for o in one_shot]), atol=1e-4, rtol=1e-4)
            ref = score_full("reference", t.roles.reference, prompts, responses, t.roles.pad_id, t.cfg.generation.temperature)
            for i, o in enumerate(ref):
                n = len(responses[i])
                torch.testing.assert_close(exp.ref_logprobs[i, :n], torch.tensor(o.logprobs), atol=1e-4, rtol=1e-4)
            if step == 0:
                vals = score_full("critic", t.roles.scoring_critic, prompts, responses, t.roles.pad_id)
                for i, o in enumerate(vals):
                    n = len(responses[i])
                    torch.testing.assert_close(exp.values[i, :n], torch.tensor(o.values), atol=1e-4, rtol=1e-4)
            for r in exp.rollouts:
                assert all(step - 1 <= v <= step for v in r.versions)
        assert min(t.roles.rollout.admitted) >= 4, f"both replicas decoded a share: {t.roles.rollout.admitted}"
        # chunks of 4 tokens (overlap.chunk_size) while decoding, not only each sequence at its end
        assert t.roles.rollout.chunks_sent > sum(t.roles.rollout.admitted), t.roles.rollout.chunks_sent
        assert {"rollout0", "rollout1"} <= {s.lane for s in t.tracer.spans}
        ckpt = save_checkpoint(t, tmp_path / "r2")
        states = t.roles.rollout.state_dict()["generator"]
        assert len(states) == 2 and not torch.equal(states[0], states[1]), "each replica samples with its own stream"
        ray.kill(t.roles.rollout.replicas[1])
        with pytest.raises(RuntimeError, match=r"rollout replica \(role=rollout, rank=1\) died"):
            for _ in range(3):
                t.run_step()
    finally:
        t.close()
    with Trainer.from_config(cfg, progress=False) as r:  # the checkpoint restores every replica's sampling state
        load_checkpoint(r, ckpt)
        for a, b in zip(r.roles.rollout.state_dict()["generator"], states):
            assert torch.equal(a, b)
        r.run_step()
        assert r.step == 4


@pytest.mark.slow
def test_a_checkpoint_saves_the_rows_the_replicas_decode_and_a_resume_takes_them_back(ray_local, tiny_models,
                                                                                     tiny_prompts, tmp_path):
    """oppo mode, one rollout replica: the rows in flight at a checkpoint come home from the replica
    with their partial responses and are saved; a Trainer resumed from it and the live one (both
    re-admit them) train the same batches, the carried rows' earlier tokens kept."""
    cfg = _cfg(tiny_models, tiny_prompts, tmp_path / "r", "overlap.mode=oppo", "overlap.delta=2", "overlap.max_lag=2",
               "placement.ray.rollout_replicas=1", *RAY)
    with Trainer.from_config(cfg, progress=False) as t:
        for _ in range(6):
            t.run_step()
            if any(not r.finished and r.response_ids for r in t.roles.rollout.in_flight()):
                break
        partial = {r.uid: list(r.response_ids) for r in t.roles.rollout.in_flight() if r.response_ids}
        assert partial, "no row in flight with a partial response: the test would prove nothing"
        ckpt = save_checkpoint(t, tmp_path / "r")
        with Trainer.from_config(cfg, progress=False) as r:
            load_checkpoint(r, ckpt)
            assert {u: list(x.response_ids) for u, x in r.loop.untrained().items() if u in partial} == partial
            carried = 0
            for _ in range(2):
                t.run_step()
                r.run_step()
                a, b = t.last_result.exp.rollouts, r.last_result.exp.rollouts
                assert [x.response_ids for x in a] == [x.response_ids for x in b]
                for x in b:
                    if x.uid in partial:
                        carried += 1
                        assert x.response_ids[:len(partial[x.uid])] == partial[x.uid]
            assert carried, "no carried row was trained after the resume"
