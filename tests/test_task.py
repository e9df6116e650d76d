"""Tests of the built-in tasks (``oppo.task``): generator, judge, tokenizer, registry, and a
miniature ``prepare`` (seconds, not the real build)."""

from __future__ import annotations

import importlib
import json
import random
import time

import pytest

from oppo.task import TASKS, PrepareSizes, get_task, positive_task, prepare
from oppo.task import arith, models, positive
prepare_mod = importlib.import_module("oppo.task.prepare")  # the name `prepare` is the function
from oppo.task.text import detokenize, join_prompt_response, split
from oppo.task.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, build_tokenizer

from conftest import one_core

# --- registry -----------------------------------------------------------------------------------


def test_get_task_unknown_lists_known_tasks():
    with pytest.raises(ValueError, match="arith.*positive"):
        get_task("nope")


def test_tasks_have_importable_judge_and_reward():
    assert set(TASKS) == {"positive", "arith"}
    pos, ari = get_task("positive"), get_task("arith")
    assert pos.reward_function is None and pos.uses_reward_model
    assert ari.reward_function == "oppo.task.arith:reward" and not ari.uses_reward_model
    for task in (pos, ari):
        module, name = task.judge_function.split(":")
        fn = getattr(importlib.import_module(module), name)
        prompts = task.prompts(4, seed=0)
        assert fn(prompts, ["the answer is 3."] * 4) == task.judge(prompts, ["the answer is 3."] * 4)
        assert task.max_new_tokens > 0


def test_default_max_new_tokens_is_the_corpus_tail_quantile():
    assert positive.DEFAULT_MAX_NEW_TOKENS == positive.suggest_max_new_tokens()
    assert get_task("positive").max_new_tokens == positive.DEFAULT_MAX_NEW_TOKENS
    longer = positive_task(positive.TaskParams(tail_prob=0.3, long_median=10.0))
    assert longer.max_new_tokens > positive.DEFAULT_MAX_NEW_TOKENS


def test_task_params_are_validated():
    with pytest.raises(ValueError, match="tail_prob"):
        positive.TaskParams(tail_prob=1.5)


# --- generator ----------------------------------------------------------------------------------


def test_generator_is_deterministic_in_seed():
    a, b, c = positive.generate(200, 7), positive.generate(200, 7), positive.generate(200, 8)
    assert a == b
    assert a != c
    assert get_task("positive").prompts(30, 5) == get_task("positive").prompts(30, 5)
    assert arith.examples(30, 1) == arith.examples(30, 1) != arith.examples(30, 2)


def _quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def test_corpus_response_lengths_are_heavy_tailed_and_configurable():
    lengths = [len(ex.response_tokens) + 1 for ex in positive.generate(5000, 0)]
    assert _quantile(lengths, 0.99) >= 4 * _quantile(lengths, 0.5)
    assert _quantile(lengths, 0.995) <= positive.DEFAULT_MAX_NEW_TOKENS
    no_tail = positive.TaskParams(tail_prob=0.0)
    short = [len(ex.response_tokens) + 1 for ex in positive.generate(5000, 0, no_tail)]
    assert _quantile(short, 0.99) < _quantile(lengths, 0.99) / 1.5


def test_corpus_uses_only_the_vocabulary_and_ends_every_response():
    vocab = set(positive.vocabulary())
    assert 300 <= len(vocab) <= 1500
    assert positive.L.POSITIVE_WORDS <= vocab and positive.L.NEGATIVE_WORDS <= vocab
    for ex in positive.generate(2000, 3):
        assert set(ex.prompt_tokens) <= vocab and set(ex.response_tokens) <= vocab
        assert ex.response_tokens and ex.response_tokens[-1] in (".", "!")
        assert detokenize(split(ex.response)) == ex.response
    arith_vocab = set(arith.vocabulary())
    for p, r in arith.examples(500, 0):
        assert set(p) <= arith_vocab and set(r) <= arith_vocab


# --- judge --------------------------------------------------------------------------------------

PROMPT = "we stayed at the hotel for three nights. the"


def test_judge_prefers_positive_text():
    good = "room was lovely and the staff was very friendly. we felt happy afterwards."
    bad = "room was dirty and the staff was very rude. we felt miserable afterwards."
    neutral = "room had two lamps. we waited for ten minutes."
    g, b, n = positive.judge([PROMPT] * 3, [good, bad, neutral])
    assert g > n > b
    assert -1.0 <= b and g <= 1.0


def test_judge_penalises_repetition_cutoff_salad_and_empty():
    clean = "room was lovely. the staff was friendly."
    (score_clean,) = positive.judge([PROMPT], [clean])
    loop = " ".join(["the staff was friendly."] * 6)
    word = "lovely " * 12 + "lovely."
    cut = "room was lovely. the staff was"
    salad = "room was lovely. lovely superb great wonderful amazing."
    for degenerate in (loop, word, cut, salad):
        (s,) = positive.judge([PROMPT], [degenerate])
        assert s < score_clean - 0.5, degenerate
    assert positive.judge([PROMPT], [""]) == [positive.EMPTY_SCORE]
    assert positive.judge_parts(PROMPT, cut)["cutoff"] == positive.CUTOFF_PENALTY
    assert positive.judge_score([PROMPT], [clean]) == [score_clean]


def test_judge_gives_no_penalty_to_corpus_text_and_is_fast():
    examples = positive.generate(3000, 11)
    t = time.perf_counter()
    parts = [positive.judge_parts(ex.prompt, ex.response) for ex in examples]
    assert time.perf_counter() - t < 3.0  # thousands per second, even on a busy machine
    penalised = sum(1 for p in parts if p["repetition"] + p["malformed"] + p["cutoff"] > 0)
    assert penalised / len(parts) < 0.01


def test_degenerate_variants_score_below_their_source():
    rng = random.Random(0)
    lower = 0
    examples = positive.generate(300, 2)
    for ex in examples:
        bad = detokenize(positive.corrupt(rng, ex.response_tokens))
        lower += positive.judge([ex.prompt], [bad])[0] < positive.judge([ex.prompt], [ex.response])[0]
    assert lower / len(examples) > 0.9


def test_flip_sentiment_changes_only_sentiment_words():
    rng = random.Random(1)
    toks = ("the", "soup", "was", "delicious", "and", "the", "staff", "was", "rude", ".")
    flipped = positive.flip_sentiment(rng, toks)
    assert flipped != toks and len(flipped) == len(toks)
    for a, b in zip(toks, flipped):
        if a != b:
            assert (a in positive.L.POSITIVE_WORDS) == (b in positive.L.NEGATIVE_WORDS)


# --- arith reward -------------------------------------------------------------------------------


def test_arith_reward_checks_the_answer():
    prompts = ["what is 7 plus 5?", "what is 13 minus 4?", "how many words are in cat sun dog?"]
    assert arith.reward(prompts, ["the answer is 12.", "the answer is 9.", "the answer is 3."]) == [1.0] * 3
    assert arith.reward(prompts, ["the answer is 11.", "the answer is 8.", "the answer is 4."]) == [0.0] * 3
    assert arith.reward(prompts[:1], ["the answer is."]) == [arith.NO_ANSWER]
    assert arith.reward(prompts[:1], ["the answer is 12"]) == [1.0 - arith.CUTOFF_PENALTY]
    examples = arith.examples(200, 4)
    ps = [detokenize(p) for p, _ in examples]
    assert arith.reward(ps, [detokenize(r) for _, r in examples]) == [1.0] * len(ps)
    with pytest.raises(ValueError):
        arith.reward(["hello?"], ["the answer is 1."])


def test_arith_accuracy_counts_right_first_numbers_only():
    prompts = ["what is 7 plus 5?"] * 6
    responses = ["the answer is 12.", "the answer is 12", "12 or 13.", "the answer is 13.", "the answer is.", ""]
    assert arith.reward(prompts, responses) == [1.0, 0.8, 1.0, 0.0, -0.5, -0.7]
    assert arith.accuracy(prompts, responses) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert get_task("arith").accuracy_function == "oppo.task.arith:accuracy"
    assert get_task("positive").accuracy_function is None


# --- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_special_tokens(tmp_path):
    from transformers import AutoTokenizer

    build_tokenizer(positive.vocabulary()).save_pretrained(str(tmp_path))
    assert (tmp_path / "tokenizer.json").is_file()
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (
        PAD_ID, BOS_ID, EOS_ID, UNK_ID)
    for ex in positive.generate(300, 5):
        text = join_prompt_response(ex.prompt, ex.response)
        ids = tok(text)["input_ids"]
        assert ids[0] == BOS_ID and UNK_ID not in ids
        assert tok.decode(ids, skip_special_tokens=True) == text
        resp = tok(ex.response, add_special_tokens=False)["input_ids"]
        assert len(resp) == len(ex.response_tokens)
        assert tok.decode(resp + [EOS_ID, PAD_ID], skip_special_tokens=True) == ex.response
    assert tok("The Food was GREAT.")["input_ids"] == tok("the food was great.")["input_ids"]


# --- prepare (miniature) ------------------------------------------------------------------------

TINY = PrepareSizes.tiny()  # (the tiny build itself: conftest.builtin_home, shared with other modules)


@pytest.fixture(autouse=True)
def _one_core():
    with one_core():
        yield


def test_fingerprint_tracks_what_was_asked_for():
    fp = prepare_mod.fingerprint
    pos = get_task("positive")
    base = fp(pos, 0, TINY)
    assert fp(get_task("positive"), 0, PrepareSizes.tiny()) == base
    assert fp(pos, 1, TINY) != base
    assert fp(pos, 0, PrepareSizes()) != base
    assert fp(positive_task(positive.TaskParams(tail_prob=0.2)), 0, TINY) != base
    assert fp(get_task("arith"), 0, TINY) != base


def test_prepare_writes_a_complete_cache(builtin_home):
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification,
                              AutoTokenizer)

    home, prep, _ = builtin_home
    root = home / "positive"
    assert prep.root == root and not prep.reused
    for name in ("prepare.json", "prompts.jsonl", "eval_prompts.jsonl", "tokenizer/tokenizer.json",
                 "policy/model.safetensors", "policy/tokenizer.json", "policy/generation_config.json",
                 "reward/model.safetensors", "reward/tokenizer.json"):
        assert (root / name).is_file(), name
    info = json.loads((root / "prepare.json").read_text())
    for key in ("sft_eos_rate", "length_p50", "length_p99", "rm_pairwise_accuracy",
                "rm_judge_correlation", "rm_judge_correlation_kind", "seconds", "task_params",
                "seed", "sizes", "max_new_tokens", "version", "fingerprint", "weights_sha256",
                "policy_parameters", "reward_parameters"):
        assert key in info, key
    assert info["max_new_tokens"] == get_task("positive").max_new_tokens
    train, held = prep.prompts(), prep.eval_prompts()
    assert len(train) == TINY.n_prompts and len(held) == TINY.n_eval_prompts
    assert not set(train) & set(held)

    tok = AutoTokenizer.from_pretrained(str(prep.policy_path))
    policy = AutoModelForCausalLM.from_pretrained(str(prep.policy_path))
    assert policy.generation_config.eos_token_id == tok.eos_token_id == EOS_ID
    assert policy.generation_config.pad_token_id == PAD_ID
    rm = AutoModelForSequenceClassification.from_pretrained(str(prep.reward_path))
    assert rm.config.num_labels == 1 and rm.config.pad_token_id == PAD_ID
    rm_tok = AutoTokenizer.from_pretrained(str(prep.reward_path))
    batch = rm_tok([PROMPT + " room was lovely.", PROMPT], padding=True, return_tensors="pt")
    assert rm(**batch).logits.shape == (2, 1)
    out = policy.generate(**tok(train[:2], padding=True, return_tensors="pt"), max_new_tokens=4)
    assert out.shape[0] == 2


def test_prepare_reuses_a_valid_cache(builtin_home):
    home, first, build_seconds = builtin_home
    weights = home / "positive" / "policy" / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    t = time.perf_counter()
    again = prepare("positive", home=home, seed=0, progress=False, sizes=TINY)
    assert time.perf_counter() - t < build_seconds
    assert again.reused
    assert again.info["fingerprint"] == first.info["fingerprint"]
    assert weights.stat().st_mtime_ns == mtime


def test_prepare_force_and_stale_caches_rebuild(tmp_path, monkeypatch):
    first = prepare("positive", home=tmp_path, seed=0, progress=False, sizes=TINY)
    forced = prepare("positive", home=tmp_path, seed=0, progress=False, sizes=TINY, force=True)
    assert not forced.reused and forced.info["fingerprint"] == first.info["fingerprint"]
    # Deterministic from the seed: the rebuild has the same weights.
    assert forced.info["weights_sha256"] == first.info["weights_sha256"]
    other_seed = prepare("positive", home=tmp_path, seed=1, progress=False, sizes=TINY)
    assert not other_seed.reused and other_seed.info["fingerprint"] != first.info["fingerprint"]
    # A damaged cache is not trusted.
    (tmp_path / "positive" / "reward" / "model.safetensors").write_bytes(b"junk")
    assert prepare_mod.verify(tmp_path / "positive", other_seed.info["fingerprint"]) is not None
    assert not prepare("positive", home=tmp_path, seed=1, progress=False, sizes=TINY).reused
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_prepare_is_atomic_when_interrupted(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("interrupted")

    # Fresh home: nothing valid-looking is left behind.
    monkeypatch.setattr(models, "train_reward_model", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        prepare("positive", home=tmp_path, seed=0, progress=False, sizes=TINY)
    assert not (tmp_path / "positive").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    # Existing cache: a failed forced rebuild leaves it intact and valid.
    monkeypatch.undo()
    good = prepare("positive", home=tmp_path, seed=0, progress=False, sizes=TINY)
    monkeypatch.setattr(models, "train_reward_model", boom)
    with pytest.raises(RuntimeError):
        prepare("positive", home=tmp_path, seed=0, progress=False, sizes=TINY, force=True)
    monkeypatch.undo()
    assert prepare_mod.verify(tmp_path / "positive", good.info["fingerprint"]) is None
    assert prepare("positive", home=tmp_path, seed=0, progress=False, sizes=TINY).reused


def test_prepare_arith_builds_policy_only(tmp_path, monkeypatch):
    monkeypatch.setenv("OPPO_HOME", str(tmp_path))
    prep = prepare("arith", progress=False, sizes=TINY)
    assert prep.root == tmp_path / "arith" and prep.reward_path is None
    assert not (prep.root / "reward").exists()
    assert "sft_accuracy" in prep.info and "rm_pairwise_accuracy" not in prep.info
    assert 0.0 <= prep.info["sft_accuracy"] <= 1.0
    assert prep.info["reward_function"] == "oppo.task.arith:reward"

    # a step on it logs task/accuracy: the share of responses whose first number is right
    import oppo.task
    from oppo.config import load_config
    from oppo.trainer import Trainer

    monkeypatch.setattr(oppo.task, "prepare", lambda **kw: prep)
    cfg = load_config(None, ["data.task=arith", "ppo.batch_size=8", "ppo.minibatch_size=8", "ppo.micro_batch_size=8",
                             "placement.threads=1", f"run.out_dir={tmp_path / 'run'}", "log.progress=false"])
    t = Trainer.from_config(cfg, progress=False)
    try:
        m = t.run_step()
        texts = t.last_result.texts
        right = arith.accuracy([p for p, _ in texts], [r for _, r in texts])
        assert m["task/accuracy"] == pytest.approx(sum(right) / len(right))
    finally:
        t.close()


def test_sampler_stops_rows_at_eos():
    import torch

    torch.manual_seed(0)
    model = models.build_policy(TINY.model, 50, max_new_tokens=8)
    with torch.no_grad():  # make EOS likely, so some rows stop early and leave the batch
        model.lm_head.weight[EOS_ID] *= 50.0
    out = models.sample(model, [[BOS_ID, 5, 6], [BOS_ID, 7]], max_new_tokens=8, batch_size=2, seed=0)
    assert [s.prompt_index for s in out] == [0, 1]
    for s in out:
        assert EOS_ID not in s.ids and len(s.ids) <= 8
        assert s.ended or len(s.ids) == 8


def test_prepare_says_its_step_count_and_time_left(monkeypatch, capsys):
    """Without a terminal, prepare's heartbeat says the phase, the steps done of how many, and the
    time left at the phase's rate so far (not only "still running (1078s so far)"); each training
    and sampling loop reports its count."""
    import torch

    log = prepare_mod._Log(True)
    log.phases = 4
    clock = [1000.0]
    monkeypatch.setattr(prepare_mod.time, "time", lambda: clock[0])
    log.phase("SFT policy")
    assert log.status() == "phase 1/4 still running (0s so far)"
    tick = log.work(700, "step")
    clock[0] += 300.0
    tick(200)
    assert log.status() == "phase 1/4: step 200/700, 300s so far, about 12 min left"  # 300 s / 200 x 500
    tick(690)
    assert log.status().endswith("about 4s left")
    monkeypatch.undo()
    with log.heartbeat(every=0.01):  # (pytest's stderr is no terminal)
        time.sleep(0.2)
    assert "step 690/700" in capsys.readouterr().err

    ticks = []
    torch.manual_seed(0)
    model = models.build_policy(TINY.model, 50, max_new_tokens=8)
    models.train_sft(model, [[BOS_ID, 5, 6, EOS_ID]] * 4, steps=3, batch_size=2, lr=1e-3, seed=0, progress=False,
                     tick=ticks.append)
    assert ticks == [1, 2, 3]
    ticks.clear()
    models.sample(model, [[BOS_ID, 5]] * 5, max_new_tokens=2, batch_size=2, seed=0, tick=ticks.append)
    assert ticks == [2, 4, 5]


def test_prepare_gives_the_same_models_whatever_the_load(builtin_home, tmp_path, monkeypatch):
    """The build runs at ``BUILD_THREADS`` torch threads whatever the caller's count and the
    machine's load (issue 51: it took the idle cores, so two users with the same seed got models
    that depended on their load at its start): a build from a process at 2 threads on 2 idle cores
    records the same thread count and gives the same weights as the session's build (one core,
    whatever load the machine has), and the caller's count is restored."""
    import os

    import torch

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # 2 cores
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # idle
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        info = prepare("positive", home=tmp_path, seed=0, progress=False, sizes=TINY).info
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    first = builtin_home.prepared.info
    assert info["threads"] == first["threads"] == prepare_mod.BUILD_THREADS
    assert info["weights_sha256"] == first["weights_sha256"]


# --- the shipped build (oppo.task.shipped) ----------------------------------------------------------


def _no_training(monkeypatch):
    """Any training or sampling of a build fails the test (an install must need none)."""
    def trained(*args, **kwargs):
        raise AssertionError("prepare trained or sampled a model")

    for name in ("train_sft", "train_reward_model", "sample"):
        monkeypatch.setattr(models, name, trained)


def test_a_shipped_build_installs_exactly_without_training(builtin_home, tmp_path, monkeypatch):
    """A build exported as the package ships it (weights as float16) installs into an empty home as
    the very cache the build wrote (the float32 weights' hashes in prepare.json check out), with no
    training; another seed, or a shipped copy that does not check out, is built instead."""
    shipped = importlib.import_module("oppo.task.shipped")
    ship = tmp_path / "shipped"
    shipped.export(builtin_home.home / "positive", ship / "positive")
    assert len(list(ship.rglob("model.fp16.safetensors"))) == 2 and not list(ship.rglob("model.safetensors"))
    monkeypatch.setattr(shipped, "SHIPPED", ship)
    _no_training(monkeypatch)
    home = tmp_path / "home"
    prep = prepare("positive", home=home, seed=0, progress=False, sizes=TINY)
    assert prep.info["weights_sha256"] == builtin_home.prepared.info["weights_sha256"]
    assert prepare_mod.verify(prep.root, prep.info["fingerprint"]) is None and "installed_from" in prep.info
    assert prepare("positive", home=home, seed=0, progress=False, sizes=TINY).reused
    with pytest.raises(AssertionError, match="trained"):  # not the shipped seed: built
        prepare("positive", home=home, seed=1, progress=False, sizes=TINY)
    weights = ship / "positive" / "reward" / "model.fp16.safetensors"
    data = bytearray(weights.read_bytes())
    data[-2:] = b"\x00\x7c"  # one weight changed (to +inf)
    weights.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match="trained"):
        prepare("positive", home=tmp_path / "home2", seed=0, progress=False, sizes=TINY)
    assert not [p for p in (tmp_path / "home2").iterdir() if ".tmp-" in p.name]


def test_export_refuses_weights_that_float16_does_not_hold(builtin_home, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    shipped = importlib.import_module("oppo.task.shipped")
    root = tmp_path / "cache"
    import shutil

    shutil.copytree(builtin_home.home / "positive", root)
    f = root / "policy" / "model.safetensors"
    tensors = load_file(str(f))
    name = next(iter(tensors))
    tensors[name] = tensors[name] + torch.full_like(tensors[name], 1e-7)
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="not float16 values: rebuild"):
        shipped.export(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_shipped_models_load_at_once_with_no_training(tmp_path, monkeypatch):
    """With an empty ``$OPPO_HOME``, the built-in task's models (the default seed and sizes, what
    ``oppo train`` asks for) come from the package: no training, a second or so, weight hashes
    checked, the quality bars of docs/task.md held. Fails when the shipped build is stale (the task,
    its sizes or PREPARE_VERSION changed): refresh it as oppo/task/shipped.py says."""
    import torch
    from transformers import AutoModelForCausalLM

    shipped = importlib.import_module("oppo.task.shipped")
    fp = prepare_mod.fingerprint(get_task("positive"), 0, prepare_mod.default_sizes("positive"))
    assert shipped.shipped_build("positive", fp) is not None, "the shipped build is stale: refresh it"
    _no_training(monkeypatch)
    monkeypatch.setenv("OPPO_HOME", str(tmp_path))
    prep = prepare("positive", progress=False)
    info = prep.info
    assert prep.root == tmp_path / "positive" and "installed_from" in info
    assert prepare_mod.verify(prep.root, fp) is None
    assert info["sft_eos_rate"] >= 0.95 and info["length_ratio_p99_p50"] >= 4  # the long tail
    assert info["rm_pairwise_accuracy"] >= 0.90
    policy = AutoModelForCausalLM.from_pretrained(str(prep.policy_path))
    assert policy.dtype == torch.float32 and prep.reward_path is not None
