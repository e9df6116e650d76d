"""benchmarks/gpu_check.sh, the first call a lent GPU gets, in its CPU smoke form (``SMOKE=1``): every
part must end ok and the results must be finite, so that the GPU's few minutes are not spent on a typo
or a NaN placeholder (issue 46: a call's check part stopped at step 0 on one).
And gpu_profile's trace reading on a hand-made CUDA trace: the CUDA-only counts the CPU smoke cannot
produce (launches, syncs, copies, graphs, kernel backends, bf16 matmul share)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("versions", "attention", "gpu_tests", "bench", "profile")
"""benchmarks/gpu_check.py's parts, in order."""


def _no_nan(text: str):
    """json.loads that refuses NaN and Infinity (Python's json reads them by default)."""
    def refuse(c):
        raise ValueError(f"non-finite number {c} in the JSON")
    return json.loads(text, parse_constant=refuse)


def _numbers(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _numbers(v)
    elif isinstance(x, list):
        for v in x:
            yield from _numbers(v)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield x


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_part(tmp_path):
    """``SMOKE=1 bash benchmarks/gpu_check.sh`` (the eight-minute GPU call, on the CPU with tiny sizes):
    every part ends ok in the one summary table, rc 0, the result files few and finite: the attention
    check's grouped-K/V path copies no K/V and equals the math path, the bench ran oppo then
    sequential, the profile of one oppo step has its windows. (``gpu_session.sh``, the longer loan's
    call, is checked for syntax only: its smoke, ``SMOKE=1 bash benchmarks/gpu_session.sh``, runs by hand.)"""
    env = {**os.environ, "SMOKE": "1", "OUT": str(tmp_path), "WORK": str(tmp_path / "work"),
           "PYTHON": sys.executable}
    for key in [k for k in env if k in ("SKIP", "ONLY") or k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))]:
        env.pop(key)  # (its gpu_tests part runs pytest: not as this run's xdist worker)
    t = time.perf_counter()
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=600)
    seconds = time.perf_counter() - t
    out = tmp_path / "gpu_check"
    summary = (out / "summary.md").read_text()
    log = (out / "parts.log").read_text() if (out / "parts.log").is_file() else ""
    status = dict(re.findall(r"^\| (\w+) \| ([^|]+?) \| \d+ \|", summary, flags=re.M))
    assert list(status) == list(PARTS), summary
    failed = [p for p in PARTS if not status[p].startswith("ok")]
    assert not failed, f"parts failed: {failed}\n{summary}\n{log[-6000:]}"
    assert "skipped: no CUDA" in status["gpu_tests"] and "every part ok" in summary
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "torch" in summary and "transformers" in summary  # part (a)'s versions, in the table's head
    assert len([p for p in out.iterdir() if p.is_file()]) <= 8, sorted(p.name for p in out.iterdir())

    attn = json.loads((out / "attention.json").read_text())
    assert attn["problems"] == [] and attn["learner"]["auto"] == "oppo_sdpa_gqa"
    for case in ("decode", "chunk"):
        rows = attn["decode"]["cases"][case]
        assert rows["sdpa"]["repeat_kv"] and not rows["oppo_sdpa_gqa"]["repeat_kv"]  # the copy it saves
        assert rows["oppo_sdpa_gqa"]["error"] < 1e-5 and rows["oppo_sdpa_gqa"]["finite"]
    bench = _no_nan((out / "bench.json").read_text())
    assert list(bench["modes"]) == ["oppo", "sequential"]
    prof = _no_nan((out / "profile.json").read_text())
    assert prof["mode"] == "oppo" and all(math.isfinite(x) for x in _numbers(prof))
    # the bucketed road a GPU takes by default (auto is off on the CPU): docs/gpu-shapes.md
    assert "ppo.shape_buckets=on" in prof["settings"]
    assert "shape_buckets: 'on'" in bench["settings"]
    windows = prof["baseline"]["windows"]
    assert {"generate", "train", "step"} <= set(windows)
    assert windows["step"]["attention"]["calls"] > 0 and 0 < windows["step"]["busy_share"] <= 1.0001
    md = (out / "profile.md").read_text()
    assert "one oppo PPO step" in md and not re.search(r"\bnan\b", md, re.I)
    # the longer loan's call still parses
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_session.sh")]).returncode == 0
    print(f"gpu_check smoke: {seconds:.0f} s")


def _gpu_profile():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # (gpu_profile imports gpu_bench beside it)
    try:
        spec = importlib.util.spec_from_file_location("gpu_profile", ROOT / "benchmarks" / "gpu_profile.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["gpu_profile"] = mod  # (its dataclasses look their module up while being built)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": float(ts), "dur": float(dur), "pid": 1, "tid": tid,
            "args": args}


def test_profile_reads_a_cuda_trace():
    """A hand-made trace in kineto's chrome format with the CUDA events the CPU smoke has none of:
    each count lands in the window that made the host call, kernels in the window that launched
    them; the attention call's backend comes from its kernel's name (cuDNN's say "flash" too)."""
    gp = _gpu_profile()
    M = gp.MARK
    ev = [
        _x("user_annotation", f"{M}step", 0, 1000),
        _x("user_annotation", f"{M}actor/generate", 10, 290),
        _x("user_annotation", f"{M}scorer/score_reward", 300, 100),
        _x("user_annotation", f"{M}learner/train", 500, 400),
        # generate: a graph launch (its kernel runs inside the window) and a capture
        _x("cuda_runtime", "cudaStreamBeginCapture", 20, 5, correlation=1),
        _x("cuda_runtime", "cudaGraphLaunch", 30, 5, correlation=2),
        _x("kernel", "void gemv_bf16_kernel", 40, 100, correlation=2),
        # score: an attention call whose kernel is cuDNN's, and an .item(): copy + sync
        _x("user_annotation", f"{gp.ATTN}0", 310, 30),
        _x("cpu_op", "aten::_scaled_dot_product_cudnn_attention", 312, 20, **{"External id": 7}),
        _x("cuda_runtime", "cudaLaunchKernel", 315, 5, correlation=3, **{"External id": 7}),
        _x("kernel", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma", 320, 50, correlation=3,
           **{"External id": 7}),
        _x("cpu_op", "aten::item", 350, 40, **{"External id": 8}),
        _x("cuda_runtime", "cudaMemcpyAsync", 352, 3, correlation=4, **{"External id": 8}),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 360, 2, correlation=4),
        _x("cuda_runtime", "cudaStreamSynchronize", 356, 30, correlation=5, **{"External id": 8}),
        # train: a bf16 and an fp32 matmul, launched at the window's end, run after it (still train's)
        _x("cpu_op", "aten::mm", 600, 10, **{"External id": 9, "Input type": ["c10::BFloat16", "c10::BFloat16"]}),
        _x("cuda_runtime", "cudaLaunchKernel", 602, 5, correlation=6, **{"External id": 9}),
        _x("kernel", "nvjet_tst_128x256", 610, 300, correlation=6),  # (its op found through its launch)
        _x("cpu_op", "aten::addmm", 700, 10, **{"External id": 10, "Input type": ["float", "float", "float"]}),
        _x("cuda_runtime", "cuLaunchKernel", 702, 5, correlation=7, **{"External id": 10}),
        _x("kernel", "sm90_xmma_gemm_f32f32", 910, 100, correlation=7, **{"External id": 10}),
        _x("cpu_op", "aten::_scaled_dot_product_efficient_attention_backward", 800, 90, tid=2),
        _x("cpu_op", "aten::_efficient_attention_backward", 805, 80, tid=2),  # (inside it: one call)
        _x("cuda_runtime", "cudaDeviceSynchronize", 950, 10),  # in the step, outside every window
    ]
    calls = [gp.AttentionCall("scaled_dot_product_attention", "8x32x64x64 8x8x64x64 bfloat16", 0.4)]
    out = gp.analyse_trace(ev, calls, cuda=True)
    w = out["windows"]
    assert (w["generate"]["graph_captures"], w["generate"]["graph_launches"], w["generate"]["launches"]) == (1, 1, 0)
    assert w["generate"]["kernel_s"] == pytest.approx(100e-6) and w["generate"]["busy_share"] == pytest.approx(100 / 290)
    assert (w["score"]["host_syncs"], w["score"]["dtoh_copies"], w["score"]["launches"]) == (1, 1, 1)
    assert w["score"]["sync_ops"] == {"aten::item": 1}
    assert w["score"]["attention"]["backends"] == {"cudnn": 1} and w["score"]["attention"]["max_host_ms"] == 0.4
    assert w["train"]["launches"] == 2 and w["train"]["kernels"] == 2
    assert w["train"]["matmul_bf16_share"] == pytest.approx(300 / 400)
    assert w["train"]["busy_s"] == pytest.approx(290e-6)  # the late kernel clipped at the window's end
    assert w["train"]["attention"]["backward_backends"] == {"efficient": 1}
    assert w["train"]["attention"]["backward_max_ms"] == pytest.approx(0.09)
    assert w["other"]["host_syncs"] == 1 and w["step"]["host_syncs"] == 2 and w["step"]["launches"] == 3
    assert [c["backend"] for c in out["attention_calls"]] == ["cudnn"]
    assert gp.kernel_backend("void pytorch_flash::flash_fwd_kernel<>") == "flash"
    assert gp.kernel_backend("fmha_cutlassF_bf16_aligned_64x128_rf_sm80") == "efficient"
    assert gp.call_backend(["ampere_bf16_s16816gemm", "softmax_warp_forward"], []) == "math"
