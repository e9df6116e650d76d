"""Shared fixtures: tiny models created from a config in a temporary directory and loaded back
through the same code a user's models go through; the built-in task prepared at its tiny sizes."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

WORDS = ("the a good bad great awful film book day story was is and but very not quite it "
         "i we liked hated loved fine nice poor sad happy . ,").split()


TINY_PROMPTS = ("the film was", "i liked the book", "a day", "we hated it but", "the story is very",
                "it was quite", "the book", "a great")


def make_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.save_pretrained(path)
    return tok


def make_models(root, seed: int = 0, hidden: int = 32, layers: int = 2, tie: bool = False):
    """Write policy/ and reward/ directories (tokenizer included) under ``root``; return their paths.
    ``tie``: the policy's output head shares the input embedding's weight."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(seed)
    paths = {}
    for name in ("policy", "reward"):
        d = root / name
        tok = make_tokenizer(d)
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256, pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id, bos_token_id=None, num_labels=1,
                          tie_word_embeddings=tie and name == "policy")
        model = (LlamaForCausalLM if name == "policy" else LlamaForSequenceClassification)(cfg)
        model.save_pretrained(d)
        paths[name] = d
    return paths


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def vmodels(tmp_path_factory):
    """Tiny models vLLM serves: head size 24, which vLLM's CPU attention lacks, and an output head
    tied to the embedding, so every engine on them serves them rewritten (rollout/vllm/heads.py:
    heads padded to 32, head untied) and every test of one checks the rewrite too."""
    return make_models(tmp_path_factory.mktemp("vllm_tiny"), hidden=96, tie=True)


@pytest.fixture(scope="session")
def vllm_engine(vmodels):
    """One vLLM engine on ``vmodels``' policy for the whole session (a start costs 15-30 s on 2
    cores): tests/test_vllm.py and the conformance suite reset it to what they need
    (``test_vllm.reset``); none may kill it."""
    from oppo.rollout.vllm.backend import VLLMRolloutBackend

    eng = VLLMRolloutBackend(str(vmodels["policy"]), (1,), 0, 12, temperature=1.0, seed=0, max_num_seqs=16)
    yield eng
    eng.close()


class Builtin(NamedTuple):
    """The built-in task prepared for tests: its ``$OPPO_HOME``, what ``prepare`` returned, and how
    long the build took."""

    home: Path
    prepared: Any
    seconds: float


@pytest.fixture(scope="session")
def builtin_home(tmp_path_factory) -> Builtin:
    """An ``$OPPO_HOME`` holding the built-in task ("positive") prepared at ``PrepareSizes.tiny()``
    (seconds; the default sizes take CPU-minutes), for ``oppo train``'s own task with no model
    named. A run on it must ask for those sizes, or ``prepare`` would rebuild at the default ones:
    ``builtin_task`` in this process, ``builtin_cli`` in a child."""
    import time

    from oppo.task import PrepareSizes, prepare

    home = tmp_path_factory.mktemp("oppo_home")
    t = time.perf_counter()
    with one_core():
        prepared = prepare("positive", home=home, seed=0, progress=False, sizes=PrepareSizes.tiny())
    return Builtin(home, prepared, time.perf_counter() - t)


@contextlib.contextmanager
def one_core():
    """This thread on one core: ``prepare`` gives torch as many threads as the process has cores,
    and a tiny model runs fastest on one (two spin against each other on a busy 2-core machine:
    minutes instead of seconds for ``PrepareSizes.tiny()``)."""
    if not hasattr(os, "sched_setaffinity"):  # (not Linux)
        yield
        return
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, cores)


@pytest.fixture
def builtin_task(builtin_home, monkeypatch) -> Builtin:
    """Runs in this process train on ``builtin_home``'s task: ``$OPPO_HOME`` points there and the
    built-in task's sizes are the tiny ones."""
    prep = importlib.import_module("oppo.task.prepare")  # (oppo.task.prepare is also the function)
    monkeypatch.setenv("OPPO_HOME", str(builtin_home.home))
    monkeypatch.setattr(prep, "default_sizes", lambda task: prep.PrepareSizes.tiny())
    return builtin_home


_BUILTIN_CLI = ("import importlib, sys; prep = importlib.import_module('oppo.task.prepare'); "
                "prep.default_sizes = lambda task: prep.PrepareSizes.tiny(); "
                "from oppo.cli import main; sys.exit(main())")


def builtin_cli(builtin: Builtin, env: dict) -> tuple[list[str], dict]:
    """``oppo`` in a child process on ``builtin``'s task (as ``builtin_task`` in this one): the
    command line to put its arguments after (``train ...``), and ``env`` with ``$OPPO_HOME``."""
    return [sys.executable, "-c", _BUILTIN_CLI], {**env, "OPPO_HOME": str(builtin.home)}


@pytest.fixture(scope="session")
def tiny_prompts(tmp_path_factory):
    import json

    d = tmp_path_factory.mktemp("prompts")
    p = d / "prompts.jsonl"
    p.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TINY_PROMPTS))
    return p


@pytest.fixture(scope="session")
def ray_local(request):
    """A local Ray cluster of two nodes of 1 CPU each, started once per test session by the first
    test that asks (a start costs ~25 s on 2 busy cores) and shut down at its end. Skips without
    Ray."""
    ray = pytest.importorskip("ray")
    from oppo.cluster import start_local_cluster

    if not ray.is_initialized():
        request.config.add_cleanup(start_local_cluster(nodes=2, cpus_per_node=1))


# ------------------------------------------------------------------ parallel runs (pytest-xdist)
# `make test` runs the suite on two workers (``-n 2 --dist loadgroup``; docs/testing.md): most of its
# time is processes starting (Ray clusters and actors, `oppo train` children, the scorer's child),
# which the two overlap. The tests are handed out in shares, a whole share to one worker:

SHARED = {"ray_local": "ray", "vllm_engine": "vllm"}
"""Session fixtures that cost a start of 15-30 s: the tests on each are one share, so that one
worker starts it once. A test on both goes with the vLLM engine (that worker starts a cluster too)."""


def worker_share(item: pytest.Item) -> str:
    """The share ``item`` runs in: ``SHARED``'s name for the session fixture it uses (taken as an
    argument, by a ``needs(name)`` mark where a test takes it through ``request.getfixturevalue``,
    or, for Ray, by the ``ray`` mark), else its file (its module fixtures then start once)."""
    needs = set(item.fixturenames) | {m.args[0] for m in item.iter_markers("needs")}
    if item.get_closest_marker("ray"):
        needs.add("ray_local")
    for name in ("vllm_engine", "ray_local"):
        if name in needs:
            return SHARED[name]
    return item.nodeid.split("::")[0]


def _shares_file(worker_basetemp: str, worker: str) -> Path:
    """Where a worker leaves its tests' shares for the controller: beside its own temporary
    directory, in the run's (xdist gives each worker ``<the run's basetemp>/popen-<worker>``)."""
    return Path(worker_basetemp).parent / f"shares-{worker}.json"


def pytest_collection_modifyitems(config, items):
    """On an xdist worker: the Ray and vLLM shares, the longest, put first (so that the files handed
    out after them even the two workers out), and every test's share written for the controller's
    scheduler (``pytest_xdist_make_scheduler``). Every worker collects the same items in the same
    order, as xdist requires. (xdist's own ``xdist_group`` marks would say the same, but on pytest 9.2
    they no longer reach its scheduler: pytest-xdist issue 1386.)"""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker or not config.option.basetemp:
        return
    import json

    share = {item.nodeid: worker_share(item) for item in items}
    first = list(SHARED.values())
    items.sort(key=lambda item: first.index(share[item.nodeid]) if share[item.nodeid] in first else len(first))
    _shares_file(config.option.basetemp, worker).write_text(json.dumps(share))


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # (optional: a run without xdist has no such hook)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``: xdist's scope scheduler (a share at a time to the worker that runs out
    of work, in the order collected) over ``worker_share``'s shares, as the workers wrote them.
    Without their files (collected elsewhere), each file is a share."""
    if config.getoption("dist") != "loadgroup":
        return None
    import json

    from xdist.scheduler import LoadScopeScheduling

    base = config._tmp_path_factory.getbasetemp()  # (the run's; the workers' are below it)

    class Shares(LoadScopeScheduling):
        shares: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.shares is None:  # (first asked once every worker has collected: the files are there)
                self.shares = {}
                for f in sorted(base.glob("shares-*.json")):
                    self.shares.update(json.loads(f.read_text()))
            return self.shares.get(nodeid) or nodeid.split("::")[0]

    return Shares(config, log)


@pytest.fixture
def nothing_loads(monkeypatch):
    """Every expensive loader fails loudly: the error under test must come first, before anything
    loads. Returns the failing stand-in, for tests that refuse more (``test_entry_validation``)."""
    import oppo.setup.load

    def boom(*a, **k):
        raise AssertionError("something was loaded before the bad input was reported")

    for name in ("load_tokenizer", "read_records", "load_reward_model", "load_causal_lm", "load_critic",
                 "load_function"):
        monkeypatch.setattr(oppo.setup.load, name, boom)
    return boom


def assert_continued(done, saved: dict) -> None:
    """Rows re-admitted with partial responses (``saved``: uid -> (response ids, log-probs, versions)
    before) came back, each with its saved prefix kept as it was."""
    assert sorted(r.uid for r in done) == sorted(saved)
    for r in done:
        ids, lps, versions = saved[r.uid]
        n = len(ids)
        assert r.response_ids[:n] == ids and r.logprobs[:n] == lps and r.versions[:n] == versions


def returned(rows, done):
    """The engine's records of ``rows`` (it never changes those it is given), from the finished
    records it handed back; each row's exactly once."""
    by_uid = {r.uid: r for r in done}
    assert len(by_uid) == len(done) and set(by_uid) == {r.uid for r in rows}
    assert all(by_uid[r.uid] is not r for r in rows)
    return [by_uid[r.uid] for r in rows]
