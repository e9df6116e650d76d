"""The single controller: the numbered stages of a PPO step (``stages``), the sequential loop
that is the oracle (``sequential``), and one overlapped loop for intra, inter, oppo and pipeline
(``overlapped``), all over the roles ``setup.build.build_roles`` built. Its state, one part per job:
the rows in flight (``streams``), the overlap controller behind one Protocol (``controller``), the
rows' checkpoint save, restore and drain (``inflight``). Nothing here asks where a role runs."""

from ..scheduler import OverlapController
from .overlapped import overlapped_step
from .sequential import sequential_step
from .stages import OverlapPolicy, Loop, StepResult

__all__ = ["OverlapController", "OverlapPolicy", "Run", "StepResult", "overlapped_step", "sequential_step"]
