"""Projections: the PPO step of a named GPU cluster, simulated per mode with roofline costs.

:func:`paper_setting` is the OPPO paper's setup as far as the paper gives it (7B actor with a
value head, 7B reward model, 8 GPUs with 7 generating and training and 1 scoring, batch 112)
plus what it does not give, chosen and stated here: prompts of 256 tokens, responses
log-normal with median 128 tokens, capped at 1024, TRL-style one-shot reference and
policy/value forwards on the actor GPUs after generation, one PPO epoch in 4 minibatches,
Delta 8 and max_lag 1 (oppo's defaults), 256-token chunks.

:func:`scale_sweep` keeps the node layout (7 actor GPUs + 1 scorer GPU per node) and the
per-GPU batch (16 sequences per actor GPU) and grows the cluster: weak scaling, the
long-tail straggler effect grows with the number of sequences a step waits for.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any

from .costs import GPUS, Efficiency, Roofline, model_shape
from .lengths import LogNormalLengths
from .sim import MODES, DeviceSplit, RunResult, Workload, simulate

__all__ = ["gpu_costs", "paper_setting", "parse_placement", "project", "scale_sweep", "Scenario"]


def gpu_costs(gpu: str, actor_b: float = 7.0, reward_b: float = 7.0, eff: Efficiency | None = None,
              node_gpus: int = 8) -> Roofline:
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}; one of {', '.join(GPUS)}")
    a, r = model_shape(actor_b), model_shape(reward_b)
    return Roofline(GPUS[gpu], {"policy": a, "actor": a, "reference": a, "critic": a, "reward": r},
                    eff or Efficiency(), node_gpus)


def parse_placement(text: str, gpus: int | None = None) -> tuple[int, int]:
    """``"7+1"`` -> (7, 1); ``"8"`` -> (8, 0): everything shares the 8 GPUs."""
    parts = [int(p) for p in str(text).split("+")]
    if len(parts) == 1:
        parts.append(0)
    if len(parts) != 2 or parts[0] < 1 or parts[1] < 0:
        raise ValueError(f"--placement: give ACTOR+SCORER GPUs like 7+1 (or one number to share), not {text!r}")
    if gpus is not None and sum(parts) != gpus:
        raise ValueError(f"--placement {text} uses {sum(parts)} GPUs but --gpus is {gpus}; make them agree")
    return parts[0], parts[1]


@dataclass(frozen=True)
class Scenario:
    """What the planner projects: a workload on a placement at some costs, with a one-line
    description (``paper_setting`` builds one; ``tuner.Setting`` is another thing: the
    overlap knobs a step runs with)."""

    workload: Workload
    placement: DeviceSplit
    costs: Roofline
    label: str
    max_new_tokens: int
    sigma: float


def paper_setting(gpu: str = "h200", sigma: float = 1.0, actor_b: float = 7.0, reward_b: float = 7.0,
                  actor_gpus: int = 7, scorer_gpus: int = 1, batch: int = 112, max_new_tokens: int = 1024,
                  median: float | None = None, prompt_tokens: int = 256, delta: int = 8, max_lag: int = 1,
                  chunk: int = 256, epochs: int = 1, minibatches: int = 4, micro: int = 4,
                  eff: Efficiency | None = None) -> Scenario:
    median = median or max_new_tokens / 8
    wl = Workload(batch=batch, lengths=LogNormalLengths(median, sigma, max_new_tokens, seed=17),
                  prompt_tokens=prompt_tokens, delta=min(delta, batch), max_lag=max_lag, chunk=chunk,
                  minibatch=max(1, batch // minibatches), micro=micro, epochs=epochs)
    if scorer_gpus:
        pl = DeviceSplit(actor_gpus, scorer_gpus, scorer_roles=("reward",), actor_roles=("reference", "policy"),
                       critic="value_head")
    else:
        pl = DeviceSplit(actor_gpus, 0, scorer_roles=("reward",), actor_roles=("reference", "policy"),
                       critic="value_head")
    costs = gpu_costs(gpu, actor_b, reward_b, eff)
    label = (f"{actor_b:g}B actor (value head), {reward_b:g}B reward model, {GPUS[gpu].name} x "
             f"{actor_gpus + scorer_gpus} ({pl.label()}), B={batch}, prompts {prompt_tokens} tokens, responses "
             f"log-normal median {median:g} sigma {sigma:g} cap {max_new_tokens}, Delta {wl.delta}, max_lag {max_lag}, "
             f"chunk {chunk}, {epochs} epoch(s) x {minibatches} minibatches")
    return Scenario(wl, pl, costs, label, max_new_tokens, sigma)


def project(setting: Scenario, modes=MODES, steps: int = 60, warmup: int = 2) -> dict[str, RunResult]:
    return {m: simulate(m, setting.workload, setting.costs, setting.placement, steps, warmup,
                        keep_spans=setting.placement.actor_devices <= 8) for m in modes}


def summarize(results: dict[str, RunResult]) -> dict[str, dict]:
    """Per mode: step times, speedup over sequential (of the mean step time: training time), busy
    fractions, tokens/s."""
    base = results["sequential"].step_time_median if "sequential" in results else None
    out = {}
    for m, r in results.items():
        util = r.utilization()
        timed = r.timed
        out[m] = {
            "step_time_median_s": r.step_time_median,
            "step_time_mean_s": r.step_time_mean,
            # over a long run the wall-clock per step is the mean; the median is what oppo bench reports
            "speedup": results["sequential"].step_time_mean / r.step_time_mean if base else None,
            "speedup_median": base / r.step_time_median if base else None,
            "utilization": util,
            "busy_fraction_worker": r.busy_fraction("lane"),  # (the key predates the word "lane"; saved plans have it)
            "tokens_per_s": r.tokens_per_s(),
            "decode_share_of_step": statistics.mean((s.close - s.start) / s.time for s in timed),
            "offpolicy_token_frac": sum(s.offpolicy_tokens for s in timed) / max(1, sum(s.tokens for s in timed)),
            "lag_max": max((max(s.lags) for s in timed), default=0),
        }
    return out


def scale_sweep(gpu: str, gpus_list: list[int], sigmas: list[float], per_gpu_batch: int = 16,
                node: tuple[int, int] = (7, 1), delta_frac: float = 8 / 112, steps: int = 60, warmup: int = 2,
                modes=MODES, progress=None, **kw) -> list[dict]:
    """Weak scaling: ``gpus`` GPUs in nodes of ``node`` (actor, scorer) GPUs, ``per_gpu_batch``
    sequences per actor GPU, Delta = ``delta_frac`` of B."""
    rows = []
    per_node = sum(node)
    for sigma in sigmas:
        for n in gpus_list:
            if n % per_node:
                raise ValueError(f"--scale: {n} GPUs is not a whole number of {per_node}-GPU nodes")
            nodes = n // per_node
            a, s = node[0] * nodes, node[1] * nodes
            B = per_gpu_batch * a
            st = paper_setting(gpu, sigma=sigma, actor_gpus=a, scorer_gpus=s, batch=B,
                               delta=max(1, round(delta_frac * B)), **kw)
            # big batches give steady means in fewer steps; 10 timed steps at least
            n_steps = max(warmup + 10, min(steps, round(steps * 112 / B)))
            res = summarize(project(st, modes, n_steps, warmup))
            rows.append({"gpus": n, "sigma": sigma, "batch": B, "delta": st.workload.delta_at(0), "steps": n_steps,
                         "placement": st.placement.label(),
                         **{f"{m}_speedup": res[m]["speedup"] for m in modes},
                         **{f"{m}_step_s": res[m]["step_time_mean_s"] for m in modes},
                         **{f"{m}_util": res[m]["utilization"]["all_devices"] for m in modes}})
            if progress:
                progress(f"  {n} GPUs, sigma {sigma}: oppo {res['oppo']['speedup']:.2f}x")
    return rows


def sensitivity(base: dict, sigma: float, steps: int = 60) -> list[dict]:
    """The paper setting at ``sigma`` with one assumption changed at a time."""
    eff = base.get("eff") or Efficiency()
    variants: list[tuple[str, dict[str, Any]]] = [
        ("as assumed above", {}),
        ("Delta 16", {"delta": 16}),
        ("Delta 28 (B/4)", {"delta": 28}),
        ("max_lag 2", {"max_lag": 2}),
        ("max_lag 2, Delta 28", {"max_lag": 2, "delta": 28}),
        ("4 PPO epochs (TRL's default)", {"epochs": 4}),
        ("a faster decoder (5 ms per step, not 20: CUDA graphs, as serving engines do)", {"eff": replace(eff, decode_step_s=0.005)}),
        ("chunk 64 tokens", {"chunk": 64}),
        ("responses capped at 2048 (median 256)", {"max_new_tokens": 2048}),
        ("3B actor, 7B reward model", {"actor_b": 3.0}),
        ("H100 instead of H200", {"gpu": "h100"}),
        ("A100 instead of H200", {"gpu": "a100"}),
    ]
    rows = []
    for label, change in variants:
        kw = {**base, **change}
        res = summarize(project(paper_setting(sigma=sigma, **kw), steps=steps))
        rows.append({"variant": label, **{f"{m}_speedup": res[m]["speedup"] for m in res},
                     "sequential_step_s": res["sequential"]["step_time_mean_s"],
                     "utilization_gain": res["oppo"]["utilization"]["all_devices"]
                     / res["sequential"]["utilization"]["all_devices"]})
    return rows
