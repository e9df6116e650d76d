"""Fingerprints of the models a run reads but does not train, so a resume notices when one of them
was re-exported with other weights at the same path (a resumed run's KL went from 0.003 to 59.6,
exit 0: its reference model had been replaced).

Recorded in every checkpoint (``models.json``, :func:`oppo.checkpoint.save_checkpoint`), computed
once per run when the models load (``Trainer.__init__``), compared on resume
(:func:`changed_models`).

A weights fingerprint hashes, for every tensor of the loaded model's ``state_dict``: its name,
shape and dtype, the exact bits of a fixed strided sample of up to :data:`SAMPLE` values, and the
wrapping int64 sum of its bytes read as 8-byte words (exact and independent of summation order, so
the same weights give the same fingerprint on CPU and GPU; a change to any single value changes
it). Re-training or a re-export with other weights changes nearly every value, and the sample alone
catches it; the sum catches sparse edits (a few new embedding rows). Cost: one read of the weights
(a 1B bf16 model: 0.1 s on 2 CPU cores) and one host sync per model.

The fingerprint is of the tensors *as loaded*: the same files loaded in another dtype give another
fingerprint. A run resumes with its own dtype settings (``policy.dtype`` must match on resume), so
this never misfires; it only means fingerprints of two runs with different dtypes do not compare.

The tokenizer's fingerprint hashes its vocabulary (added tokens included), its special tokens and,
for a fast tokenizer, its ``tokenizer.json`` contents (merges, normalizer, pre-tokenizer) without
the padding and truncation state that encoding calls set. A reward *function* has no weights: its
import path is a setting, compared on resume with the others (``settings_mismatches``).
"""

from __future__ import annotations

import hashlib
import json

import torch

SAMPLE = 256
"""Values sampled from each tensor, at a fixed stride."""

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 (hex) of ``model``'s state_dict as loaded (module docstring)."""
    h = hashlib.sha256()
    sums, samples = [], []
    with torch.no_grad():
        items = sorted(model.state_dict().items())
        for name, t in items:
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype};".encode())
            if t.is_meta or t.numel() == 0:
                sums.append(torch.zeros((), dtype=torch.int64))  # (on the CPU: a meta tensor has no values)
                samples.append(torch.zeros(0, dtype=torch.uint8))
                continue
            flat = t.detach().reshape(-1)
            if not flat.is_contiguous():
                flat = flat.contiguous()
            bits = flat.view(_INT_VIEW[flat.element_size()])  # (the exact bits, any float dtype)
            sums.append(_words(flat).sum(dtype=torch.int64))  # wraps on overflow: still exact, order-independent
            stride = max(1, flat.numel() // SAMPLE)
            samples.append(bits[::stride][:SAMPLE].contiguous().view(torch.uint8))
        # one host transfer per device (a CPU-GPU sync point), not one per tensor
        by_device: dict = {}
        for i, s in enumerate(sums):
            by_device.setdefault(s.device, []).append(i)
        host_sums: list[int] = [0] * len(sums)  # (every entry is set below)
        host_samples: list[bytes] = [b""] * len(sums)
        for idx in by_device.values():
            stacked = torch.stack([sums[i] for i in idx]).cpu()
            joined = torch.cat([samples[i] for i in idx]).cpu()
            off = 0
            for j, i in enumerate(idx):
                host_sums[i] = int(stacked[j])
                n = samples[i].numel()
                host_samples[i] = joined[off:off + n].numpy().tobytes()
                off += n
    for (name, _), total, sample in zip(items, host_sums, host_samples):
        h.update(f"{name}:{total};".encode())
        h.update(sample)
    return h.hexdigest()


def _words(flat: torch.Tensor) -> torch.Tensor:
    """``flat``'s bytes as the widest integers that tile them: summing 8-byte words is ~25x faster
    on the CPU than summing bf16 values as int16 (1B parameters: 0.08 s against 2 s on 2 cores)."""
    raw = flat.view(torch.uint8)
    for word in (torch.int64, torch.int32, torch.int16):
        if raw.numel() % word.itemsize == 0:
            try:
                return raw.view(word)
            except RuntimeError:  # a tensor whose storage offset is not aligned to the word
                continue
    return raw


def tokenizer_fingerprint(tok) -> str:
    """sha256 (hex) of a tokenizer's vocabulary, special tokens and (fast tokenizers) its
    ``tokenizer.json`` contents (module docstring)."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
    h.update(json.dumps({k: str(v) for k, v in sorted(tok.special_tokens_map.items())}).encode())
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("padding", None)
        spec.pop("truncation", None)
        h.update(json.dumps(spec, sort_keys=True).encode())
    return h.hexdigest()


def run_fingerprints(roles) -> dict:
    """``{role: {"path", "fingerprint"}}`` of the models a run reads (a :class:`~oppo.setup.roles.Roles`,
    just built): the reference (without ``reference.path`` the initial policy, or with LoRA its
    base: the policy's path), the reward model (not a reward function), the critic as initialised
    (critic-free algorithms have none) and the policy's tokenizer."""
    paths = roles.paths
    out = {"reference": {"path": paths.reference or paths.policy,
                         "fingerprint": weights_fingerprint(roles.reference)},
           "tokenizer": {"path": paths.policy, "fingerprint": tokenizer_fingerprint(roles.tokenizer)}}
    if roles.reward_model is not None:
        out["reward"] = {"path": paths.reward, "fingerprint": weights_fingerprint(roles.reward_model)}
    if roles.critic is not None:
        out["critic"] = {"path": paths.critic, "fingerprint": weights_fingerprint(roles.critic)}
    return out


def changed_models(saved: dict, now: dict) -> list[tuple[str, str, str]]:
    """(role, path when saved, path now) for every model whose fingerprint in ``saved`` (a
    checkpoint's ``models.json``) differs from ``now``'s; a role either side lacks is not compared.
    Both: ``{role: {"path": ..., "fingerprint": ...}}``."""
    return [(role, str(saved[role].get("path")), str(now[role].get("path")))
            for role in sorted(saved.keys() & now.keys())
            if saved[role].get("fingerprint") != now[role].get("fingerprint")]


__all__ = ["changed_models", "run_fingerprints", "tokenizer_fingerprint", "weights_fingerprint"]
