import torch

from oppo.models import load_causal_lm, load_tokenizer
from oppo.rollout.eager.backend import EagerBackend, Rollout, sample_tokens
from conftest import returned

PROMPTS = ["the film was", "i liked the book and", "a", "we hated it but the story"]


def _load(tiny_models):
    tok = load_tokenizer(str(tiny_models["policy"]))
    model = load_causal_lm(str(tiny_models["policy"]), "policy", torch.device("cpu"), torch.float32).eval()
    return tok, model


def _rollouts(tok, prompts=PROMPTS):
    return [Rollout(i, i, p, tok(p)["input_ids"], 0) for i, p in enumerate(prompts)]


def _eos_biased(model, tok, bias=3.0):
    """Make EOS likely enough that rows end at different times."""
    with torch.no_grad():
        model.get_output_embeddings().weight[tok.eos_token_id] += bias * model.get_output_embeddings().weight.std()
    return model


def _reference_greedy(model, tok, prompts, n):
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, do_sample=False, max_new_tokens=n, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)
    refs = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id) + 1]
        refs.append(row)
    return refs


def test_greedy_equals_generate(tiny_models):
    tok, model = _load(tiny_models)
    eng = EagerBackend(model, tok.eos_token_id, tok.pad_token_id, max_new_tokens=16, greedy=True)
    rs = _rollouts(tok)
    eng.admit(rs)
    rs = returned(rs, eng.generate_all())
    for r, ref in zip(rs, _reference_greedy(model, tok, PROMPTS, 16)):
        assert r.response_ids == ref


def test_greedy_equals_generate_with_staggered_admission_and_eos(tiny_models):
    """Rows that join mid-decode (continuous batching) and rows that end early still decode
    exactly as generate does them alone."""
    tok, model = _load(tiny_models)
    model = _eos_biased(model, tok)
    refs = _reference_greedy(model, tok, PROMPTS, 24)
    assert len({len(r) for r in refs}) > 1, "fixture should give different lengths"
    eng = EagerBackend(model, tok.eos_token_id, tok.pad_token_id, max_new_tokens=24, greedy=True)
    rs = _rollouts(tok)
    eng.admit(rs[:2])
    done = []
    for _ in range(3):
        done += eng.step()
    eng.admit(rs[2:])
    rs = returned(rs, done + eng.generate_all())
    for r, ref in zip(rs, refs):
        assert r.response_ids == ref
        assert r.ended_with_eos == (ref[-1] == tok.eos_token_id)


def test_behaviour_logprobs_match_a_full_forward(tiny_models):
    tok, model = _load(tiny_models)
    eng = EagerBackend(model, tok.eos_token_id, tok.pad_token_id, max_new_tokens=10, temperature=0.7, seed=3)
    rs = _rollouts(tok)
    eng.admit(rs)
    rs = returned(rs, eng.generate_all())
    for r in rs:
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(r.prompt_ids) - 1:-1] / 0.7
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(r.response_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs), lp, atol=1e-4, rtol=1e-4)
        assert r.versions == [0] * len(r.response_ids)


def test_sampling_is_seeded_and_stops_at_max_new_tokens(tiny_models):
    tok, model = _load(tiny_models)
    outs = []
    for _ in range(2):
        eng = EagerBackend(model, tok.eos_token_id, tok.pad_token_id, max_new_tokens=7, seed=11)
        rs = _rollouts(tok)
        eng.admit(rs)
        rs = returned(rs, eng.generate_all())
        outs.append([r.response_ids for r in rs])
        assert all(len(r.response_ids) <= 7 for r in rs)
        assert all(r.ended_with_eos or len(r.response_ids) == 7 for r in rs)
    assert outs[0] == outs[1]


def test_chunks_cover_each_response_once(tiny_models):
    tok, model = _load(tiny_models)
    model = _eos_biased(model, tok)
    eng = EagerBackend(model, tok.eos_token_id, tok.pad_token_id, max_new_tokens=20, seed=1)
    rs = _rollouts(tok)
    eng.admit(rs)
    got = {r.uid: [] for r in rs}
    finals = set()
    done = []
    while eng.active:
        done += eng.step()
        for c in eng.take_chunks(3):
            assert c.uid not in finals
            got[c.uid].extend(c.tokens)
            assert c.final or len(c.tokens) == 3
            if c.final:
                finals.add(c.uid)
    for c in eng.take_chunks(3):
        got[c.uid].extend(c.tokens)
        finals.add(c.uid)
    assert finals == {r.uid for r in rs}
    for r in returned(rs, done):
        assert got[r.uid] == r.response_ids


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0, -2.0]]).repeat(200, 1)
    g = torch.Generator().manual_seed(0)
    tok, _ = sample_tokens(logits, 1.0, top_k=2, top_p=1.0, generator=g)
    assert set(tok.tolist()) <= {0, 1}
    tok, _ = sample_tokens(logits, 1.0, top_k=0, top_p=0.5, generator=g)
    assert set(tok.tolist()) == {0}  # p(0) = 0.70 > 0.5 alone
    tok, lp = sample_tokens(logits, 2.0, top_k=0, top_p=1.0, generator=g)
    expected = torch.log_softmax(logits / 2.0, -1).gather(1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp, expected)


def test_truncated_sampling_records_the_truncated_distribution():
    """top-k/top-p: the behaviour log-prob is that of the distribution the token was drawn from
    (renormalised over the kept set), not of the untruncated softmax."""
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0, -2.0]]).repeat(50, 1)
    g = torch.Generator().manual_seed(0)
    tok, lp = sample_tokens(logits, 1.0, top_k=2, top_p=1.0, generator=g)
    # kept {0, 1}: p(0) = e^4 / (e^4 + e^3) = 1 / (1 + e^-1) = 0.7311, p(1) = 0.2689
    want = {0: torch.tensor(0.7311).log(), 1: torch.tensor(0.2689).log()}
    for t, l in zip(tok.tolist(), lp.tolist()):
        assert abs(l - float(want[t])) < 1e-3
    tok, lp = sample_tokens(logits, 1.0, top_k=0, top_p=0.5, generator=g)
    assert tok.eq(0).all() and lp.abs().max() < 1e-6  # the nucleus is {0} alone: log 1 = 0


def test_stops_on_every_generation_config_eos(tiny_models):
    """A second stop id from generation_config (a list, as Llama 3 instruct's) ends a row at its
    first occurrence, as an EOS."""
    from oppo.models import stop_token_ids

    tok, model = _load(tiny_models)
    eng = EagerBackend(model, tok.eos_token_id, tok.pad_token_id, max_new_tokens=16, greedy=True)
    rs = _rollouts(tok)
    eng.admit(rs)
    free = [r.response_ids for r in returned(rs, eng.generate_all())]
    other = free[0][2]  # a token the first row emits third
    assert other != tok.eos_token_id
    model.generation_config.eos_token_id = [tok.eos_token_id, other]
    ids = stop_token_ids(tok, model)
    assert set(ids) == {tok.eos_token_id, other}
    eng = EagerBackend(model, ids, tok.pad_token_id, max_new_tokens=16, greedy=True)
    rs = _rollouts(tok)
    eng.admit(rs)
    rs = returned(rs, eng.generate_all())
    for r, f in zip(rs, free):
        want = f[: f.index(other) + 1] if other in f else f
        assert r.response_ids == want
        assert r.ended_with_eos == (want[-1] in ids)
    assert len(rs[0].response_ids) == 3 and rs[0].ended_with_eos


def test_stale_kv_keep_tags_tokens_over_an_old_prefix_as_old(tiny_models):
    """stale_kv=keep: after a weight update, tokens decoded by the new weights over a KV prefix
    computed by the old ones carry the old version (off-policy: the learner recomputes them);
    recompute() rebuilds the cache and new tokens are on-policy again."""
    tok, model = _load(tiny_models)
    eng = EagerBackend(model, tok.eos_token_id, tok.pad_token_id, max_new_tokens=12, seed=0)
    eng.admit(_rollouts(tok, ["the film was"]))
    for _ in range(3):
        eng.step()
    eng.set_version(1)  # new weights arrive; the cache is kept
    for _ in range(3):
        eng.step()
    (row,) = eng.in_flight()  # the engine's record (it never changes the one it was given)
    assert row.versions == [0] * 6, "hybrid tokens are not pi_1's"
    eng.recompute()
    eng.step()
    eng.step()
    (row,) = eng.in_flight()
    assert row.versions == [0] * 6 + [1, 1]
