"""Weights between processes through Ray's object store, without pickling tensors.

Ray stores numpy arrays out of band and hands a reader on the same node a read-only view of the
shared-memory buffer (no copy, no unpickling), while torch tensors are pickled through torch's
own reducer (a copy in, a copy out). So the sender returns :func:`pack` (numpy views of its CPU
tensors: one copy, into the object store) and the receiver copies the views straight into its
parameters with :func:`unpack_into` (one copy, cast to the target's dtype). bf16, which numpy
lacks, travels as its int16 bit pattern. Measured on the 2-core dev machine (load ~9), rank 0 of
a learner group to a module in the controller, 72 MiB of fp32 weights (median of 10): 1160 ms as
a pickled state dict, 129 ms packed (min 658 vs 50 ms); the tiny test model: 14.7 vs 2.5 ms.

Across nodes this goes through Ray's object transfer; on GPU a NCCL broadcast from the learner's
rank 0 to the rollout workers is the next step (not here yet).
"""

from __future__ import annotations

import warnings

import torch

Packed = dict[str, tuple[object, str]]  # name -> (numpy array, torch dtype name)


def pack(module: torch.nn.Module, trainable_only: bool = False) -> Packed:
    """``module``'s state dict as numpy arrays (views of CPU tensors; a device copy on GPU).
    ``trainable_only``: only the parameters that train (what an update changes: with LoRA the
    adapters, not the frozen base), for :func:`unpack_into` with ``partial=True``."""
    state = module.state_dict()
    if trainable_only:
        state = {k: p for k, p in module.named_parameters() if p.requires_grad}
    return pack_state(state)


def pack_state(state: dict[str, torch.Tensor]) -> Packed:
    """:func:`pack` of a state dict (e.g. a sharded model's, all-gathered)."""
    out = {}
    for name, t in state.items():
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            out[name] = (t.view(torch.int16).numpy(), "bfloat16")
        else:
            out[name] = (t.numpy(), str(t.dtype).removeprefix("torch."))
    return out


@torch.no_grad()
def unpack_into(module: torch.nn.Module, packed: Packed, partial: bool = False) -> None:
    """Copy :func:`pack`'s arrays into ``module``'s tensors of the same names (cast to their
    dtype and device). Every name of ``module``'s state dict must be there (``partial``: some
    may be left out), and no other."""
    targets = module.state_dict(keep_vars=True)
    if not packed.keys() <= targets.keys() or (not partial and targets.keys() != packed.keys()):
        missing, extra = sorted(targets.keys() - packed.keys()), sorted(packed.keys() - targets.keys())
        raise KeyError(f"weights do not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the object store's arrays are read-only: we only read
        for name, (arr, dtype) in packed.items():
            src = torch.from_numpy(arr)
            if dtype == "bfloat16":
                src = src.view(torch.bfloat16)
            targets[name].data.copy_(src)


def is_packed(weights) -> bool:
    return isinstance(weights, dict) and all(isinstance(v, tuple) and len(v) == 2 for v in weights.values())
