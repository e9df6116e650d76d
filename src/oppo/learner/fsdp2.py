"""``placement.learner=fsdp2``: the learner sharded with FSDP2 on Ray ranks, its spec (help,
settings, checks); the update strategy is ``fsdp.Sharded``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .registry import EngineSpec, Ranks, check_ranks, group_builder

if TYPE_CHECKING:
    from ..config import Config


def _sharded() -> Any:
    from .fsdp import Sharded

    return Sharded()


def checks(own: Ranks, cfg: Config) -> list[str]:
    """Its ranks, and enough micro-batches in a minibatch that no rank only pads."""
    p, n = cfg.ppo, own.ranks
    micro = p.minibatch_size // p.micro_batch_size
    out = check_ranks(own, "fsdp2")
    if n > micro:
        out.append(f"learner.fsdp2.ranks={n} sharded ranks, but a minibatch has only {micro} micro-batches "
                   f"(ppo.minibatch_size={p.minibatch_size} / ppo.micro_batch_size={p.micro_batch_size}): some "
                   f"ranks would only pad. Use at most {micro} ranks, or a smaller ppo.micro_batch_size.")
    return out


ENGINE = EngineSpec(
    "fsdp2", "each Ray rank holds 1/learner.fsdp2.ranks of the parameters, gradients and AdamW state (torch "
             "FSDP2, fully_shard); the same update. With LoRA the frozen base and the adapters are sharded alike; "
             "under bfloat16 the ranks compute in bf16 over fp32 masters (FSDP2 mixed precision, gradients reduced "
             "in fp32). ppo.micro_batch_size: at most ppo.minibatch_size / ranks, so that no rank only pads",
    build_remote=group_builder(_sharded), checks=checks, settings=Ranks)
