"""The single controller: the numbered stages of a PPO step (``stages``), the sequential loop
that is the oracle (``sequential``), and one overlapped loop for intra, inter, oppo and pipeline
(``overlapped``), all over the roles ``setup.build.build_roles`` built. Nothing here asks where a role
runs."""

from .overlapped import overlapped_step
from .sequential import sequential_step
from .stages import OverlapPolicy, Run, StepResult

__all__ = ["OverlapPolicy", "Run", "StepResult", "overlapped_step", "sequential_step"]
