"""Building a Config: defaults, a recipe, a YAML file and ``key=value`` overrides, each value
coerced to its field's type; an unknown key is refused with the setting it most likely meant (or
where it moved, :data:`MOVED`); a saved config is read back with :func:`from_dict`."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from .. import from_trl
from ..parts import ALGORITHMS
from .schema import TASK_PRESETS, Config, ConfigError, all_keys, fields_of, sections
from .validate import validate


def _section(cfg: Config, key: str) -> tuple[Any, str] | None:
    """(settings object, field name) that ``key`` (``section.field`` or ``rollout.backend.field``)
    names; None for no setting."""
    name, _, leaf = key.rpartition(".")
    section = dict(sections(cfg)).get(name)
    if section is None or leaf not in {f.name for f in fields_of(section)}:
        return None
    return section, leaf


# other trainers' names (TRL, OpenRLHF, verl) for oppo's settings, by the last component: spelling
# alone is a poor guide (difflib puts "learning_rate" nearest to "is_truncate")
_ALIASES = {"learning_rate": ("actor_lr", "critic_lr"), "lr": ("actor_lr", "critic_lr"),
            "actor_learning_rate": ("actor_lr",), "policy_lr": ("actor_lr",),
            "critic_learning_rate": ("critic_lr",), "value_lr": ("critic_lr",), "vf_lr": ("critic_lr",),
            "mini_batch_size": ("minibatch_size",), "ppo_epochs": ("epochs",), "cliprange": ("clip_eps",),
            "init_kl_coef": ("kl_coef",), "prompt_key": ("field",), "input_key": ("field",),
            "prompt_field": ("field",)}

# settings that moved to another section or were renamed (old key -> new key; every old spelling
# straight to today's): given by hand (a YAML file, an override) the old name is refused with the new
# one named; a saved config (a checkpoint's, a bench's) is read with the old names moved
# (upgrade_settings). {learner} in a key: a learner engine's name (moved_to)
_RAY = ("address", "scorer_cpus", "scorer_gpus", "rollout_cpus", "rollout_gpus", "weight_sync", "weight_sync_bucket_mb")
_RANKS = {"learner_workers": "ranks", "learner_cpus": "cpus", "learner_gpus": "gpus", "spread": "spread"}
MOVED = {"overlap.scorer_process": "placement.local.scorer_process",
         "overlap.critic_on_worker": "placement.local.critic_on_worker",
         "overlap.actor_threads": "placement.actor_threads", "overlap.scorer_threads": "placement.scorer_threads",
         "run.threads": "placement.threads",
         # issue 34: the overlap controller's trials cover Delta as well as the chunk
         "overlap.chunk_trial_steps": "overlap.trial_steps", "overlap.chunk_retune_every": "overlap.retune_every",
         # issue 37: a rollout backend's own settings are its section of rollout
         "lora.sync": "rollout.vllm.lora_sync",
         # a placement's own settings are its section of placement
         "placement.scorer_process": "placement.local.scorer_process",
         "placement.critic_on_worker": "placement.local.critic_on_worker",
         **{f"placement.{k}": f"placement.ray.{k}" for k in _RAY},
         "placement.rollout_workers": "placement.ray.rollout_replicas",
         "placement.learner_sharding": "placement.learner",
         # issue 44: a learner engine's ranks are its own section ({learner}: placement.learner's value);
         # placement.backend named the placement
         **{f"placement{at}.{k}": f"learner.{{learner}}.{v}" for k, v in _RANKS.items() for at in ("", ".ray")},
         "placement.backend": "placement.name",
         # generation.engine picked the rollout backend ("engine" is the learner's word: placement.learner)
         "generation.engine": "generation.backend",
         # issue 52: an algorithm's own settings are its section of algo (algo.settings={k: v} -> algo.<name>.k)
         "algo.std_normalize": "algo.grpo.std_normalize",
         # "worker" names the scorer worker alone: Ray's copies of the policy are rollout replicas, and a
         # learner engine's ranks are its ranks
         "placement.ray.rollout_workers": "placement.ray.rollout_replicas",
         "learner.{learner}.workers": "learner.{learner}.ranks"}


def moved_to(key: str, learner: str) -> str | None:
    """The key a setting of :data:`MOVED` is now under, or None for a key that did not move. An old
    key with ``{learner}`` matches any engine's name there, and the new key takes that name; else
    the new key's ``{learner}`` is ``learner``, placement.learner's value."""
    if key in MOVED:
        return MOVED[key].format(learner=learner)
    for old, new in MOVED.items():
        head, templated, tail = old.partition("{learner}")
        name = key[len(head):len(key) - len(tail)]
        if templated and key.startswith(head) and key.endswith(tail) and name and "." not in name:
            return new.format(learner=name)
    return None


@dataclasses.dataclass(frozen=True)
class ChangedDefault:
    """A setting whose default changed: a run saved before the change ran with ``before`` unless
    its settings say otherwise (a saved config without the key: ``before``)."""

    key: str
    before: Any
    now: Any
    since: str  # the change, as a reader finds it in the history


# Defaults that changed (docs/checkpoints.md). A resume takes the checkpoint's own value of each where the
# user does not set it (resumed_config): a changed default is not a changed setting. A setting added with a
# default that behaves as the releases before it did needs no entry; one whose default changes what an
# older run did (delta_rule: the older runs ran the paper's rule) does.
CHANGED_DEFAULTS: tuple[ChangedDefault, ...] = (
    ChangedDefault("overlap.delta_rule", "reward_slope", "cost", "f2fb8ba (issue 34): the cost-aware overlap "
                   "controller"),
    ChangedDefault("ppo.micro_batch_tokens", 0, -1, "cc1419d (issue 46): a token budget from the device's free "
                   "memory on CUDA"),
    ChangedDefault("data.max_prompt_tokens", 128, None, "issue 53: prompts are not cut to 128 tokens by default "
                   "(empty: the models' positions minus generation.max_new_tokens)"),
)


def upgrade_settings(d: dict) -> dict:
    """A saved config dict (nested sections) with the keys of :data:`MOVED` under their new names
    (a value already under the new name wins), and the settings of :data:`CHANGED_DEFAULTS` that it
    lacks at their value before the change (what the run ran with). ``d`` is unchanged."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    for changed in CHANGED_DEFAULTS:  # saved before the setting existed: the run did what the old default does
        within, leaf = changed.key.split(".")
        if isinstance(out.get(within), dict) and leaf not in out[within]:
            out[within][leaf] = changed.before
    algo = out.get("algo")
    if isinstance(algo, dict) and isinstance(algo.get("settings"), dict):  # before issue 52: one mapping
        own = algo.pop("settings")  # (empty, as every config.yaml wrote it: nothing to move)
        if own:
            algo[algo.get("name") or "ppo"] = {**own, **(algo.get(algo.get("name") or "ppo") or {})}
    placed = out["placement"] if isinstance(out.get("placement"), dict) else {}
    learner = placed.get("learner") or placed.get("learner_sharding") or "replicate"
    engines = [e for e, own in (out.get("learner") or {}).items() if isinstance(own, dict)]
    known = set(all_keys())  # (an engine of today whose own setting has an old key's name keeps it)
    moves: list[tuple[str, str]] = []  # (in MOVED's order: of two old names of one setting, the older one wins)
    for old, new in MOVED.items():
        moves += ([(old.format(learner=e), new.format(learner=e)) for e in engines if old.format(learner=e) not in known]
                  if "{learner}" in old else [(old, new.format(learner=learner))])
    for old, new in moves:
        (*os_, ok), (*ns, nk) = old.split("."), new.split(".")
        src: dict | None = out
        for part in os_:  # (placement.ray.<key>: a section within a section, copied before a key leaves it)
            inner = src.get(part) if src is not None else None
            if src is not None and isinstance(inner, dict):
                src[part] = inner = dict(inner)
            src = inner if isinstance(inner, dict) else None
        if src is not None and ok in src:
            value = src.pop(ok)
            section = out.setdefault(ns[0], {})
            for part in ns[1:]:  # (rollout.<backend>, placement.<name>, learner.<engine>)
                section[part] = section = dict(section.get(part) or {})
            section.setdefault(nk, value)
    return out


def _words_match(a: str, b: str) -> bool:
    """Two words one spelling slip apart (lrr/lr, seeds/seed), not two different words (kl/vf)."""
    return a == b or difflib.SequenceMatcher(None, a, b).ratio() >= 0.8


def _same_operation(leaf: str, known_leaf: str) -> bool:
    """Whether ``known_leaf`` can be what ``leaf`` meant: the same name misspelled (batchsize,
    actor_lrr), or a part of it (lr -> actor_lr). A name sharing a word or two with another
    (whiten_rewards, whiten_advantages; vf_coef, kl_coef) is another operation, not a typo."""
    joined = difflib.SequenceMatcher(None, leaf.replace("_", ""), known_leaf.replace("_", "")).ratio()
    if joined >= 0.85:
        return True
    words, known_words = leaf.split("_"), known_leaf.split("_")
    return all(any(_words_match(w, k) for k in known_words) for w in words)


def _suggest(key: str, known: list[str]) -> str:
    section, _, leaf = key.rpartition(".")
    aliased = [f"{s}.{a}" for s in [section] + sorted({k.split(".")[0] for k in known})
               for a in _ALIASES.get(leaf, ()) if f"{s}.{a}" in known]
    if aliased:
        first, *rest = list(dict.fromkeys(aliased))
        also = f" (Or '{rest[0]}'.)" if rest and rest[0].split(".")[0] == first.split(".")[0] else ""
        return f" Did you mean '{first}'?{also}"
    sections = sorted({k.split(".")[0] for k in known})
    if section and section not in sections:  # a misspelled section (ppoo.batch_size)
        section = next(iter(difflib.get_close_matches(section, sections, n=1, cutoff=0.6)), section)
    close = [k for k in known if _same_operation(leaf, k.split(".")[-1])]
    close.sort(key=lambda k: (k.split(".")[0] != section,
                              -difflib.SequenceMatcher(None, leaf, k.split(".")[-1]).ratio()))
    return f" Did you mean '{close[0]}'?" if close else ""


def _unknown(cfg: Config, key: str, value: Any, source: str) -> str | None:
    """One line saying why ``key`` is not a setting and what to write instead; None for a setting."""
    known = all_keys(cfg)
    new = moved_to(key, cfg.placement.learner) if key in MOVED or key not in known else None
    if new is not None:
        why = (" (\"worker\" names the scorer worker alone)" if "worker" in key.rpartition(".")[2] and
               key.rpartition(".")[0] == new.rpartition(".")[0] else
               f" (a placement's own settings are its section, placement.{new.split('.')[1]})" if new.count(".") == 2
               and new.startswith("placement.") else " (a rollout backend's own settings are its section)"
               if new.startswith("rollout.") else " (a learner engine's own settings are its section, "
               "learner.<placement.learner>)" if new.startswith("learner.") else " (where a role runs and how much "
               "hardware it gets is in the placement section)" if new.startswith("placement.") and not
               key.startswith("placement.") else " (it picks the rollout backend; the learner engine is "
               "placement.learner)" if new == "generation.backend" else " (an algorithm's own settings are its "
               "section, algo.<name>)" if new.startswith("algo.") else "")
        return f"Unknown setting '{key}' (from {source}): {key} is now {new}{why}. Rename it to {new}."
    if key == "algo.settings":
        name = cfg.algo.name if cfg.algo.name != "ppo" else "<algo.name>"  # (the name may be set after this key)
        try:
            given = yaml.safe_load(value) if isinstance(value, str) else value
        except yaml.YAMLError:
            given = None
        given = given if isinstance(given, dict) else {}
        if not given:  # (an older run's config.yaml: it wrote the empty mapping)
            return (f"Unknown setting '{key}' (from {source}): an algorithm's own settings are now its section, "
                    f"algo.<name>.*, and this one sets none: delete it.")
        shown = ", ".join(f"algo.{name}.{k}={v}" for k, v in given.items())
        return (f"Unknown setting '{key}' (from {source}): an algorithm's own settings are now its section, "
                f"algo.<name>.* (`oppo train --help` lists each algorithm's). Write {shown}.")
    if key in known:
        return None
    section, _, leaf = key.rpartition(".")
    if section.startswith("algo.") and (spec := ALGORITHMS.find(section[5:])) is not None and leaf in spec.config_keys:
        return (f"Unknown setting '{key}' (from {source}): algo.name={spec.name} reads {leaf} from "
                f"{spec.config_keys[leaf]}; set that instead.")
    trl = from_trl.lookup(key)
    if trl is not None:
        return f"Unknown setting '{key}' (from {source}): {trl.says(value)}."
    return f"Unknown setting '{key}' (from {source}).{_suggest(key, known)}"


def _refuse_unknown(cfg: Config, items: list[tuple[str, Any, str]]) -> None:
    """Raise one ConfigError naming every unknown key of ``items`` ((key, value, source)), a line each."""
    lines = [line for key, value, source in items if (line := _unknown(cfg, key, value, source))]
    if not lines:
        return
    trl = any(from_trl.lookup(key) for key, _, _ in items if key not in all_keys(cfg))
    tail = "`oppo train --help` lists every setting" + ("; docs/from-trl.md maps TRL's." if trl else ".")
    raise ConfigError("\n".join(lines[:-1] + [f"{lines[-1]} {tail}"]))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML/override value to the field's declared type, or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner[0])
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true or false, got {value!r}.")
    if tp is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and _is_int(value))):
            raise ConfigError(f"{key}: expected an integer, got {value!r}.")
        return int(value)
    if tp is float:
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}.") from None
    if tp is str:
        if value is None:
            raise ConfigError(f"{key}: must not be empty.")
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}.")
        return str(value)
    if tp is dict or origin is dict:
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.strip() else {}
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}: expected a mapping such as {{name: value}}, got {value!r}.")
        return value
    if tp is list or origin is list:
        if isinstance(value, str):
            value = yaml.safe_load(value if value.startswith("[") else f"[{value}]")
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list such as [8, 16, 32], got {value!r}.")
        return value
    return value


def _is_int(s: str) -> bool:
    try:
        int(s)
        return True
    except ValueError:
        return False


def _set(cfg: Config, key: str, value: Any, source: str) -> None:
    _refuse_unknown(cfg, [(key, value, source)])
    found = _section(cfg, key)
    assert found is not None  # (_refuse_unknown raised otherwise)
    section, leaf = found
    hints = typing.get_type_hints(type(section))
    setattr(section, leaf, _coerce(key, value, hints[leaf]))


def _flatten(d: dict, prefix: str = "", within: frozenset[str] | None = None) -> dict[str, Any]:
    """``{"section.field": value}`` of a nested mapping of sections (a YAML file, a saved config)."""
    if within is None:  # the sections within sections: rollout.<backend>, placement.<name>
        within = frozenset(name for name, _ in sections(Config()) if "." in name)
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        # a section (or one within a section); a mapping under a setting is its value
        if isinstance(v, dict) and (not prefix or key in within):
            out.update(_flatten(v, key + ".", within))
        else:
            out[key] = v
    return out


def _file_items(p: Path, what: str) -> list[tuple[str, Any, str]]:
    """(key, value, source) of each setting in the YAML config file ``p``."""
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {p} must hold a mapping of sections (policy:, ppo:, ...).")
    return [(key, value, str(p)) for key, value in _flatten(data).items()]


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                recipe: str | None = None) -> Config:
    """Build a Config from defaults, then a recipe (``oppo.recipes``), then a YAML file, then
    ``key=value`` overrides. Unknown keys and values of the wrong type are refused here; the
    settings as a whole are validated by the run's one check (``setup.check``, or
    :func:`~oppo.config.validate` directly)."""
    cfg = Config()
    explicit: set[str] = set()
    items: list[tuple[str, Any, str]] = []  # (key, value, where it came from)
    if recipe is not None:
        from .. import recipes

        found = recipes.find(recipe)
        if found is None:
            raise ConfigError(f"Unknown recipe {recipe!r}; the recipes are: {', '.join(recipes.names()) or 'none'} "
                              f"(`oppo recipes` says what each trains).")
        # (a prompt file the recipe ships beside it: its bare name read as its path there)
        items += [(key, recipes.shipped_path(value) if key == "data.prompts" else value, source)
                  for key, value, source in _file_items(found, "Recipe")]
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"Config file {p} not found. Give an existing YAML file to --config.")
        items += _file_items(p, "Config file")
    pairs = _split_overrides(overrides)
    _refuse_unknown(cfg, items + [(key, raw or None, "the command line") for key, raw in pairs])  # all at once
    items += [(key, _parse_override(cfg, key, raw), "the command line") for key, raw in pairs]
    for key, value, source in items:
        _set(cfg, key, value, source)
        explicit.add(key)
    cfg.__dict__[_EXPLICIT] = frozenset(explicit)  # (a resume tells a changed default from the user's value)
    if cfg.uses_builtin_task:
        for key, value in TASK_PRESETS.get(cfg.data.task, {}).items():
            if key not in explicit:
                _set(cfg, key, value, f"the built-in task {cfg.data.task!r}'s preset")
                cfg.__dict__.setdefault("_presets", {})[key] = value  # (a policy object drops them: setup/inputs.py)
    return cfg


def with_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """A copy of ``cfg`` with ``key=value`` overrides applied (``cfg`` is unchanged)."""
    out = copy.deepcopy(cfg)
    pairs = _split_overrides(overrides)
    _refuse_unknown(out, [(key, raw or None, "the command line") for key, raw in pairs])
    for key, raw in pairs:
        _set(out, key, _parse_override(out, key, raw), "the command line")
    if _EXPLICIT in out.__dict__:
        out.__dict__[_EXPLICIT] = out.__dict__[_EXPLICIT] | {key for key, _ in pairs}
    return out


def _split_overrides(overrides: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """(key, raw value) of each ``key=value`` override, stripped."""
    pairs = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"Override '{item}' must look like section.key=value (e.g. ppo.actor_lr=1e-6).")
        key, raw = (x.strip() for x in item.split("=", 1))
        pairs.append((key, raw))
    return pairs


def _parse_override(cfg: Config, key: str, raw: str) -> Any:
    """An override's value: YAML for numbers, booleans and lists; text settings keep their text
    (data.split=on is 'on', policy.path=0755 is '0755', not True and 493)."""
    if not raw:
        return None
    if key not in all_keys(cfg):
        return raw  # _set reports the unknown key
    found = _section(cfg, key)
    assert found is not None  # (a known key)
    section, name = found
    tp = typing.get_type_hints(type(section))[name]
    if str in (tp, *typing.get_args(tp)) and raw[0] not in "'\"":
        return raw
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}={raw!r}: cannot parse the value ({getattr(e, 'problem', e)}).") from None


def to_dict(cfg: Config) -> dict:
    """The nested settings of ``cfg``, each placement's own under ``placement.<name>`` (as written)."""
    d = dataclasses.asdict(cfg)
    d["placement"].update(d["placement"].pop("by_name"))
    d["algo"].update(d["algo"].pop("by_name"))
    return d


def resolved_settings(d: dict) -> dict:
    """A config dict (``to_dict``, or a checkpoint's saved one) with an empty ``ppo.kl_coef``
    replaced by the algorithm's default: the value in effect, for comparing two runs' settings (an
    empty one under grpo is 0.04, as a checkpoint that named 0.04 was). ``d`` is unchanged."""
    ppo, name = d.get("ppo"), (d.get("algo") or {}).get("name", "ppo")
    spec = ALGORITHMS.find(name)
    if isinstance(ppo, dict) and "kl_coef" in ppo and ppo["kl_coef"] is None and spec is not None:
        return {**d, "ppo": {**ppo, "kl_coef": spec.kl_coef}}
    return d


def from_dict(d: dict) -> Config:
    """A Config from a saved config dict (``to_dict``; settings moved since are read under their
    new names: :func:`upgrade_settings`)."""
    cfg = Config()
    for key, value in _flatten(upgrade_settings(d)).items():
        _set(cfg, key, value, "a saved config")
    return cfg


_EXPLICIT = "_explicit"  # the keys a file or an override set (load_config, with_overrides); absent: built in code


def user_set(cfg: Config, key: str) -> bool:
    """Whether ``key`` (``section.field``) holds a value the user gave: set by a recipe, a file or an
    override (:func:`load_config`); for a Config built in code, a value other than the default."""
    explicit = cfg.__dict__.get(_EXPLICIT)
    if explicit is not None:
        return key in explicit
    found, default = _section(cfg, key), _section(Config(), key)
    assert found is not None and default is not None, key
    return getattr(*found) != getattr(*default)


def resumed_config(cfg: Config, saved: dict) -> tuple[Config, list[str]]:
    """The settings a resumed run goes on with: ``cfg``, but for each setting of
    :data:`CHANGED_DEFAULTS` the user did not set, the value the checkpoint's run used (``saved``,
    its config dict; a setting it lacks at the value before the change). A changed default is
    not a changed setting: the run's own value counts. Returns the settings (``cfg`` itself when
    nothing is taken; else a validated copy) and a line for each value taken."""
    flat = _flatten(upgrade_settings(saved))
    taken = {c.key: flat[c.key] for c in CHANGED_DEFAULTS
             if c.key in flat and not user_set(cfg, c.key) and flat[c.key] != getattr(*_setting(cfg, c.key))}
    if not taken:
        return cfg, []
    out = copy.deepcopy(cfg)
    lines = []
    for key, value in taken.items():
        now = getattr(*_setting(cfg, key))
        _set(out, key, value, "the checkpoint's settings")
        change = next(c for c in CHANGED_DEFAULTS if c.key == key)
        lines.append(f"{key}={value}, the value the checkpoint's run used (the default is {now} since {change.since}"
                     f"; to change it, start a new run)")
    try:
        validate(out)  # (a predicate here: are the checkpoint's values valid beside today's other settings?)
        return out, lines
    except ConfigError:  # (not valid with today's other settings: the resume's settings check names the value)
        return cfg, []


def _setting(cfg: Config, key: str) -> tuple[Any, str]:
    found = _section(cfg, key)
    assert found is not None, key
    return found


