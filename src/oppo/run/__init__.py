"""A training run: its directory (:mod:`.dirs`), the one preflight (:mod:`.start`, resume checks in
:mod:`.resume`), the entry (:mod:`.entry`), the loop (:mod:`.loop`), what it writes
(:mod:`.files`) and says (:mod:`.lines`, :mod:`.summary`), and stopping (:mod:`.stop`). This file
only re-exports the names other modules and users import from ``oppo.run``."""

from .dirs import INPUTS_DIR, LINK_NAME, LOCK_FILE, RUN_FILES, holds_run
from .entry import train
from .files import FAILURE_FILE
from .lines import loading_line, machine_threads, policy_line, threads_lines
from .start import RunStart, start_run
from .stop import STOP, Preempted, StopRequest
from .summary import recovery_line, run_summary

__all__ = ["FAILURE_FILE", "INPUTS_DIR", "LINK_NAME", "LOCK_FILE", "RUN_FILES", "Preempted", "RunStart", "STOP",
           "StopRequest", "holds_run", "loading_line", "machine_threads", "start_run", "policy_line", "recovery_line",
           "run_summary", "threads_lines", "train"]
