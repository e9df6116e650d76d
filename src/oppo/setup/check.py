"""The one hand-off from a config to the roles: :func:`check` turns a config and the objects a user
gave into a :class:`Checked` record (the settings validated, every input checked, nothing loaded),
the only way to obtain one; the Trainer is built from it (``Trainer(checked)``, or
``Trainer.from_config(cfg, **objects)``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ..config import Config, validate
from .inputs import Inputs, split_inputs
from .preflight import PreflightError, problems

_ISSUED = object()  # what only check() passes: a Checked is never made by hand


@dataclass(frozen=True)
class Checked:
    """A run's settings and inputs, checked once (:func:`check`); what ``Trainer`` is built from."""

    cfg: Config
    """The validated settings; each setting given an object holds its marker (``setup.inputs``)."""
    inputs: Inputs
    """The objects given from Python in place of paths (empty where none was)."""
    backend: str
    """The rollout backend the run asks for (``generation.backend``): a backend's name, or ``auto``,
    which picks one once the policy has loaded (``rollout.registry.resolve_backend``)."""
    _issued: object = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._issued is not _ISSUED:
            raise TypeError("a Checked record comes from oppo.setup.check(cfg, ...), which validates the settings "
                            "and checks the inputs; it is not built by hand.")


def check(cfg: Config, inputs: Inputs | None = None, found: Sequence[str] = ()) -> Checked:
    """The settings validated (``config.validate``), then every path and object the roles are built
    from checked (``setup.preflight.problems``), before any model loads; ``found``: the caller's own
    problems (a run directory's, a checkpoint's), reported with these in one message. ``cfg`` holds
    the markers of ``inputs``' objects (:func:`~oppo.setup.inputs.split_inputs`). Raises
    ``ConfigError`` or :class:`~oppo.setup.preflight.PreflightError`."""
    inputs = inputs if inputs is not None else Inputs()
    validate(cfg)
    all_found = [*found, *problems(cfg, inputs)]
    if all_found:
        raise PreflightError(all_found)
    return Checked(cfg, inputs, cfg.generation.backend, _ISSUED)


def check_objects(cfg: Config, **objects: Any) -> Checked:
    """:func:`check` for a config and objects given by keyword (``oppo.Trainer.from_config``): the
    objects split from the settings (:func:`~oppo.setup.inputs.split_inputs`), then checked."""
    cfg, inputs = split_inputs(cfg, **objects)
    return check(cfg, inputs)


__all__ = ["Checked", "check", "check_objects"]
