"""The part registry's old home: every kind's :class:`Registry` and the plugin-shipping helpers now
live in :mod:`oppo.parts` (re-exported here for code that imports them from this module)."""

from .parts import (PartSpec, Registry, UnknownPart, check_section, modules_by_value, part_modules,
                        setting)

__all__ = ["PartSpec", "Registry", "UnknownPart", "check_section", "modules_by_value", "part_modules", "setting"]
