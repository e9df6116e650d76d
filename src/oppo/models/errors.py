"""The error every loader and check raises: its message names the fix."""

from __future__ import annotations

class ModelLoadError(ValueError):
    """A model, tokenizer or function could not be loaded; the message names the fix."""
