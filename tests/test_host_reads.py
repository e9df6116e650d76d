"""The decode loop's reads from the device (issue: decode overhead on the GPU).

A row's tokens, log-probs and versions stay in the engine's device records between steps: the
host reads them once, at a step where a row ends or a chunk is due, and its ``Rollout`` lists do
not grow token by token. Otherwise a step reads one flag per row when a row may end by EOS, and
nothing when every row has a forced length. Reads are counted as calls of the tensor methods that
copy to the host (``tolist``, ``item``, ``cpu``, ``numpy``, ``bool``/``int``/``float``) outside
the model's own forward; on a CPU they cost nothing, so they are counted, not timed. The old loop
(one ``tolist`` and an append per row at every step) fails both tests.
"""

from __future__ import annotations

import pytest
import torch

from oppo.api.records import ChunkReady, Rollout, SequenceFinished
from oppo.rollout.eager.backend import EagerBackend
from oppo.rollout.static import StaticBackend

EOS, PAD = 1, 0
PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [12, 13, 14, 15, 16, 17, 18, 19], [20], [21, 22, 23], [30, 31, 32, 33]]
READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__")


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(eos_bias: float):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256,
                                         eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None,
                                         initializer_range=0.2)).eval()
    with torch.no_grad():
        w = model.get_output_embeddings().weight
        w[EOS] += eos_bias * w.std()
    return model


def _engine(kind: str, model, greedy: bool = False, every: int = 1):
    """``every``: the engine's ``stop_check_every`` (1, the CPU's default; CUDA's is larger)."""
    if kind == "eager":
        eng = EagerBackend(model, EOS, PAD, 16, seed=3, greedy=greedy)
    else:
        eng = StaticBackend(model, EOS, PAD, 16, seed=3, max_rows=8, max_len=40, greedy=greedy)
    eng.stop_check_every = every
    return eng


def _rows(targets):
    return [Rollout(i, i, "", list(p), 0, target_length=t) for i, (p, t) in enumerate(zip(PROMPTS, targets))]


def _count_reads(monkeypatch, engine=None, parts: list | None = None) -> list[int]:
    """Count the host reads of tensors outside the models' forwards (their own are the model step's):
    ``engine``'s backbone and head, or the ``(owner, attribute)`` callables of ``parts``."""
    count, inside = [0], [False]
    for name in READS:
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, **k):
            if not inside[0]:
                count[0] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for owner, part in parts if parts is not None else [(engine, "backbone"), (engine, "head")]:
        module = getattr(owner, part)

        def model(*a, _module=module, **k):
            inside[0] = True
            try:
                return _module(*a, **k)
            finally:
                inside[0] = False

        setattr(owner, part, model)
    return count


def _drain(engine, rows, chunk, count):
    """advance(chunk) until every row ended; per call: (reads, events, the engine's records' list
    lengths before, after); the engine's finished records of ``rows`` (in their order; it never
    changes the rows given) and the chunks."""
    engine.admit(rows)
    mine = {r.uid: r for r in engine.rows}  # the engine's own records (read without a pull)
    assert set(mine) == {r.uid for r in rows} and all(mine[r.uid] is not r for r in rows)
    calls, chunks, done = [], {r.uid: [] for r in rows}, {}
    while engine.active:
        before, n = [len(r.response_ids) for r in mine.values()], count[0]
        events = engine.advance(chunk)
        calls.append((count[0] - n, events, before, [len(r.response_ids) for r in mine.values()]))
        for e in events:
            if isinstance(e, ChunkReady):
                chunks[e.chunk.uid].append(e.chunk.tokens)
            if isinstance(e, SequenceFinished):
                assert e.rollout is mine[e.rollout.uid] and e.rollout.uid not in done
                done[e.rollout.uid] = e.rollout
    assert all(not r.response_ids for r in rows)
    return calls, [done[r.uid] for r in rows], chunks


def _per_token_reference(kind, model, targets, chunk, greedy=False):
    """The same rows through ``step`` (records pulled every step) and ``take_chunks``: the old
    loop's outputs."""
    eng, rows = _engine(kind, model, greedy), _rows(targets)
    eng.admit(rows)
    chunks, done = {r.uid: [] for r in rows}, {}
    while eng.active:
        done.update((r.uid, r) for r in eng.step())
        for c in eng.take_chunks(chunk):
            chunks[c.uid].append(c.tokens)
    return [done[r.uid] for r in rows], chunks


@pytest.mark.parametrize("kind", ["eager", "static"])
def test_forced_lengths_read_nothing_between_chunks_and_finishes(kind, monkeypatch):
    """Every row has a forced length, so the host knows which step ends which row: a step with
    no event reads nothing and touches no Rollout; a step where rows end or chunks are due reads
    the records once (plus, eager, the KV cache's compaction on retire: ``kv.KVRows.select``).
    Tokens, log-probs, versions and chunks are those of the per-token loop."""
    model = _model(eos_bias=0.0)
    targets = [5, 11, 16, 16, 13, 16]
    ref_rows, ref_chunks = _per_token_reference(kind, model, targets, 8)
    eng = _engine(kind, model)
    count = _count_reads(monkeypatch, eng)
    calls, rows, chunks = _drain(eng, _rows(targets), 8, count)
    monkeypatch.undo()
    quiet = [c for c in calls if not c[1]]
    assert len(quiet) > len(calls) // 2, "fixture: most steps have no event"
    assert all(reads == 0 and before == after for reads, _, before, after in quiet)
    for reads, events, _, _ in calls:
        ends = any(isinstance(e, SequenceFinished) for e in events)
        assert reads <= (3 if ends and kind == "eager" else 1)  # (eager: KVRows.select's two on retire)
    assert [len(r.response_ids) for r in rows] == targets
    for r, want in zip(rows, ref_rows):
        assert (r.response_ids, r.logprobs, r.policy_logprobs, r.versions, r.ended_with_eos) == \
            (want.response_ids, want.logprobs, want.policy_logprobs, want.versions, want.ended_with_eos)
    assert chunks == ref_chunks


@pytest.mark.parametrize("kind", ["eager", "static"])
def test_eos_reads_one_flag_per_step_and_records_once(kind, monkeypatch):
    """Rows may end by EOS at any step: one read per step (a flag per row) and the records once
    more at a step where a row ends or a chunk is due; the Rollouts grow only then. The outputs
    are the per-token loop's, chunk for chunk."""
    model = _model(eos_bias=1.5)
    targets = [None] * len(PROMPTS)
    ref_rows, ref_chunks = _per_token_reference(kind, model, targets, 5)
    eng = _engine(kind, model)
    count = _count_reads(monkeypatch, eng)
    calls, rows, chunks = _drain(eng, _rows(targets), 5, count)
    monkeypatch.undo()
    ends = [len(r.response_ids) for r in rows]
    assert len(set(ends)) > 2 and any(r.ended_with_eos for r in rows), "fixture: rows end at different steps"
    quiet = [c for c in calls if not c[1]]
    assert quiet and all(reads == 1 and before == after for reads, _, before, after in quiet)
    assert all(reads <= 2 for reads, events, _, _ in calls if not any(isinstance(e, SequenceFinished) for e in events))
    for r, want in zip(rows, ref_rows):
        assert (r.response_ids, r.logprobs, r.policy_logprobs, r.versions) == \
            (want.response_ids, want.logprobs, want.policy_logprobs, want.versions)
    assert chunks == ref_chunks


@pytest.mark.parametrize("kind", ["eager", "static"])
def test_stop_flags_read_every_k_steps_change_no_output(kind, monkeypatch):
    """CUDA's deferred stop check (``stop_check_every``, issue 50), driven on the CPU with K = 4:
    a step reads the stop flags only every K steps (and at a row's known end: the token budget),
    never in between; a row that ended keeps decoding, unrecorded, until then. Greedy, so the
    rows kept in the batch change no draw: tokens, versions, EOS flags and every chunk equal the
    per-token loop's (the final chunk comes at the retirement, with the same tokens); both log-probs
    too, to float tolerance (the batch holds other rows at some steps, so the forward sums in
    another order: up to 1e-6 here)."""
    K, model = 4, _model(eos_bias=1.0)
    targets = [None] * len(PROMPTS)
    ref_rows, ref_chunks = _per_token_reference(kind, model, targets, 5, greedy=True)
    assert len({len(r.response_ids) for r in ref_rows}) > 3 and any(r.ended_with_eos for r in ref_rows), \
        "fixture: rows end at different steps, between two checks"
    eng = _engine(kind, model, greedy=True, every=K)
    count = _count_reads(monkeypatch, eng)
    calls, rows, chunks = _drain(eng, _rows(targets), 5, count)
    for r, want in zip(rows, ref_rows):
        assert (r.response_ids, r.versions, r.ended_with_eos) == (want.response_ids, want.versions, want.ended_with_eos)
        for got, exp in ((r.logprobs, want.logprobs), (r.policy_logprobs, want.policy_logprobs)):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(exp), rtol=0, atol=1e-5)
    assert chunks == ref_chunks
    # no chunks: the only reads are the checks (and, at a check where rows end, their records once,
    # plus eager's KV compaction: KVRows.select's two)
    eng = _engine(kind, model, greedy=True, every=K)
    count = _count_reads(monkeypatch, eng)
    calls, rows, _ = _drain(eng, _rows(targets), None, count)
    monkeypatch.undo()
    for step, (reads, events, _, _) in enumerate(calls, 1):
        if step % K and step < 16:  # (16: the token budget, every row's known end)
            assert reads == 0 and not events, step
        else:
            assert reads <= (1 if not events else 4 if kind == "eager" else 2), step
    assert [r.response_ids for r in rows] == [r.response_ids for r in ref_rows]


@pytest.mark.parametrize("kind", ["eager", "static"])
def test_stop_flags_read_every_k_steps_sample_validly(kind):
    """Sampled, K = 4: the rows kept a few steps past their end take part in each step's draw, so
    the tokens are other samples than a per-step check's; they are valid ones: each row stops at
    its first EOS, its behaviour log-probs are a full forward's, its chunks add up to it. A row
    that ended unread is not in flight (``in_flight`` retires it; the next advance reports it);
    the flags are read every K steps rather than every step."""
    K, model = 4, _model(eos_bias=1.5)
    ref = _engine(kind, model)
    ref.admit(_rows([None] * len(PROMPTS)))
    while ref.active:
        ref.advance(3)
    eng = _engine(kind, model, every=K)
    eng.admit(_rows([None] * len(PROMPTS)))
    done, chunks, settled = [], {i: [] for i in range(len(PROMPTS))}, set()
    while eng.active:
        flags = eng._stopped[eng._slots].tolist() if eng.rows else []
        if not settled and any(flags):  # rows ended unread: in_flight hands out the others only
            settled = {r.uid for r, f in zip(eng.rows, flags) if f}
            flying = eng.in_flight()
            assert settled.isdisjoint(r.uid for r in flying) and all(EOS not in r.response_ids for r in flying)
            assert eng.active == len(flying) + len(settled)
        for e in eng.advance(3):
            if isinstance(e, ChunkReady):
                chunks[e.chunk.uid].extend(e.chunk.tokens)
            if isinstance(e, SequenceFinished):
                done.append(e.rollout)
    assert settled, "fixture: a row ends between two checks"
    assert eng.decode_steps == ref.decode_steps and eng.host_reads < ref.host_reads
    assert sorted(r.uid for r in done) == list(range(len(PROMPTS))) and any(r.ended_with_eos for r in done)
    for r in done:
        assert EOS not in r.response_ids[:-1] and r.ended_with_eos == (r.response_ids[-1] == EOS)
        assert len(r.response_ids) == len(r.logprobs) == len(r.policy_logprobs) == len(r.versions) <= 16
        assert chunks[r.uid] == r.response_ids
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(r.prompt_ids) - 1:-1]
        lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(r.response_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs), lp, atol=1e-4, rtol=1e-4)


def test_deferred_stop_check_still_names_a_diverged_row():
    """A non-finite log-prob between two checks stops the run at the next one, with the guard's message."""
    from oppo.guard import NonFiniteError

    model = _model(eos_bias=0.0)
    with torch.no_grad():
        model.get_output_embeddings().weight[7] = float("inf")
    eng = _engine("eager", model, every=4)
    eng.set_version(2)
    eng.admit(_rows([None, None]))
    with pytest.raises(NonFiniteError, match=r"non-finite logits in sampling with the policy of version 2.*rows 0, 1"):
        for _ in range(4):
            eng.advance(None)


@pytest.mark.parametrize("buckets", ["on", "off"])
def test_scorer_outputs_stay_on_the_device_until_the_barrier(tiny_models, monkeypatch, buckets):
    """The scorer loop's outputs (reference log-probs, critic values, the reward score) stay on the
    device through every chunk flush and are read once per role at the barrier (before: a read of
    the per-token outputs at every flush, and of the scores at every flush that finished a
    sequence). Same numbers as the one-shot scorer. The dynamic cache's own bookkeeping
    (``ppo.shape_buckets=off``: ``kv.KVRows.repack``'s fill check each flush, ``select``'s compaction
    when a row leaves) still reads and is not counted; the slots (buckets on: CUDA's default) read
    nothing."""
    from oppo.models import load_causal_lm, load_critic, load_reward_model, load_tokenizer
    from oppo.scoring.streaming import StreamingScorer, score_full
    from oppo.scoring.worker import AdmitMsg, BarrierMsg, ChunksMsg, ScorerLoop
    from oppo.trace import Tracer
    from oppo.api.records import Chunk

    tok, dev = load_tokenizer(str(tiny_models["policy"])), torch.device("cpu")
    pad = tok.pad_token_id
    models = {"reference": load_causal_lm(str(tiny_models["policy"]), "reference", dev, torch.float32).eval(),
              "reward": load_reward_model(str(tiny_models["reward"]), dev, torch.float32, pad),
              "critic": load_critic(str(tiny_models["reward"]), dev, torch.float32, pad).eval()}
    from oppo.forward import set_packing

    for m in models.values():
        set_packing(m, "auto", buckets)
    scorers = {kind: StreamingScorer(kind, m, pad) for kind, m in models.items()}
    loop = ScorerLoop(scorers, tracer=Tracer(enabled=False))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    responses = [[14, 15, 16, 17, 18, 19, 20], [21, 22, 23, 24, 25], [26, 27, 28, 29, 3, 4, 5, 6, 7]]
    parts = [(s.kv, part[3:]) if part.startswith("kv.") else (s, part) for s in scorers.values()
             for part in ("backbone", "head", "kv.select", "kv.repack") if not (part.startswith("kv.") and buckets == "on")]
    count = _count_reads(monkeypatch, parts=parts)  # (the models' own reads are the forward's, not the loop's)
    replies = []
    loop.handle([AdmitMsg((0, 1, 2), tuple(map(tuple, prompts)), 0)], replies.append)
    flush_reads = []
    for at in range(0, 9, 3):  # chunks of 3; rows 1 and 0 finish at the second and third flush
        chunks = tuple(Chunk(u, tuple(r[at: at + 3]), at + 3 >= len(r)) for u, r in enumerate(responses)
                       if at < len(r))
        n = count[0]
        loop.handle([ChunksMsg(chunks, 0)], replies.append)
        flush_reads.append(count[0] - n)
    n = count[0]
    loop.handle([BarrierMsg(1)], replies.append)
    barrier_reads = count[0] - n
    monkeypatch.undo()
    assert flush_reads == [0, 0, 0] and barrier_reads == len(scorers), (flush_reads, barrier_reads)
    got = replies[0].results
    for kind, m in models.items():
        want = score_full(kind, m, prompts, responses, pad)
        for u in range(3):
            if kind == "reward":
                assert got[kind][u].score == pytest.approx(want[u].score, abs=1e-5)
            else:
                have = got[kind][u].logprobs if kind == "reference" else got[kind][u].values
                exp = want[u].logprobs if kind == "reference" else want[u].values
                torch.testing.assert_close(torch.tensor(have), torch.tensor(exp), atol=1e-5, rtol=1e-5)
