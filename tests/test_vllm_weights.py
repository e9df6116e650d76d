"""The shared weight buffer of the vLLM engine (``oppo.rollout.vllm.weights``), without vLLM: its
layout, its lifetime (no /dev/shm file left behind, even by a killed process) and, on a GPU, the
CUDA IPC handle a second process opens. The loads into a running vLLM engine are tested in
``test_vllm.py``."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch

from oppo.rollout.vllm.weights import BufferLayout, SharedUnavailable, SharedWeights

PAIRS = [("a.weight", torch.randn(3, 5)), ("b.bias", torch.arange(7)), ("c", torch.randn(2, 2, 2))]


def test_layout_slots_are_aligned_and_indexed():
    layout = BufferLayout.of(PAIRS, torch.bfloat16)
    assert [s.dtype for s in layout.slots] == ["bfloat16", "int64", "bfloat16"]  # floats in the engine's dtype
    assert all(s.offset % 64 == 0 for s in layout.slots) and layout.nbytes >= sum(s.nbytes for s in layout.slots)
    assert layout.index(PAIRS[1:]) == [1, 2]
    assert layout.index([("a.weight", torch.zeros(5, 3))]) is None, "another shape: a new layout"
    assert layout.index([("d", torch.zeros(1))]) is None, "another name: a new layout"


def test_buffer_lifetime():
    """The buffer's file is in /dev/shm while it lives and holds what was written; close() unlinks
    it; a process killed with its buffer open leaves none behind (multiprocessing's resource
    tracker unlinks it)."""
    layout = BufferLayout.of(PAIRS, torch.float32)
    shared = SharedWeights(layout)
    shared.write(PAIRS, layout.index(PAIRS))
    views = layout.views(torch.from_file(shared.path, shared=True, size=layout.nbytes, dtype=torch.uint8))
    for (_, w), v in zip(PAIRS, views):
        assert torch.equal(v, w)
    del views
    assert os.path.basename(shared.path).startswith("oppo-vllm-") and os.path.exists(shared.path)
    shared.close()
    assert not os.path.exists(shared.path)
    shared.close()  # (idempotent)

    code = ("import os, signal, torch\n"
            "from oppo.rollout.vllm.weights import BufferLayout, SharedWeights\n"
            "s = SharedWeights(BufferLayout.of([('w', torch.zeros(1000))]))\n"
            "print(s.path, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr
    path = out.stdout.strip()
    assert path.startswith("/dev/shm/oppo-vllm-"), out
    deadline = time.time() + 20
    while os.path.exists(path) and time.time() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(path), "the resource tracker did not unlink a dead process's buffer"


def test_full_shm_is_refused(monkeypatch):
    """Less room in /dev/shm than the weights need: refused at creation (the engine then loads
    through vLLM's RPC), not a SIGBUS at a later write."""
    from oppo.rollout.vllm import weights as vllm_weights

    class Full:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(vllm_weights.os, "statvfs", lambda path: Full)
    with pytest.raises(SharedUnavailable, match="MiB free"):
        SharedWeights(BufferLayout.of([("w", torch.zeros(1 << 20))]))


_READER = """
import pickle, sys, torch
from oppo.rollout.vllm.weights import open_buffer
handle, layout = pickle.load(open(sys.argv[1], "rb"))
views = layout.views(open_buffer(handle))
for line in sys.stdin:  # one line per round: print each slot's sum as this process sees it
    torch.cuda.synchronize()
    print(" ".join(f"{float(v.double().sum()):.6f}" for v in views), flush=True)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_ipc_buffer_is_seen_by_another_process(tmp_path):
    """GPU: the buffer's IPC handle opens in another process (as in vLLM's worker, with its own
    device index), which sees each later write once the writer has synchronised."""
    pairs = [(n, w.cuda()) for n, w in PAIRS]
    layout = BufferLayout.of(pairs, torch.float32)
    shared = SharedWeights(layout, torch.device("cuda", torch.cuda.current_device()))
    try:
        shared.write(pairs, layout.index(pairs))
        f = tmp_path / "handle.pkl"
        f.write_bytes(pickle.dumps((shared.handle(), layout)))
        reader = subprocess.Popen([sys.executable, "-c", _READER, str(f)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            for k in range(2):
                want = " ".join(f"{float(w.double().sum()):.6f}" for _, w in pairs)
                reader.stdin.write("\n")
                reader.stdin.flush()
                assert reader.stdout.readline().strip() == want, f"round {k}"
                pairs = [(n, w * 2 + 1) for n, w in pairs]
                shared.write(pairs, layout.index(pairs))
        finally:
            reader.stdin.close()
            reader.wait(timeout=60)
        other = dict(shared.handle(), uuid="GPU-another")
        from oppo.rollout.vllm.weights import open_buffer

        with pytest.raises(SharedUnavailable, match="vLLM's worker runs on"):
            open_buffer(other)
    finally:
        shared.close()
