"""Stage cost models: what one piece of work costs on one device.

The simulator (``sim.py``) describes every piece of work as a :class:`Work` (an operation of
:data:`OPS`, the model it runs, the sizes that set its cost); a cost model turns it into seconds.
:class:`LinearCosts` is fitted from oppo's own traces (``calibrate.py``); :class:`Roofline` takes
a named GPU's spec-sheet figures and the efficiencies stated in :class:`Efficiency`.

Design notes (the operations, the two models): docs/planner.md, "Stage costs"."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np

__all__ = ["Work", "CostModel", "LinearCosts", "FEATURES", "nnls", "GPU", "GPUS", "ModelShape", "MODELS",
           "model_shape", "Efficiency", "Roofline"]

OPS = ("decode", "prefill", "stream", "oneshot", "train", "book", "sync")


@dataclass(frozen=True)
class Work:
    """One piece of work on one device (sizes summed over its ``calls``)."""

    op: str
    role: str = ""
    calls: int = 1
    rows: float = 0.0
    tokens: float = 0.0
    attn: float = 0.0
    opt_steps: int = 0
    dp: int = 1

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; one of {', '.join(OPS)}")


class CostModel(Protocol):
    """Seconds of work on one device."""

    def time(self, work: Work) -> float: ...

    def decode_steps(self, rows: np.ndarray, attn: np.ndarray) -> np.ndarray:
        """Seconds of each of a sequence of decode steps (``rows``, ``attn``: one entry per step)."""
        ...

    def describe(self) -> str: ...


# --------------------------------------------------------------------------- fitted, linear

FEATURES = {  # the sizes each operation's cost is linear in (the CPU fit; more would overfit)
    "decode": ("calls", "rows", "attn"),
    "prefill": ("calls", "tokens"),
    "stream": ("calls", "tokens"),
    "oneshot": ("calls", "tokens"),
    "train": ("calls", "tokens"),
    "book": ("calls", "rows"),
    "sync": ("calls",),
}


def _prefix(work: Work) -> str:
    return work.op if work.op in ("decode", "prefill", "book", "sync") else f"{work.op}.{work.role}"


@dataclass
class LinearCosts:
    """``time(work) = sum of coef[feature] * size`` over the features of ``FEATURES``.

    ``coef`` keys read ``<op>[.<role>].<size>``, e.g. ``decode.rows`` (seconds per sequence
    per decode step) or ``train.actor.tokens`` (seconds per padded token of a PPO update).
    A missing key costs nothing.
    """

    coef: dict[str, float] = field(default_factory=dict)
    label: str = "fitted"
    # set by calibrate.fit: how well the model explains the spans, per kind of span; outside to_dict, equality and repr
    fit_stats: dict[str, dict[str, float]] | None = field(default=None, compare=False, repr=False)

    @staticmethod
    def features(work: Work) -> dict[str, float]:
        p = _prefix(work)
        return {f"{p}.{name}": float(getattr(work, name)) for name in FEATURES[work.op]}

    def time(self, work: Work) -> float:
        return sum(self.coef.get(k, 0.0) * v for k, v in self.features(work).items())

    def decode_steps(self, rows: np.ndarray, attn: np.ndarray) -> np.ndarray:
        c = self.coef
        return (c.get("decode.calls", 0.0) + c.get("decode.rows", 0.0) * np.asarray(rows, float)
                + c.get("decode.attn", 0.0) * np.asarray(attn, float))

    def describe(self) -> str:
        return f"{self.label}: " + ", ".join(f"{k}={v:.3g}" for k, v in sorted(self.coef.items()) if v)

    def to_dict(self) -> dict:
        return {"label": self.label, "coef": dict(sorted(self.coef.items()))}

    @classmethod
    def from_dict(cls, d: dict) -> "LinearCosts":
        return cls(dict(d["coef"]), d.get("label", "fitted"))


def nnls(A: np.ndarray, b: np.ndarray, iters: int = 500) -> np.ndarray:
    """Non-negative least squares, ``min ||A x - b||`` with ``x >= 0`` (Lawson-Hanson active set)."""
    A, b = np.asarray(A, float), np.asarray(b, float)
    n = A.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, bool)
    w = A.T @ (b - A @ x)
    for _ in range(iters):
        if passive.all() or w[~passive].max(initial=-np.inf) <= 1e-12 * max(1.0, np.abs(w).max()):
            break
        j = np.argmax(np.where(passive, -np.inf, w))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
        w = A.T @ (b - A @ x)
    return x


# --------------------------------------------------------------------------- roofline


@dataclass(frozen=True)
class GPU:
    """Spec-sheet figures of one GPU (dense bf16 tensor-core peak; no sparsity)."""

    key: str
    name: str
    tflops: float  # dense bf16, TFLOP/s
    hbm_tbs: float  # HBM bandwidth, TB/s
    memory_gib: float
    nvlink_gbs: float  # per-GPU bandwidth for collectives inside a node, GB/s
    network_gbs: float  # per-GPU bandwidth for collectives across nodes (one 400 Gb/s NIC per GPU)


GPUS = {
    "h100": GPU("h100", "H100 SXM", 989.0, 3.35, 80, 450.0, 50.0),
    "h200": GPU("h200", "H200 SXM", 989.0, 4.8, 141, 450.0, 50.0),
    "a100": GPU("a100", "A100 SXM 80GB", 312.0, 2.0, 80, 300.0, 25.0),
}


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a transformer: parameters, layers, width, KV width per token."""

    name: str
    params_b: float
    layers: int
    d_model: int
    kv_dim: int  # key (= value) width per layer: kv heads x head dim

    @property
    def params(self) -> float:
        return self.params_b * 1e9

    def kv_bytes_per_token(self, bytes_per: int = 2) -> float:
        return 2 * self.layers * self.kv_dim * bytes_per  # keys and values, every layer


MODELS = {  # Qwen2.5 shapes (the OPPO paper's actors are Qwen2.5-7B and -3B)
    0.5: ModelShape("Qwen2.5-0.5B-like", 0.49, 24, 896, 128),
    1.5: ModelShape("Qwen2.5-1.5B-like", 1.5, 28, 1536, 256),
    3.0: ModelShape("Qwen2.5-3B-like", 3.1, 36, 2048, 256),
    7.0: ModelShape("Qwen2.5-7B-like", 7.6, 28, 3584, 512),
    14.0: ModelShape("Qwen2.5-14B-like", 14.7, 48, 5120, 1024),
    32.0: ModelShape("Qwen2.5-32B-like", 32.5, 64, 5120, 1024),
    72.0: ModelShape("Qwen2.5-72B-like", 72.7, 80, 8192, 1024),
}


def model_shape(size_b: float) -> ModelShape:
    """The preset of that size, or the nearest preset scaled in width to ``size_b`` parameters."""
    if float(size_b) in MODELS:
        return MODELS[float(size_b)]
    near = min(MODELS.values(), key=lambda m: abs(math.log(m.params_b / size_b)))
    s = math.sqrt(size_b / near.params_b)
    return ModelShape(f"{size_b:g}B (scaled {near.name})", size_b, near.layers, int(near.d_model * s),
                      int(near.kv_dim * s))


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the spec-sheet peaks a real run reaches, and fixed overheads (assumptions).

    Defaults describe an eager PyTorch / Hugging Face stack like the paper's TRL baseline and
    oppo's eager backend (``generation.backend=eager``): no CUDA graphs, no paged attention. oppo's
    static backend (the default on CUDA: CUDA graphs) and a serving engine decode with
    about a third of ``decode_step_s`` (measured: ``docs/benchmarks-notes.md``, "Static backend").
    """

    decode_bw: float = 0.6  # of HBM bandwidth, decode (reads the weights and the KV cache every step)
    decode_step_s: float = 0.020  # per decode step: kernel launches, sampling, Python
    forward: float = 0.5  # of peak FLOP/s, prefill and scoring forwards
    forward_call_s: float = 0.005  # per forward call
    train_mfu: float = 0.35  # of peak FLOP/s, PPO update (forward + backward)
    recompute: bool = True  # activation checkpointing: one more forward in the backward
    micro_call_s: float = 0.01  # per training micro-batch
    comm: float = 0.7  # of link bandwidth, collectives
    bytes_per: int = 2  # bf16 weights and KV cache


@dataclass
class Roofline:
    """Roofline costs of ``models`` (role -> shape) on ``gpu`` with efficiencies ``eff``.

    Training is sharded ZeRO-3 style inside a node (parameters gathered for each micro-batch
    over NVLink, overlapped with compute) and data-parallel across nodes (one gradient
    all-reduce per optimizer step over the network).
    """

    gpu: GPU
    models: dict[str, ModelShape]
    eff: Efficiency = field(default_factory=Efficiency)
    node_gpus: int = 8

    def _model(self, role: str) -> ModelShape:
        return self.models.get(role) or self.models["policy"]

    def _forward_s(self, m: ModelShape, calls: float, tokens: float, attn: float, eff: float) -> float:
        flops = 2 * m.params * tokens + 4 * m.layers * m.d_model * attn
        weights = calls * m.params * self.eff.bytes_per
        return (max(flops / (self.gpu.tflops * 1e12 * eff), weights / (self.gpu.hbm_tbs * 1e12 * self.eff.decode_bw))
                + calls * self.eff.forward_call_s)

    def decode_steps(self, rows: np.ndarray, attn: np.ndarray) -> np.ndarray:
        m, e = self._model("policy"), self.eff
        rows, attn = np.asarray(rows, float), np.asarray(attn, float)
        bytes_ = m.params * e.bytes_per + attn * m.kv_bytes_per_token(e.bytes_per)
        flops = 2 * m.params * rows + 4 * m.layers * m.d_model * attn
        return (np.maximum(bytes_ / (self.gpu.hbm_tbs * 1e12 * e.decode_bw), flops / (self.gpu.tflops * 1e12 * e.forward))
                + e.decode_step_s)

    def _train_s(self, w: Work) -> float:
        m, e = self._model(w.role), self.eff
        passes = 4 if e.recompute else 3  # forward, backward (2x), and the recomputed forward
        flops = passes * (2 * m.params * w.tokens + 4 * m.layers * m.d_model * w.attn)
        compute = flops / (self.gpu.tflops * 1e12 * e.train_mfu) + w.calls * e.micro_call_s
        shard = min(w.dp, self.node_gpus)
        pbytes = m.params * e.bytes_per
        # ZeRO-3 inside the node: gather the parameters for forward and backward, reduce-scatter
        # the gradients, every micro-batch (overlapped with compute, so the larger one counts)
        gather = 3 * pbytes * (shard - 1) / shard / (self.gpu.nvlink_gbs * 1e9 * e.comm) * w.calls
        nodes = math.ceil(w.dp / self.node_gpus)
        # across nodes: a ring all-reduce of this GPU's gradient shard, once per optimizer step
        allreduce = (2 * (pbytes / shard) * (nodes - 1) / nodes / (self.gpu.network_gbs * 1e9 * e.comm)
                     * w.opt_steps)
        # AdamW: fp32 master weights, two moments and the gradient, read and written per step
        optim = w.opt_steps * 2 * 16 * m.params / shard / (self.gpu.hbm_tbs * 1e12 * e.decode_bw)
        return max(compute, gather) + allreduce + optim

    def time(self, w: Work) -> float:
        e = self.eff
        if w.op == "decode":
            per = self.decode_steps(np.array([w.rows / max(1, w.calls)]), np.array([w.attn / max(1, w.calls)]))
            return float(per[0]) * w.calls
        if w.op in ("prefill", "stream", "oneshot"):
            return self._forward_s(self._model(w.role or "policy"), w.calls, w.tokens, w.attn, e.forward)
        if w.op == "train":
            return self._train_s(w)
        if w.op == "sync":  # colocated: the rollout backend reads the learner's weights (no copy); see sim.py for pipeline
            return 0.0
        return 0.001 * w.calls  # book: the controller's tensors, negligible next to a GPU step

    def describe(self) -> str:
        g, e = self.gpu, self.eff
        roles = ", ".join(f"{r} {m.name}" for r, m in self.models.items())
        return (f"roofline on {g.name} (spec sheet: {g.tflops:g} TFLOP/s dense bf16, {g.hbm_tbs:g} TB/s HBM, "
                f"{g.nvlink_gbs:g} GB/s NVLink, {g.network_gbs:g} GB/s network per GPU); models: {roles}; "
                f"efficiencies (assumed): decode {e.decode_bw:.0%} of HBM + {e.decode_step_s * 1e3:g} ms per step, "
                f"forwards {e.forward:.0%} of peak + {e.forward_call_s * 1e3:g} ms per call, training MFU "
                f"{e.train_mfu:.0%}{' with activation recompute' if e.recompute else ''}, collectives "
                f"{e.comm:.0%} of link bandwidth")

    def to_dict(self) -> dict:
        return {"gpu": asdict(self.gpu), "models": {r: asdict(m) for r, m in self.models.items()},
                "efficiency": asdict(self.eff), "node_gpus": self.node_gpus}
