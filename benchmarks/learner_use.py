"""The learner's use of the hardware: train-stage MFU and the padded share of what it computes.

    PYTHONPATH=src python benchmarks/learner_use.py --size small --batch 32 --micro 4 --steps 4

``sequential`` mode on a synthetic policy and reward model (also the critic) of ``--size``
(``oppo.bench.MODEL_SIZES``, random weights) with the representative long-tailed lengths scaled
to ``--max-new-tokens``. Per timed step (the first is a warm-up) it reads ``time/train`` and
computes the padded share of the positions the actor's micro-batches computed (the learner's
own ``perf/train_padded_frac``, in its row layout, packed or not; else, from the trained batch,
``learner.padding_stats``; for older code, which has none, the same count in its layout) and the train stage's MFU (forward and backward of actor and
critic: ``oppo.perf``'s accounting, inlined so that older code is measured the same way, against
a matmul peak measured in the same process). Prints medians; ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _matmul_params(model) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def _fwd_flops(model, lengths) -> float:
    cfg = model.config
    width = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return 2.0 * _matmul_params(model) * sum(lengths) + 4.0 * cfg.num_hidden_layers * width * sum(
        n * (n + 1) / 2 for n in lengths)


def _peak(dtype) -> float:
    a, b = torch.randn(1024, 1024).to(dtype), torch.randn(1024, 1024).to(dtype)
    ts = []
    for i in range(6):
        t = time.perf_counter()
        torch.mm(a, b)
        if i:
            ts.append(time.perf_counter() - t)
    return 2.0 * 1024 ** 3 / statistics.median(ts)


def _padded(exp, mbs, micro) -> float:
    """Older code's padded share: runs of ``micro`` rows in the [left-padded prompt | response]
    layout, a micro-batch as wide as its longest prompt plus its longest response."""
    P = exp.P
    start = exp.valid[:, :P].argmax(1).tolist()
    resp = exp.mask.sum(1).long().tolist()
    real_len = exp.valid.sum(1).long().tolist()
    computed = real = 0
    for mb in mbs:
        for rows in mb.split(micro):
            r = rows.tolist()
            computed += len(r) * (P - min(start[i] for i in r) + max(resp[i] for i in r))
            real += sum(real_len[i] for i in r)
    return 1.0 - real / computed


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--minibatch", type=int, default=16)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--models", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    from oppo.bench import WORKLOADS, write_synthetic_models
    from oppo.config import load_config
    from oppo.trainer import Trainer

    torch.set_num_threads(a.threads)
    root = Path(a.models or tempfile.mkdtemp(prefix="oppo-learner-use-"))
    paths = write_synthetic_models(root, a.size, a.size)
    cfg = load_config(None, [
        f"policy.path={paths['policy']}", f"reward.path={paths['reward']}", f"data.prompts={paths['prompts']}",
        f"run.out_dir={root / 'run'}", f"placement.threads={a.threads}", "log.progress=false", "overlap.mode=sequential",
        f"ppo.batch_size={a.batch}", f"ppo.minibatch_size={a.minibatch}", f"ppo.micro_batch_size={a.micro}",
        f"generation.max_new_tokens={a.max_new_tokens}", *a.overrides])
    t = Trainer.from_config(cfg, progress=False)
    peak = _peak(t.roles.compute_dtype)
    sorts = "lengths" in inspect.signature(t.roles.learner.minibatches).parameters
    try:  # the learner's own measure, where it has one (packed micro-batches, ppo.micro_batch_tokens)
        from oppo.learner.batch import padding_stats
    except ImportError:
        padding_stats = None
    rows = []
    try:
        t.length_sampler = WORKLOADS["representative"].scaled(a.max_new_tokens).sampler(cfg.run.seed)
        for step in range(a.steps):
            m = t.run_step()
            exp = t.last_result.exp
            lengths = exp.valid.sum(1)
            mbs = (t.roles.learner.minibatches(a.batch, step, lengths) if sorts
                   else t.roles.learner.minibatches(a.batch, step))
            flops = 3 * cfg.ppo.epochs * sum(_fwd_flops(mdl, lengths.tolist()) for mdl in (t.roles.policy, t.roles.critic)
                                             if mdl is not None)
            if step:
                if "perf/train_padded_frac" in m:  # the learner's own count, in its own row layout
                    padded = m["perf/train_padded_frac"]
                else:
                    padded = (padding_stats(exp, mbs, cfg.ppo)["perf/train_padded_frac"] if padding_stats
                              else _padded(exp, mbs, a.micro))
                rows.append({"train_s": m["time/train"], "padded": padded,
                             "mfu": flops / m["time/train"] / peak})
    finally:
        t.close()
    res = {k: statistics.median(r[k] for r in rows) for k in ("train_s", "padded", "mfu")}
    res.update(peak_gflops=peak / 1e9, sorted_minibatches=sorts)
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "result": res, "steps": rows}, indent=1))


if __name__ == "__main__":
    main()
