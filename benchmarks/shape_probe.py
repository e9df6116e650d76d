"""What a GPU would pay per call, counted on the CPU: new attention shapes per step and host reads
per backward pass (issue 46's CPU measure).

    python benchmarks/shape_probe.py                      # the issue's probe: 16 layers, B = 64, 5 steps
    python benchmarks/shape_probe.py --quick              # 4 layers, B = 16: the mechanism in a minute
    python benchmarks/shape_probe.py ppo.shape_buckets=off   # the same without bucketed shapes

A model as deep as the 1B (16 layers) but narrow (hidden 64), run through the bf16 code path
(``policy.dtype=bfloat16``) with the representative long-tailed lengths, in ``sequential`` and in
``intra`` with chunk 16, every role in this process (``placement.local.scorer_process=false``) so
that every attention call is seen. For each step it prints:

- the attention *signatures* (query, key and mask shapes, dtype, causal flag of each
  ``scaled_dot_product_attention`` call) not seen in an earlier step, by the folder of the oppo
  code that made the call (learner, scoring, rollout). On a GPU every new signature is a cuDNN plan
  built, a CUDA graph that cannot be replayed, a recompilation; after the warm-up steps a run
  should see (almost) none;
- the learner's reads of a device value by the host (``item``, ``tolist``, ``bool``, ``int``,
  ``float``, ``cpu``, ``numpy``: each a CPU-GPU sync point on a GPU) per backward pass, counted
  inside ``Learner.update`` (transformers' own included).

Writes ``shape_probe.json`` under ``--out`` when given.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy")
FOLDERS = ("learner", "scoring", "rollout")


def folder_of_caller() -> str:
    """The role folder of the innermost oppo frame that belongs to one (``oppo/<folder>/``)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename.replace("\\", "/")
        if "/oppo/" in name:
            for folder in FOLDERS:
                if f"/oppo/{folder}/" in name:
                    return folder
        f = f.f_back
    return "other"


class Counter:
    """Patches ``scaled_dot_product_attention`` and the tensor reads; counts per step."""

    def __init__(self):
        self.seen: set[tuple] = set()
        self.new: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.reads = self.backwards = 0
        self.in_update = self.in_micro = False
        self.micro_reads = 0
        self.sites: collections.Counter = collections.Counter()  # where the learner's reads are made

    def install(self) -> None:
        import torch.nn.functional as F

        from oppo.learner.local import Learner

        real_sdpa = F.scaled_dot_product_attention

        def sdpa(q, k, v, attn_mask=None, *a, **kw):
            sig = (tuple(q.shape), tuple(k.shape), tuple(attn_mask.shape) if attn_mask is not None else None,
                   str(q.dtype), bool(kw.get("is_causal", False)))
            where = folder_of_caller()
            self.calls[where] += 1
            if (where, sig) not in self.seen:
                self.seen.add((where, sig))
                self.new[where] += 1
            return real_sdpa(q, k, v, attn_mask, *a, **kw)

        F.scaled_dot_product_attention = sdpa
        for name in READS:
            real = getattr(torch.Tensor, name)

            def counted(t, *a, _real=real, _name=name, **kw):
                f = sys._getframe(1)
                # AdamW's step counters off the fused CUDA path are host tensors: their item() reads
                # no device (on CUDA the fused kernel keeps them on the device and reads none)
                if self.in_update and "torch/optim/" not in f.f_code.co_filename:
                    self.reads += 1
                    self.micro_reads += self.in_micro
                    self.sites[f"{_name} {f.f_code.co_filename.split('site-packages/')[-1]}:{f.f_lineno}"] += 1
                return _real(t, *a, **kw)

            setattr(torch.Tensor, name, counted)
        real_backward = torch.Tensor.backward

        def backward(t, *a, **kw):
            if self.in_update:
                self.backwards += 1
            return real_backward(t, *a, **kw)

        torch.Tensor.backward = backward
        real_update = Learner.update
        from oppo.learner import local

        for owner, attr in ((Learner, "_actor_micro_step"), (local, "critic_micro_step")):
            real_step = getattr(owner, attr)

            def micro(*a, _real=real_step, **kw):
                self.in_micro = True
                try:
                    return _real(*a, **kw)
                finally:
                    self.in_micro = False

            setattr(owner, attr, micro)

        def update(learner, *a, **kw):
            self.in_update = True
            try:
                return real_update(learner, *a, **kw)
            finally:
                self.in_update = False

        Learner.update = update

    def take(self) -> dict:
        out = {"new_signatures": dict(self.new), "attention_calls": dict(self.calls), "learner_reads": self.reads, "micro_step_reads": self.micro_reads,
               "learner_backwards": self.backwards,
               "reads_per_backward": self.reads / self.backwards if self.backwards else None}
        self.new, self.calls = collections.Counter(), collections.Counter()
        self.reads = self.backwards = self.micro_reads = 0
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 layers, B = 16, 4 steps.")
    p.add_argument("--steps", type=int, default=None, help="Steps per mode (default 5; --quick 4).")
    p.add_argument("--modes", default="sequential,intra")
    p.add_argument("--out", default=None)
    p.add_argument("--sites", action="store_true", help="Print where the learner's host reads are made.")
    p.add_argument("overrides", nargs="*", help="section.key=value settings for every mode.")
    args = p.parse_args(argv)
    from oppo.bench import WORKLOADS, write_synthetic_models
    from oppo.bench import workloads
    from oppo.config import load_config
    from oppo.trainer import Trainer

    layers, B = (4, 16) if args.quick else (16, 64)
    steps = args.steps or (4 if args.quick else 5)
    workloads.MODEL_SIZES["probe"] = dict(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=176, vocab_size=512)
    work = WORKLOADS["representative"].scaled(128)
    root = Path(tempfile.mkdtemp(prefix="shape_probe_"))
    paths = write_synthetic_models(root / "models", "probe", "probe", prompt_words=(8, 48))
    counter = Counter()
    counter.install()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result: dict = {"layers": layers, "batch": B, "steps": steps, "overrides": args.overrides, "modes": {}}
    for mode in [m for m in args.modes.split(",") if m]:
        cfg = load_config(None, [
            f"policy.path={paths['policy']}", f"reward.path={paths['reward']}", f"data.prompts={paths['prompts']}",
            "policy.device=cpu", "policy.dtype=bfloat16", f"ppo.batch_size={B}", f"ppo.minibatch_size={B // 2}",
            f"ppo.micro_batch_size={max(1, B // 4)}", f"generation.max_new_tokens={work.max_new_tokens}",
            "data.max_prompt_tokens=64", "log.progress=false", "run.samples=0", f"overlap.mode={mode}",
            "overlap.chunk_size=16", "overlap.delta=0", "placement.local.scorer_process=false",
            f"run.out_dir={root / 'runs' / mode}", *args.overrides])
        counter.seen.clear()  # each mode on its own: a mode's shapes are not paid for by another's
        t = Trainer.from_config(cfg, progress=False)
        t.length_sampler = work.sampler(cfg.run.seed)
        rows = []
        try:
            counter.take()  # (building the trainer: probes and warm-ups are not a step's)
            for step in range(steps):
                t0 = time.perf_counter()
                m = t.run_step()
                row = counter.take()
                row["seconds"] = time.perf_counter() - t0
                row["padded_frac"] = m.get("perf/train_padded_frac")
                rows.append(row)
                new = row["new_signatures"]
                print(f"{mode} step {step}: new attention signatures {sum(new.values())} {new}, attention calls "
                      f"{row['attention_calls']}, learner host reads {row['learner_reads']} over "
                      f"{row['learner_backwards']} backward passes"
                      + (f" ({row['reads_per_backward']:.1f} each)" if row["reads_per_backward"] else "")
                      + f", {row['micro_step_reads']} inside micro-steps"
                      + (f", padded share {row['padded_frac']:.1%}" if row["padded_frac"] is not None else "")
                      + f", {row['seconds']:.1f} s", flush=True)
        finally:
            t.close()
        result["modes"][mode] = rows
        if args.sites:
            for site, n in counter.sites.most_common(12):
                print(f"  {n:6d}  {site}")
        counter.sites.clear()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "shape_probe.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
