"""Where a PPO step's GPU time goes: one profiled sequential step (or ``--mode oppo``), window by window (issue 46).

    PYTHONPATH=src python benchmarks/gpu_profile.py --out benchmarks/gpu_profile     (CUDA, <= 4 minutes)
    PYTHONPATH=src python benchmarks/gpu_profile.py --device cpu --tiny --out /tmp/prof   (the smoke, seconds)

The workload is gpu_bench's (``gpu_bench.trainer_settings``; ``oppo.bench.write_synthetic_models`` and
the representative forced lengths of ``oppo.bench.WORKLOADS``): a 1B policy and a 125M reward model
that is also the critic, bf16, B = 64, long-tailed response lengths. The trainer runs in sequential
mode, so that its three windows (generate, score, train: the spans ``control/sequential.py`` records
through ``Tracer.span``, marked here for the profiler) hold one stage each. One warm-up step
runs untimed, one step unprofiled (its time is the step's without the profiler's overhead), then one
step under ``torch.profiler`` (CUDA activity on CUDA, CPU activity in the smoke). For each window it
prints and writes (``profile.md``, ``profile.json`` under ``--out``):

- wall time against summed kernel time and the union of device activity (the GPU's busy share);
  on CPU, the aten ops' self time and the share of the window spent inside an op;
- the top kernels by GPU time (on CPU: ops by self time);
- counts: host syncs (``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` / ``cudaEventSynchronize``
  / synchronous ``cudaMemcpy``, with the ops they sync in), device-to-host copies, kernel launches,
  CUDA-graph launches and captures (CUDA only: absent on CPU), aten ops (both);
- per attention call (``scaled_dot_product_attention`` and the other attention entry points torch,
  transformers and flash-attn bring, wrapped while the step runs): the backend that ran (on CUDA from
  the kernels it launched: flash, efficient, cudnn, math; else from the aten op it dispatched to),
  and the longest host time of one call (a cuDNN plan built on a new shape shows as an outlier);
  the signatures (shapes, dtype, mask) new in the profiled step, which the steps before it did not
  see: each is a miss of every shape-keyed cache; the attention backward ops alike (by their aten op);
- the share of matmul time in bf16 (the dtype of the op that launched each matmul kernel);
- model FLOPs utilisation against the measured matmul peak and the device's spec peak
  (``oppo.perf``), beside the attainable ceiling: forward + backward + AdamW of ONE packed row of
  the train window's actor tokens (the trained sequences end to end, position ids restarting at 0
  for each, as oppo packs them), on the same policy loaded fresh, without oppo around it;
- an A/B of each remedy of issue 46 (:data:`REMEDIES`, and any ``--ab KEY=ON/OFF``): a fresh
  trainer per arm that differs from the baseline, one warm-up step, one profiled step. A remedy
  whose setting ``oppo.config`` does not have (yet) is skipped, and so is an arm the time budget
  (``--budget-s``) has no room for, each saying why.

A figure that has no value (a count that only CUDA has, an MFU without a spec peak) is absent from
the JSON, never NaN (written with ``allow_nan=False``), and "-" in the tables. The chrome traces of
the profiled steps (large) stay under ``--work``.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import gc
import itertools
import json
import math
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_bench import trainer_settings  # (benchmarks/: the script's own folder is on sys.path)
from oppo.bench import WORKLOADS, machine, mode_overrides, write_synthetic_models
from oppo.config import ConfigError, load_config, with_overrides
from oppo.perf import forward_flops, peak_flops, spec_peak_flops

WINDOWS = {"actor": "generate", "scorer": "score", "learner": "train"}
"""A tracer span's lane -> the sequential window it belongs to (``control/sequential.py``)."""
MARK = "gpu_profile:"  # record_function names: the stage spans, the step, each attention call
ATTN = "gpu_profile:attention#"


@dataclass(frozen=True)
class Remedy:
    """One A/B row: a setting switched on and off. ``on`` None: the setting's default (where the
    default is the remedy, as the device-sized token budget)."""

    name: str
    key: str
    on: str | None
    off: str


REMEDIES = (
    # ppo.shape_buckets=auto (the default) is on where the model is on CUDA: the baseline's own arm there
    Remedy("shape buckets (learner, scorer and prefill shapes from a small fixed set)", "ppo.shape_buckets", None,
           "off"),
    Remedy("attention backend chosen by a probe", "ppo.attention", "auto", "sdpa"),
    Remedy("micro-batch token budget sized to the device", "ppo.micro_batch_tokens", None, "0"),
)
"""The remedies of issue 46, each as its config key (skipped where ``oppo.config`` lacks it)."""

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
         "cuCtxSynchronize", "cuEventSynchronize")
SYNC_COPIES = ("cudaMemcpy", "cudaMemcpy2D", "cuMemcpyDtoH", "cuMemcpyDtoH_v2")  # synchronous copies
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::_scaled_mm",
              "aten::mv", "aten::addmv", "aten::dot", "aten::_grouped_mm", "aten::_int_mm"}
"""The aten ops that launch matmul kernels (``linear`` and ``matmul`` call these)."""
ATTENTION_ENTRY_POINTS = (
    ("torch.nn.functional", "scaled_dot_product_attention"),
    ("torch.nn.attention.flex_attention", "flex_attention"),
    ("torch.nn.attention.varlen", "varlen_attn"),
    ("flash_attn", "flash_attn_func"), ("flash_attn", "flash_attn_varlen_func"),
    ("flash_attn.flash_attn_interface", "flash_attn_func"),
    ("flash_attn.flash_attn_interface", "flash_attn_varlen_func"),
    ("transformers.integrations.flex_attention", "flex_attention"),
    ("transformers.modeling_flash_attention_utils", "flash_attn_func"),
    ("transformers.modeling_flash_attention_utils", "flash_attn_varlen_func"),
)
"""Module attributes an attention call goes through (where the module is imported): wrapped while
the profiled step runs. transformers' SDPA path looks ``torch.nn.functional``'s function up at each
call; a module that imported a function by name holds its own reference, wrapped there too."""


# ====================================================================== what runs during the step


@dataclass
class AttentionCall:
    kind: str  # the entry point: sdpa, flex_attention, flash_attn_varlen_func, ...
    shape: str  # query and key shapes, dtype, mask: the signature a shape-keyed plan cache sees
    host_ms: float  # host time of the call (asynchronous on CUDA: launches, and a plan build)


def _signature(args, kwargs) -> str:
    tensors = [a for a in args[:3] if isinstance(a, torch.Tensor)]
    parts = ["x".join(map(str, t.shape)) for t in tensors[:2]]
    if tensors:
        parts.append(str(tensors[0].dtype).replace("torch.", ""))
    mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    if isinstance(mask, torch.Tensor):
        parts.append(f"mask {'x'.join(map(str, mask.shape))} {str(mask.dtype).replace('torch.', '')}")
    elif mask is not None:
        parts.append(f"mask {type(mask).__name__}")  # a flex BlockMask
    if kwargs.get("is_causal"):
        parts.append("causal")
    for key in ("cu_seqlens_q", "cu_seq_q"):
        if isinstance(kwargs.get(key), torch.Tensor):
            parts.append(f"{kwargs[key].numel() - 1} seqs")
    return " ".join(parts)


@contextlib.contextmanager
def recording_attention(calls: list[AttentionCall]):
    """Wrap every attention entry point (:data:`ATTENTION_ENTRY_POINTS`) of the modules already
    imported (the warm-up step ran every path the profiled step takes: a module not imported by then
    is not used) so that each call appends an :class:`AttentionCall` to ``calls`` and is marked for
    the profiler (``ATTN<i>``); restored on exit. Nothing is imported here: a module imported while
    torch's function is wrapped would keep the wrapper."""
    counter, lock, restore = itertools.count(), threading.Lock(), []
    found = [(sys.modules[m], attr) for m, attr in ATTENTION_ENTRY_POINTS if m in sys.modules]
    for module, attr in found:
        fn = getattr(module, attr, None)
        if not callable(fn):
            continue

        def recorded(*args, _fn=fn, _kind=attr, **kwargs):
            with lock:
                i = next(counter)
                calls.append(AttentionCall(_kind, "", 0.0))
            t = time.perf_counter()
            with torch.profiler.record_function(f"{ATTN}{i}"):
                out = _fn(*args, **kwargs)
            calls[i] = AttentionCall(_kind, _signature(args, kwargs), 1e3 * (time.perf_counter() - t))
            return out

        setattr(module, attr, functools.wraps(fn)(recorded))
        restore.append((module, attr, fn))
    try:
        yield calls
    finally:
        for module, attr, fn in restore:
            setattr(module, attr, fn)


@contextlib.contextmanager
def marked_spans(tracer):
    """Each ``tracer.span`` (the trainer's stage spans) also a profiler range named ``MARK`` +
    lane/stage: the windows, on the profiler's own clock."""
    original = tracer.span

    @contextlib.contextmanager
    def span(lane, stage, step, **args):
        with torch.profiler.record_function(f"{MARK}{lane}/{stage}"), original(lane, stage, step, **args) as a:
            yield a

    tracer.span = span
    try:
        yield
    finally:
        del tracer.span  # the class's method again


# ====================================================================== reading the trace


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _self_times(ops: list[dict]) -> dict[int, float]:
    """Each cpu op's self time (its duration less its direct children's), per thread; by id()."""
    out, by_tid = {}, defaultdict(list)
    for e in ops:
        by_tid[e.get("tid")].append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[dict] = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) <= e["ts"]:
                stack.pop()
            out[id(e)] = e.get("dur", 0)
            if stack:
                out[id(stack[-1])] -= e.get("dur", 0)
            stack.append(e)
    return out


def op_backend(name: str) -> str | None:
    """The attention backend an aten op name says (``aten::_scaled_dot_product_flash_attention``...)."""
    n = name.lower()
    if "attention" not in n and "attn" not in n:
        return None
    for key, backend in (("cudnn", "cudnn"), ("for_cpu", "flash (cpu)"), ("flash", "flash"),
                         ("efficient", "efficient"), ("math", "math"), ("flex", "flex")):
        if key in n:
            return backend
    return None


def kernel_backend(name: str) -> str | None:
    """The attention backend a CUDA kernel's name says; None for a kernel that is no attention
    kernel (the math path's are gemms and a softmax: see :func:`call_backend`)."""
    n = name.lower()
    if "cudnn" in n or "fort_native_sdpa" in n:  # cuDNN's SDPA kernels (their names also say "flash")
        return "cudnn"
    if "flash" in n:  # pytorch_flash::flash_fwd_kernel, flash-attn's
        return "flash"
    if "fmha" in n or "memeff" in n or "attentionkernel" in n:  # PyTorchMemEffAttention / cutlass fmha
        return "efficient"
    if "triton_tem" in n or "flex_attention" in n:  # FlexAttention's kernels (an inductor template)
        return "flex"
    return None


def call_backend(kernels: list[str], ops: list[str]) -> str:
    """One attention call's backend: from its kernels (CUDA), else the aten op it dispatched to."""
    for k in kernels:
        if (b := kernel_backend(k)) is not None:
            return b
    if kernels and any("softmax" in k.lower() for k in kernels):
        return "math"
    for o in ops:
        if (b := op_backend(o)) is not None:
            return b
    return "unknown"


def _dtype_of(op: dict | None, kernel_name: str = "") -> str:
    if op is not None:
        types = op.get("args", {}).get("Input type") or []
        if types:
            return "bf16" if "BFloat16" in types[0] else "fp16" if "Half" in types[0] else types[0] or "?"
    n = kernel_name.lower()
    return "bf16" if "bf16" in n else "fp16" if "f16" in n else "?"


def _looks_like_gemm(name: str) -> bool:
    n = name.lower()
    return any(k in n for k in ("gemm", "nvjet", "xmma", "cutlass", "gemv")) and kernel_backend(name) is None


def analyse_trace(events: list[dict], calls: list[AttentionCall], cuda: bool, top: int = 10) -> dict:
    """The profiled step's figures, per window (``generate``, ``score``, ``train``, ``other``: the
    step outside them) and for the whole ``step``: see the module docstring. ``events``: the chrome
    trace's events (``torch.profiler`` via kineto); ``calls``: the wrapped attention calls, in order."""
    X = [e for e in events if e.get("ph") == "X" and "ts" in e]
    ann = [e for e in X if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(MARK)]
    step_ev = [e for e in ann if e["name"] == f"{MARK}step"]
    if not step_ev:
        raise RuntimeError("gpu_profile: the trace holds no step range (was the step run under the profiler?)")
    step = (step_ev[0]["ts"], step_ev[0]["ts"] + step_ev[0]["dur"])
    spans: dict[str, list[float]] = {}
    for e in ann:
        lane = e["name"][len(MARK):].split("/")[0]
        if lane in WINDOWS:
            w = spans.setdefault(WINDOWS[lane], [math.inf, -math.inf])
            w[0], w[1] = min(w[0], e["ts"]), max(w[1], e["ts"] + e["dur"])
    windows = sorted(((s, e, name) for name, (s, e) in spans.items()), key=lambda w: w[0])

    def where(ts: float) -> str | None:
        for s, e, name in windows:
            if s <= ts <= e:
                return name
        return "other" if step[0] <= ts <= step[1] else None

    cpu_ops = [e for e in X if e.get("cat") == "cpu_op"]
    runtime = [e for e in X if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    device = [e for e in X if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    op_by_id = {e["args"]["External id"]: e for e in cpu_ops if "External id" in e.get("args", {})}
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in runtime if "correlation" in e.get("args", {})}
    # a kernel's op: through its launch (correlation -> the runtime call's External id -> the op
    # that made it), else the kernel's own External id
    launch_op = {e["args"]["correlation"]: e["args"]["External id"] for e in runtime
                 if "correlation" in e.get("args", {}) and "External id" in e["args"]}

    names = [n for n in ("generate", "score", "train") if n in spans] + ["other"]
    acc = {n: defaultdict(float) for n in names + ["step"]}
    tops = {n: Counter() for n in names + ["step"]}
    top_counts = {n: Counter() for n in names + ["step"]}
    sync_ops = {n: Counter() for n in names + ["step"]}
    busy: dict[str, list] = {n: [] for n in names + ["step"]}

    def add(w: str | None, key: str, v: float = 1.0) -> None:
        if w is not None:
            acc[w][key] += v
            acc["step"][key] += v

    if cuda:
        for e in device:
            corr = e.get("args", {}).get("correlation")
            w = where(launch_ts.get(corr, e["ts"]))  # the window that launched it
            if w is None:
                continue
            dur = e.get("dur", 0.0)
            for k in (w, "step"):
                busy[k].append((e["ts"], e["ts"] + dur))
            if e["cat"] == "gpu_memcpy" and "dtoh" in e["name"].lower():
                add(w, "dtoh_copies")
            if e["cat"] != "kernel":
                continue
            add(w, "kernel_us", dur)
            add(w, "kernels")
            name = e["name"][:140]
            for k in (w, "step"):
                tops[k][name] += dur
                top_counts[k][name] += 1
            op = op_by_id.get(launch_op.get(corr, e.get("args", {}).get("External id")))
            if (op is not None and op["name"] in MATMUL_OPS) or (op is None and _looks_like_gemm(e["name"])):
                add(w, "matmul_us", dur)
                if _dtype_of(op, e["name"]) == "bf16":
                    add(w, "matmul_bf16_us", dur)
        for e in runtime:
            w = where(e["ts"])
            if w is None:
                continue
            n = e["name"]
            if n.startswith(SYNCS) or n in SYNC_COPIES:
                add(w, "host_syncs")
                op = op_by_id.get(e.get("args", {}).get("External id"))
                for k in (w, "step"):
                    sync_ops[k][op["name"] if op is not None else "(no aten op)"] += 1
            elif n.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel")):
                add(w, "launches")
            elif n.startswith(("cudaGraphLaunch", "cuGraphLaunch")):
                add(w, "graph_launches")
            elif n.startswith(("cudaStreamBeginCapture", "cuStreamBeginCapture")):
                add(w, "graph_captures")
    selfs = _self_times(cpu_ops) if not cuda else {}  # (on CUDA the kernels are the device's work)
    for e in cpu_ops:
        w = where(e["ts"])
        if w is None:
            continue
        if e["name"].startswith("aten::"):  # (not the autograd nodes and Functions the profiler also lists)
            add(w, "aten_ops")
        if not cuda:  # the CPU is the device: ops' self time, and the window's time inside an op
            add(w, "kernel_us", selfs[id(e)])
            for k in (w, "step"):
                busy[k].append((e["ts"], e["ts"] + e.get("dur", 0.0)))
                tops[k][e["name"]] += selfs[id(e)]
                top_counts[k][e["name"]] += 1
            if e["name"] in MATMUL_OPS:
                add(w, "matmul_us", e.get("dur", 0.0))
                if _dtype_of(e) == "bf16":
                    add(w, "matmul_bf16_us", e.get("dur", 0.0))
    # attention backward ops (run by autograd, not through the wrapped functions): the outermost of
    # each nest (aten::_scaled_dot_product_efficient_attention_backward calls
    # aten::_efficient_attention_backward), whose duration holds a plan build
    last_end: dict = {}
    for e in sorted((e for e in cpu_ops if "backward" in e["name"] and op_backend(e["name"]) is not None),
                    key=lambda e: (e.get("tid"), e["ts"], -e.get("dur", 0.0))):
        w, end = where(e["ts"]), e["ts"] + e.get("dur", 0.0)
        if w is None or e["ts"] < last_end.get(e.get("tid"), -math.inf):
            continue  # (inside the one counted)
        last_end[e.get("tid")] = end
        for k in (w, "step"):
            acc[k][f"attn_bwd/{op_backend(e['name'])}"] += 1
            acc[k]["attn_bwd_max_us"] = max(acc[k]["attn_bwd_max_us"], e.get("dur", 0.0))

    attention = attention_calls(ann, X, cpu_ops, runtime, op_by_id, calls, where, cuda)
    out: dict = {"windows": {}}
    for n in names + ["step"]:
        a = acc[n]
        s, e = (step if n in ("step", "other") else spans[n])
        wall_us = e - s if n != "other" else (step[1] - step[0]) - sum(x[1] - x[0] for x in windows)
        clipped = [(max(x, s), min(y, e)) for x, y in busy[n] if min(y, e) > max(x, s)]  # (other: the step's)
        row: dict = {"wall_s": wall_us / 1e6, "aten_ops": int(a["aten_ops"])}
        if a["kernel_us"] or busy[n]:
            row["kernel_s"] = a["kernel_us"] / 1e6
            row["busy_s"] = _union(clipped) / 1e6
            if wall_us > 0:
                row["busy_share"] = row["busy_s"] / (wall_us / 1e6)
        if cuda:
            for key in ("kernels", "launches", "graph_launches", "graph_captures", "host_syncs", "dtoh_copies"):
                row[key] = int(a[key])
            row["sync_ops"] = dict(sync_ops[n].most_common(8))
        if a["matmul_us"]:
            row["matmul_s"] = a["matmul_us"] / 1e6
            row["matmul_bf16_share"] = a["matmul_bf16_us"] / a["matmul_us"]
        row["top"] = [{"name": k, "ms": v / 1e3, "count": top_counts[n][k]} for k, v in tops[n].most_common(top)]
        mine = [c for c in attention["calls"] if c["window"] == n or n == "step"]
        if mine:
            longest = max(mine, key=lambda c: c["host_ms"])
            row["attention"] = {
                "calls": len(mine), "backends": dict(Counter(c["backend"] for c in mine)),
                "signatures": len({c["shape"] for c in mine}), "max_host_ms": longest["host_ms"],
                "max_host_shape": longest["shape"], "max_host_backend": longest["backend"],
                "median_host_ms": statistics.median(c["host_ms"] for c in mine)}
        bwd = {k.split("/", 1)[1]: int(v) for k, v in a.items() if k.startswith("attn_bwd/")}
        if bwd:
            row.setdefault("attention", {})["backward_backends"] = bwd
            row["attention"]["backward_max_ms"] = a["attn_bwd_max_us"] / 1e3
        out["windows"][n] = row
    out["attention_calls"] = attention["calls"]
    return out


def attention_calls(ann, X, cpu_ops, runtime, op_by_id, calls, where, cuda) -> dict:
    """Each wrapped attention call's window, signature, host time and backend (its kernels, found
    through the launches made on its thread inside its range; else the aten ops run there)."""
    by_tid_ops, by_tid_rt = defaultdict(list), defaultdict(list)
    for e in cpu_ops:
        by_tid_ops[e.get("tid")].append(e)
    for e in runtime:
        by_tid_rt[e.get("tid")].append(e)
    for d in (by_tid_ops, by_tid_rt):
        for v in d.values():
            v.sort(key=lambda e: e["ts"])
    kernels_by_corr = defaultdict(list)
    for e in X:
        if e.get("cat") == "kernel" and "correlation" in e.get("args", {}):
            kernels_by_corr[e["args"]["correlation"]].append(e["name"])

    ts_cache: dict = {}

    def inside(key, evs, s, e):
        """The events of ``evs`` (sorted by start) that start within [s, e]."""
        if key not in ts_cache:
            ts_cache[key] = [x["ts"] for x in evs]
        ts = ts_cache[key]
        return evs[bisect.bisect_left(ts, s):bisect.bisect_right(ts, e)]

    out = []
    for e in ann:
        if not e["name"].startswith(ATTN):
            continue
        i = int(e["name"][len(ATTN):])
        if i >= len(calls):
            continue
        s, end, tid = e["ts"], e["ts"] + e["dur"], e.get("tid")
        ops = [o["name"] for o in inside(("op", tid), by_tid_ops[tid], s, end)]
        kernels = []
        if cuda:
            for r in inside(("rt", tid), by_tid_rt[tid], s, end):
                kernels += kernels_by_corr.get(r.get("args", {}).get("correlation"), [])
        c = calls[i]
        out.append({"i": i, "window": where(s) or "outside", "kind": c.kind, "shape": c.shape,
                    "host_ms": c.host_ms, "backend": call_backend(kernels, ops)})
    out.sort(key=lambda c: c["i"])
    return {"calls": out}


# ====================================================================== the runs


def profile_trainer(trainer, trace: Path, cuda: bool, shapes: bool = True) -> tuple[dict, dict]:
    """One step of ``trainer`` under the profiler: (its metrics, :func:`analyse_trace`'s figures).
    ``shapes``: record each op's input types (the bf16 matmul share reads them; a trace several
    times larger, slower to write and read: the A/B arms go without)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    calls: list[AttentionCall] = []
    with recording_attention(calls), marked_spans(trainer.tracer):
        with profile(activities=activities, record_shapes=shapes) as prof:
            with record_function(f"{MARK}step"):
                metrics = trainer.run_step()
                if cuda:
                    torch.cuda.synchronize()
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))  # kineto writes it natively: no Python-side event tree
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    return metrics, analyse_trace(events, calls, cuda)


def build_trainer(settings: list[str], label: str, work: Path, workload, mode: str = "sequential"):
    from oppo.trainer import Trainer

    cfg = with_overrides(load_config(None, settings), [
        *mode_overrides(mode), f"run.out_dir={work / 'runs' / label}", "run.save_every=0", "log.trace=true"])
    Path(cfg.run.out_dir).mkdir(parents=True, exist_ok=True)
    t = Trainer.from_config(cfg, progress=False)
    t.length_sampler = workload.sampler(cfg.run.seed)
    return t


def free(trainer) -> None:
    trainer.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def finite(d: dict) -> dict:
    """``d`` without the numbers that are not finite (a figure with no value is absent)."""
    return {k: v for k, v in d.items() if not (isinstance(v, float) and not math.isfinite(v))}


STEP_KEYS = ("time/step", "time/generate", "time/score", "time/train", "time/old_logprobs", "time/weight_sync",
             "perf/train_mfu", "perf/train_mfu_spec", "perf/generate_mfu", "perf/generate_mfu_spec",
             "perf/train_tflops", "perf/peak_tflops", "perf/peak_spec_tflops", "perf/decode_step_ms",
             "perf/train_padded_frac", "perf/train_tokens")


def run_profile(settings: list[str], label: str, work: Path, workload, cuda: bool, say, baseline: bool = False,
                mode: str = "sequential") -> dict:
    """A fresh trainer in ``mode`` (``--mode``; sequential by default): a warm-up step, (``baseline``) an unprofiled step, a profiled one
    (``baseline``: with the ops' input types). Returns the figures, with the trainer's facts the
    ceiling needs under ``_trainer``."""
    t0 = time.time()
    trainer = build_trainer(settings, label, work, workload, mode)
    try:
        built = time.time() - t0
        before: list[AttentionCall] = []  # the attention shapes of the steps before the profiled one
        with recording_attention(before):
            trainer.run_step()  # warm-up: the first step's one-time costs (CUDA graphs, plans, allocator)
            say(f"gpu_profile: {label}: built in {built:.1f} s, warm-up step {time.time() - t0 - built:.1f} s")
            out: dict = {"label": label, "build_s": built}
            if baseline:
                m = trainer.run_step()
                out["unprofiled"] = {k: m[k] for k in STEP_KEYS if k in m and math.isfinite(m[k])}
        t1 = time.time()
        metrics, figures = profile_trainer(trainer, work / "traces" / f"{label}.json", cuda, shapes=baseline)
        out["profiled"] = {k: metrics[k] for k in STEP_KEYS if k in metrics and math.isfinite(metrics[k])}
        new_signatures(figures, {c.shape for c in before}, len(before) and (2 if baseline else 1))
        out.update(figures)
        out["profile_s"] = time.time() - t1
        out["seconds"] = time.time() - t0
        out["_trainer"] = trainer_facts(trainer)
        return out
    finally:
        free(trainer)


def new_signatures(figures: dict, seen: set[str], steps_before: int) -> None:
    """Each window's attention signatures that no step before the profiled one saw
    (``attention.new_signatures``, after ``steps_before`` steps): what a shape-keyed cache (cuDNN's
    plans, CUDA graphs, compiled kernels) pays for again in this step. Issue 46's goal: at most 2 per
    step in the learner and scorers together, after two warm-up steps."""
    for name, row in figures["windows"].items():
        shapes = {c["shape"] for c in figures["attention_calls"] if name == "step" or c["window"] == name}
        if "attention" in row and "calls" in row["attention"]:
            row["attention"]["new_signatures"] = len(shapes - seen)
            row["attention"]["steps_before"] = steps_before


def trainer_facts(trainer) -> dict:
    """What the windows' FLOPs and the ceiling need from the profiled step's trainer."""
    roles = trainer.roles
    exp = trainer.last_result.exp
    lengths = [int(n) for n in exp.valid.sum(1).tolist()]
    critic = roles.scoring_critic if roles.scoring_critic is not None else roles.critic
    score_models = [m for m in (roles.reward_model, roles.reference, critic) if m is not None]
    return {"lengths": lengths, "device": str(roles.device), "compute_dtype": roles.compute_dtype,
            "param_dtype": next(roles.policy.parameters()).dtype, "backend": roles.backend,
            "generate_flops": forward_flops(roles.policy, lengths),
            "score_flops": sum(forward_flops(m, lengths) for m in score_models),
            "threads": torch.get_num_threads()}


def ceiling(policy_path: Path, facts: dict, iters: int = 3, warmup: int = 2) -> dict:
    """Forward + backward + AdamW of ONE packed row of the train window's actor tokens (its
    sequences end to end, position ids restarting at 0 for each: transformers' packed-sequence
    mask keeps them apart, as in oppo's packed layout), on the policy loaded fresh, in the
    trainer's weights' dtype under autocast to its compute dtype; fused AdamW on CUDA. The median
    of ``iters`` timed iterations after ``warmup``; FLOPs counted as ``oppo.perf`` counts them."""
    from transformers import AutoModelForCausalLM

    device, lengths = torch.device(facts["device"]), facts["lengths"]
    cuda = device.type == "cuda"
    model = AutoModelForCausalLM.from_pretrained(str(policy_path), dtype=facts["param_dtype"]).to(device)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-7, fused=cuda)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, sum(lengths)), generator=g).to(device)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    autocast = (torch.autocast(device.type, dtype=facts["compute_dtype"])
                if facts["compute_dtype"] != facts["param_dtype"] else contextlib.nullcontext())
    times = []
    for i in range(warmup + iters):
        if cuda:
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast:
            logits = model(input_ids=ids, position_ids=pos).logits  # [1, N, V]
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    flops = 3 * forward_flops(model, lengths)
    attn = getattr(model.config, "_attn_implementation", None)
    del model, opt, logits, loss
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    s = statistics.median(times)
    out = {"tokens": sum(lengths), "sequences": len(lengths), "seconds": s, "tflops": flops / s / 1e12,
           "attention": attn or "?"}
    out.update(mfus(flops, s, facts))
    return out


def mfus(flops: float, seconds: float, facts: dict) -> dict:
    """``mfu`` against the measured matmul peak, ``mfu_spec`` against the device's spec peak (absent
    where ``oppo.perf`` knows none)."""
    out = {}
    if seconds > 0:
        out["mfu"] = flops / seconds / peak_flops(facts["device"], facts["compute_dtype"], facts["threads"])
        spec = spec_peak_flops(facts["device"], facts["compute_dtype"])
        if spec is not None:
            out["mfu_spec"] = flops / seconds / spec
    return out


def add_flops(result: dict) -> None:
    """Each window's model FLOPs and MFU (``oppo.perf``'s accounting): generate, the actor's forward;
    score, the reward model's, reference's and critic's; train, what the trainer counted
    (``perf/train_tflops`` x ``time/train``: the update and the old-log-prob recompute)."""
    facts, prof = result["_trainer"], result["profiled"]
    flops = {"generate": facts["generate_flops"], "score": facts["score_flops"]}
    if "perf/train_tflops" in prof and "time/train" in prof:
        flops["train"] = prof["perf/train_tflops"] * 1e12 * prof["time/train"]
    for name, f in flops.items():
        row = result["windows"].get(name)
        if row is not None and row["wall_s"] > 0:
            row["model_tflop"] = f / 1e12
            row.update(mfus(f, row["wall_s"], facts))


# ====================================================================== A/B


def config_value(cfg, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def has_key(cfg, key: str) -> bool:
    try:
        config_value(cfg, key)
        return True
    except AttributeError:
        return False


def plan_ab(remedies, settings: list[str]) -> list[dict]:
    """Each remedy's arms: ``{"remedy", "key", "arms": [{"arm", "setting", "value", "baseline"}]}``
    or ``{"remedy", "key", "skipped": why}``."""
    base = load_config(None, settings)
    rows = []
    for r in remedies:
        row: dict = {"remedy": r.name, "key": r.key}
        if not has_key(base, r.key):
            rows.append({**row, "skipped": f"no setting {r.key} in oppo.config (not built yet)"})
            continue
        arms = []
        try:
            for arm, value in (("on", r.on), ("off", r.off)):
                cfg = base if value is None else load_config(None, settings + [f"{r.key}={value}"])
                v = config_value(cfg, r.key)
                arms.append({"arm": arm, "setting": f"{r.key}={value}" if value is not None else f"{r.key}={v} (default)",
                             "value": repr(v), "baseline": v == config_value(base, r.key),
                             "override": [] if value is None else [f"{r.key}={value}"]})
        except ConfigError as e:
            rows.append({**row, "skipped": f"{type(e).__name__}: {e}"})
            continue
        if arms[0]["value"] == arms[1]["value"]:
            rows.append({**row, "skipped": f"on and off are the same setting here ({r.key} = {arms[0]['value']})"})
            continue
        rows.append({**row, "arms": arms})
    return rows


def arm_summary(res: dict) -> dict:
    """An A/B arm's figures: step and stage times (profiled step), per window the GPU busy share and
    host syncs, the step's launches and captures, the longest attention call."""
    p, w = res["profiled"], res["windows"]
    out = {k.split("/")[1]: p[k] for k in ("time/step", "time/generate", "time/score", "time/train",
                                            "perf/train_mfu", "perf/train_mfu_spec") if k in p}
    for name in ("generate", "score", "train"):
        if name in w and "busy_share" in w[name]:
            out[f"{name}_busy"] = w[name]["busy_share"]
    step = w["step"]
    for key in ("host_syncs", "launches", "graph_captures", "aten_ops"):
        if key in step:
            out[key] = step[key]
    if "attention" in step and "max_host_ms" in step["attention"]:
        out["attention_max_host_ms"] = step["attention"]["max_host_ms"]
        out["attention_signatures"] = step["attention"]["signatures"]
        out["attention_new_signatures"] = step["attention"]["new_signatures"]
    return out


# ====================================================================== output


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def to_markdown(r: dict) -> str:
    L = [f"# gpu_profile: one {r.get('mode', 'sequential')} PPO step, {r['workload']}", "",
         f"Machine: {r['machine']}", "", f"Command: `{r['command']}`", "", f"Rollout engine: {r.get('engine', '?')}", ""]
    base = r.get("baseline")
    if base is None:
        return "\n".join(L + ["(no profiled step yet)", ""])
    un, pr = base.get("unprofiled", {}), base["profiled"]
    L += [f"Step: {_f(un.get('time/step'), '.2f')} s unprofiled, {_f(pr.get('time/step'), '.2f')} s under the "
          f"profiler (warm-up step untimed). Trainer's own figures (unprofiled step): train MFU "
          f"{_f(un.get('perf/train_mfu'), '.1%')} of the measured peak ({_f(un.get('perf/peak_tflops'), '.3g')} TFLOP/s), "
          f"{_f(un.get('perf/train_mfu_spec'), '.1%')} of the spec peak ({_f(un.get('perf/peak_spec_tflops'), '.3g')} "
          f"TFLOP/s).", "", "## Windows (the profiled step)", "",
          "| window | wall (s) | kernels (s) | busy (s) | busy share | kernels | launches | graph launches | "
          "graph captures | host syncs | DtoH copies | aten ops | matmul bf16 | MFU | MFU (spec) | ceiling MFU | "
          "ceiling MFU (spec) |", "|---|" + "---|" * 16]
    c = r.get("ceiling", {})
    for name, w in base["windows"].items():
        L.append(f"| {name} | {w['wall_s']:.3f} | {_f(w.get('kernel_s'), '.3f')} | {_f(w.get('busy_s'), '.3f')} | "
                 f"{_f(w.get('busy_share'), '.0%')} | {_f(w.get('kernels'), 'd')} | {_f(w.get('launches'), 'd')} | "
                 f"{_f(w.get('graph_launches'), 'd')} | {_f(w.get('graph_captures'), 'd')} | "
                 f"{_f(w.get('host_syncs'), 'd')} | {_f(w.get('dtoh_copies'), 'd')} | {w['aten_ops']} | "
                 f"{_f(w.get('matmul_bf16_share'), '.0%')} | {_f(w.get('mfu'), '.1%')} | {_f(w.get('mfu_spec'), '.1%')} | "
                 f"{_f(c.get('mfu') if name in ('generate', 'score', 'train') else None, '.1%')} | "
                 f"{_f(c.get('mfu_spec') if name in ('generate', 'score', 'train') else None, '.1%')} |")
    L += ["", "MFU here: the profiled step's model FLOPs in the window / the window's wall time, the profiler's "
          "own overhead included (the trainer's figures of the unprofiled step are above). "
          "On CPU, kernels = the aten ops' self time and busy = the time inside an op; the CUDA-only counts "
          "are '-'. Counts are of the host calls made in the window; kernels are assigned to the window that "
          "launched them. Windows: the trainer's stage spans (generate: actor/*, score: scorer/*, train: "
          "learner/*, which in sequential mode holds the old-log-prob recompute); other: the rest of the step.", ""]
    if c:
        tw = base["windows"].get("train", {})
        L += ["## The attainable ceiling", "",
              f"Forward + backward + AdamW of one packed row of {c['tokens']:,} tokens ({c['sequences']} sequences, "
              f"the train window's), the policy alone (attention: {c['attention']}): {c['seconds'] * 1e3:.1f} ms, "
              f"{c['tflops']:.3g} TFLOP/s, MFU {_f(c.get('mfu'), '.1%')} (spec {_f(c.get('mfu_spec'), '.1%')})."]
        v = r.get("train_vs_ceiling", {})
        if "unprofiled" in v:
            L += [f"The train window ran at {un['perf/train_tflops']:.3g} TFLOP/s in the unprofiled step: the "
                  f"ceiling is **{v['unprofiled']:.1f}x** that (goal: within 2x)"
                  + (f"; {v['profiled']:.1f}x in the profiled step ({tw['model_tflop']:.3g} TFLOP in "
                     f"{tw['wall_s']:.3f} s)." if "profiled" in v else ".")]
        L.append("")
    L += ["## Top kernels per window (GPU time; on CPU: ops by self time)", ""]
    for name, w in base["windows"].items():
        if name == "step" or not w.get("top"):
            continue
        L += [f"**{name}**", "", "| ms | count | kernel |", "|---|---|---|"]
        L += [f"| {t['ms']:.2f} | {t['count']} | `{t['name'][:110]}` |" for t in w["top"]]
        L.append("")
    if any(w.get("sync_ops") for w in base["windows"].values()):
        L += ["## Host syncs by the op that made them", "", "| window | op: syncs |", "|---|---|"]
        for name, w in base["windows"].items():
            if w.get("sync_ops"):
                L.append(f"| {name} | " + ", ".join(f"`{k}`: {v}" for k, v in w["sync_ops"].items()) + " |")
        L.append("")
    L += ["## Attention", "", "| window | calls | backends | signatures | new signatures | longest host (ms) | "
          "its shape, backend | median host (ms) | backward: backends | backward longest (ms) |", "|---|" + "---|" * 9]
    for name, w in base["windows"].items():
        a = w.get("attention")
        if not a:
            continue
        L.append(f"| {name} | {a.get('calls', '-')} | {a.get('backends', '-')} | {a.get('signatures', '-')} | "
                 f"{a.get('new_signatures', '-')} | {_f(a.get('max_host_ms'), '.2f')} | {a.get('max_host_shape', '-')}, {a.get('max_host_backend', '-')} | "
                 f"{_f(a.get('median_host_ms'), '.3f')} | {a.get('backward_backends', '-')} | "
                 f"{_f(a.get('backward_max_ms'), '.2f')} |")
    L += ["", "New signatures: the profiled step's attention shapes that the steps before it (the warm-up, and for "
          "the baseline the unprofiled step) did not see: each costs a shape-keyed cache (cuDNN plans, CUDA "
          "graphs) a miss.", "", "## A/B of the remedies (a fresh trainer per arm: a warm-up step, then one profiled step)", "",
          "| remedy | arm | setting | step (s) | generate | score | train | train busy | host syncs | launches | "
          "captures | attention signatures (new) | attention longest (ms) | train MFU |", "|---|" + "---|" * 13]
    for row in r.get("ab", []):
        if "skipped" in row:
            L.append(f"| {row['remedy']} | skipped | `{row['key']}` | {row['skipped']} |" + " |" * 10)
            continue
        for arm in row["arms"]:
            s = arm.get("figures")
            if s is None:
                L.append(f"| {row['remedy']} | {arm['arm']} | `{arm['setting']}` | not run: "
                         f"{arm.get('not_run', '?')} |" + " |" * 10)
                continue
            L.append(f"| {row['remedy']} | {arm['arm']}{' (baseline)' if arm['baseline'] else ''} | `{arm['setting']}` | "
                     f"{_f(s.get('step'), '.2f')} | {_f(s.get('generate'), '.2f')} | {_f(s.get('score'), '.2f')} | "
                     f"{_f(s.get('train'), '.2f')} | {_f(s.get('train_busy'), '.0%')} | {_f(s.get('host_syncs'), 'd')} | "
                     f"{_f(s.get('launches'), 'd')} | {_f(s.get('graph_captures'), 'd')} | "
                     f"{_f(s.get('attention_signatures'), 'd')} ({_f(s.get('attention_new_signatures'), 'd')}) | "
                     f"{_f(s.get('attention_max_host_ms'), '.2f')} | "
                     f"{_f(s.get('train_mfu'), '.1%')} |")
    L += ["", f"In all {r.get('seconds', 0):.0f} s.", ""]
    return "\n".join(L)


def _public(x):
    """``x`` for the JSON: private keys (``_trainer``) left out, dtypes as text."""
    if isinstance(x, dict):
        return {str(k): _public(v) for k, v in x.items() if not str(k).startswith("_")}
    if isinstance(x, (list, tuple)):
        return [_public(v) for v in x]
    if isinstance(x, torch.dtype):
        return str(x)
    return x


def write(result: dict, out: Path, calls_cap: int = 3000) -> None:
    r = _public(result)
    base = r.get("baseline")
    if base and len(base.get("attention_calls", [])) > calls_cap:
        base["attention_calls_left_out"] = len(base["attention_calls"]) - calls_cap
        base["attention_calls"] = base["attention_calls"][:calls_cap]
    for row in r.get("ab", []):
        for arm in row.get("arms", []):
            arm.pop("result", None)
    text = json.dumps(r, indent=1, allow_nan=False)  # a NaN here is a bug: it raises
    (out / "profile.json").write_text(text)
    (out / "profile.md").write_text(to_markdown(result))


# ====================================================================== main


def parse(argv):
    p = argparse.ArgumentParser(prog="gpu_profile.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/gpu_profile", help="Where profile.md and profile.json go.")
    p.add_argument("--work", default=None, help="Models, runs and chrome traces (default OUT/work).")
    p.add_argument("--models", default=None, help="The synthetic models' folder (written, or reused if they match).")
    p.add_argument("--device", default="cuda", help="cuda, or cpu (with --tiny: the smoke).")
    p.add_argument("--tiny", action="store_true", help="Smoke sizes: tiny models, B = 8, lengths up to 64.")
    p.add_argument("--policy-size", default=None, help="Policy size (oppo.bench.MODEL_SIZES; default 1b).")
    p.add_argument("--reward-size", default=None, help="Reward/critic size (default 125m).")
    p.add_argument("--batch", type=int, default=None, help="B (default 64; --tiny 8).")
    p.add_argument("--budget-s", type=float, default=None,
                   help="Start no A/B arm that would end past this many seconds in all (default 225; --tiny 120).")
    p.add_argument("--ab", action="append", default=[], metavar="KEY=ON/OFF",
                   help="One more A/B row (repeatable), e.g. ppo.packing=on/off.")
    p.add_argument("--no-ab", action="store_true", help="The baseline's profile and the ceiling only.")
    p.add_argument("--mode", default="sequential",
                   help="The overlap mode profiled (default sequential: one stage a window; oppo: the scorer "
                        "slots and their graphs beside the decode loop, windows overlapping).")
    p.add_argument("overrides", nargs="*", help="section.key=value settings of every run.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    started = time.time()
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_profile: no CUDA device; use --device cpu --tiny for the CPU smoke run.")
    tiny = args.tiny
    policy_size = args.policy_size or ("tiny" if tiny else "1b")
    reward_size = args.reward_size or ("tiny" if tiny else "125m")
    B = args.batch or (8 if tiny else 64)
    budget = args.budget_s or (120.0 if tiny else 225.0)
    workload = WORKLOADS["representative"]
    if tiny:
        workload = workload.scaled(64)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else out / "work"
    dtype = torch.bfloat16 if cuda else torch.float32
    extra = []
    for spec in args.ab:
        key, _, values = spec.partition("=")
        on, _, off = values.partition("/")
        if not key or not on or not off:
            raise SystemExit(f"gpu_profile: --ab {spec!r}: write KEY=ON/OFF, e.g. ppo.packing=on/off")
        extra.append(Remedy(key, key, on, off))
    say(f"gpu_profile: building {policy_size} policy + {reward_size} reward model on {args.device}")
    paths = write_synthetic_models(Path(args.models) if args.models else work / "models", policy_size, reward_size,
                                   args.device if cuda else "cpu", dtype, prompt_words=(4, 24) if tiny else (16, 96))
    settings = trainer_settings(paths, args.device, B, workload, tiny) + list(args.overrides)
    result: dict = {
        "machine": machine(), "command": "python benchmarks/gpu_profile.py " + " ".join(argv), "mode": args.mode,
        "workload": f"{policy_size} policy + {reward_size} reward/critic (synthetic, random weights), {dtype} on "
                    f"{args.device}, B = {B}, {workload.name} lengths (forced, up to {workload.max_new_tokens})",
        "settings": settings, "models_s": time.time() - started}
    base = run_profile(settings, "baseline", work, workload, cuda, say, baseline=True, mode=args.mode)
    result["baseline"], result["backend"] = base, base["_trainer"]["backend"]
    add_flops(base)
    result["seconds"] = time.time() - started
    write(result, out)
    say(f"gpu_profile: baseline profiled in {base['seconds']:.1f} s; the ceiling")
    result["ceiling"] = c = ceiling(paths["policy"], base["_trainer"])
    # how far the train window is from the ceiling: a ratio of rates, so the unprofiled step (another
    # batch) compares too
    v = result["train_vs_ceiling"] = {}
    if base.get("unprofiled", {}).get("perf/train_tflops"):
        v["unprofiled"] = c["tflops"] / base["unprofiled"]["perf/train_tflops"]
    if base["windows"].get("train", {}).get("model_tflop"):
        tw = base["windows"]["train"]
        v["profiled"] = c["tflops"] / (tw["model_tflop"] / tw["wall_s"])
    result["seconds"] = time.time() - started
    write(result, out)
    rows = [] if args.no_ab else plan_ab(REMEDIES + tuple(extra), settings)
    result["ab"] = rows
    cost = base["seconds"]  # an arm: a build, a warm-up step and a profiled step (the baseline: one step more)
    for row in rows:
        for arm in row.get("arms", []):
            if arm["baseline"]:
                arm["figures"] = arm_summary(base)
                continue
            left = started + budget - time.time()
            if cost > left:
                arm["not_run"] = f"out of time (an arm takes about {cost:.0f} s, {max(left, 0):.0f} s left)"
                say(f"gpu_profile: A/B {arm['setting']}: {arm['not_run']}")
                continue
            say(f"gpu_profile: A/B {arm['setting']}")
            res = run_profile(settings + arm["override"], f"ab-{arm['setting'].split(' ')[0]}", work, workload, cuda,
                              say, mode=args.mode)
            arm["figures"] = arm_summary(res)
            result["seconds"] = time.time() - started
            write(result, out)
    result["seconds"] = time.time() - started
    write(result, out)
    print((out / "profile.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
