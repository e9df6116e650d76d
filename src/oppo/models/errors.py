"""The error every loader and check raises: its message names the fix. Defined in ``oppo.errors``
(a module that imports nothing), so that the preflight's error can be one without loading torch."""

from __future__ import annotations

from ..errors import ModelLoadError

__all__ = ["ModelLoadError"]
