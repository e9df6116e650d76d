"""The advantage stage (stages 4 and 5 of the PPO step, ``control/sequential.py``) on a batch: the
algorithm's rewards and advantages, with the non-finite guard, for every mode alike."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from .. import guard
from .advantages import missing_eos_penalty
from .core import Algorithm

if TYPE_CHECKING:
    from ..config import PPOConfig
    from ..learner.batch import Experience


@dataclass(frozen=True)
class AdvantageSettings:
    """What the advantage stage reads of the ``ppo`` section besides the algorithm: the penalty of
    a response without EOS (``ppo.missing_eos_penalty``) and what the guard does with a non-finite
    value (``ppo.nonfinite``). A record, so the stage reads no config object."""

    missing_eos_penalty: Optional[float] = None
    nonfinite: str = "error"

    @classmethod
    def of(cls, ppo: PPOConfig) -> "AdvantageSettings":
        """The settings a ``ppo`` section holds (any object with these fields)."""
        return cls(ppo.missing_eos_penalty, ppo.nonfinite)


@torch.no_grad()
def compute_advantages(exp: Experience, settings: AdvantageSettings, algorithm: Algorithm, step: int = -1
                       ) -> Experience:
    """Stages 4 and 5 (a new record): per-token rewards (KL-shaped when the KL goes in the reward),
    then the algorithm's advantages and, with a critic, returns.

    The guard (``guard.py``): every input and output must be finite at response tokens, else
    ``NonFiniteError`` names the first such tensor (inputs first: the cause, not its spread
    through whitening) and its rows; under ``ppo.nonfinite=skip`` a warning, and the record comes
    back ``trainable=False`` (the step's update is skipped: ``control.stages.update``)."""
    assert exp.scores is not None  # (attach_scores runs first)
    ended = torch.tensor([r.ended_with_eos for r in exp.rollouts], device=exp.scores.device)
    scores = missing_eos_penalty(exp.scores, ended, settings.missing_eos_penalty)
    res = algorithm.advantages(scores, exp.mask, exp.old_logprobs, exp.ref_logprobs, exp.values, exp.group_ids)
    bad = guard.nonfinite_rows({"scores": scores, "values": exp.values, "reference log-probs": exp.ref_logprobs,
                                "old log-probs": exp.old_logprobs, "importance weights": exp.is_weights,
                                "rewards": res.rewards, "advantages": res.advantages, "returns": res.returns},
                               exp.mask)
    if bad is not None:
        name, rows = bad
        guard.report(f"non-finite {name} at {guard.at_step(step)}, advantages: rows {guard.first(rows)} of "
                     f"{exp.mask.shape[0]} (sequences {guard.first([exp.rollouts[i].uid for i in rows])})",
                     skip=settings.nonfinite == "skip")
    return dataclasses.replace(exp, rewards=res.rewards, kl=res.kl, advantages=res.advantages, returns=res.returns,
                               stats={**(exp.stats or {}), **{k: float(v) for k, v in res.stats.items()}},
                               trainable=bad is None)
