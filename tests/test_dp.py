"""The data-parallel learner group: 2 Ray ranks (gloo), on two nodes, train the single learner's weights on the same
batch; its state is the single learner's format, so it resumes on another number of ranks; rank 0's
actor weights reach the rollout model the way the trainer's weight sync reads them (``weights_out``);
a dead rank is named and stops the group.

One local Ray cluster of two nodes (shared with the other Ray test modules) and one group of 2 ranks.
"""

import random

import pytest
import torch

ray = pytest.importorskip("ray")

from oppo.algo import get_algorithm  # noqa: E402
from oppo.config import PPOConfig  # noqa: E402
from oppo.algo.stage import AdvantageSettings, compute_advantages  # noqa: E402
from oppo.learner.batch import Experience, attach_scores, build_experience  # noqa: E402
from oppo.api.records import Scores  # noqa: E402
from oppo.models import load_tokenizer  # noqa: E402
from oppo.learner.dp import Replicated  # noqa: E402
from oppo.learner.group import LearnerGroup, LearnerSpec, learner_state, load_learner_state  # noqa: E402
from oppo.api.specs import ModelSpec  # noqa: E402
from oppo.rollout.eager.backend import Rollout  # noqa: E402
from oppo.api.records import ScoredOutputs
from oppo.scoring.streaming import score_full  # noqa: E402
from oppo.weights.sync import load_source  # noqa: E402

pytestmark = pytest.mark.ray

# 2 minibatches x 2 epochs = 4 optimizer steps per update; micro-batches of 3 split each minibatch
# of 4 rows into 3 + 1: the two ranks get uneven shares. Learning rates large enough that the
# weights move well beyond the tolerance; weight decay on.
CFG = PPOConfig(batch_size=8, minibatch_size=4, micro_batch_size=3, epochs=2, actor_lr=1e-3, critic_lr=1e-3,
                weight_decay=0.01, entropy_coef=0.01)
# PPO with its KL term in the actor loss (the algorithm's part of the loss crosses the ranks too)
ALGO = get_algorithm("ppo", kl_placement="loss", kl_estimator="k3", kl_coef=0.1)


@pytest.fixture(scope="module")
def spec(tiny_models):
    pad = load_tokenizer(str(tiny_models["policy"])).pad_token_id
    return LearnerSpec(actor=ModelSpec("policy", str(tiny_models["policy"]), device="cpu"),
                       critic=ModelSpec("critic", str(tiny_models["reward"]), pad_id=pad, device="cpu"),
                       ppo=CFG, temperature=0.9, seed=3, algorithm=ALGO)


def _experience(learner, pad: int, seed: int) -> Experience:
    """B sequences of random tokens, scored like a real step: the learner's own log-probs as old
    (and behaviour) log-probs, the critic's values, random scores, GAE."""
    rng = random.Random(seed)
    rollouts = []
    for i in range(CFG.batch_size):
        resp = [rng.randrange(3, 30) for _ in range(rng.randint(1, 12))]
        ended = rng.random() < 0.6
        if ended:
            resp[-1] = 1
        rollouts.append(Rollout(i, i, "", [rng.randrange(3, 30) for _ in range(rng.randint(2, 6))], 0,
                                response_ids=resp, logprobs=[0.0] * len(resp), versions=[0] * len(resp),
                                finished=True, ended_with_eos=ended))
    exp = build_experience(rollouts, pad, torch.device("cpu"))
    with torch.no_grad():
        prompts, responses = [r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts]
        old = score_full("reference", learner.actor, prompts, responses, pad, 0.9)
        values = score_full("critic", learner.critic, prompts, responses, pad)
    for r, o in zip(rollouts, old):
        r.logprobs = o.logprobs
    exp.behaviour_logprobs = exp.old_logprobs = build_experience(rollouts, pad, torch.device("cpu")).old_logprobs
    ref = [ScoredOutputs(logprobs=[x - 0.05 * rng.random() for x in o.logprobs]) for o in old]
    return compute_advantages(attach_scores(exp, Scores([rng.gauss(0, 1) for _ in rollouts], ref, values)),
                              AdvantageSettings.of(CFG), ALGO)


def _assert_state_close(got: dict, want: dict, moved_from: dict | None = None):
    for part in ("actor", "critic"):
        assert got[part].keys() == want[part].keys()
        for k, v in want[part].items():
            torch.testing.assert_close(got[part][k], v, atol=1e-5, rtol=1e-5, msg=f"{part}.{k}")
        if moved_from is not None:  # the comparison is not vacuous: the update moved the weights
            gap = max((want[part][k] - moved_from[part][k]).abs().max().item() for k in want[part])
            assert gap > 1e-3, f"{part} barely moved ({gap})"
    for part in ("actor_opt", "critic_opt"):
        assert got[part]["param_groups"] == want[part]["param_groups"]
        assert got[part]["state"].keys() == want[part]["state"].keys()
        for i, st in want[part]["state"].items():
            for name in ("step", "exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(got[part]["state"][i][name], st[name], atol=1e-6, rtol=1e-4,
                                           msg=f"{part}[{i}].{name}")


@pytest.mark.slow
def test_dp_group_trains_like_one_learner_resumes_across_sizes_and_stops_on_a_dead_rank(ray_local, spec):
    pad = spec.critic.pad_id
    single = spec.build()
    initial = learner_state(single)
    exp0 = _experience(single, pad, seed=0)
    rollout = spec.actor.load()  # what the rollout backend would sample with
    group = LearnerGroup(spec, 2, Replicated(), num_cpus=1, placement="STRICT_SPREAD", timeout_s=120)
    try:
        assert len(set(group.nodes())) == 2, "one rank per node: gloo and the weights cross nodes"
        # the off-policy correction on rank 0 equals the local one
        local_exp, remote_exp = _experience(single, pad, seed=5), _experience(single, pad, seed=5)
        for e in (local_exp, remote_exp):
            e.versions[0] -= 1  # one off-policy row
        local_exp = single.old_logprobs(local_exp, 0)
        remote_exp = group.old_logprobs(remote_exp, 0)
        torch.testing.assert_close(remote_exp.old_logprobs, local_exp.old_logprobs, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(remote_exp.is_weights, local_exp.is_weights, atol=1e-6, rtol=1e-5)

        # one update: the single learner's weights, AdamW state and stats
        want_stats = single.update(exp0, 0)
        after0 = learner_state(single)
        stats = group.update(exp0, 0)
        _assert_state_close(group.state_dict(), after0, moved_from=initial)
        assert {"loss/policy", "loss/value", "loss/kl", "grad_norm/actor"} <= want_stats.keys()
        for k, v in want_stats.items():
            # a clip fraction counts tokens at a threshold: on the first minibatch the values equal
            # the rollout values, a tie that floating-point noise (another thread count) breaks
            # either way for a token or two
            tol = dict(abs=0.05) if k.endswith("clipfrac") else dict(rel=1e-4, abs=1e-6)
            assert stats[k] == pytest.approx(v, **tol), k
        # the weight sync (the trainer's: weights.sync.load_source of weights_out): rank 0's actor is now
        # the rollout model
        load_source(rollout, group.weights_out())
        for k, v in after0["actor"].items():
            torch.testing.assert_close(rollout.state_dict()[k], v, atol=1e-5, rtol=1e-5, msg=k)

        # a DP checkpoint resumes on one learner: the next update agrees
        resumed = spec.build()
        load_learner_state(resumed, group.state_dict())
        exp1 = _experience(resumed, pad, seed=1)
        resumed.update(exp1, 1)
        group.update(exp1, 1)
        _assert_state_close(group.state_dict(), learner_state(resumed), moved_from=after0)

        # and a single learner's checkpoint resumes on the group: back to the start, same step 0
        group.load_state_dict(initial)
        group.update(exp0, 0)
        _assert_state_close(group.state_dict(), after0)

        # a dead rank: named, and the whole group stopped (rank 0 would wait in its all-reduce)
        ranks = list(group.ranks)
        ray.kill(ranks[1])
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(ranks[1].actor_state.remote())
        with pytest.raises(RuntimeError, match=r"learner actor \(role=learner, rank=1\) died: "
                                               r".*killed by `ray.kill`.*group was stopped"):
            group.update(exp1, 1)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(ranks[0].actor_state.remote(), timeout=60)
    finally:
        group.close()
