"""The static-shape rollout backend (oppo.rollout.static) against the eager backend and Hugging Face:
greedy token-for-token equality under continuous batching (staggered admission, rows ending at
different times, slots reused), behaviour log-probs against a full forward, sliding windows that
bite, and the engine bookkeeping the trainer relies on. CUDA-graph capture is opt-in (gpu)."""

import re
import pytest
import torch

from oppo.rollout.static import StaticBackend, UnsupportedForStaticDecode, bucket_size
from oppo.rollout.eager.backend import Rollout, EagerBackend
from conftest import returned
from validated import load_valid

EOS, PAD = 1, 0


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models decode fastest on one thread; two OpenMP threads on a shared 2-core machine
    spin against each other (measured: 0.2 s vs 22 s for the same test under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [12, 13, 14, 15, 16, 17, 18, 19], [20], [21, 22, 23], [30, 31, 32, 33],
           [40, 41], [7, 7, 7, 7, 7, 7]]


def _model(kind: str = "llama", window: int | None = None, seed: int = 0, eos_bias: float = 0.0):
    """A small random decoder whose greedy outputs vary (init std 0.2) and, with ``eos_bias``,
    end at different lengths."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, \
        Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None,
                  initializer_range=0.2)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **common))
    elif kind == "mistral":  # every layer windowed: one mask
        model = MistralForCausalLM(MistralConfig(num_hidden_layers=2, sliding_window=window, **common))
    else:  # qwen2: full attention in layer 0, windowed after: a mask per layer type
        model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=3, use_sliding_window=window is not None,
                                             sliding_window=window, max_window_layers=1, **common))
    model.eval()
    if eos_bias:
        with torch.no_grad():
            w = model.get_output_embeddings().weight
            w[EOS] += eos_bias * w.std()
    return model


def _rows(prompts=PROMPTS):
    return [Rollout(i, i, "", list(p), 0) for i, p in enumerate(prompts)]


def _generate(model, prompts, n):
    """Hugging Face greedy decoding, one prompt at a time (no padding at all), cut at EOS."""
    out = []
    for p in prompts:
        g = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           do_sample=False, max_new_tokens=n, eos_token_id=EOS, pad_token_id=PAD)
        g = g[0, len(p):].tolist()
        out.append(g[: g.index(EOS) + 1] if EOS in g else g)
    return out


def _continuous(eng, rows, first=2):
    """Admit ``first`` rows, then refill every free slot from the queue after each step, as the
    overlapped trainer does; return {slot: [uids it hosted]} and the engine's finished records of
    ``rows`` (in their order)."""
    queue = list(rows)
    hosted: dict[int, list[int]] = {}
    done = []

    def admit(k):
        new = [queue.pop(0) for _ in range(min(k, len(queue)))]
        eng.admit(new)
        for r in new:
            i = next(i for i, x in enumerate(eng.rows) if x.uid == r.uid)
            assert eng.rows[i] is not r  # the engine decodes into a record of its own
            hosted.setdefault(eng.slot_of[i], []).append(r.uid)

    admit(first)
    while eng.active or queue:
        done.extend(eng.step())
        admit(len(eng._free))
    return hosted, returned(rows, done)


def test_greedy_equals_eager_engine_and_generate_with_continuous_batching():
    model = _model(eos_bias=2.0)
    n = 20
    refs = _generate(model, PROMPTS, n)
    assert len({len(r) for r in refs}) > 2 and any(r[-1] == EOS for r in refs), "fixture: varied lengths"
    eng = StaticBackend(model, EOS, PAD, n, greedy=True, max_rows=3, max_len=64)
    hosted, rows = _continuous(eng, _rows())
    assert max(len(u) for u in hosted.values()) > 1, "a retired row's slot was reused"
    assert len(hosted) <= 3
    for r, ref in zip(rows, refs):
        assert r.response_ids == ref
        assert r.ended_with_eos == (ref[-1] == EOS)
        assert r.finished and r.versions == [0] * len(ref)
    eager = EagerBackend(model, EOS, PAD, n, greedy=True)
    erows = _rows()
    eager.admit(erows)
    erows = returned(erows, eager.generate_all())
    assert [r.response_ids for r in erows] == refs
    assert eng.captures == 0 and eng.active == 0 and sorted(eng._free) == [0, 1, 2]


def test_next_logits_equal_the_eager_engine_step_by_step():
    """Same admissions into both engines; every step's next-token logits agree (fp32)."""
    model = _model(eos_bias=1.5, seed=1)
    a = EagerBackend(model, EOS, PAD, 16, greedy=True)
    b = StaticBackend(model, EOS, PAD, 16, greedy=True, max_rows=8, max_len=40)
    ra, rb = _rows(), _rows()
    for eng, rows in ((a, ra), (b, rb)):
        eng.admit(rows[:3])
    da, db = [], []
    for t in range(40):
        torch.testing.assert_close(b.next_logits, a.next_logits, atol=1e-5, rtol=1e-5)
        assert b.uids() == a.uids()
        if t == 2:
            a.admit(ra[3:6])
            b.admit(rb[3:6])
        if not a.active:
            break
        da += a.step()
        db += b.step()
    assert not b.active
    ra, rb = returned(ra[:6], da), returned(rb[:6], db)
    assert [r.response_ids for r in ra] == [r.response_ids for r in rb]


@pytest.mark.parametrize("top_k", [0, 5])
def test_sampled_logprobs_equal_a_full_forward(top_k):
    """Behaviour log-probs are those of the (truncated, renormalised) distribution sampled, as a
    full forward of the finished sequence computes them; the same seed samples what the eager
    engine samples."""
    model = _model(seed=2)
    temp = 0.7
    eng = StaticBackend(model, EOS, PAD, 12, temperature=temp, top_k=top_k, seed=3, max_rows=4, max_len=40)
    _, rows = _continuous(eng, _rows(), first=3)
    eager = EagerBackend(model, EOS, PAD, 12, temperature=temp, top_k=top_k, seed=3)
    erows = _eager_continuous(eager, _rows(), first=3, slots=4)
    assert [r.response_ids for r in rows] == [r.response_ids for r in erows]
    for r in rows:
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(r.prompt_ids) - 1:-1].float() / temp  # [T, V]
        if top_k:
            kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(r.response_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs), lp, atol=1e-4, rtol=1e-4)


def _eager_continuous(eng, rows, first, slots):
    """As ``_continuous`` for the eager backend (``slots`` rows at most); its finished records."""
    queue = list(rows)
    done = []
    eng.admit([queue.pop(0) for _ in range(first)])
    while eng.active or queue:
        done.extend(eng.step())
        free = slots - eng.active
        eng.admit([queue.pop(0) for _ in range(min(free, len(queue)))])
    return returned(rows, done)


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_sliding_window_equals_generate(kind):
    """A window of 4 columns bites (sequences reach 25 tokens): each row's tokens are contiguous
    in its slot, so the window counted in cache columns is the window in positions. Mistral
    windows every layer (one mask); Qwen2 mixes full and windowed layers (a mask per type)."""
    model = _model(kind, window=4, seed=4)
    prompts = PROMPTS[:5]
    refs = _generate(model, prompts, 18)
    eng = StaticBackend(model, EOS, PAD, 18, greedy=True, max_rows=2, max_len=32)
    assert eng.window == 4 and eng._masks_as_dict == (kind == "qwen2")
    _, rows = _continuous(eng, _rows(prompts), first=1)
    assert [r.response_ids for r in rows] == refs
    # the window changes the outputs: the same weights without it decode differently
    unwindowed = _model(kind, window=None, seed=4)
    assert _generate(unwindowed, prompts, 18) != refs


def test_forced_lengths_stop_ids_versions_recompute_and_abort():
    model = _model(seed=5)
    eng = StaticBackend(model, (EOS, 9), PAD, 30, seed=0, max_rows=4, max_len=48)
    assert eng.eos_id == EOS and eng.eos_ids == frozenset({EOS, 9})
    rows = _rows(PROMPTS[:3])
    for r, t in zip(rows, (3, 7, 12)):
        r.target_length = t
    eng.admit(rows)
    done = []
    for _ in range(3):
        done += eng.step()
    eng.set_version(1)  # new weights, KV kept: tokens over the old prefix stay version 0
    for _ in range(2):
        done += eng.step()
    assert [r.uid for r in done] == [0]
    assert done[0].finished and len(done[0].response_ids) == 3 and done[0].ended_with_eos
    assert [r.uid for r in eng.in_flight()] == [1, 2] and eng.in_flight()[0].versions == [0] * 5
    eng.recompute()  # rebuilt under version 1 in the same slots
    while eng.active:
        done += eng.step()
    rows = returned(rows, done)
    assert [len(r.response_ids) for r in rows] == [3, 7, 12]
    assert rows[1].versions == [0] * 5 + [1, 1]
    assert rows[2].versions == [0] * 5 + [1] * 7
    assert all(r.response_ids[-1] == EOS and EOS not in r.response_ids[:-1] for r in rows)
    chunks = eng.take_chunks(4)
    assert {c.uid for c in chunks if c.final} == {0, 1, 2}
    # abort frees the slots; rows admitted after decode exactly as alone
    more = _rows(PROMPTS[3:7])
    eng.admit(more[:4])
    done = eng.step()
    eng.abort({more[1].uid, more[2].uid})
    assert eng.uids() == [more[0].uid, more[3].uid] and len(eng._free) == 2
    extra = Rollout(99, 99, "", list(PROMPTS[7]), 1)
    eng.admit([extra])
    done += eng.generate_all()
    assert not extra.response_ids and not extra.finished  # the engine's own record decoded
    # a stop id other than the tokenizer's EOS ends the row as an EOS
    for r in returned(more[:1] + more[3:] + [extra], done):
        assert r.finished and (r.ended_with_eos == (r.response_ids[-1] in (EOS, 9)))


def test_peak_cache_bytes_is_the_reservation_and_the_budget_is_checked():
    from oppo.rollout.eager.backend import KVBudgetError

    model = _model()
    eng = StaticBackend(model, EOS, PAD, 8, greedy=True, max_rows=4, max_len=32)
    eng.admit(_rows(PROMPTS[:1]))
    # 2 layers x (K + V) x 4 slots x 2 kv heads x 32 columns x head dim 8 x 4 bytes
    assert eng.peak_cache_bytes == 2 * 2 * 4 * 2 * 32 * 8 * 4
    eng.peak_cache_bytes = 0  # the trainer's per-step reset: the reservation stays
    assert eng.peak_cache_bytes == 2 * 2 * 4 * 2 * 32 * 8 * 4
    small = StaticBackend(model, EOS, PAD, 8, greedy=True, max_rows=4, max_len=32)
    small.kv_budget_mb = 0.01
    with pytest.raises(KVBudgetError, match="kv_budget_mb"):
        small.admit(_rows(PROMPTS[:1]))


def test_refusals_name_the_fix():
    model = _model()
    eng = StaticBackend(model, EOS, PAD, 8, greedy=True, max_rows=2, max_len=16)
    with pytest.raises(ValueError, match="max_rows"):
        eng.admit(_rows(PROMPTS[:3]))
    with pytest.raises(ValueError, match="max_len"):
        eng.admit([Rollout(0, 0, "", list(range(2, 12)), 0)])  # 10 + 8 - 1 > 16
    assert sorted(eng._free) == [0, 1], "a refused admission frees its slots"
    with pytest.raises(ValueError, match="cuda_graph"):
        StaticBackend(model, EOS, PAD, 8, capture="cuda_graph")  # the model is on the CPU
    with pytest.raises(ValueError, match="capture"):
        StaticBackend(model, EOS, PAD, 8, capture="graphs")
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(UnsupportedForStaticDecode, match="sdpa"):
            StaticBackend(model, EOS, PAD, 8)
    finally:
        model.config._attn_implementation = "sdpa"


def test_buckets_cover_every_size_with_bounded_waste():
    for smallest in (1, 16):
        sizes = [bucket_size(n, 10_000, smallest) for n in range(1, 5000)]
        assert all(b >= n for n, b in zip(range(1, 5000), sizes))
        assert all(b <= max(smallest, 1.5 * n) for n, b in zip(range(1, 5000), sizes))
        assert len(set(sizes)) <= 2 * 13 + 1  # two per doubling
    assert [bucket_size(n, 64, 1) for n in (1, 2, 3, 5, 7, 13, 33, 100)] == [1, 2, 3, 6, 8, 16, 48, 64]
    assert [bucket_size(n, 1000) for n in (1, 17, 25, 33, 49, 65, 97)] == [16, 24, 32, 48, 64, 96, 128]


def test_trainer_with_the_static_engine_trains_the_same_batches(tiny_models, tiny_prompts, tmp_path):
    """The trainer drives the static backend exactly as the eager one: in oppo mode (streamed
    chunks, carried rows) the same seed samples the same responses and the same rewards."""
    from oppo.config import load_config
    from oppo.trainer import Trainer

    def run(static: bool):
        cfg = load_config(None, [
            f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
            f"data.prompts={tiny_prompts}", "ppo.batch_size=4", "ppo.minibatch_size=4", "ppo.micro_batch_size=4",
            "generation.max_new_tokens=10", "overlap.mode=oppo", "overlap.delta=2", "overlap.max_lag=1",
            "placement.local.scorer_process=false", f"run.out_dir={tmp_path / str(static)}", "log.progress=false"])
        t = Trainer.from_config(cfg, progress=False)
        t.length_sampler = lambda i, member: 2 + (i * 7) % 9  # rows end at different times: some are carried
        if static:
            e = t.roles.rollout
            t.roles.rollout = StaticBackend(t.roles.rollout_policy, t.roles.stop_ids, t.roles.pad_id, t.max_new_tokens,
                                           cfg.generation.temperature, cfg.generation.top_k, cfg.generation.top_p,
                                           seed=cfg.run.seed, max_rows=cfg.ppo.batch_size + 2,
                                           max_len=t.roles.prompt_set.width + t.max_new_tokens)
            del e
        try:
            out = []
            for _ in range(3):
                m = t.run_step()
                out.append((m["reward/mean"], m["response_length/mean"], m["overlap/carried"]))
            return out, [r.response_ids for r in t.last_result.exp.rollouts]
        finally:
            t.close()

    (eager, eager_ids), (static, static_ids) = run(False), run(True)
    assert any(carried for _, _, carried in eager), "fixture: rows carried across steps"
    assert static_ids == eager_ids
    for e, s in zip(eager, static):
        assert s[1:] == e[1:]
        assert s[0] == pytest.approx(e[0], abs=1e-4)


def test_captured_step_reads_only_static_buffers():
    """The CUDA-graph path on a CPU: each (Rb, Lb) step is traced once with ``make_fx`` (which,
    like a graph capture, bakes in every Python value and keeps only tensor reads and writes)
    and replayed for later steps while rows are admitted and retired around it. Equal outputs
    mean admission and retirement reach the step only through the static buffers (fed tokens,
    slot lengths, KV slots), never through a value a capture would freeze."""
    from torch.fx.experimental.proxy_tensor import make_fx

    model = _model(eos_bias=2.0)
    refs = _generate(model, PROMPTS, 20)
    replays = []

    class Traced:
        def __init__(self, forward):
            self.gm = make_fx(forward)()  # runs the step once, as a warm-up does
            self.out = torch.empty(0)

        def replay(self):
            replays.append(1)
            r = self.gm()
            self.out.resize_(r.shape).copy_(r)

    def capture(forward):  # in place of the CUDA capture (oppo.kernels.graphs); the bucketed prefill runs as on CUDA
        g = Traced(forward)
        return g, g.out

    eng = StaticBackend(model, EOS, PAD, 20, greedy=True, max_rows=3, max_len=64, capture="cuda_graph",
                              graph_capture=capture)
    hosted, rows = _continuous(eng, _rows())
    assert max(len(u) for u in hosted.values()) > 1
    assert [r.response_ids for r in rows] == refs
    assert 1 <= eng.captures <= 6 and len(replays) > 3 * eng.captures


@pytest.mark.slow
def test_compiled_decode_equals_eager_on_cpu():
    """capture='compile' (torch.compile of the same step; one variant per bucket)."""
    model = _model(eos_bias=2.0)
    refs = _generate(model, PROMPTS[:4], 12)
    eng = StaticBackend(model, EOS, PAD, 12, greedy=True, max_rows=2, max_len=24, capture="compile")
    _, rows = _continuous(eng, _rows(PROMPTS[:4]), first=2)
    assert [r.response_ids for r in rows] == refs
    assert eng.captures >= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_equals_eager_on_gpu(dtype):
    """Captured decode (one CUDA graph per bucket, slots admitted and retired between replays)
    gives the uncaptured engine's tokens, and in fp32 Hugging Face's."""
    model = _model(eos_bias=2.0).to("cuda", dtype)
    outs = {}
    for capture in ("none", "cuda_graph"):
        eng = StaticBackend(model, EOS, PAD, 20, greedy=True, max_rows=3, max_len=64, capture=capture)
        _, rows = _continuous(eng, _rows())
        outs[capture] = [r.response_ids for r in rows]
        if capture == "cuda_graph":
            assert 1 <= eng.captures <= 8
    assert outs["cuda_graph"] == outs["none"]
    if dtype == torch.float32:
        assert outs["none"] == _generate(model.cpu(), PROMPTS, 20)


def test_generation_backend_static_is_wired(tiny_models, tiny_prompts, tmp_path):
    """generation.backend=static builds the static backend and trains the eager backend's run."""
    from oppo.config import load_config
    from oppo.rollout.static import StaticBackend
    from oppo.trainer import Trainer

    out = {}
    for engine in ("eager", "static"):
        cfg = load_config(None, [
            f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
            f"data.prompts={tiny_prompts}", "placement.threads=1", "ppo.batch_size=4", "ppo.minibatch_size=2",
            "ppo.micro_batch_size=2", "generation.max_new_tokens=8", "overlap.mode=sequential",
            f"generation.backend={engine}", f"run.out_dir={tmp_path / engine}", "log.progress=false"])
        t = Trainer.from_config(cfg, progress=False)
        try:
            assert isinstance(t.roles.rollout, StaticBackend) == (engine == "static")
            out[engine] = [(t.run_step()["loss/policy"], t.last_result.exp.ids.clone()) for _ in range(2)]
        finally:
            t.close()
    for (la, ia), (lb, ib) in zip(out["eager"], out["static"]):
        assert torch.equal(ia, ib) and abs(la - lb) < 1e-4


def test_auto_backend_is_static_with_graphs_on_cuda_for_supported_policies_else_eager():
    """generation.backend=auto (the default): static with CUDA graphs on a CUDA device when the
    policy suits the static backend, eager otherwise (on CPU without asking the model, so CPU runs
    and the golden metrics are unchanged); explicit values are kept. ``torch.device("cuda")``
    stands for the device: nothing runs there."""
    from oppo.config import Config, ConfigError, help_text, load_config
    from oppo.rollout.registry import backend_settings, resolve_backend

    def never():
        raise AssertionError("auto asked the model where it did not need to")

    cuda = torch.device("cuda")
    assert resolve_backend("auto", torch.device("cpu"), never)[0] == "eager"
    assert resolve_backend("auto", cuda, lambda: None)[0] == "static"
    kind, why = resolve_backend("auto", torch.device("cuda:1"), lambda: "attention 'flex' takes no 4-D mask")
    assert kind == "eager" and "flex" in why
    for asked in ("eager", "static", "vllm"):
        assert resolve_backend(asked, cuda, never)[0] == asked
    # the settings a trainer builds its engine with: the policy is checked (config + a 2-token probe)
    cfg, model = Config(), _model()
    assert cfg.generation.backend == "auto"

    def settings(stop_ids, pad_id, max_new_tokens, device, model):  # (as placements.rollout_settings reads cfg)
        return backend_settings(cfg.generation, cfg.rollout, stop_ids, pad_id, max_new_tokens, device,
                                seed=cfg.run.seed, max_rows=cfg.ppo.batch_size, prompt_width=8, model=model)

    s = settings((EOS,), PAD, 8, cuda, model=model)
    assert (s.kind, s.backend.capture) == ("static", "cuda_graph") and "CUDA graphs" in s.reason
    s = settings((EOS,), PAD, 8, torch.device("cpu"), model=model)
    assert s.kind == "eager" and s.backend is None
    model.config._attn_implementation = "flash_attention_2"
    try:
        s = settings((EOS,), PAD, 8, cuda, model=model)
        assert s.kind == "eager" and "sdpa" in s.reason
    finally:
        model.config._attn_implementation = "sdpa"
    from transformers import Lfm2Config, Lfm2ForCausalLM  # convolution + attention: no plain KV everywhere

    hybrid = Lfm2ForCausalLM(Lfm2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        layer_types=["conv", "full_attention"]))
    s = settings((EOS,), PAD, 8, cuda, model=hybrid)
    assert s.kind == "eager" and "conv" in s.reason
    # Ray rollout replicas run eager under auto (settings for cpu); static is refused there
    ray = ["placement.name=ray", "placement.ray.rollout_replicas=2"]
    load_config(None, ray)
    with pytest.raises(ConfigError, match="generation.backend=auto"):
        load_valid(None, [*ray, "generation.backend=static"])
    shown = help_text().split("generation.backend = ")[1].split("generation.kv_budget_mb")[0]
    assert re.search(r"\[auto\|eager\|static\|vllm[|\]]", shown) and "fallback" in shown and "CUDA graphs" in shown


def test_capture_is_thread_local_on_one_side_stream_after_warmups(monkeypatch):
    """What makes a capture survive other threads' CUDA work (module docstring): each bucket is
    warmed up and then captured in thread-local mode on the engine's one side stream, ordered
    after the decoding thread's stream, into one pool. The CUDA calls are recorded by fakes; the
    decode step is the real one, on the CPU."""
    import inspect

    real = inspect.signature(torch.cuda.graph).parameters
    assert {"pool", "stream", "capture_error_mode"} <= set(real), "the fakes take what torch.cuda.graph takes"
    eng = StaticBackend(_model(), EOS, PAD, 8, greedy=True, max_rows=2, max_len=32)
    eng.admit(_rows(PROMPTS[:2]))
    log, on = [], []

    class Stream:
        def __init__(self, device=None):
            log.append(("new stream", self))

        def wait_stream(self, other):
            log.append(("wait", self, other))

    class StreamCtx:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            on.append(self.s)

        def __exit__(self, *exc):
            on.pop()

    class Graph:
        def __init__(self, g, pool=None, stream=None, capture_error_mode="global"):
            log.append(("capture", stream, pool, capture_error_mode))
            self.ctx = StreamCtx(stream)

        def __enter__(self):
            self.ctx.__enter__()

        def __exit__(self, *exc):
            self.ctx.__exit__()
            log.append("captured")

    decoding = Stream()  # the decoding thread's stream
    on.append(decoding)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", StreamCtx)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: on[-1])
    monkeypatch.setattr(torch.cuda, "graph", Graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    step = eng._captured_step
    monkeypatch.setattr(eng, "_captured_step", lambda rb, lb: (log.append(("step", on[-1])), step(rb, lb))[1])
    log.clear()
    # the engine's captures (oppo.kernels.graphs, the recipe the scorer slots share), as a first decode step makes them
    outs = [eng._graphs.get(key, lambda key=key: eng._captured_step(*key))[1] for key in ((2, 16), (2, 24))]
    assert log[0][0] == "new stream" and log[0][1] is not decoding
    side, pool = log[0][1], eng._graphs._pool
    name = {id(side): "side", id(decoding): "decoding", id(pool): "pool"}
    shown = [e if isinstance(e, str) else tuple(name.get(id(x), x) for x in e) for e in log[1:]]
    one = [("wait", "side", "decoding"), ("step", "side"), ("step", "side"), ("wait", "decoding", "side"),
           ("capture", "side", "pool", "thread_local"), ("step", "side"), "captured"]
    # one side stream and one pool for every bucket; warm-ups on the side stream after it waited for
    # the decoding stream, which waits for them before any replay; then the thread-local capture
    assert shown == one + one
    assert outs[0].shape == (2, 50) and torch.isfinite(outs[0]).all()
