"""Run configuration: nested dataclasses, a YAML file plus dotted overrides.

    oppo train --config run.yaml ppo.actor_lr=1e-6 overlap.mode=sequential

Every field carries its help text in ``metadata["help"]`` (``oppo train --help`` prints them).
Validation raises :class:`ConfigError` with a message that names the problem and the fix; it
never rewrites a value behind the user's back. Derived sizes are computed once, in
:func:`validate`, and exposed as properties.
"""

from .help import help_text
from .parse import MOVED, from_dict, load_config, resolved_settings, to_dict, upgrade_settings, with_overrides
from .schema import (MODES, TASK_PRESETS, AlgoConfig, Config, ConfigError, CriticConfig, DataConfig,
                     GenerationConfig, LogConfig, LoraConfig, OverlapConfig, PlacementConfig, PolicyConfig,
                     PPOConfig, ReferenceConfig, RewardConfig, RunConfig, all_keys, choices_of, fields_of, opt, sections)
from .validate import validate

__all__ = ["MODES", "MOVED", "TASK_PRESETS", "AlgoConfig", "Config", "ConfigError", "CriticConfig", "DataConfig",
           "GenerationConfig", "LogConfig", "LoraConfig", "OverlapConfig", "PlacementConfig", "PolicyConfig",
           "PPOConfig", "ReferenceConfig", "RewardConfig", "RunConfig", "all_keys", "choices_of", "from_dict",
           "fields_of", "help_text", "load_config", "opt", "resolved_settings", "sections", "to_dict", "upgrade_settings",
           "validate", "with_overrides"]
