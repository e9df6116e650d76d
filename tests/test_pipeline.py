"""overlap.mode=pipeline (in-flight weight updates, PipelineRL): decoding goes on while the
learner trains, new weights load between decode steps, and every token is trained with the
version that sampled it.

The timing of a load is not reproducible, so these tests check what holds whatever the timing:
each token's behaviour log-prob is the one of the policy version it carries (under
stale_kv=recompute, exactly: the versions are snapshots taken after each update), no token is
older than max_lag + 1 versions, and over a run some tokens were sampled while the learner
trained and some sequences span a weight load."""

import copy
import json

import pytest
import torch

from oppo.checkpoint import load_checkpoint, save_checkpoint
from oppo.config import load_config
from oppo.trainer import Trainer
from validated import load_valid


def _cfg(tiny_models, tiny_prompts, tmp_path, *extra):
    return load_config(None, [
        f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
        f"data.prompts={tiny_prompts}", "placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=2",
        "ppo.micro_batch_size=2", "generation.max_new_tokens=40", "overlap.chunk_size=4", "overlap.delta=2",
        "overlap.refill=true", "overlap.mode=pipeline", f"run.out_dir={tmp_path / 'out'}", "log.progress=false",
        "run.steps=100", *extra])


def _teacher_forced(model, rollout, temperature: float) -> torch.Tensor:
    ids = torch.tensor([rollout.prompt_ids + rollout.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    P = len(rollout.prompt_ids)
    return torch.log_softmax(logits, -1)[P - 1:-1].gather(-1, torch.tensor(rollout.response_ids)[:, None])[:, 0]


def _overlaps(trained) -> tuple[int, int]:
    """Of the (step, row) pairs trained: how many rows have tokens sampled while the previous update
    trained, and how many span a weight load. Whether a given step shows them depends on the timing
    (a machine busy with other work may finish a step's decoding before its update): a run goes on
    a few steps more until it has shown both."""
    return (sum(any(v < r.start_version for v in r.versions) for _, r in trained),
            sum(len(set(r.versions)) > 1 for _, r in trained))


@pytest.mark.parametrize("critic_on_worker", [True, False])
def test_pipeline_tokens_carry_the_version_that_sampled_them(tiny_models, tiny_prompts, tmp_path, critic_on_worker):
    """critic_on_worker: the scorer worker trains the critic it scores with (in message order), as
    in oppo mode; else the learner thread trains it and the scorers get a copy at each load."""
    steps, most, max_lag = 4, 8, 1  # (more steps, up to ``most``, only until the overlaps were seen)
    t = Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path, "overlap.stale_kv=recompute", f"overlap.max_lag={max_lag}",
                     f"placement.local.critic_on_worker={critic_on_worker}"), progress=False)
    try:
        assert t.roles.rollout_policy is not t.roles.policy, "the learner trains the master while the engine samples a copy"
        assert (t.roles.scoring_critic is t.roles.critic) == critic_on_worker
        critic0 = copy.deepcopy(t.roles.critic.state_dict())
        snapshots = {0: copy.deepcopy(t.roles.policy.state_dict())}
        trained, metrics = [], []
        while t.step < steps or (t.step < most and not all(_overlaps(trained))):
            metrics.append(t.run_step())
            snapshots[t.step] = copy.deepcopy(t.roles.policy.state_dict())
            trained += [(t.step - 1, r) for r in t.last_result.exp.rollouts]
            # the weights are loaded at the end of every step: the serving copy equals the master
            for a, b in zip(t.roles.policy.parameters(), t.roles.rollout_policy.parameters()):
                assert torch.equal(a, b)
            for a, b in zip(t.roles.critic.parameters(), t.roles.scoring_critic.parameters()):
                assert torch.equal(a, b)
        assert any(not torch.equal(v, t.roles.critic.state_dict()[k]) for k, v in critic0.items()), "the critic trained"
    finally:
        t.close()
    model = copy.deepcopy(t.roles.policy)
    checked = set()
    for v in sorted({v for _, r in trained for v in r.versions}):
        model.load_state_dict(snapshots[v])
        for step, r in trained:
            idx = [i for i, x in enumerate(r.versions) if x == v]
            if idx:
                want = _teacher_forced(model, r, t.cfg.generation.temperature)[idx]
                torch.testing.assert_close(torch.tensor(r.logprobs)[idx], want, atol=2e-4, rtol=1e-4)
                checked.update((r.uid, i) for i in idx)
    assert len(checked) == sum(len(r.response_ids) for _, r in trained), "every trained token was checked"
    for step, r in trained:
        assert all(step - max_lag - 1 <= v <= step for v in r.versions), (step, r.versions)
    sampled_early, spans_a_load = _overlaps(trained)
    assert sampled_early > 0, "some tokens of a step's batch were sampled while the previous update trained"
    assert spans_a_load > 0, "some sequences were in flight when new weights loaded"
    assert sum(m["pipeline/inflight_tokens"] for m in metrics) > 0
    assert all(m["time/weight_sync"] > 0 for m in metrics)


def test_pipeline_keep_tags_tokens_with_the_oldest_weights_of_their_row(tiny_models, tiny_prompts, tmp_path):
    """stale_kv=keep: a row's KV prefix stays from the weights that computed it, so its later
    tokens count as that (older) version: versions never increase along a row that spans a load."""
    t = Trainer.from_config(_cfg(tiny_models, tiny_prompts, tmp_path, "overlap.stale_kv=keep"), progress=False)
    try:
        rows, staler = [], 0
        for _ in range(3):
            m = t.run_step()
            exp = t.last_result.exp
            rows += exp.rollouts
            assert 0.0 <= m["overlap/offpolicy_token_frac"] <= 1.0
            # staleness per token (issue 22 item 2): step - version of every trained token, apart
            # from the sequences' lag (step - start_version)
            step = t.step - 1
            lags = [step - v for r in exp.rollouts for v in r.versions]
            assert m["overlap/token_lag_mean"] == pytest.approx(sum(lags) / len(lags))
            assert m["overlap/token_lag_max"] == max(lags)
            assert sum(m[f"overlap/token_lag_{n}"] for n in range(max(lags) + 1)) == len(lags)
            assert m["overlap/seq_lag_max"] == max(step - r.start_version for r in exp.rollouts)
            staler += sum(step - r.versions[0] > step - r.start_version for r in exp.rollouts)
    finally:
        t.close()
    assert all(len(set(r.versions)) == 1 for r in rows), "keep: one version per row (the one that built its KV)"
    assert any(r.versions[0] < r.start_version for r in rows), "some rows were sampled while the learner trained"
    assert staler > 0, "their tokens are staler than their sequences' lag says"


def test_pipeline_checkpoint_between_steps_saves_the_begun_step_and_resumes(tiny_models, tiny_prompts, tmp_path):
    """A checkpoint after a step whose successor was already begun (prompts admitted while the
    learner trained) saves them with the carried sequences, partial responses included; the resume
    takes them back: every prompt position is trained once."""
    cfg = _cfg(tiny_models, tiny_prompts, tmp_path, "run.steps=4")
    t = Trainer.from_config(cfg, progress=False)
    positions = []
    try:
        for _ in range(2):
            t.run_step()
            positions += [r.prompt_index for r in t.last_result.exp.rollouts]
        assert t.loop.next_begun, "step 2 was begun while step 1's update trained"
        begun = {u for u, r in t.loop.rollouts.items() if r.start_version == 2}
        ckpt = save_checkpoint(t, tmp_path / "out")
        assert not t.loop.next_begun
        saved = {d["uid"]: d for d in json.loads((ckpt / "in_flight.json").read_text())}
        assert begun and begun <= set(saved), "the begun step's sequences are saved"
        assert {u: r.response_ids for u, r in t.loop.untrained().items()} == \
            {u: d["response_ids"] for u, d in saved.items()}
    finally:
        t.close()
    r = Trainer.from_config(cfg, progress=False)
    try:
        load_checkpoint(r, ckpt)
        assert {u: x.response_ids for u, x in r.loop.untrained().items()} == \
            {u: d["response_ids"] for u, d in saved.items()}, "taken back with their partial responses"
        while r.step < 4:
            r.run_step()
            positions += [x.prompt_index for x in r.last_result.exp.rollouts]
        assert not r.loop.next_begun, "no step begins after the run's last"
        in_flight = set(r.loop.scheduler.in_flight) | set(r.loop.scheduler.finished_pool)
    finally:
        r.close()
    assert len(positions) == len(set(positions)) == 16, "no prompt position trained twice"
    untrained = {r.loop.rollouts[u].prompt_index for u in in_flight}
    assert set(range(max(positions) + 1)) <= set(positions) | untrained, "no prompt position lost"


def test_pipeline_is_a_mode_with_its_help():
    cfg = load_config(None, ["overlap.mode=pipeline"])
    assert cfg.in_flight and cfg.streams and cfg.carries
    with pytest.raises(ValueError, match="overlap.mode"):
        load_valid(None, ["overlap.mode=pipelined"])
