"""The rollout backend's decode step alone, timed on a fresh one its spec builds
(``rollout.registry.probe_backend``): the decode overhead a bench reports is measured against it."""

from __future__ import annotations

import statistics
import time

import torch


def backend_step_probe(t, rows: int, prompt_len: int = 32, new_tokens: int = 16, repeats: int = 3) -> float | None:
    """Seconds per decode step of the trainer's rollout backend alone: a fresh backend of the same
    kind (its backend's ``probe``: eager, or static with the same capture) on the same model decodes ``rows`` rows of
    ``prompt_len`` random tokens for ``new_tokens`` sampled steps (the run's temperature, top-k and
    top-p) with no EOS; the median of
    ``repeats`` passes after an untimed one (``benchmarks/decode_speed.py``'s measure). None for a
    backend oppo does not build here (one that loads its own weights, Ray rollout replicas). All ``rows`` rows decode every step,
    where a trained step's rows finish one by one: the probe's step is the costlier, so the decode
    overhead it gives (``summarize``) errs low."""
    from ..rollout import registry
    from ..api.records import Rollout

    backend = t.roles.rollout
    probe = registry.probe_backend(backend, rows, prompt_len + new_tokens, new_tokens)
    if probe is None:
        return None
    sync = torch.cuda.synchronize if backend.device.type == "cuda" else (lambda: None)
    vocab = t.roles.tokenizer.vocab_size if hasattr(t.roles.tokenizer, "vocab_size") else 100
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, max(4, vocab), (prompt_len,), generator=g).tolist() for _ in range(rows)]
    times = []
    for rep in range(repeats + 1):
        probe.admit([Rollout(i, i, "", list(p), 0) for i, p in enumerate(prompts)])
        sync()
        t0, steps = time.perf_counter(), 0
        while probe.active:
            probe.step()
            steps += 1
        sync()
        probe.finished = []
        if rep:
            times.append((time.perf_counter() - t0) / steps)
    probe.close()
    return statistics.median(times)
