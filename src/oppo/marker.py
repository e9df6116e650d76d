"""The value a setting holds when the Python API was given an object for it (a model, a reward
callable, a data set): ``<object: ...>``, written by :func:`oppo.setup.inputs.marker`. A leaf module, so
that the loaders can tell an object from a path without importing the API's input handling."""

from __future__ import annotations

from typing import Any

MARKER = "<object"


def is_marker(value: Any) -> bool:
    """Whether a setting's value names an object instead of a path or spec."""
    return isinstance(value, str) and value.startswith(MARKER)
