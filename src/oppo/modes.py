"""The overlap modes (``overlap.mode``): one table of what each does.

The config (choices, help, ``Config.streams`` / ``carries`` / ``in_flight``), the controller
(``control.stages.OverlapPolicy``) and the planner (``plan.sim``) all read this table; a mode's
behaviour is written down nowhere else. Imports nothing (the planner and the config load it
without torch).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    """One overlap mode and the three things it switches on."""

    name: str
    streams: bool  # intra-step overlap: chunks stream to the scorers while the actor decodes
    carries: bool  # inter-step overlap: overcommit, carry unfinished sequences into the next step
    in_flight: bool  # in-flight weight updates (PipelineRL): the learner trains while the rollout backend decodes
    help: str  # one line for ``oppo train --help``


TABLE: tuple[Mode, ...] = (
    Mode("sequential", False, False, False, "stage after stage"),
    Mode("intra", True, False, False, "stream chunks to the scorers while decoding"),
    Mode("inter", False, True, False, "overcommit and carry long generations"),
    Mode("oppo", True, True, False, "both"),
    Mode("pipeline", True, True, True,
         "oppo plus in-flight weight updates (PipelineRL: decoding goes on while the learner trains, new weights "
         "load between decode steps; not bitwise reproducible)"),
)

BY_NAME: dict[str, Mode] = {m.name: m for m in TABLE}
NAMES: tuple[str, ...] = tuple(BY_NAME)


def get(name: str) -> Mode:
    """The mode called ``name``; ValueError naming the modes if there is none."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown mode {name!r}; one of {', '.join(NAMES)}") from None


def help_text() -> str:
    """``overlap.mode``'s help: each mode's line."""
    return "; ".join(f"{m.name}: {m.help}" for m in TABLE) + "."
