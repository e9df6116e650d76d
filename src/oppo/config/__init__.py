"""Run configuration: nested dataclasses, a YAML file plus dotted overrides.

    oppo train --config run.yaml ppo.actor_lr=1e-6 overlap.mode=sequential

Every field carries its help text in ``metadata["help"]`` (``oppo train --help`` prints them).
Validation raises :class:`ConfigError` with a message that names the problem and the fix; it
never rewrites a value behind the user's back. Derived sizes are computed once, in
:func:`validate`, and exposed as properties.
"""

from .help import help_text
from .parse import (CHANGED_DEFAULTS, MOVED, ChangedDefault, from_dict, load_config, resolved_settings, resumed_config,
                    to_dict, upgrade_settings, user_set, with_overrides)
from .schema import (MODES, TASK_PRESETS, AlgoConfig, Config, ConfigError, CriticConfig, DataConfig,
                     GenerationConfig, LogConfig, LoraConfig, OverlapConfig, PlacementConfig, PolicyConfig,
                     PPOConfig, ReferenceConfig, RewardConfig, RunConfig, all_keys, choices_of, fields_of, opt, sections)
from .validate import validate

__all__ = ["CHANGED_DEFAULTS", "MODES", "MOVED", "ChangedDefault", "TASK_PRESETS", "AlgoConfig", "Config", "ConfigError", "CriticConfig", "DataConfig",
           "GenerationConfig", "LogConfig", "LoraConfig", "OverlapConfig", "PlacementConfig", "PolicyConfig",
           "PPOConfig", "ReferenceConfig", "RewardConfig", "RunConfig", "all_keys", "choices_of", "from_dict",
           "fields_of", "help_text", "load_config", "opt", "resolved_settings", "resumed_config", "sections", "to_dict",
           "upgrade_settings", "user_set", "validate", "with_overrides"]
