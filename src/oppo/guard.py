"""Numbers stay finite: the checks that stop a non-finite loss, advantage, gradient norm or weight
before it reaches the optimizer or the rollout backend.

The checks run at the advantage stage, before every optimizer step (losses, gradient norm), after
an update's last step (weights) and in the sampler, each where the host already reads or with one
sync. ``ppo.nonfinite=error`` (default) raises :class:`NonFiniteError`; ``skip`` skips the
optimizer step (or the step's update) and counts it (``guard/skipped_updates``). A non-finite
updated weight or sampling distribution stops the run in either setting.

Design notes (where each check runs): docs/implementation-details.md, "The non-finite guard"."""

from __future__ import annotations

import math
import warnings

import torch

FIX = ("lower the learning rate (ppo.actor_lr / ppo.critic_lr) or ppo.max_grad_norm, check that the reward (model or "
       "reward.function) gives finite scores, or set ppo.nonfinite=skip to skip such updates and count them "
       "(guard/skipped_updates)")

DIVERGED = ("the policy diverged (lower ppo.actor_lr or ppo.max_grad_norm, or add ppo.lr_warmup_steps), or its "
            "weights were poisoned before the sync (a run with ppo.nonfinite=error stops there first)")


class NonFiniteError(RuntimeError):
    """A non-finite loss, advantage, gradient norm, weight or sampling distribution. The message
    names the step, the stage, the tensor and the first rows or parameters affected, and the fix;
    nothing was stepped, synced or checkpointed from it."""


class NonFiniteWarning(UserWarning):
    """``ppo.nonfinite=skip``: an update was skipped (the message names what :class:`NonFiniteError` would)."""


def first(items, n: int = 3) -> str:
    """``a, b, c`` or ``a, b, c and 5 more``."""
    items = [str(i) for i in items]
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def at_step(step: int) -> str:
    return f"step {step}" if step >= 0 else "this step"


def report(msg: str, skip: bool) -> None:
    """Raise :class:`NonFiniteError` (``ppo.nonfinite=error``) or warn that the update was skipped."""
    if not skip:
        raise NonFiniteError(f"{msg}; the run stopped before the optimizer step: no weight was updated from it, "
                             f"synced to the rollout backend or checkpointed. Fix: {FIX}.")
    warnings.warn(f"{msg}; skipped (ppo.nonfinite=skip, counted in guard/skipped_updates)", NonFiniteWarning,
                  stacklevel=2)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else ``t``: the checks never start a collective."""
    return t.to_local() if hasattr(t, "to_local") else t


def nonfinite_grads(model: torch.nn.Module) -> list[str]:
    """Names of the parameters whose (local) gradient has a non-finite entry (the failure path only)."""
    return [n for n, p in model.named_parameters()
            if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all())]


def nonfinite_weights(model: torch.nn.Module) -> list[str]:
    """Names of the trained parameters with a non-finite (local) entry: one ``isfinite`` reduction
    per parameter, stacked, one host sync (``# CPU-GPU sync point``, once per update)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        return []
    with torch.no_grad():
        ok = torch.stack([torch.isfinite(_local(p)).all() for _, p in named]).tolist()  # CPU-GPU sync point
    return [n for (n, _), good in zip(named, ok) if not good]


def grad_norm_message(model: torch.nn.Module, norm: float, loss_rows: list[int], step: int, stage: str,
                      minibatch: int, n_minibatches: int) -> str:
    """What a minibatch whose loss or gradient norm is not finite says: the tensor and the first
    rows (batch indices of the micro-batches whose loss was not finite) or parameters."""
    where = f"at {at_step(step)}, {stage}, optimizer step {minibatch + 1} of {n_minibatches}"
    if loss_rows:
        return f"non-finite loss {where}: rows {first(sorted(set(loss_rows)))} of the batch"
    if math.isfinite(norm):  # the ranks agreed on another one's flag (``agree``)
        return f"non-finite loss on another learner rank {where}"
    names = nonfinite_grads(model)
    what = (f"parameters with non-finite gradients: {first(names)}" if names else
            "every gradient entry is finite, the norm overflowed (gradients too large)")
    return f"non-finite gradient norm ({norm}) {where}: {what}"


def check_weights(model: torch.nn.Module, step: int, stage: str) -> None:
    """Raise :class:`NonFiniteError` if a trained weight is not finite after an update (either
    setting: an optimizer step cannot be skipped once taken)."""
    bad = nonfinite_weights(model)
    if bad:
        raise NonFiniteError(f"non-finite updated weights at {at_step(step)}, {stage}: {first(bad)}; the run stopped "
                             f"before the weight sync: nothing was synced to the rollout backend or checkpointed. "
                             f"Fix: {FIX}.")


@torch.no_grad()
def nonfinite_rows(tensors: dict[str, torch.Tensor | None], mask: torch.Tensor) -> tuple[str, list[int]] | None:
    """The first of ``tensors`` (in order; [B] or [B, T], T response positions, None skipped) with
    a non-finite entry where ``mask`` [B, T] is set, and its rows; None if all are finite. One host
    sync (``# CPU-GPU sync point``) whatever the number of tensors."""
    named = [(k, t) for k, t in tensors.items() if t is not None]
    m = mask > 0
    flags = []
    for _, t in named:
        bad = ~torch.isfinite(t)
        flags.append((bad & m).any(1) if bad.dim() == 2 else bad)  # [B]
    rows = torch.stack(flags)  # [K, B]
    if not bool(rows.any()):  # CPU-GPU sync point (once per step)
        return None
    k = int(rows.any(1).float().argmax())
    return named[k][0], rows[k].nonzero().squeeze(1).tolist()


def sampling_message(rows: list[int], uids: list[int], version: int) -> str:
    weights = f"the weights after step {version - 1}'s update" if version > 0 else "the initial weights"
    return (f"non-finite logits in sampling with the policy of version {version} ({weights}): rows "
            f"{first(rows)} (sequences {first(uids)}) have no valid distribution (NaN or inf logits). Likely "
            f"cause: {DIVERGED}.")
