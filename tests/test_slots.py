"""The bucketed KV slots (``scoring/slots.py``) near a model's position limit: padding tokens take
position ids inside what the real tokens reach, so a learned-position model does not index past
its table and dynamic RoPE does not rescale the real tokens."""

from __future__ import annotations

import pytest
import torch

from oppo.forward import set_packing
from oppo.scoring.streaming import StreamingScorer, score_full

PAD = 0


def _gpt2(kind: str):
    """GPT-2 (learned positions, a table of n_positions=64 rows)."""
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=40, n_positions=64, n_embd=16, n_layer=2, n_head=2, pad_token_id=PAD,
                     eos_token_id=1, bos_token_id=None, num_labels=1)
    return (GPT2LMHeadModel if kind == "reference" else GPT2ForSequenceClassification)(cfg).eval()


def _llama_dynamic(kind: str):
    """Llama under dynamic RoPE: its frequencies rescale for a forward whose largest position id
    reaches past max_position_embeddings=36."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=36, pad_token_id=PAD, eos_token_id=1,
                      bos_token_id=None, num_labels=1, rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                      initializer_range=0.3)  # (large weights: a rescale moves the outputs by 0.2, not 1e-5)
    return (LlamaForCausalLM if kind == "reference" else LlamaForSequenceClassification)(cfg).eval()


def _seq(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 40, (n,), generator=g).tolist()


# (model, limit): no real token past position limit - 1; the schedules below pad past it
CASES = {"gpt2": (_gpt2, 50), "llama_dynamic": (_llama_dynamic, 36)}


@pytest.mark.parametrize("kind", ["critic", "reference", "reward"])
@pytest.mark.parametrize("arch", sorted(CASES))
def test_bucketed_slots_near_the_position_limit(arch, kind):
    build, limit = CASES[arch]
    model = build(kind)
    # row 0 ends at the limit; its prompt pads to the width ladder past 36 (33 -> 40); row 1's long
    # chunk pads row 0's short one (Cb = 32 or 16) far past the limit; row 2 idles a round
    prompts = [_seq(limit - 6 if arch == "gpt2" else 33, 1), _seq(3, 2), _seq(5, 3)]
    responses = [_seq(limit - len(prompts[0]), 4), _seq(24 if arch == "gpt2" else 16, 5), _seq(9, 6)]
    set_packing(model, "off", "off")
    expected = [score_full(kind, model, [p], [r], PAD)[0] for p, r in zip(prompts, responses)]  # alone: no padding
    set_packing(model, "auto", "on")
    s = StreamingScorer(kind, model, PAD)
    from oppo.scoring.slots import SlotKV

    assert isinstance(s.kv, SlotKV)
    s.admit([0, 1, 2], prompts)
    r0, r1, r2 = responses
    s.feed({0: (tuple(r0[:2]), False), 1: (tuple(r1[:-2]), False)})  # row 2 has no chunk this round
    s.feed({0: (tuple(r0[2:]), True), 2: (tuple(r2[:4]), False)})
    s.feed({1: (tuple(r1[-2:]), True), 2: (tuple(r2[4:]), True)})
    got = s.take_done()
    assert sorted(got) == [0, 1, 2]
    for u in range(3):
        if kind == "reward":
            assert got[u].score == pytest.approx(expected[u].score, abs=1e-5)
        else:
            want = expected[u].logprobs if kind == "reference" else expected[u].values
            have = got[u].logprobs if kind == "reference" else got[u].values
            torch.testing.assert_close(torch.tensor(have), torch.tensor(want), atol=1e-5, rtol=1e-5)


def test_static_engine_bucketed_prefill_keeps_padding_inside_the_limit():
    """The static backend's bucketed prefill (on with CUDA graphs; forced here) pads a prompt
    of 33 tokens to width 40, past dynamic RoPE's 36: its next-token logits still equal the
    eager backend's, which pads nothing."""
    from oppo.rollout.eager.backend import Rollout, EagerBackend
    from oppo.rollout.static.backend import StaticBackend

    model = _llama_dynamic("reference")
    prompts = [_seq(33, 1), _seq(3, 2), _seq(5, 3)]
    static = StaticBackend(model, 1, PAD, 3, greedy=True, max_rows=4, max_len=48)
    static.bucket_prefill = True
    eager = EagerBackend(model, 1, PAD, 3, greedy=True)
    for eng in (static, eager):
        eng.admit([Rollout(i, i, "", p, 0) for i, p in enumerate(prompts)])
    torch.testing.assert_close(static.next_logits, eager.next_logits, atol=1e-5, rtol=1e-5)


def test_slot_graphs_with_a_stand_in_capture():
    """The scorer slots' graph road on a CPU (``oppo.kernels.graphs`` with its stand-in): chunk forwards
    replayed from the static buffers (tokens, columns, real counts) give the one-shot values, and
    one capture is made per (Rb, Cb, Lb) the run used."""
    from oppo.kernels.graphs import rerun_capture
    from oppo.scoring.slots import SlotKV

    model = _llama_dynamic("critic")
    prompts = [_seq(33, 1), _seq(3, 2), _seq(5, 3)]
    responses = [_seq(3, 4), _seq(16, 5), _seq(9, 6)]
    set_packing(model, "off", "off")
    expected = [score_full("critic", model, [p], [r], PAD)[0] for p, r in zip(prompts, responses)]
    set_packing(model, "auto", "on")
    s = StreamingScorer("critic", model, PAD)
    s.kv = SlotKV(torch.device("cpu"), graphs=True, capture=rerun_capture)
    s.admit([0, 1, 2], prompts)
    r0, r1, r2 = responses
    s.feed({0: (tuple(r0[:2]), False), 1: (tuple(r1[:-2]), False)})
    s.feed({0: (tuple(r0[2:]), True), 2: (tuple(r2[:4]), False)})
    s.feed({1: (tuple(r1[-2:]), True), 2: (tuple(r2[4:]), True)})
    got = s.take_done()
    assert s.kv.graphs, "captured, not fallen back to eager"
    stats = s.kv.capture_stats()
    assert stats["captures"] == len(s.kv.shapes_seen) >= 2 and stats["keys"] == sorted(s.kv.shapes_seen)
    for u in range(3):
        torch.testing.assert_close(torch.tensor(got[u].values), torch.tensor(expected[u].values), atol=1e-5, rtol=1e-5)
