"""The off-policy path, by hand: old log-probs, importance weights and their truncation, and the
stale state of carried sequences (stale_kv, stale_values)."""

import copy
import dataclasses
import math

import pytest
import torch

from oppo.config import PPOConfig, load_config
from oppo.forward import LayoutRule
from oppo.learner.batch import Experience, build_experience
from oppo.learner.local import Learner
from oppo.models import load_causal_lm, load_tokenizer
from oppo.rollout.eager.backend import Rollout, EagerBackend
from oppo.scoring.streaming import score_full
from oppo.trainer import Trainer

L = math.log


def _hand_experience() -> Experience:
    """Two rows, prompt width 1, responses [0, 1] and [1] over a 2-token vocabulary.

    versions at step 1: row 0's first token was sampled by version 0 (carried), the rest by 1.
    behaviour log-probs: row 0 [log .25, log .3], row 1 [log .5].
    """
    ids = torch.tensor([[1, 0, 1], [1, 1, 0]])
    valid = torch.tensor([[1, 1, 1], [1, 1, 0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    beh = torch.tensor([[L(0.25), L(0.3)], [L(0.5), 0.0]])
    return Experience(rollouts=[], ids=ids, valid=valid, P=1, mask=mask, versions=torch.tensor([[0, 1], [1, 0]]),
                      behaviour_logprobs=beh, old_logprobs=beh.clone(), is_weights=torch.ones_like(beh))


def _hand_learner(recompute_old: bool) -> Learner:
    cfg = PPOConfig(is_truncate=1.5, clip_eps=0.2)
    lrn = Learner(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), cfg, temperature=1.0, seed=0,
                  recompute_old=recompute_old)
    # pi_1 gives every token probability 1/2: equal logits at every position ([b, T] each)
    lrn._actor_logprobs = lambda mb: (torch.full((mb.b, mb.T), L(0.5)), torch.full((mb.b, mb.T), L(2.0)))
    lrn.layout_rule = lambda: LayoutRule(False)  # (no model to lay the rows out for)
    return lrn


def test_off_policy_tokens_get_pi_k_and_a_truncated_weight():
    exp = _hand_experience()
    exp = _hand_learner(recompute_old=False).old_logprobs(exp, version=1)
    # row 0 token 0 is off-policy: old := log pi_1 = log .5; weight pi_1/behaviour = .5/.25 = 2 -> truncated 1.5
    # on-policy tokens keep the sampler's log-prob and weight 1
    torch.testing.assert_close(exp.old_logprobs, torch.tensor([[L(0.5), L(0.3)], [L(0.5), 0.0]]))
    torch.testing.assert_close(exp.is_weights, torch.tensor([[1.5, 1.0], [1.0, 1.0]]))
    assert exp.stats == {}


def test_untruncated_weight():
    exp = _hand_experience()
    lrn = _hand_learner(recompute_old=False)
    lrn.ppo = dataclasses.replace(lrn.ppo, is_truncate=None)  # (its records built again)
    exp = lrn.old_logprobs(exp, version=1)
    assert exp.is_weights[0, 0].item() == pytest.approx(2.0)


def test_recompute_old_centres_every_token_on_the_training_forward():
    exp = _hand_experience()
    exp = _hand_learner(recompute_old=True).old_logprobs(exp, version=1)
    # every real token: old := log .5; weights unchanged (only off-policy tokens are reweighted)
    torch.testing.assert_close(exp.old_logprobs, torch.tensor([[L(0.5), L(0.5)], [L(0.5), 0.0]]))
    torch.testing.assert_close(exp.is_weights, torch.tensor([[1.5, 1.0], [1.0, 1.0]]))
    # the two on-policy tokens' unrecomputed first-minibatch ratios pi_1 / sampler: .5/.3 = 1.67
    # (outside [0.8, 1.2]) and .5/.5 = 1 -> half outside. (The sampler-vs-trainer gap itself is
    # the update's: offpolicy.MismatchProbe, test_mismatch_probe_by_hand.)
    assert exp.stats == {"ppo/sampler_ratio_outside_clip": pytest.approx(0.5)}


def test_staleness_weights_use_the_untruncated_sampler_distribution():
    """top-k/top-p: the token was drawn from the truncated distribution (behaviour .25 / .5 = its
    probability among the kept tokens), but its weight compares pi_1 with the sampling version's
    own untruncated probability (policy_logprobs): .5 / .25 = 2 -> truncated 1.5 here, and an
    on-policy token's centre is that untruncated log-prob too."""
    exp = _hand_experience()
    exp.policy_logprobs = torch.tensor([[L(0.4), L(0.2)], [L(0.5), 0.0]])
    exp.behaviour_logprobs = torch.tensor([[L(0.8), L(0.4)], [L(1.0), 0.0]])  # truncated, renormalised
    exp.old_logprobs = exp.policy_logprobs.clone()  # (as build_experience sets it)
    lrn = _hand_learner(recompute_old=False)
    lrn.ppo = dataclasses.replace(lrn.ppo, is_truncate=None)  # (its records built again)
    exp = lrn.old_logprobs(exp, version=1)
    # off-policy token: pi_1 / pi_0 = .5 / .4 = 1.25 (against the truncated .8 it would be .625)
    torch.testing.assert_close(exp.is_weights, torch.tensor([[1.25, 1.0], [1.0, 1.0]]))
    torch.testing.assert_close(exp.old_logprobs, torch.tensor([[L(0.5), L(0.2)], [L(0.5), 0.0]]))


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (5, 1.0), (4, 0.7)])
@pytest.mark.parametrize("recompute_old", [False, True])
def test_no_weight_change_means_every_weight_is_1(tiny_models, top_k, top_p, recompute_old):
    """Issue 22 item 1: sequences carried across a version bump with no weight change are on-policy
    in all but name, so every token's importance weight is 1, whatever the truncation. (Against
    the truncated behaviour log-prob they weighed the kept mass: about top_p.)"""
    tok = load_tokenizer(str(tiny_models["policy"]))
    model = load_causal_lm(str(tiny_models["policy"]), "policy", torch.device("cpu"), torch.float32).eval()
    eng = EagerBackend(model, tok.eos_token_id, tok.pad_token_id, max_new_tokens=10, temperature=0.8,
                        top_k=top_k, top_p=top_p, seed=1)
    eng.admit([Rollout(i, i, p, tok(p)["input_ids"], 0) for i, p in enumerate(["the film was", "a day", "we"])])
    for _ in range(4):
        eng.step()
    eng.set_version(1)  # "new" weights: the same ones
    rollouts = sorted(eng.finished + eng.generate_all(), key=lambda r: r.uid)
    exp = build_experience(rollouts, tok.pad_token_id, torch.device("cpu"))
    off = (exp.versions < 1) & (exp.mask > 0)
    assert off.sum() >= 4, "the fixture must carry tokens"
    lrn = Learner(model, None, PPOConfig(is_truncate=None, micro_batch_size=2), temperature=0.8, seed=0,
                  recompute_old=recompute_old)
    exp = lrn.old_logprobs(exp, version=1)
    w = exp.is_weights[exp.mask > 0]
    torch.testing.assert_close(w, torch.ones_like(w), atol=1e-4, rtol=0)
    assert (exp.behaviour_logprobs - exp.policy_logprobs)[off].abs().max() > 1e-3, "truncation must bite"


def test_mismatch_probe_by_hand():
    """d = trainer - sampler on the tokens sampled by the trained version (the stale one and the
    masked one are left out): d = [log 2, 0, -log 2] -> mean |d| = 2 log 2 / 3 = 0.4621, max log 2;
    w = e^d = [2, 1, .5] -> k3 = w - 1 - d = [1 - log 2, 0, log 2 - .5] -> mean (0.5) / 3 = 0.1667;
    ESS = (3.5)^2 / (3 (4 + 1 + .25)) = 12.25 / 15.75 = 0.7778. Two micro-batches, merged as two
    data-parallel ranks would be."""
    from oppo.learner.offpolicy import MismatchProbe

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    probe = MismatchProbe(opt, version=3)
    trainer = torch.tensor([[L(0.4), L(0.3), 9.0]])
    sampler = torch.tensor([[L(0.2), L(0.3), 0.0]])
    probe.observe(trainer, sampler, torch.tensor([[3, 3, 3]]), torch.tensor([[1.0, 1.0, 0.0]]))
    other = MismatchProbe(opt, version=3)
    other.observe(torch.tensor([[L(0.1), 5.0]]), torch.tensor([[L(0.2), 0.0]]), torch.tensor([[3, 2]]),
                  torch.tensor([[1.0, 1.0]]))
    st = MismatchProbe.stats(MismatchProbe.merge([probe.partial(), other.partial()]))
    assert st["mismatch/tokens"] == 3
    assert st["mismatch/logprob_abs_diff"] == pytest.approx(2 * L(2) / 3)
    assert st["mismatch/logprob_abs_diff_max"] == pytest.approx(L(2))
    assert st["mismatch/kl"] == pytest.approx(0.5 / 3)
    assert st["mismatch/ess"] == pytest.approx(12.25 / 15.75)
    opt.param_groups[0]["params"][0].grad = torch.ones(1)
    opt.step()  # the weights moved: later forwards are no longer pi_k's
    before = probe.partial()
    probe.observe(trainer, sampler, torch.tensor([[3, 3, 3]]), torch.tensor([[1.0, 1.0, 1.0]]))
    assert probe.partial() == before
    assert MismatchProbe.stats([0.0] * 6) == {}


def test_mismatch_probe_removes_its_hook_when_its_update_ends():
    """Issue 51: with one optimizer step per update (minibatch = batch, one epoch) the probe's step
    hook was removed only by a forward after the step, which never came: 50 hooks after 50 updates.
    Each update's probe, read at its end, leaves none; a forward after the step is still ignored."""
    from oppo.learner.offpolicy import MismatchProbe

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param])
    trainer, sampler = torch.tensor([[L(0.4)]]), torch.tensor([[L(0.2)]])
    ones = torch.ones(1, 1)
    for k in range(50):  # the update's pattern: forward, backward, its one step, then the stats
        probe = MismatchProbe(opt, version=k)
        probe.observe(trainer, sampler, torch.full((1, 1), k), ones)
        param.grad = torch.ones(1)
        opt.step()
        assert probe.stepped
        assert MismatchProbe.stats(probe.partial())["mismatch/tokens"] == 1
    assert len(opt._optimizer_step_post_hooks) == 0
    probe = MismatchProbe(opt, version=50)  # two steps in an update: the forward after the first is pi_51's
    probe.observe(trainer, sampler, torch.full((1, 1), 50), ones)
    opt.step()
    probe.observe(trainer, sampler, torch.full((1, 1), 50), ones)
    opt.step()
    assert MismatchProbe.stats(probe.partial())["mismatch/tokens"] == 1
    assert len(opt._optimizer_step_post_hooks) == 0


def test_nothing_off_policy_changes_nothing():
    exp = _hand_experience()
    exp.versions.fill_(1)
    before = exp.old_logprobs.clone()
    exp = _hand_learner(recompute_old=False).old_logprobs(exp, version=1)
    assert torch.equal(exp.old_logprobs, before) and torch.equal(exp.is_weights, torch.ones_like(before))


def test_stale_kv_recompute_rebuilds_the_cache_under_new_weights(tiny_models):
    """After new weights arrive, recompute() gives the next-token logits of a full forward under
    the new weights; keeping the cache does not (the prefix was computed by the old ones)."""
    tok = load_tokenizer(str(tiny_models["policy"]))
    model = load_causal_lm(str(tiny_models["policy"]), "policy", torch.device("cpu"), torch.float32).eval()
    eng = EagerBackend(model, tok.eos_token_id, tok.pad_token_id, max_new_tokens=30, seed=0)
    eng.admit([Rollout(0, 0, "p", tok("the film was")["input_ids"], 0),
               Rollout(1, 1, "q", tok("a day")["input_ids"], 0)])
    for _ in range(4):
        eng.step()
    assert eng.active == 2
    with torch.no_grad():  # a weight update
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    eng.set_version(1)

    def full_forward_logits():
        out = []
        for r in eng.rows:
            with torch.no_grad():
                out.append(model(torch.tensor([r.prompt_ids + r.response_ids])).logits[0, -1])
        return torch.stack(out)

    eng.step()  # one token under the kept (stale) cache
    kept = eng.next_logits.clone()
    want = full_forward_logits()
    assert (kept - want).abs().max() > 1e-3, "the kept cache is stale"
    eng.recompute()
    torch.testing.assert_close(eng.next_logits, want, atol=1e-4, rtol=1e-4)
    assert eng.logits_version == [1, 1] and eng.kv_version == [1, 1]


@pytest.mark.parametrize("stale_values", ["recompute", "keep"])
def test_stale_values(tiny_models, tiny_prompts, tmp_path, stale_values):
    """oppo mode streams critic values while sequences decode. A sequence carried over an update
    has values of its prefix from the previous critic: stale_values=recompute replaces them with
    the current critic's (the one-shot values of the whole sequence); keep leaves them."""
    cfg = load_config(None, [
        f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
        f"data.prompts={tiny_prompts}", "placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=4",
        "ppo.micro_batch_size=4", "generation.max_new_tokens=24", "overlap.mode=oppo", "overlap.delta=4",
        "overlap.max_lag=2", "overlap.chunk_size=2", f"overlap.stale_values={stale_values}",
        "ppo.critic_lr=1e-2", f"run.out_dir={tmp_path}", "log.progress=false"])
    t = Trainer.from_config(cfg, progress=False)
    try:
        carried_seen = 0
        for _ in range(4):
            critic_now = copy.deepcopy(t.roles.scoring_critic)  # the critic of this step (updated after scoring)
            t.run_step()
            exp = t.last_result.exp
            rs = exp.rollouts
            want = score_full("critic", critic_now, [r.prompt_ids for r in rs], [r.response_ids for r in rs],
                              t.roles.pad_id)
            for i, (r, w) in enumerate(zip(rs, want)):
                n = len(r.response_ids)
                got = exp.values[i, :n]
                gap = (got - torch.tensor(w.values)).abs().max().item()
                if r.start_version < t.step - 1:  # carried across an update
                    carried_seen += 1
                    if stale_values == "recompute":
                        assert gap < 1e-4
                    elif n > 2:
                        assert gap > 1e-4, "keep: the prefix's values are the previous critic's"
                else:
                    assert gap < 1e-4
        assert carried_seen > 0, "the fixture must carry some sequences"
    finally:
        t.close()
