"""Invariants across modes: with no deferral the overlapped runtime reproduces the sequential
loop step for step; the learner's loss does not depend on the micro-batch split."""

import pytest
import torch

from oppo.config import load_config
from oppo.trainer import Trainer


def tiny_cfg(tiny_models, tiny_prompts, tmp_path, *extra):
    return load_config(None, [
        f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
        f"data.prompts={tiny_prompts}", "placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=2",
        "ppo.micro_batch_size=1", "generation.max_new_tokens=12", "overlap.chunk_size=4",
        f"run.out_dir={tmp_path}", "log.progress=false", *extra])


def run_steps(cfg, n=3, weights=None):
    """``n`` steps' experience and metrics; ``weights``: a dict that receives the critic's weights
    before the first step, the policy's and the critic's after the last, and the critic's AdamW
    state as the parent holds it."""
    t = Trainer.from_config(cfg, progress=False)
    try:
        if weights is not None:
            weights["critic_before"] = {k: v.clone() for k, v in t.roles.critic.state_dict().items()}
        out = []
        for _ in range(n):
            m = t.run_step()
            exp = t.last_result.exp
            out.append({"m": m, "ids": exp.ids.clone(), "scores": exp.scores.clone(),
                        "ref": exp.ref_logprobs.clone(), "values": exp.values.clone()})
        if weights is not None:
            weights["policy"] = {k: v.clone() for k, v in t.roles.policy.state_dict().items()}
            weights["critic"] = {k: v.clone() for k, v in t.roles.critic.state_dict().items()}
            weights["critic_opt"] = [{k: v.clone() for k, v in st.items()}
                                     for st in t.roles.learner.critic_opt.state.values()]
        return out
    finally:
        t.close()


@pytest.fixture(scope="module")
def reference_runs(tiny_models, tiny_prompts, tmp_path_factory):
    """Three steps of ``sequential`` and of ``intra`` as on CPU by default (scorers and the
    critic's update in a child process), once for the module: the runs the others must equal."""
    out, runs, weights = tmp_path_factory.mktemp("modes"), {}, {}
    for mode in ("sequential", "intra"):
        weights[mode] = {}
        runs[mode] = run_steps(tiny_cfg(tiny_models, tiny_prompts, out / mode, f"overlap.mode={mode}",
                                        "placement.local.scorer_process=true", "placement.local.critic_on_worker=true"),
                               weights=weights[mode])
    return runs, weights


def assert_same_run(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x["ids"], y["ids"]), "same responses"
        torch.testing.assert_close(x["scores"], y["scores"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x["ref"], y["ref"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x["values"], y["values"], atol=1e-5, rtol=1e-5)
        for k in ("reward/mean", "loss/value", "kl/mean", "ppo/clipfrac"):
            assert x["m"][k] == pytest.approx(y["m"][k], abs=1e-4, rel=1e-3), k
        assert x["m"]["loss/policy"] == pytest.approx(y["m"]["loss/policy"], abs=1e-4)


@pytest.mark.parametrize("process", ["true", "false"])
def test_intra_equals_sequential(reference_runs, tiny_models, tiny_prompts, tmp_path, process):
    """Both scorer workers: a child process (the CPU default) and a thread (the GPU one)."""
    runs, _ = reference_runs
    intra = runs["intra"] if process == "true" else run_steps(
        tiny_cfg(tiny_models, tiny_prompts, tmp_path / "i", "overlap.mode=intra", "placement.local.scorer_process=false"))
    assert_same_run(runs["sequential"], intra)


@pytest.mark.parametrize("mode", ["oppo", "inter"])
def test_no_deferral_equals_intra(reference_runs, tiny_models, tiny_prompts, tmp_path, mode):
    """With Delta = 0 and max_lag = 0, `oppo` (and `inter`) equal `intra` step for step."""
    other = run_steps(tiny_cfg(tiny_models, tiny_prompts, tmp_path / "o", f"overlap.mode={mode}",
                               "overlap.delta=0", "overlap.max_lag=0"))
    assert_same_run(reference_runs[0]["intra"], other)


def test_oppo_carries_and_tags_versions(tiny_models, tiny_prompts, tmp_path):
    cfg = tiny_cfg(tiny_models, tiny_prompts, tmp_path, "overlap.mode=oppo", "overlap.delta=3",
                   "overlap.max_lag=1", "generation.max_new_tokens=24")
    t = Trainer.from_config(cfg, progress=False)
    try:
        carried_seen, offpolicy = 0, 0.0
        for _ in range(5):
            m = t.run_step()
            exp = t.last_result.exp
            assert exp.mask.shape[0] == 4
            assert m["overlap/seq_lag_max"] <= 1 and m["overlap/token_lag_max"] <= 1
            # every token's version is between the sequence's start and the training step
            for r in exp.rollouts:
                assert all(r.start_version <= v <= t.step - 1 for v in r.versions)
            carried_seen = max(carried_seen, m["overlap/carried"])
            offpolicy = max(offpolicy, m["overlap/offpolicy_token_frac"])
        assert carried_seen > 0
        assert offpolicy > 0
    finally:
        t.close()


def test_micro_batch_split_does_not_change_the_update(tiny_models, tiny_prompts, tmp_path):
    """Same minibatch, different micro-batch sizes: same gradients, so same weights after a step."""
    weights = []
    for micro in (1, 2):
        cfg = tiny_cfg(tiny_models, tiny_prompts, tmp_path / str(micro), "overlap.mode=sequential",
                       f"ppo.micro_batch_size={micro}")
        t = Trainer.from_config(cfg, progress=False)
        t.run_step()
        weights.append({k: v.clone() for k, v in t.roles.policy.state_dict().items()})
        weights.append({k: v.clone() for k, v in t.roles.critic.state_dict().items()})
        t.close()
    for a, b in ((weights[0], weights[2]), (weights[1], weights[3])):
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


def test_critic_trained_on_worker_is_the_learners_critic(reference_runs):
    """With the critic's update on the scorer process, the weights and AdamW moments the parent
    checkpoints are the ones the child updated (shared memory, updated in place)."""
    runs, weights = reference_runs
    m, intra = runs["intra"][-1]["m"], weights["intra"]
    assert "loss/value" in m and "grad_norm/critic" in m
    assert {float(st["step"]) for st in intra["critic_opt"]} == {6.0}, "3 steps x 2 minibatches, seen from the parent"
    moved = [k for k, v in intra["critic"].items() if not torch.equal(v, intra["critic_before"][k])]
    assert moved, "the parent's critic weights changed"
    assert all(float(st["exp_avg_sq"].abs().sum()) > 0 for st in intra["critic_opt"] if st["exp_avg_sq"].numel() > 1)


def test_critic_on_worker_gives_the_sequential_weights(reference_runs):
    """Actor and critic updated at the same time (critic on the scorer process) end with the
    weights of the sequential loop, which updates one after the other."""
    _, weights = reference_runs
    for role in ("policy", "critic"):
        a, b = weights["sequential"][role], weights["intra"][role]
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)
