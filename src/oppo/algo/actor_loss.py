"""The actor's loss, composed (stage 6): the importance weights of off-policy tokens, and on one
micro-batch the algorithm's policy loss, its KL term when the KL goes in the loss, and the
entropy bonus.

Pure functions of tensors and the :class:`~.core.Algorithm`, no config object and no I/O: the
learner runs the forward, calls :func:`actor_loss`, then the backward and the optimizer step
(``learner.local``). Every learner (local, data-parallel, FSDP2) gets the same loss from here,
so the sum below is written once. Each returns its value and a dict of detached statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Tuple, Union

import torch

from .core import ClippedTokenLoss
from .losses import aggregate
from .masks import Number, Stats, Tensor, masked_mean

if TYPE_CHECKING:
    from .core import Algorithm

__all__ = ["ActorLossSettings", "ActorTokens", "actor_loss", "importance_weights", "sampler_ratio_outside_clip"]


@dataclass(frozen=True)
class ActorLossSettings:
    """The run-wide settings of the actor loss (``ppo.clip_eps``, ``clip_eps_high``, ``dual_clip``,
    ``loss_agg``, ``entropy_coef``): a record, so the loss reads no config object."""

    clip_eps: float = 0.2
    clip_eps_high: Optional[float] = None
    dual_clip: Optional[float] = None
    loss_agg: str = "token_mean"
    entropy_coef: float = 0.0

    @classmethod
    def of(cls, ppo) -> "ActorLossSettings":
        """The settings a ``ppo`` section holds (any object with these fields)."""
        return cls(ppo.clip_eps, ppo.clip_eps_high, ppo.dual_clip, ppo.loss_agg, ppo.entropy_coef)


@dataclass(frozen=True)
class ActorTokens:
    """What the actor loss reads of one micro-batch's b rows besides the forward's log-probs, each
    [b, T] response-aligned (``algo.masks``): the ratio's centre ``old_logprobs`` (pi_k), the
    ``advantages``, the response ``mask``, the ``is_weights`` of off-policy tokens
    (:func:`importance_weights`) and the reference's log-probs (None: no KL in the loss)."""

    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    is_weights: Tensor
    ref_logprobs: Optional[Tensor] = None


def actor_loss(algorithm: Optional["Algorithm"], logprobs: Tensor, entropy: Tensor, tokens: ActorTokens,
               settings: ActorLossSettings, num_tokens: Union[Number, Tensor], num_seqs: Union[Number, Tensor]
               ) -> Tuple[Tensor, Stats]:
    """The actor's loss on one micro-batch: ``policy_loss + [coef * KL] - entropy_coef * entropy``.

    ``logprobs``, ``entropy`` [b, T]: the training forward's (the entropy differentiable only when
    ``settings.entropy_coef`` puts it in the loss; otherwise a statistic). ``algorithm`` None:
    plain PPO (:class:`ClippedTokenLoss`, no KL term). ``num_tokens`` / ``num_seqs``: the
    minibatch's denominators (``losses.aggregate``), so micro-batches' losses add up to the
    minibatch's. Stats, detached: ``loss/policy``, ``ppo/clipfrac``, ``ppo/approx_kl``,
    ``ppo/entropy``, and ``loss/kl`` with the KL loss's own when the KL is in the loss,
    ``ppo/dual_clipfrac`` with ``ppo.dual_clip``.
    """
    s, mask = settings, tokens.mask
    policy_loss = algorithm.policy_loss if algorithm is not None else ClippedTokenLoss()
    pl, pstats = policy_loss(logprobs, tokens.old_logprobs, tokens.advantages, mask, is_weights=tokens.is_weights,
                             clip_eps=s.clip_eps, clip_eps_high=s.clip_eps_high, dual_clip=s.dual_clip,
                             loss_agg=s.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
    loss = pl
    extra: Stats = {}
    if algorithm is not None and algorithm.kl_in_loss:  # GRPO-style KL term
        if tokens.ref_logprobs is None:
            raise ValueError(f"{algorithm.name} puts the KL in the loss: the batch needs reference log-probs")
        kl_term, kstats = algorithm.actor_loss_extra(
            logprobs, tokens.ref_logprobs, mask, is_weights=tokens.is_weights, loss_agg=s.loss_agg,
            num_tokens=num_tokens, num_seqs=num_seqs)
        loss = loss + kl_term
        extra = {"loss/kl": kl_term.detach(), **{k: torch.as_tensor(v).detach() for k, v in kstats.items()}}
    if "dual_clipfrac" in pstats:  # ppo.dual_clip set
        extra["ppo/dual_clipfrac"] = pstats["dual_clipfrac"].detach()
    if s.entropy_coef:  # in the backward only when it is in the loss; otherwise a detached statistic
        loss = loss - s.entropy_coef * aggregate(entropy, mask, s.loss_agg, num_tokens, num_seqs)
    stats = {"loss/policy": pl.detach(), "ppo/clipfrac": pstats["clipfrac"].detach(),
             "ppo/approx_kl": pstats["approx_kl"].detach(), "ppo/entropy": masked_mean(entropy.detach(), mask),
             **extra}
    return loss, stats


def importance_weights(old_logprobs: Tensor, sampler_logprobs: Tensor, off: Tensor,
                       is_truncate: Optional[float]) -> Tensor:
    """[B, T] the weight of each token in the actor loss: pi_k / pi_v = exp(old - sampler) (both
    untruncated log-probs) truncated at ``is_truncate`` (decoupled PPO, as AReaL does) where
    ``off`` (sampled by an older version), 1 elsewhere: an on-policy token's gap is numerical,
    reported, not corrected (``Learner.old_logprobs``)."""
    w = torch.exp(old_logprobs - sampler_logprobs)  # [B, T]
    if is_truncate is not None:
        w = w.clamp(max=is_truncate)
    return torch.where(off, w, torch.ones_like(w))


def sampler_ratio_outside_clip(old_logprobs: Tensor, sampler_logprobs: Tensor, on: Tensor, clip_eps: float,
                               clip_eps_high: Optional[float]) -> Stats:
    """``ppo/sampler_ratio_outside_clip``: the share of the recomputed on-policy tokens ``on`` [B, T]
    whose ratio of the training forward's log-probs to the sampler's falls outside the clip range:
    the first minibatch's clipped share had the old log-probs not been recomputed. {} without
    such tokens. Reads the device (``on.any()``, once per update)."""
    if not on.any():  # CPU-GPU sync point (once per update)
        return {}
    ratio = torch.exp(old_logprobs - sampler_logprobs)[on]
    eps_hi = clip_eps_high if clip_eps_high is not None else clip_eps
    return {"ppo/sampler_ratio_outside_clip": ((ratio < 1 - clip_eps) | (ratio > 1 + eps_hi)).float().mean()}
