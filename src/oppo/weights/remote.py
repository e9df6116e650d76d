""":class:`RemoteWeights`, the handle of trained weights held by another process, on its own:
the role Protocols (``api.protocols.WeightSource``) name it and the weight sync (``sync.py``)
loads it, so it imports neither, and neither imports the other to reach it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RemoteWeights:
    """Trained weights held by another process: a Ray object ref to the packed arrays of a learner
    rank (``sync.pack``), loaded straight from Ray's object store by whoever needs them."""

    ref: Any
