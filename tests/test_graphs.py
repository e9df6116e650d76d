"""The one CUDA-graph capture helper (``oppo.kernels.graphs``): its bookkeeping on a CPU with a stand-in
for the graph, and the static backend capturing only the buckets a run reaches."""

from __future__ import annotations

import pytest
import torch

from oppo.kernels.graphs import CapturedGraphs, rerun_capture

EOS, PAD = 1, 0


def test_captured_graphs_bookkeeping():
    """One capture per key until cleared; seconds from the clock; a capture that raises records
    nothing; each replay reruns the forward into the first output (the stand-in)."""
    ticks = iter(range(0, 100, 5))  # each capture: two clock reads 5 s apart
    runs = []

    def forward():
        runs.append(1)
        return torch.full((2,), float(len(runs)))

    g: CapturedGraphs[tuple[int, int]] = CapturedGraphs(capture=rerun_capture, clock=lambda: float(next(ticks)))
    graph, out = g.get((1, 16), forward)
    assert g.get((1, 16), forward)[1] is out and len(runs) == 1  # the second get captures nothing
    graph.replay()
    assert out.tolist() == [2.0, 2.0]
    g.get((2, 16), forward)
    assert g.stats() == {"captures": 2, "seconds": 10.0, "keys": [(1, 16), (2, 16)]}
    g.clear()
    assert (1, 16) not in g and len(g) == 0
    g.get((1, 16), forward)
    assert g.stats() == {"captures": 3, "seconds": 15.0, "keys": [(1, 16), (2, 16)]}

    def broken():
        raise RuntimeError("a host read inside the capture")

    with pytest.raises(RuntimeError, match="host read"):
        g.get((3, 16), broken)
    assert (3, 16) not in g and g.captures == 3


def _policy():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=128, pad_token_id=PAD, eos_token_id=EOS,
                      bos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def test_static_engine_captures_only_the_buckets_a_run_reaches():
    """capture=cuda_graph with the stand-in: two rows in an engine of 16 slots x 64 columns capture
    the row bucket of 2 and the length buckets up to their prompt + new tokens, one graph each on
    first use (none at build), and decode the uncaptured engine's tokens."""
    from oppo.rollout.eager.backend import Rollout
    from oppo.rollout.static.backend import StaticBackend, bucket_size

    model = _policy()
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    tokens = {}
    for capture in ("none", "cuda_graph"):
        eng = StaticBackend(model, EOS, PAD, 12, greedy=True, max_rows=16, max_len=64, capture=capture,
                                  graph_capture=rerun_capture if capture == "cuda_graph" else None)
        assert eng.captures == 0, "nothing is captured at build"
        rows = [Rollout(i, i, "", p, 0) for i, p in enumerate(prompts)]
        eng.admit(rows)
        done = []
        while eng.active:
            done.extend(eng.step())
        tokens[capture] = sorted((r.uid, tuple(r.response_ids)) for r in done)
    stats = eng.capture_stats()
    top_rb, top_lb = bucket_size(2, 16, smallest=1), bucket_size(5 + 12, 64)
    assert stats["keys"] and all(rb <= top_rb and lb <= top_lb for rb, lb in stats["keys"]), stats
    assert stats["captures"] == len(stats["keys"]) == eng.captures and stats["seconds"] > 0
    every = {(bucket_size(r, 16, 1), bucket_size(c, 64)) for r in range(1, 17) for c in range(1, 65)}
    assert stats["captures"] < len(every) / 4  # (capture_all made all 40)
    assert tokens["cuda_graph"] == tokens["none"]


def test_bench_reports_decode_captures():
    """The bench's hardware table gives each mode's decode graphs and their seconds (the static
    engine's ``capture_stats``); a mode whose engine captures nothing shows a dash."""
    from oppo.bench.summaries import _hardware, hardware_markdown

    rec = {"decode_captures": {"captures": 3, "seconds": 1.54, "keys": [(1, 16), (2, 16), (2, 24)]}}
    hw = _hardware(rec, [{"perf/train_mfu": 0.1}])
    assert hw["decode_captures"] == 3 and hw["decode_capture_s"] == 1.54
    md = hardware_markdown({"oppo": {"hardware": hw}, "sequential": {"hardware": {"train_mfu": 0.1}}})
    row = {line.split("|")[1].strip(): line for line in md if line.startswith("| ") and "MFU" not in line}
    assert row["oppo"].rstrip(" |").endswith("3 (1.5 s)") and row["sequential"].rstrip(" |").endswith("-")
