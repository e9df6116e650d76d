"""The Protocol every overlap controller implements (:class:`OverlapController`): the cost-aware
:class:`~oppo.scheduler.tuner.OverlapTuner` and the paper's :class:`~oppo.scheduler.ChunkSizeTuner`
(with :class:`~oppo.scheduler.DeltaController`); ``control.controller.build_controller`` picks one."""

from __future__ import annotations

from typing import Any, Protocol

from .records import StepTiming


class OverlapController(Protocol):
    """Before a step: :meth:`chunk_size`; after it: :meth:`observe`; then its lines for the run's
    log (:meth:`take_decisions`) and its figures for the step's metrics (:meth:`step_metrics`).
    Its state is checkpointed (``state_dict``)."""

    def chunk_size(self) -> int:
        """Tokens per streamed chunk for the next step; 0: the scorers score it one-shot."""
        ...

    def observe(self, ran: StepTiming, /) -> None:
        """The step that ran with the controller's setting, measured."""
        ...

    def take_decisions(self) -> list[str]:
        """The controller's decisions since the last call, one line each with its reason."""
        ...

    def step_metrics(self) -> dict[str, float]:
        ...

    def state_dict(self) -> dict[str, Any]:
        ...

    def load_state_dict(self, d: dict[str, Any], /) -> None:
        ...
