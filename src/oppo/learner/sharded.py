"""The learner's trained state in ``torch.distributed.checkpoint`` (DCP) format: sharded on write,
resharded on read.

A sharded learner (``placement.learner=fsdp2``) saves, in ``<checkpoint>/learner/``, every
rank's shards of the actor's and the critic's parameters and AdamW state (one ``.distcp`` file per
rank, ``.metadata`` from rank 0), keyed by parameter name, not by rank or position. So it loads
on any number of sharded ranks (DCP reshards), and without any process group into one learner or
into data-parallel replicas (:func:`dense_optim_state`). ``checkpoint.save_checkpoint`` calls
:meth:`ShardedLearnerState.save` inside its temporary directory, so the whole checkpoint is still
renamed into place atomically, ``state.json`` last; the Hugging Face export of the policy (and the
critic) is written beside it as before, for users.

The ranks must write to a file system they all see (one node, or a shared mount).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

import torch

SHARDED_DIR = "learner"


def _state(models: Mapping[str, tuple[torch.nn.Module, torch.optim.Optimizer]]) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {name: {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, o)}
            for name, (m, o) in models.items()}


def save_sharded(path: str | Path, models: Mapping[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
                 no_dist: bool | None = None) -> None:
    """Write ``{"actor": (model, AdamW)[, "critic": ...]}`` (sharded or not) as DCP to ``path``. In a
    process group (unless ``no_dist``): a collective, each rank writes its shards."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if no_dist is None:
        no_dist = not dist.is_initialized()
    dcp.save(_state(models), checkpoint_id=str(path), no_dist=no_dist)


def load_sharded(path: str | Path, models: Mapping[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
                 no_dist: bool | None = None) -> None:
    """Load a :func:`save_sharded` checkpoint into these models and optimizers (weights and AdamW
    state, resharded to however they are sharded now). ``no_dist``: read it whole in this process
    (default: when no process group is initialised)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    if no_dist is None:
        no_dist = not dist.is_initialized()
    state = _state(models)  # (initialises empty AdamW state, so that every key is there to load into)
    dcp.load(state, checkpoint_id=str(path), no_dist=no_dist)
    for name, (m, o) in models.items():
        set_model_state_dict(m, state[name]["model"])
        set_optimizer_state_dict(m, o, state[name]["optim"])


def dense_optim_state(optim: dict, actor: torch.nn.Module, critic: torch.nn.Module | None) -> dict:
    """A checkpoint's optimizer states in the single learner's format (``{"actor"[, "critic"]}``,
    ``opt.state_dict()``s). A sharded learner's checkpoint (``{"sharded": path}``) is read whole into
    ``actor`` and ``critic`` (its weights too, the checkpoint's fp32 masters) and AdamWs over their
    trained parameters; any other is returned as it is."""
    if "sharded" not in optim:
        return optim
    models = {"actor": (actor, torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad]))}
    if critic is not None:
        models["critic"] = (critic, torch.optim.AdamW(critic.parameters()))
    load_sharded(optim["sharded"], models, no_dist=True)
    return {name: opt.state_dict() for name, (_, opt) in models.items()}


class ShardedLearnerState:
    """What a sharded learner's ``checkpoint_state()`` returns: not the state itself (no rank holds
    it whole) but a writer. ``save(directory)`` has every rank write its shards there (``write``)
    and returns what ``optim.pt`` records instead: ``{"sharded": <directory name>}``."""

    def __init__(self, write: Callable[[str], None]):
        self.write = write

    def save(self, directory: Path) -> dict:
        self.write(str(directory))
        return {"sharded": Path(directory).name}


__all__ = ["SHARDED_DIR", "ShardedLearnerState", "dense_optim_state", "load_sharded", "save_sharded"]
