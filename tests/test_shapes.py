"""Shapes from a small fixed set (issue 46): what a GPU would pay per new shape, checked on the CPU.

The ladders (``oppo.shapes``), the learner's and one-shot scorers' layouts on them
(``forward.lay_out_rows`` with buckets), the streamed chunks' slots (``scoring.slots``), and the packing
probe that decides whether packed sequences may share more than one row.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from oppo import shapes
from oppo.forward import RowLayout, LayoutRule, lay_out_rows, layout_rule


def test_ladders_by_hand():
    # 2 per octave: 1 2 3 4 | 6 8 | 12 16 | 24 32 ...; 4 per octave from 16: 16 20 24 28 32 40 ...
    assert [shapes.ladder(n) for n in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    assert [shapes.width(n) for n in (1, 16, 17, 21, 33, 100, 129)] == [16, 16, 20, 24, 40, 112, 160]
    assert shapes.ladder(0) == 0 and shapes.rows_ladder(10) == [1, 2, 3, 4, 6, 8]
    assert shapes.ladder(5, 1) == 8  # powers of two
    for n in range(1, 3000):  # never below n, at most half above (a quarter for widths, from 16)
        assert n <= shapes.rows(n) <= 1.5 * n
        assert n <= shapes.width(n) <= max(16, 1.25 * n)
    with pytest.raises(ValueError, match="power of two"):
        shapes.ladder(5, 3)
    assert shapes.resolve("auto", torch.device("cpu")) is False and shapes.resolve("auto", "cuda:0") is True
    assert shapes.resolve("on", "cpu") is True and shapes.resolve("off", "cuda") is False


def _placed(layout: RowLayout) -> None:
    """Every sequence inside one row, none overlapping."""
    taken = set()
    for s, n in zip(layout.start, layout.lengths):
        row, col = divmod(s, layout.width)
        assert row < layout.rows and col + n <= layout.width
        cells = set(range(s, s + n))
        assert not cells & taken
        taken |= cells


@pytest.mark.parametrize("cost", [1 / 384, 1 / 12288, 0.0])
def test_bucketed_layouts_come_from_few_shapes_with_little_padding(cost):
    """200 micro-batches of 16 long-tailed sequences: bucketed, every shape is a ladder value and
    the shapes are few (exact, nearly every micro-batch is a new one); the padded share stays near
    10% (8 per octave would halve it at twice the shapes)."""
    rng = random.Random(0)
    exact, bucketed, real, computed = set(), set(), 0, 0
    for _ in range(200):
        lengths = [max(2, min(300, int(40 * 2.718 ** rng.gauss(0, 0.75)))) + rng.randint(8, 48) for _ in range(16)]
        lay = lay_out_rows(lengths, True, cost, buckets=True)
        _placed(lay)
        assert lay.rows == shapes.rows(lay.rows) and lay.width == shapes.width(lay.width)
        bucketed.add((lay.rows, lay.width))
        exact.add((lambda e: (e.rows, e.width))(lay_out_rows(lengths, True, cost)))
        real, computed = real + sum(lengths), computed + lay.computed
    assert len(bucketed) <= 25 < 150 <= len(exact), (len(bucketed), len(exact))
    assert 1 - real / computed <= 0.11


def test_unpacked_buckets_add_rows_and_columns_of_padding():
    lay = lay_out_rows([5, 9, 7, 3, 30], False, buckets=True)
    assert (lay.rows, lay.width) == (6, 32) and lay.start == (0, 32, 64, 96, 128) and not lay.packed
    _placed(lay)


def test_one_row_plan_packs_everything_in_one_row():
    lay = LayoutRule(True, 0.0, buckets=True, one_row=True).layout([5, 9, 7])
    assert (lay.rows, lay.width, lay.start) == (1, 24, (0, 5, 14))


class _RowsMeet(torch.nn.Module):
    """A backbone whose attention keeps packed sequences apart in one row but mixes rows (as a
    variable-length kernel fed several rows does): its output adds every row's first token."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 4)
        self.config = type("Cfg", (), {"vocab_size": 32, "hidden_size": 4, "_attn_implementation": "flash"})()

    def forward(self, input_ids, position_ids=None, use_cache=False, **_):
        h = self.emb(input_ids)  # [R, L, H]: each token alone: sequences never meet within a row
        return type("Out", (), {"last_hidden_state": h + h[:, :1].sum(0, keepdim=True) - h[:, :1]})()  # rows meet


def test_packing_probe_runs_two_rows():
    plan = layout_rule(_RowsMeet(), "auto", "off")
    assert plan.packed and plan.one_row and plan.attention_cost == 0.0
    lay = plan.layout([3, 4, 5, 6])
    assert lay.rows == 1 and lay.packed


def test_streamed_slots_see_few_shapes(tiny_models):
    """A scorer streams 40 sequences of long-tailed lengths in chunks of 16 (rows admitted in three
    waves, finishing one by one): the chunk forwards' (rows, chunk, columns) come from the ladders,
    few of them, and the scores equal the one-shot ones."""
    from oppo.forward import set_packing
    from oppo.models import load_critic, load_tokenizer
    from oppo.scoring.slots import SlotKV
    from oppo.scoring.streaming import StreamingScorer, score_full

    tok = load_tokenizer(str(tiny_models["policy"]))
    critic = load_critic(str(tiny_models["reward"]), torch.device("cpu"), torch.float32, tok.pad_token_id).eval()
    set_packing(critic, "auto", "on")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 30) for _ in range(rng.randint(2, 20))] for _ in range(40)]
    responses = [[rng.randrange(3, 30) for _ in range(max(1, min(120, int(12 * 2.718 ** rng.gauss(0, 0.9)))))]
                 for _ in range(40)]
    s = StreamingScorer("critic", critic, tok.pad_token_id)
    assert isinstance(s.kv, SlotKV)
    fed = {}
    for wave in (range(0, 16), range(16, 30), range(30, 40)):
        s.admit(list(wave), [prompts[u] for u in wave])
        fed.update({u: 0 for u in wave})
        for _ in range(2):
            chunk = {u: (tuple(responses[u][fed[u]: fed[u] + 16]), fed[u] + 16 >= len(responses[u])) for u in s.uids}
            for u in chunk:
                fed[u] += 16
            s.feed(chunk)
    while s.uids:
        chunk = {u: (tuple(responses[u][fed[u]: fed[u] + 16]), fed[u] + 16 >= len(responses[u])) for u in s.uids}
        for u in chunk:
            fed[u] += 16
        s.feed(chunk)
    seen = s.kv.shapes_seen
    assert all(rb == shapes.rows(rb) and cb == shapes.ladder(cb, 1) and lb == shapes.ladder(lb, 2, 16)
               for rb, cb, lb in seen)
    assert len(seen) <= 16, seen
    got = s.take_done()
    want = score_full("critic", critic, prompts, responses, tok.pad_token_id)
    for u in range(40):
        torch.testing.assert_close(torch.tensor(got[u].values), torch.tensor(want[u].values), atol=1e-5, rtol=1e-5)
    set_packing(critic, "auto", "auto")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["reference", "critic"])
def test_streamed_slots_in_cuda_graphs_equal_one_shot(tiny_models, kind):
    """On CUDA the slots' chunk forwards replay CUDA graphs (one capture per shape): the scores are
    the one-shot forward's, and no shape is captured twice."""
    from oppo.forward import set_packing
    from oppo.models import load_causal_lm, load_critic, load_tokenizer
    from oppo.scoring.streaming import StreamingScorer, score_full

    tok = load_tokenizer(str(tiny_models["policy"]))
    dev = torch.device("cuda")
    model = (load_causal_lm(str(tiny_models["policy"]), "reference", dev, torch.float32) if kind == "reference"
             else load_critic(str(tiny_models["reward"]), dev, torch.float32, tok.pad_token_id)).eval()
    set_packing(model, "auto", "on")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 30) for _ in range(rng.randint(2, 12))] for _ in range(12)]
    responses = [[rng.randrange(3, 30) for _ in range(rng.randint(1, 60))] for _ in range(12)]
    s = StreamingScorer(kind, model, tok.pad_token_id)
    assert s.kv.graphs
    s.admit(list(range(12)), prompts)
    fed = dict.fromkeys(range(12), 0)
    while s.uids:
        chunk = {u: (tuple(responses[u][fed[u]: fed[u] + 8]), fed[u] + 8 >= len(responses[u])) for u in s.uids}
        for u in chunk:
            fed[u] += 8
        s.feed(chunk)
    assert s.kv.graphs and s.kv.captures == len(s.kv.shapes_seen)
    got, want = s.take_done(), score_full(kind, model, prompts, responses, tok.pad_token_id)
    for u in range(12):
        a, b = (got[u].logprobs, want[u].logprobs) if kind == "reference" else (got[u].values, want[u].values)
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-4)


def test_attention_path_by_name_and_probe(tiny_models, tiny_prompts, tmp_path):
    """ppo.attention: auto keeps the loaded path on the CPU; a path by name is set on every model
    and trains; the probe times each path and names one that fails."""
    from oppo.kernels import attention, varlen
    from oppo.config import load_config
    from oppo.models import load_causal_lm
    from oppo.trainer import Trainer

    policy = load_causal_lm(str(tiny_models["policy"]), "policy", torch.device("cpu"), torch.float32)
    said: list[str] = []
    assert attention.choose(policy, [], "auto", 2, 32, said.append) == "sdpa" and not said
    timings = attention.probe(policy, 2, 32, ["oppo_sdpa_math", "no_such_path"], repeats=1)
    assert isinstance(timings["oppo_sdpa_math"], float) and "failed" in str(timings["no_such_path"])
    assert policy.config._attn_implementation == "sdpa"  # left as it was
    cfg = load_config(None, [f"policy.path={tiny_models['policy']}", f"reward.path={tiny_models['reward']}",
                             f"data.prompts={tiny_prompts}", "ppo.attention=oppo_sdpa_math",
                             "overlap.mode=sequential", "ppo.batch_size=4", "ppo.minibatch_size=4",
                             "ppo.micro_batch_size=2", "generation.max_new_tokens=8", "log.progress=false",
                             "run.samples=0", f"run.out_dir={tmp_path / 'run'}"])
    t = Trainer.from_config(cfg, progress=False)
    try:
        m = t.run_step()
        # (packed forwards put a model on oppo_varlen:<its path>, which runs the path for every other forward)
        assert all(varlen.base(model.config._attn_implementation) == "oppo_sdpa_math" for model in t.models().values())
        assert any(model.config._attn_implementation == "oppo_varlen:oppo_sdpa_math" for model in t.models().values())
        assert math.isfinite(m["loss/policy"])  # it trained
    finally:
        t.close()


def test_micro_batch_token_budget_sized_to_the_device(tiny_models):
    """ppo.micro_batch_tokens=-1 (the default): no budget on the CPU; the bytes a token keeps for
    the backward by hand (1B shape: 16 layers x (20 x 2048 + 8 x 5632) bytes = 1.38 MiB)."""
    from types import SimpleNamespace

    from oppo.config import PPOConfig
    from oppo.learner.batch import MicroBatching, token_budget
    from oppo.learner.budget import activation_bytes, sized
    from oppo.models import load_causal_lm

    one_b = SimpleNamespace(config=SimpleNamespace(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16))
    assert activation_bytes(one_b) == 16 * (20 * 2048 + 8 * 5632)
    assert activation_bytes(one_b, checkpointing=True) == 2 * 2048 * 16 + 20 * 2048 + 8 * 5632
    assert PPOConfig().micro_batch_tokens == -1 and token_budget(MicroBatching.of(PPOConfig())) == 0  # unresolved: no budget
    policy = load_causal_lm(str(tiny_models["policy"]), "policy", torch.device("cpu"), torch.float32)
    cpu = sized(PPOConfig(), [policy])
    assert cpu.micro_batch_tokens == 0 and cpu.micro_batch_size == PPOConfig().micro_batch_size
    assert sized(PPOConfig(micro_batch_tokens=500), [policy]).micro_batch_tokens == 500  # a value given stays


def test_static_engine_bucketed_prefill_decodes_the_same(tiny_models):
    """The static backend's prefill on the ladders (rows of a repeated prompt, columns of padding;
    on by default with CUDA graphs) samples the same tokens and log-probs as the exact prefill."""
    from oppo.api.records import Rollout
    from oppo.models import load_causal_lm
    from oppo.rollout.static import StaticBackend

    model = load_causal_lm(str(tiny_models["policy"]), "policy", torch.device("cpu"), torch.float32).eval()
    prompts = [[5, 6, 7, 8, 9], [3, 4], [12, 13, 14, 15, 16, 17, 18], [20], [21, 22, 23]]
    out = {}
    for bucketed in (False, True):
        eng = StaticBackend(model, 1, 0, 12, seed=3, max_rows=8, max_len=40)
        eng.bucket_prefill = bucketed
        eng.admit([Rollout(i, i, "", list(p), 0) for i, p in enumerate(prompts)])
        out[bucketed] = {r.uid: (r.response_ids, r.logprobs) for r in eng.generate_all()}
    assert out[True].keys() == out[False].keys()
    for u in out[False]:
        assert out[True][u][0] == out[False][u][0]
        torch.testing.assert_close(torch.tensor(out[True][u][1]), torch.tensor(out[False][u][1]), atol=1e-5, rtol=1e-5)


def test_varlen_layouts_hold_a_few_shapes_for_a_run():
    """On variable-length attention a micro-batch is one row, its width on the coarse token ladder
    (``forward.varlen_width``): over 20 minibatches of 32 long-tailed sequences (lognormal, up to
    512), the mask path's bucketed rows x widths change with nearly every minibatch, the varlen
    row takes at most three widths, with the padded share the ladder allows (a third at most)."""
    from oppo.config import PPOConfig
    from oppo.forward import varlen_width
    from oppo.learner.batch import MicroBatching, micro_groups, token_budget

    assert [varlen_width(n) for n in (1, 17, 256, 257, 385, 1000, 1025, 1537, 4097)] == [16, 24, 256, 384, 512, 1024,
                                                                                           1536, 2048, 6144]
    rng = random.Random(0)
    runs = [[max(2, min(512, int(rng.lognormvariate(4.6, 0.8)))) for _ in range(32)] for _ in range(20)]
    micro = MicroBatching.of(PPOConfig(minibatch_size=32, micro_batch_size=32, micro_batch_tokens=16384))
    seen: dict[str, set] = {"mask": set(), "varlen": set()}
    real = computed = 0
    for lens in runs:
        for group in micro_groups(None, list(range(32)), micro, lens):
            n = [lens[i] for i in group]
            for name, plan in (("mask", LayoutRule(True, 1 / 12288, buckets=True)),
                               ("varlen", LayoutRule(True, buckets=True, varlen=True))):
                lay = plan.layout(n, token_budget(micro))
                _placed(lay)
                seen[name].add((lay.rows, lay.width))
                if name == "varlen":
                    assert lay.rows == 1 and lay.varlen and lay.width <= max(sum(n), 16384)
                    real, computed = real + sum(n), computed + lay.computed
    assert len(seen["varlen"]) <= 3 < 6 <= len(seen["mask"]), seen
    assert 1 - real / computed <= 1 / 3
    # the budget caps a rung past it; a longer sequence takes its own size
    assert LayoutRule(True, buckets=True, varlen=True).layout([700, 200], 1000).width == 1000  # (1024 past it)
    assert LayoutRule(True, buckets=True, varlen=True).layout([1100], 1024).width == 1536  # (its rung)
