"""Fingerprints of the models and data a run reads but does not train, so a resume notices when one
of them was re-exported with other weights at the same path (it would load silently, and the run
would train against another model), or when the prompt set or the chat template changed (the
checkpoint's data position would name other records).

Recorded in every checkpoint (``models.json``), computed once per run when the models load,
compared on resume (:func:`changed_models`). A weights fingerprint is sha256 over every tensor's
name, shape and dtype and the CRC-32 of each :data:`CHUNK` bytes of its exact bits, hashed on the
host (the same on CPU and GPU): position-dependent, so swapped or offsetting changes are caught,
and cheap (chunks on a thread per core). It is of the tensors *as loaded*: another dtype gives
another fingerprint, which never misfires since a resume keeps ``policy.dtype``. The tokenizer's
hashes its vocabulary, special tokens and ``tokenizer.json``. Figures and the earlier scheme:
``docs/implementation-details.md``, "Models changed under a resumed run".
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


PROMPTS_SCHEME = "p1"
"""Prefix of a prompt set's fingerprint (``"p1:<hex>"``)."""


def prompts_fingerprint(prompt_set) -> str:
    """``"p1:"`` + sha256 (hex) of what a run reads from its prompt set, in record order: each
    prompt as the data set holds it (a text, or a conversation's messages), as tokenised (chat
    template applied, truncated) and the columns carried for the reward function and the judge.
    A resume's data position names a record by its index, so a line inserted, removed or edited
    (or another template) would make it another record, with another record's columns.

    Values are hashed in a canonical form (:func:`_canonical`): a set (say, a column of accepted
    answers) by its sorted elements, at any depth, and a column's mappings by their keys, so the
    fingerprint does not depend on ``PYTHONHASHSEED`` (issue 51: ``str()`` of a set printed it in
    hash order, and a resume was refused or not by the seed). Strings, numbers, lists and dicts hash
    as before, so runs saved earlier resume (a prompt's own dicts, a conversation's messages, keep
    their order as before: the file's, not the hash seed's)."""
    h = hashlib.sha256()
    h.update(json.dumps(prompt_set.raw or prompt_set.texts, default=_canonical).encode())
    h.update(json.dumps(prompt_set.ids).encode())
    for name in sorted(prompt_set.columns):
        h.update(json.dumps([name, prompt_set.columns[name]], default=_canonical, sort_keys=True).encode())
    return f"{PROMPTS_SCHEME}:{h.hexdigest()}"


def _canonical(x):
    """``json.dumps``' ``default`` for what JSON cannot hold: a set or frozenset as the list of its
    elements sorted by their canonical JSON, any other mapping as a dict (its keys sorted by the
    caller's ``sort_keys``, or here), anything else as ``str()`` (what it was before). JSON calls it
    again for what it returns, so the form is canonical at every depth."""
    from collections.abc import Mapping

    if isinstance(x, (set, frozenset)):
        return sorted(x, key=lambda v: json.dumps(v, default=_canonical, sort_keys=True))
    if isinstance(x, Mapping):
        return {k: x[k] for k in sorted(x, key=lambda k: json.dumps(k, default=_canonical, sort_keys=True))}
    return str(x)


def chat_template_fingerprint(tok) -> str:
    """sha256 (hex) of a tokenizer's chat template (``"none"`` hashed when it has none)."""
    template = getattr(tok, "chat_template", None)
    return hashlib.sha256(json.dumps(template if template is not None else "none", sort_keys=True,
                                     default=str).encode()).hexdigest()


def run_fingerprints(roles) -> dict:
    """``{role: {"path", "fingerprint"}}`` of the models and data a run reads (a
    :class:`~oppo.setup.build.Roles`, just built): the reference (without ``reference.path`` the
    initial policy, or with LoRA its base: the policy's path), the reward models (not a reward
    function), the critic as initialised (critic-free algorithms have none), the policy's
    tokenizer, the prompt set (``prompts``: :func:`prompts_fingerprint`) and, where the prompts went
    through it, the tokenizer's chat template (``chat_template``)."""
    paths = roles.paths
    out = {"reference": {"path": paths.reference or paths.policy,
                         "fingerprint": weights_fingerprint(roles.reference)},
           "tokenizer": {"path": paths.policy, "fingerprint": tokenizer_fingerprint(roles.tokenizer)}}
    data = roles.cfg.data
    source = data.prompts or f"the {data.task} task's prompts"
    out["prompts"] = {"path": source, "fingerprint": prompts_fingerprint(roles.prompt_set)}
    if getattr(roles.prompt_set, "templated", False):
        out["chat_template"] = {"path": paths.policy, "fingerprint": chat_template_fingerprint(roles.tokenizer)}
    if roles.reward_model is not None:
        out["reward"] = {"path": paths.reward, "fingerprint": weights_fingerprint(roles.reward_model)}
    if roles.extra_reward_models:  # reward.terms' further reward models, by scorer role
        term_paths = {t.role: t.path for t in roles.reward.terms}
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


__all__ = ["changed_models", "chat_template_fingerprint", "prompts_fingerprint", "run_fingerprints",
           "tokenizer_fingerprint", "weights_fingerprint"]
