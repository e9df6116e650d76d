"""Fingerprints of the models a run reads but does not train, so a resume notices when one of them
was re-exported with other weights at the same path (a resumed run's KL went from 0.003 to 59.6,
exit 0: its reference model had been replaced).

Recorded in every checkpoint (``models.json``, :func:`oppo.checkpoint.save_checkpoint`), computed
once per run when the models load (``Trainer.__init__``), compared on resume
(:func:`changed_models`).

A weights fingerprint is sha256 over, for every tensor of the loaded model's ``state_dict`` in
name order: its name, shape and dtype, and the CRC-32 of each :data:`CHUNK` bytes of its exact bits
in memory order. A CRC is position-dependent: it detects every change of one value (any burst of up
to 32 bits) for certain, and a value that moves (two rows swapped, +k here and -k there) but for a
2^-32 chance per chunk; a re-export changes nearly every chunk. The same weights give the same
fingerprint on CPU and GPU (the bytes are hashed on the host). (The first scheme, a wrapping sum of
8-byte words plus 256 strided samples, missed both swaps and +k/-k in one lane; its fingerprints
carry no scheme prefix and are not compared with these: :func:`changed_models`.)
Cost: one read of the weights by zlib's CRC-32 (about 2.5 GB/s a core), chunks on a thread per core
(zlib releases the GIL); sha256, cryptographic, runs at half that speed here (over a second per 1B
parameters). Measured: ``weights_fingerprint`` of a module holding 0.98B bf16 parameters (two
131M-element tensors and 43 of 2048 x 8192), best of 3, on our 2-core CPU machine with the other
core busy: 0.83 s (sha256 in its place: 1.6 s; the old sum and samples: 0.37 s); with both cores
free, about half. A GPU model adds its device-to-host copy, one tensor at a time.

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
import os
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

SCHEME = "w2"
"""Prefix of a weights fingerprint (``"w2:<hex>"``); fingerprints of another scheme are not compared."""

CHUNK = 4 << 20
"""Bytes checksummed as one piece (small enough that the threads share a layer's matrices)."""

_IN_FLIGHT = 1 << 30  # bytes of host copies waiting to be hashed, at most (a GPU model copies ahead)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """``"w2:"`` + sha256 (hex) of ``model``'s state_dict as loaded, its bytes by chunk CRC-32
    (module docstring)."""
    h = hashlib.sha256()
    pending: deque = deque()  # (futures of one tensor's chunks, the bytes they read)
    in_flight = 0
    with torch.no_grad(), ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for name, t in sorted(model.state_dict().items()):
            header = f"{name}|{tuple(t.shape)}|{t.dtype};".encode()
            if t.is_meta or t.numel() == 0:  # (a meta tensor has no values)
                pending.append(([], header, 0))
                continue
            raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()  # exact bits, any dtype
            futures = [pool.submit(_crc, raw[i:i + CHUNK]) for i in range(0, raw.size, CHUNK)]
            pending.append((futures, header, raw.size))
            in_flight += raw.size
            while in_flight > _IN_FLIGHT and len(pending) > 1:  # bound the host copies of a GPU model
                in_flight -= _drain(h, pending.popleft())
        while pending:
            _drain(h, pending.popleft())
    return f"{SCHEME}:{h.hexdigest()}"


def _crc(b) -> bytes:
    return zlib.crc32(b).to_bytes(4, "little")


def _drain(h, item) -> int:
    """Feed one tensor's header and chunk checksums into ``h``, in order; the bytes they covered."""
    futures, header, size = item
    h.update(header)
    for f in futures:
        h.update(f.result())
    return size


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
    """``{role: {"path", "fingerprint"}}`` of the models a run reads (a :class:`~oppo.setup.build.Roles`,
    just built): the reference (without ``reference.path`` the initial policy, or with LoRA its
    base: the policy's path), the reward models (not a reward function), the critic as initialised
    (critic-free algorithms have none) and the policy's tokenizer."""
    paths = roles.paths
    out = {"reference": {"path": paths.reference or paths.policy,
                         "fingerprint": weights_fingerprint(roles.reference)},
           "tokenizer": {"path": paths.policy, "fingerprint": tokenizer_fingerprint(roles.tokenizer)}}
    if roles.reward_model is not None:
        out["reward"] = {"path": paths.reward, "fingerprint": weights_fingerprint(roles.reward_model)}
    if roles.extra_reward_models:  # reward.terms' further reward models, by scorer role
        term_paths = {t.role: t.path for t in roles.composite.terms}
        for role, model in roles.extra_reward_models.items():
            out[role] = {"path": term_paths[role], "fingerprint": weights_fingerprint(model)}
    if roles.critic is not None:
        out["critic"] = {"path": paths.critic, "fingerprint": weights_fingerprint(roles.critic)}
    return out


def changed_models(saved: dict, now: dict) -> list[tuple[str, str, str]]:
    """(role, path when saved, path now) for every model whose fingerprint in ``saved`` (a
    checkpoint's ``models.json``) differs from ``now``'s; a role either side lacks is not compared.
    Both: ``{role: {"path": ..., "fingerprint": ...}}``. Fingerprints of two schemes (a checkpoint
    from before :data:`SCHEME`) are not compared: that role resumes unchecked."""
    return [(role, str(saved[role].get("path")), str(now[role].get("path")))
            for role in sorted(saved.keys() & now.keys())
            if _scheme(saved[role].get("fingerprint")) == _scheme(now[role].get("fingerprint"))
            and saved[role].get("fingerprint") != now[role].get("fingerprint")]


def _scheme(fp) -> str:
    """A fingerprint's scheme: its prefix before ``:`` (none: the first one's, and the tokenizer's)."""
    return str(fp).split(":", 1)[0] if ":" in str(fp) else ""


__all__ = ["changed_models", "run_fingerprints", "tokenizer_fingerprint", "weights_fingerprint"]
