"""Scheduling state machines for overlapped PPO: admission, step closing, staleness, chunk size.

Everything here is pure: no torch, no threads, no I/O, no clocks. Events go in (a sequence
finished, a step's update is done, a step took this long), decisions come out (admit these
prompts, train these sequences); the runtime owns the rollout backend, the clock and the models.

- :mod:`.admission`: :class:`Scheduler`, the inter-step overlap (B + Delta in flight, ``max_lag``,
  refill, groups carried whole, checkpoints); its rules and their reasons: ``docs/scheduler.md``;
- :mod:`.delta`: :class:`DeltaRule` and the paper's reward-slope :class:`DeltaController`;
- :mod:`.chunks`: :class:`ChunkSizeTuner`, the intra-step overlap's chunk size (the paper's rules);
- :mod:`.tuner`: :class:`~.tuner.OverlapTuner`, the cost-aware overlap controller (the default);
- :mod:`.controller`: :class:`OverlapController`, the Protocol both controllers implement;
- :mod:`.records`: the messages (:class:`SeqTicket`, :class:`Admit`, :class:`CloseStep`, :class:`Phase`,
  :class:`StepTiming`).
"""

from __future__ import annotations

from .admission import Scheduler
from .chunks import ChunkSizeTuner
from .controller import OverlapController
from .delta import DeltaController, DeltaRule
from .records import PARTIAL_GROUPS, Admit, CloseStep, Phase, SeqTicket, StepTiming

__all__ = [
    "Admit",
    "ChunkSizeTuner",
    "CloseStep",
    "DeltaController",
    "DeltaRule",
    "OverlapController",
    "PARTIAL_GROUPS",
    "Phase",
    "Scheduler",
    "SeqTicket",
    "StepTiming",
]
