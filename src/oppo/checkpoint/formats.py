"""Saved formats and their upgrades on load: a piece of state a checkpoint holds carries a format
version; its reader brings an older one up to date one version at a time (an upgrade function from
version v to v + 1), and refuses one it cannot read with what to do instead.

The rule for every change of a saved format (``docs/checkpoints.md``): bump the version, register
the upgrade from the one before it here (the reader's table of upgrades), and commit a checkpoint
of the release before the change as a fixture (``tests/fixtures/releases/make.py``), which
``tests/test_upgrade.py`` resumes with this release.

Imports nothing of oppo: the pure state machines (the tuner, the scheduler) use it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["FormatError", "upgraded"]

Upgrade = Callable[[dict[str, Any]], dict[str, Any]]


class FormatError(ValueError):
    """Saved state in a format this release cannot read; the message says which, and what to do."""


def upgraded(what: str, d: dict[str, Any], version: int, current: int, upgrades: Mapping[int, Upgrade]) -> dict[str, Any]:
    """``d``, saved as ``what`` in format ``version``, brought to format ``current`` by
    ``upgrades[v]`` (v -> v + 1) in turn; ``d`` itself when it is current (never changed in place).

    A newer format than ``current`` (written by a later oppo) or one with no upgrade raises
    :class:`FormatError`: a resume needs the release that wrote it (or a later one). The message
    ends with that advice; the caller adds where the run can go on instead."""
    if version > current:
        raise FormatError(f"{what} is in format {version}, written by a newer oppo than this one (it reads format "
                          f"{current} and the ones before it); resume with the oppo release that wrote it or a "
                          f"later one")
    low = current
    while low - 1 in upgrades:  # the oldest format a chain of upgrades reaches current from
        low -= 1
    if version < low:
        raise FormatError(f"{what} is in format {version}, older than this oppo reads (formats {low} to "
                          f"{current}); resume with an oppo release that reads both, then with this one")
    for v in range(version, current):
        d = upgrades[v](d)
    return d
