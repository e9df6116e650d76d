"""The reward score is read where the reward model's own Hugging Face forward reads it: the last token
of prompt + response that is not its config's pad token (``scoring.streaming`` module docstring), in
every scoring path, for pad = EOS (the token before a final EOS) and pad != EOS (the EOS itself)."""

import random

import pytest
import torch

from oppo.api.records import Chunk
from oppo.forward import set_packing
from oppo.scoring.streaming import StreamingScorer, scored_index, score_full

EOS, OTHER_PAD = 1, 0  # the tiny tokenizer's (tests/conftest.py): <pad> 0, <eos> 1


@pytest.fixture(scope="module", params=["pad=eos", "pad!=eos"])
def reward(request, tmp_path_factory):
    """A tiny one-label ``LlamaForSequenceClassification`` whose config's pad is its EOS, or not; saved
    (the Ray scorer's actor loads its model from a path) and loaded back as oppo loads a reward model."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from oppo.models import load_reward_model

    pad = EOS if request.param == "pad=eos" else OTHER_PAD
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, pad_token_id=pad, eos_token_id=EOS,
                      bos_token_id=None, num_labels=1)
    path = tmp_path_factory.mktemp("rm") / request.param
    LlamaForSequenceClassification(cfg).save_pretrained(path)
    # the scorer pads chunks with the policy tokenizer's pad (OTHER_PAD), whatever the reward model's is
    model = load_reward_model(str(path), torch.device("cpu"), torch.float32, OTHER_PAD)
    assert model.config.pad_token_id == pad
    return {"model": model, "path": str(path), "pad": pad}


def _sampled(seed: int = 0, n: int = 7):
    """Prompts and sampled responses: some end in EOS, some are truncated, one is EOS alone, and a
    prompt holds an EOS inside (a chat template's end of turn)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 32) for _ in range(rng.randint(2, 7))] for _ in range(n)]
    prompts[1][1] = EOS
    responses = [[rng.randrange(3, 32) for _ in range(rng.choice([1, 3, 6, 11]))] for _ in range(n)]
    for r in responses[::2]:
        r.append(EOS)  # ended by itself
    responses[3] = [EOS]
    return prompts, responses


@torch.no_grad()
def _hf(model, prompts, responses) -> list[float]:
    """The model's own forward, one unpadded sequence at a time: ``model(input_ids).logits``."""
    return [model(input_ids=torch.tensor([p + r])).logits[0, 0].item() for p, r in zip(prompts, responses)]


@torch.no_grad()
def _at_last_token(model, prompts, responses) -> list[float]:
    """The score head at the last token (oppo's reading before issue 51)."""
    from oppo.models import backbone_and_head

    backbone, head = backbone_and_head(model)
    return [head(backbone(input_ids=torch.tensor([p + r])).last_hidden_state[0, -1]).item()
            for p, r in zip(prompts, responses)]


def test_scored_index_is_hugging_faces_last_non_pad_token():
    assert scored_index([5, 6, 1], pad=1) == 1  # pad = EOS: the token before a final EOS
    assert scored_index([5, 6, 1], pad=0) == 2  # pad != EOS: the EOS itself
    assert scored_index([5, 1, 6], pad=1) == 2  # a pad inside: the rightmost that is not one
    assert scored_index([1, 1], pad=1) == 0  # all pad: Hugging Face's argmax gives 0
    assert scored_index([1, 1], pad=1, fallback=-1) == -1
    assert scored_index([5, 6, 1], pad=None) == 2  # no pad token: the last


def test_the_test_can_fail(reward):
    """With pad = EOS, the model's forward differs from the head at a final EOS (so the tests below
    tell the two readings apart); with pad != EOS they agree."""
    prompts, responses = _sampled()
    hf, last = _hf(reward["model"], prompts, responses), _at_last_token(reward["model"], prompts, responses)
    ended = [i for i, r in enumerate(responses) if r[-1] == EOS]
    gaps = [abs(hf[i] - last[i]) for i in ended]
    if reward["pad"] == EOS:
        assert min(gaps) > 1e-3
    else:
        assert max(gaps) < 1e-5


@pytest.mark.parametrize("packing", ["auto", "off"])
@pytest.mark.parametrize("buckets", ["off", "on"])
def test_one_shot_reads_the_models_own_position(reward, packing, buckets):
    prompts, responses = _sampled(1)
    model = reward["model"]
    set_packing(model, packing, buckets)
    try:
        got = [s.score for s in score_full("reward", model, prompts, responses, OTHER_PAD)]
    finally:
        set_packing(model, "auto", "auto")
    assert got == pytest.approx(_hf(model, prompts, responses), abs=1e-5)


@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.parametrize("buckets", ["off", "on"])
def test_streamed_reads_the_models_own_position(reward, chunk, buckets):
    """Chunks that end in EOS, a final chunk that is EOS alone (chunk 1), empty final chunks."""
    prompts, responses = _sampled(2)
    model = reward["model"]
    set_packing(model, "auto", buckets)
    try:
        s = StreamingScorer("reward", model, OTHER_PAD)
        s.admit(list(range(len(prompts))), prompts)
        sent = [0] * len(prompts)
        while len(s.done) < len(prompts):
            feed = {}
            for u in s.uids:
                toks = responses[u][sent[u]: sent[u] + chunk]
                sent[u] += len(toks)
                feed[u] = (tuple(toks), sent[u] >= len(responses[u]) and (u % 3 != 0 or not toks))
            s.feed(feed)
        got = s.take_done()
    finally:
        set_packing(model, "auto", "auto")
    assert [got[u].score for u in range(len(prompts))] == pytest.approx(_hf(model, prompts, responses), abs=1e-5)


def test_scorer_workers_read_the_models_own_position(reward):
    """The local scorer worker (thread) and the Ray scorer's actor class (run here without Ray), streamed
    and one-shot."""
    from oppo.api.specs import ModelSpec
    from oppo.scoring.ray import ScorerHost
    from oppo.scoring.worker import ScorerWorker
    from oppo.trace import Tracer

    prompts, responses = _sampled(3)
    want = _hf(reward["model"], prompts, responses)
    local = ScorerWorker({"reward": StreamingScorer("reward", reward["model"], OTHER_PAD)}, 1, Tracer())
    host = ScorerHost({"reward": ModelSpec("reward", reward["path"], device="cpu", pad_id=OTHER_PAD)}, 1.0, 1, "rm")
    try:
        for w in (local, host.worker):
            uids = list(range(len(prompts)))
            w.admit(uids, prompts, 0)
            w.feed([Chunk(u, tuple(r[:2]), len(r) <= 2) for u, r in enumerate(responses)], 0)
            w.feed([Chunk(u, tuple(r[2:]), True) for u, r in enumerate(responses) if len(r) > 2], 0)
            w.barrier()
            assert [o.score for o in w.take(uids)["reward"]] == pytest.approx(want, abs=1e-5)
        assert [o.score for o in local.score_full("reward", prompts, responses)] == pytest.approx(want, abs=1e-5)
        assert [o.score for o in host.score_full("reward", prompts, responses)] == pytest.approx(want, abs=1e-5)
    finally:
        local.close()
        host.close()


def test_the_load_check_keeps_the_reward_models_own_pad_out_of_its_probe():
    """``models.verify`` compares oppo's head with the model's forward on a random probe; the run's pad
    (the policy tokenizer's) is kept out of it, and so is the reward model's own config pad: with that
    pad as the probe's last token, the forward pools an earlier token and a sound model was refused."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from oppo.models.verify import verify_model

    vocab = 32
    last = int(torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(1234))[0, -1])  # the probe's
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=last, bos_token_id=None,
                      eos_token_id=None, num_labels=1)
    model = LlamaForSequenceClassification(cfg).eval()
    verify_model(model, "reward", pad_token_id=(last + 5) % vocab)  # raised ModelLoadError before
