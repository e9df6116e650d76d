"""``placement.learner=replicate``: each rank holds all of actor, critic and AdamW: the one local
learner in this process, or data-parallel replicas on Ray ranks (``dp.Replicated``)."""

from __future__ import annotations

from typing import Any

from .registry import EngineSpec, Ranks, check_ranks, group_builder, local


def _replicated() -> Any:
    from .dp import Replicated

    return Replicated()


ENGINE = EngineSpec(
    "replicate", "each rank holds all of actor, critic and AdamW: one learner in this process, or data-parallel "
                 "replicas on Ray ranks (gradients summed once per minibatch: the same update as one learner)",
    build_local=local, build_remote=group_builder(_replicated), settings=Ranks,
    checks=lambda own, cfg: check_ranks(own, "replicate"))
