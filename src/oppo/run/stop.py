"""Stopping a run at a step boundary: a signal asks (:data:`STOP`), the loop finishes its step,
writes a checkpoint with the sequences in flight and raises :class:`Preempted`."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path

from .summary import continue_with


class Preempted(KeyboardInterrupt):
    """The run stopped on SIGTERM/SIGINT at a step boundary, its checkpoint written (str: what was
    saved and the command that continues it). ``oppo train`` exits 128 + ``signum``."""

    def __init__(self, signum: int, run_dir: Path, checkpoint: Path, steps: int, objects: bool = False):
        self.signum, self.run_dir, self.checkpoint = signum, run_dir, checkpoint
        state = json.loads((checkpoint / "state.json").read_text())
        held = state.get("in_flight") or {}
        carried = (f", with the {held['count']} sequences in flight {held['how']}" if held.get("count") else "")
        super().__init__(f"stopped by {signal.Signals(signum).name} after {state['step']} of {steps} steps: "
                         f"checkpoint {checkpoint} holds them{carried}. "
                         f"Continue with: {continue_with(run_dir, objects)}.")

    def __str__(self) -> str:
        return self.args[0]


@dataclass
class StopRequest:
    """A stop asked for by a signal (``oppo train`` sets it from its SIGTERM/SIGINT handler,
    cli.py): the training loop finishes the step it is in, writes a checkpoint and raises
    :class:`Preempted`. A signal outside the loop, or a second one, interrupts at once
    (KeyboardInterrupt); saves are atomic, so that corrupts no checkpoint."""

    signum: int | None = None
    active: bool = False  # a training loop is running and will look at ``signum`` after its step
    run_dir: Path | None = None  # the run being trained (kept after the loop: the CLI's message names it)
    final: bool = False  # the steps are done; the final checkpoint is being written (a signal waits for it)

    def request(self, signum: int) -> bool:
        """True: the loop will stop after its current step; False: interrupt now."""
        if not self.active or self.signum is not None:
            return False
        self.signum = signum
        return True


STOP = StopRequest()  # process-wide, as signal handlers are
