"""The error a run's inputs raise when they cannot be used, in a module that imports nothing: the
check (``setup.check``, before any model loads) raises a kind of it, and every
loader in ``oppo.models`` raises it (re-exported there as ``oppo.models.ModelLoadError``)."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model, tokenizer, function or prompt set could not be loaded or used; the message names
    the fix."""
