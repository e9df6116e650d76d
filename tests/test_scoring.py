"""Streamed scores, values and reference log-probs equal the one-shot ones."""

import random

import pytest
import torch

from oppo.models import load_causal_lm, load_critic, load_reward_model, load_tokenizer
from oppo.scoring.streaming import StreamingScorer, score_full


@pytest.fixture(scope="module")
def roles(tiny_models):
    tok = load_tokenizer(str(tiny_models["policy"]))
    dev = torch.device("cpu")
    return {
        "tok": tok,
        "reference": load_causal_lm(str(tiny_models["policy"]), "reference", dev, torch.float32).eval(),
        "reward": load_reward_model(str(tiny_models["reward"]), dev, torch.float32, tok.pad_token_id),
        "critic": load_critic(str(tiny_models["reward"]), dev, torch.float32, tok.pad_token_id).eval(),
    }


def _data(seed, n=6):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 30) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    responses = [[rng.randrange(3, 30) for _ in range(rng.choice([1, 2, 5, 17, 40]))] for _ in range(n)]
    for r in responses[::2]:
        r[-1] = 1  # EOS inside the last chunk for some rows
    return prompts, responses


@pytest.fixture(params=["off", "on"])
def buckets(request, roles):
    """ppo.shape_buckets on the scorers' models: off (the dynamic cache, exact shapes) and on (the
    bucketed slots of scoring.slots, and bucketed one-shot rows), for the same numbers."""
    from oppo.forward import set_packing

    for kind in ("reference", "reward", "critic"):
        set_packing(roles[kind], "auto", request.param)
    yield request.param
    for kind in ("reference", "reward", "critic"):
        set_packing(roles[kind], "auto", "auto")


@pytest.mark.parametrize("kind", ["reward", "reference", "critic"])
@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_streaming_equals_one_shot(roles, kind, chunk, buckets):
    from oppo.scoring.slots import SlotKV

    prompts, responses = _data(chunk)
    model = roles[kind]
    pad = roles["tok"].pad_token_id
    expected = score_full(kind, model, prompts, responses, pad, temperature=0.9)
    s = StreamingScorer(kind, model, pad, temperature=0.9)
    assert isinstance(s.kv, SlotKV) == (buckets == "on")
    # admit in two groups, the second after the first has streamed a chunk (rows of different ages)
    s.admit([0, 1, 2], prompts[:3])
    emitted = {u: 0 for u in range(len(prompts))}
    s.feed({u: (tuple(responses[u][:chunk]), len(responses[u]) <= chunk) for u in range(3)})
    for u in range(3):
        emitted[u] = min(chunk, len(responses[u]))
    s.admit([3, 4, 5], prompts[3:])
    rng = random.Random(chunk)
    while len(s.done) < len(prompts):
        feed = {}
        for u in s.uids:
            if u % 2 == 0 and rng.random() < 0.3:
                continue  # some rows have no chunk this round: masked holes in the cache
            toks = responses[u][emitted[u]: emitted[u] + chunk]
            emitted[u] += len(toks)
            feed[u] = (tuple(toks), emitted[u] >= len(responses[u]))
        s.feed(feed)
    got = s.take_done()
    assert s.kv.rows == 0, "caches are freed as sequences finish"
    for u in range(len(prompts)):
        if kind == "reward":
            assert got[u].score == pytest.approx(expected[u].score, abs=1e-5)
        elif kind == "reference":
            torch.testing.assert_close(torch.tensor(got[u].logprobs), torch.tensor(expected[u].logprobs), atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(torch.tensor(got[u].values), torch.tensor(expected[u].values), atol=1e-5, rtol=1e-5)


def test_one_shot_scores_are_padding_invariant(roles):
    """A sequence scored alone or in a padded batch gets the same outputs."""
    prompts, responses = _data(5)
    pad = roles["tok"].pad_token_id
    batch = score_full("critic", roles["critic"], prompts, responses, pad)
    for i in range(len(prompts)):
        alone = score_full("critic", roles["critic"], [prompts[i]], [responses[i]], pad)[0]
        torch.testing.assert_close(torch.tensor(alone.values), torch.tensor(batch[i].values), atol=1e-5, rtol=1e-5)


def test_empty_final_chunk_and_idle_rows(roles, buckets):
    """A final chunk with no tokens completes a row; rows idle for several rounds stay exact."""
    prompts, responses = _data(11)
    pad = roles["tok"].pad_token_id
    expected = score_full("critic", roles["critic"], prompts, responses, pad)
    s = StreamingScorer("critic", roles["critic"], pad)
    s.admit(list(range(len(prompts))), prompts)
    s.feed({0: (tuple(responses[0]), False)})  # only row 0 runs; the others wait
    s.feed({1: (tuple(responses[1]), False)})
    s.feed({0: ((), True), 1: ((), True)})  # empty finals
    s.feed({u: (tuple(responses[u]), True) for u in range(2, len(prompts))})
    got = s.take_done()
    for u in range(len(prompts)):
        torch.testing.assert_close(torch.tensor(got[u].values), torch.tensor(expected[u].values), atol=1e-5, rtol=1e-5)


def test_kv_repack_drops_holes_exactly(roles):
    """A cache with holes (rows fed at different times) gives the same next hidden states after
    repacking, with fewer columns."""
    import copy

    from oppo.kv import KVRows, left_pad, right_pad
    from oppo.models import backbone_and_head

    backbone, _ = backbone_and_head(roles["reference"])
    pad = roles["tok"].pad_token_id
    prompts, responses = _data(3, n=4)
    kv = KVRows(torch.device("cpu"))
    with torch.no_grad():
        kv.forward(backbone, *left_pad(prompts, pad, torch.device("cpu")))
        for r in range(4):  # each round only one row gets tokens: the other three get holes
            ids, valid = right_pad([responses[r][:5] or [5]], pad, torch.device("cpu"))
            kv.forward_rows(backbone, torch.tensor([r]), ids, valid)
        twin = copy.deepcopy(kv)
        before = kv.length
        assert kv.repack()
        assert kv.length < before
        step = [[7, 8, 9]] * 4
        ids, valid = right_pad(step, pad, torch.device("cpu"))
        torch.testing.assert_close(kv.forward(backbone, ids, valid), twin.forward(backbone, ids, valid),
                                   atol=1e-5, rtol=1e-5)
