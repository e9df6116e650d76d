"""The streaming scorers in Ray actors give the local scorers' outputs; the critic trains there as it
does locally; a failing or dead actor is reported by role and rank at the next barrier.

One local Ray cluster of two nodes (1 CPU each, shared by the Ray test modules); each test starts as
few actors as it can.
"""

import os
import random
import subprocess
import sys

import pytest
import torch

ray = pytest.importorskip("ray")

from oppo.config import PPOConfig  # noqa: E402
from oppo.learner.batch import CriticBatch  # noqa: E402
from oppo.learner.local import CriticSettings, critic_update
from oppo.models import load_critic, load_tokenizer  # noqa: E402
from oppo.scoring.ray import RayScorerWorker  # noqa: E402
from oppo.api.specs import ModelSpec  # noqa: E402
from oppo.rollout.eager.backend import Chunk  # noqa: E402
from oppo.scoring.streaming import StreamingScorer, score_full  # noqa: E402
from oppo.trace import Tracer  # noqa: E402
from oppo.scoring.worker import ScorerWorker  # noqa: E402

pytestmark = pytest.mark.ray

TEMP = 0.9


@pytest.fixture(scope="module")
def specs(tiny_models):
    pad = load_tokenizer(str(tiny_models["policy"])).pad_token_id
    return {"reward": ModelSpec("reward", str(tiny_models["reward"]), pad_id=pad, device="cpu"),
            "reference": ModelSpec("reference", str(tiny_models["policy"]), pad_id=pad, device="cpu"),
            "critic": ModelSpec("critic", str(tiny_models["reward"]), pad_id=pad, device="cpu")}


def _data(seed, n=6):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 30) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    responses = [[rng.randrange(3, 30) for _ in range(rng.choice([1, 2, 5, 17, 30]))] for _ in range(n)]
    for r in responses[::2]:
        r[-1] = 1
    return prompts, responses


def _stream(worker, prompts, responses, chunk, step=0):
    """Admit two groups at different times and stream chunks of ``chunk`` tokens, some rows idle
    in some rounds, as the trainer does; return the outputs after a barrier."""
    emitted = [0] * len(prompts)
    rng = random.Random(chunk)
    uids = list(range(len(prompts)))
    worker.admit(uids[:3], prompts[:3], step)
    live = set(uids[:3])
    admitted_rest = False
    while live or not admitted_rest:
        chunks = []
        for u in sorted(live):
            if u % 2 == 0 and rng.random() < 0.3:
                continue
            toks = responses[u][emitted[u]: emitted[u] + chunk]
            emitted[u] += len(toks)
            final = emitted[u] >= len(responses[u])
            chunks.append(Chunk(u, tuple(toks), final))
            if final:
                live.discard(u)
        worker.feed(chunks, step)
        if not admitted_rest:
            worker.admit(uids[3:], prompts[3:], step)
            live |= set(uids[3:])
            admitted_rest = True
    worker.barrier()
    return worker.take(uids)


def _close(a, b, what):
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               atol=1e-5, rtol=1e-5, msg=what)


def _check_same(got, want):
    for role in ("reward", "reference", "critic"):
        for g, w in zip(got[role], want[role]):
            if role == "reward":
                assert g.score == pytest.approx(w.score, abs=1e-5)
            else:
                _close(g.logprobs if role == "reference" else g.values,
                       w.logprobs if role == "reference" else w.values, role)


@pytest.fixture(scope="module")
def local_outputs(specs):
    """The local thread worker's streamed outputs (checked against one-shot scoring), and the models."""
    prompts, responses = _data(3)
    models = {r: s.load() for r, s in specs.items()}
    pad = specs["reward"].pad_id
    local = ScorerWorker({r: StreamingScorer(r, m, pad, TEMP if r == "reference" else 1.0) for r, m in models.items()},
                         threads=1, tracer=Tracer(enabled=False))
    try:
        want = _stream(local, prompts, responses, chunk=4)
    finally:
        local.close()
    one_shot = {r: score_full(r, m, prompts, responses, pad, TEMP if r == "reference" else 1.0)
                for r, m in models.items()}
    _check_same(want, one_shot)
    return prompts, responses, want, one_shot


@pytest.fixture(scope="module")
def ray_worker(ray_local, specs):
    """Two actors (reward+reference; critic, trained there), one Ray CPU each: the fewest actor
    starts (each imports torch and loads its models: seconds) that still cross an actor boundary."""
    tracer = Tracer(enabled=True)
    w = RayScorerWorker(specs, tracer, temperature=TEMP, num_cpus=1, groups=[("reward", "reference"), ("critic",)],
                        critic_trainer=CFG)
    yield w, tracer
    w.close()


CFG = PPOConfig(batch_size=4, minibatch_size=2, micro_batch_size=1, critic_lr=1e-2)


def test_ray_scorer_streams_like_the_local_worker(ray_worker, local_outputs):
    """The local worker's streamed outputs; the one-shot scores on the actors; the actors' spans
    and peak cache sizes back at the controller."""
    w, tracer = ray_worker
    prompts, responses, want, one_shot = local_outputs
    assert w.labels == ["reward+reference", "critic"]
    _check_same(_stream(w, prompts, responses, chunk=3), want)
    assert set(w.results) == {"reward", "reference", "critic"} and not any(w.results.values()), "take() empties"
    assert all(p > 0 for p in w.peak_cache_bytes.values()), "peak cache sizes come back"
    assert {s.lane for s in tracer.spans} == {"scorer/reward+reference", "scorer/critic"}
    assert {s.stage for s in tracer.spans} >= {"prefill_prompt", "score_critic"}, "the actors' spans come back"
    _check_same({r: w.score_full(r, prompts, responses) for r in ("reward", "reference", "critic")}, one_shot)


def test_ray_critic_trains_like_locally_and_failures_are_named(ray_worker, specs):
    """The critic's update on its actor gives the local ``critic_update``'s weights, stats and
    AdamW state; its state round-trips for checkpoints; a pushed state dict is what it then scores
    with. Then an exception inside an actor and a killed actor surface at the next barrier, by role."""
    w, _ = ray_worker
    pad = specs["critic"].pad_id
    local = load_critic(specs["critic"].path, torch.device("cpu"), torch.float32, pad).eval()
    from oppo.forward import sequence_batch

    cp, cr = _data(7, n=4)
    ids, valid, P, rmask = sequence_batch(cp, cr, pad, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    batch = CriticBatch(ids, valid, P, rmask.float(), torch.randn(rmask.shape, generator=g) * rmask,
                        torch.randn(rmask.shape, generator=g) * rmask)
    mbs = [torch.tensor([2, 0]), torch.tensor([3, 1])]
    opt = torch.optim.AdamW(local.parameters(), lr=CFG.critic_lr, weight_decay=CFG.weight_decay)
    want_stats = critic_update(local, opt, batch, mbs, CriticSettings.of(CFG))

    before = w.critic_state()
    w.train_critic(batch, mbs, step=0)
    w.barrier()
    stats = w.take_train_stats()
    assert stats["loss/value"] == pytest.approx(want_stats["loss/value"], rel=1e-5)
    state = w.critic_state()
    for k, v in local.state_dict().items():
        torch.testing.assert_close(state["model"][k], v, atol=1e-6, rtol=1e-5, msg=k)
    want_opt = opt.state_dict()
    assert state["optim"]["state"].keys() == want_opt["state"].keys()
    for i, st in want_opt["state"].items():
        torch.testing.assert_close(state["optim"]["state"][i]["exp_avg_sq"], st["exp_avg_sq"], atol=1e-8, rtol=1e-4)
    # the values it now scores with are the trained critic's
    want_values = score_full("critic", local, cp, cr, pad)
    _check_values(w.score_full("critic", cp, cr), want_values)
    # checkpoint round trip: back to the initial state (the values change back), then a pushed state dict
    w.load_critic_state(before["model"], before["optim"])
    assert w.critic_state()["optim"]["state"] == {}
    with pytest.raises(AssertionError):
        _check_values(w.score_full("critic", cp, cr), want_values)
    w.set_critic_weights(local)
    _check_values(w.score_full("critic", cp, cr), want_values)

    # an exception inside an actor (a token id outside the vocabulary) is named at the barrier
    w.admit([100], [[10_000]], step=1)
    with pytest.raises(RuntimeError, match=r"scorer actor \(role=reward\+reference, rank=0\) failed: .*Index"):
        w.barrier()
    # a dead actor too, named beside the failed one (each actor's outcome is reported)
    ray.kill(w.actors[1])
    w.feed([Chunk(0, (3, 4), True)], step=1)
    with pytest.raises(RuntimeError, match=r"\(role=reward\+reference, rank=0\) failed: .*; "
                                           r"scorer actor \(role=critic, rank=0\) died: .*killed by `ray.kill`"):
        w.barrier()


def _check_values(got, want):
    for g, v in zip(got, want):
        _close(g.values, v.values, "critic values")


def test_init_ray_joins_the_running_cluster(ray_local):
    """``init_ray()`` (address "auto") in another process joins the cluster named by RAY_ADDRESS."""
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    code = ("import ray; from oppo.cluster import init_ray; r = init_ray(); "
            "print(len(ray.nodes()), r['CPU'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["2", "2.0"]

