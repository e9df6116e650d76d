"""What a run is given from Python in place of paths (models, a tokenizer, reward callables,
prompts), split from the settings (:func:`split_inputs`: each such setting holds a marker naming
its object, so config.yaml, checkpoints and a resume see it as any setting), checked by the rules
a path is checked with (:func:`object_problems`), and saved once (``save_pretrained``) where a role
loads its model in another process (:func:`save_for_elsewhere`). Design notes: docs/python-api.md,
"Every setting means what it does on the command line" and "Where objects must be on disk"."""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config, ConfigError
from ..errors import ModelLoadError
from ..marker import MARKER, is_marker
from ..scoring.reward_fn import function_problems


# keyword -> the setting it stands for (tokenizer: none; it comes from policy.path otherwise)
SETTINGS = {"policy": "policy.path", "reference": "reference.path", "critic": "critic.path",
            "reward_model": "reward.path", "reward_fn": "reward.function", "judge": "reward.judge",
            "prompts": "data.prompts"}
MODEL_ROLES = {"policy": "policy", "reference": "reference", "critic": "critic", "reward_model": "reward"}
"""Model keywords -> the role (as ``ResolvedPaths`` and the loaders name it)."""


@dataclass
class Inputs:
    """The objects a run was given (None: the setting's path or spec is used)."""

    policy: Any = None
    """A causal LM (``transformers.PreTrainedModel``): trained in place."""
    tokenizer: Any = None
    """The policy's tokenizer (needed with a policy object; else overrides the one at policy.path)."""
    reference: Any = None
    """A causal LM for the KL penalty (frozen)."""
    critic: Any = None
    """The critic's initialisation: a one-label sequence classifier (trained in place) or a causal LM
    (its backbone, with a new value head)."""
    reward_model: Any = None
    """A one-label ``...ForSequenceClassification`` (frozen)."""
    reward_fn: Any = None
    """``fn(prompts, responses, **asked) -> list[float]`` (``scoring.reward_fn``)."""
    judge: Any = None
    """Like ``reward_fn``; logged as judge/mean, never trained on."""
    prompts: Any = None
    """A ``datasets.Dataset`` (or ``DatasetDict``), a list of str or a list of dicts."""
    reward_terms: dict[str, Any] = field(default_factory=dict)
    """``reward.terms`` given as callables (``{"function": fn, ...}``), by term name: each term's
    ``function`` holds the callable's marker."""
    save_dir: Path | None = None
    """Where :func:`save_for_elsewhere` writes (None: a temporary directory)."""
    saved: dict[str, str] = field(default_factory=dict)
    """Role -> the directory its object was saved to."""
    temporary: bool = False
    """``save_dir`` was made by :func:`save_for_elsewhere` (the Trainer removes it when it closes)."""

    def __bool__(self) -> bool:
        return bool(self.reward_terms) or any(getattr(self, k) is not None for k in (*SETTINGS, "tokenizer"))

    def model(self, role: str) -> Any:
        """The model object of ``role`` (policy, reference, critic, reward), or None."""
        return getattr(self, {v: k for k, v in MODEL_ROLES.items()}[role])


def marker(obj: Any, data_field: str = "prompt") -> str:
    """What ``config.yaml`` records for an object: its kind and, where cheap, what tells two apart
    on resume (a data set's size and content fingerprint)."""
    import torch

    if isinstance(obj, torch.nn.Module):
        return f"{MARKER}: {type(obj).__name__}>"
    if callable(obj) and not isinstance(obj, (list, tuple)):
        from ..scoring.reward_fn import describe

        return f"{MARKER}: {describe(obj)}>"
    if type(obj).__module__.startswith("datasets."):
        n = sum(len(v) for v in obj.values()) if isinstance(obj, dict) else len(obj)
        fp = getattr(obj, "_fingerprint", None)
        return f"{MARKER}: {type(obj).__name__} of {n} rows" + (f", fingerprint {fp}" if fp else "") + ">"
    if isinstance(obj, (list, tuple)):
        digest = hashlib.sha256(json.dumps(list(obj), sort_keys=True, default=str).encode()).hexdigest()[:12]
        return f"{MARKER}: list of {len(obj)} prompts, sha256 {digest}>"
    return f"{MARKER}: {type(obj).__name__}>"


def _get(cfg: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def split_inputs(cfg: Config, **given: Any) -> tuple[Config, Inputs]:
    """``cfg`` with each object (given by keyword, or set in its setting) replaced by its marker,
    and the objects. A string given by keyword is that setting's value (``policy="org/model"`` is
    ``policy.path``). ``cfg`` is not changed. Raises ConfigError on an unknown keyword or an input
    given both ways."""
    unknown = sorted(set(given) - set(SETTINGS) - {"tokenizer", "save_dir", "reward_terms"})
    if unknown:
        raise ConfigError(f"unknown input{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: oppo.Trainer and "
                          f"oppo.train take {', '.join([*SETTINGS, 'tokenizer'])} (docs/python-api.md).")
    in_cfg = {kw: v for kw, key in SETTINGS.items() if (v := _get(cfg, key)) is not None and not isinstance(v, str)}
    term_fns = [t["function"] for t in (cfg.reward.terms if isinstance(cfg.reward.terms, list) else [])
                if isinstance(t, dict) and callable(t.get("function"))]
    if not in_cfg and not term_fns and all(given.get(kw) is None for kw in (*SETTINGS, "tokenizer")):
        # nothing to take out: the Config itself, as before (with the terms' callables given by name)
        return cfg, Inputs(save_dir=given.get("save_dir"), reward_terms=dict(given.get("reward_terms") or {}))
    # a deep copy that keeps the objects themselves (a data set, a model or a callable is not copied)
    out = copy.deepcopy(cfg, {id(v): v for v in [*in_cfg.values(), *term_fns]})
    inputs = Inputs(tokenizer=given.get("tokenizer"), save_dir=given.get("save_dir"),
                    reward_terms=dict(given.get("reward_terms") or {}))
    if term_fns:
        out.reward.terms = _split_terms(out.reward.terms, inputs)
    for kw, key in SETTINGS.items():
        section, name = key.split(".")
        obj, setting = given.get(kw), _get(cfg, key)
        if obj is not None and setting is not None and not is_marker(setting):
            shown = repr(setting) if isinstance(setting, str) else f"an object ({type(setting).__name__})"
            raise ConfigError(f"{kw}= was given and {key} is set too ({shown}); give one of them.")
        obj = setting if obj is None and kw in in_cfg else obj
        if isinstance(obj, (str, Path)):  # a path or spec, by keyword: the setting
            setattr(getattr(out, section), name, str(obj))
        elif obj is not None:
            setattr(inputs, kw, obj)
            setattr(getattr(out, section), name, marker(obj, cfg.data.field))
    if out.policy.path is not None:  # (a policy object's marker, or a path given as policy=)
        _drop_task_presets(out)
    return out, inputs


def _split_terms(terms: list, inputs: Inputs) -> list:
    """``reward.terms`` with each callable ``function`` replaced by its marker and kept in
    ``inputs.reward_terms`` under the term's name (its ``name``, else the callable's own name:
    written into the term, so that config.yaml and a resume name it the same)."""
    from ..rewards.terms import term_name
    from ..scoring.reward_fn import describe

    out = []
    for t in terms:
        fn = t.get("function") if isinstance(t, dict) else None
        if callable(fn):
            name = t.get("name") or term_name(describe(fn).rsplit(".", 1)[-1])
            if name in inputs.reward_terms:
                raise ConfigError(f"reward.terms: two callables are named {name!r}; give them distinct names "
                                  f"(name: ...).")
            inputs.reward_terms[name] = fn
            t = {**t, "function": marker(fn), "name": name}
        out.append(t)
    return out


def _drop_task_presets(cfg: Config) -> None:
    """A Config from ``load_config`` without ``policy.path`` got the built-in task's presets
    (``config.TASK_PRESETS``: learning rates for its tiny models). They apply only where no policy
    is named, as on the command line; a policy object names one, so the settings that still hold a
    preset's value go back to their defaults (those the user set are kept: load_config skips them)."""
    presets = cfg.__dict__.pop("_presets", None) or {}
    default = Config()
    dropped = []
    for key, value in presets.items():
        if _get(cfg, key) == value:
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, _get(default, key))
            dropped.append(key)
    if dropped:
        print(f"oppo: policy= names the policy, so the built-in task's presets that load_config applied "
              f"({', '.join(dropped)}) are not used; their defaults are.", file=sys.stderr)


def needs_saving(cfg: Config) -> dict[str, str]:
    """Role -> why, for the model objects a role loads elsewhere (from a path)."""
    from .. import placements
    from ..rollout import registry

    why: dict[str, str] = {}
    spec = placements.of(cfg.placement)
    if spec.remote:
        for role in ("policy", "reference", "critic", "reward"):
            why[role] = spec.where or f"placement.name={spec.name}, whose roles load their models from a directory"
    backend = cfg.generation.backend
    if backend != registry.AUTO and registry.get(backend).loads_own_weights:
        why.setdefault("policy", f"generation.backend={backend}, which loads the policy from a directory")
    return why


def save_for_elsewhere(cfg: Config, inputs: Inputs, log: bool = True) -> dict[str, str]:
    """Save each model object that a role loads elsewhere (:func:`needs_saving`), once, with
    ``save_pretrained`` (the policy with its tokenizer) under ``inputs.save_dir`` (a temporary
    directory when None: recorded in ``inputs.save_dir``; the caller removes it). Returns (and
    records in ``inputs.saved``) role -> directory, and says so on stderr."""
    import tempfile

    for role, why in needs_saving(cfg).items():
        model = inputs.model(role)
        if model is None or role in inputs.saved:
            continue
        if inputs.save_dir is None:
            inputs.save_dir, inputs.temporary = Path(tempfile.mkdtemp(prefix="oppo-inputs-")), True
        d = Path(inputs.save_dir) / role
        model.save_pretrained(d)
        if role == "policy" and inputs.tokenizer is not None:
            inputs.tokenizer.save_pretrained(d)
        inputs.saved[role] = str(d)
        if log:
            print(f"oppo: the {role} given as an object is saved to {d} for {why}", file=sys.stderr, flush=True)
    return inputs.saved


def keyword_of(setting: str) -> str | None:
    """The keyword an object for ``setting`` (e.g. ``reward.function``) is passed as."""
    return next((kw for kw, key in SETTINGS.items() if key == setting), None)



# --------------------------------------------------------------------------- the objects' checks

def object_problems(cfg: Config, inputs: Inputs, columns: list[str] | None) -> list[str]:
    """What is wrong with the objects given from Python (``oppo.Trainer.from_config(cfg, policy=...)``), by the
    rules a path or spec is checked with: each model of its role's kind (the policy a causal LM,
    the reward model a one-label sequence classifier, ...) reading the tokenizer's ids, the
    tokenizer given with a policy object, the prompts a data set or list with the prompt field.
    Also a marker (``config.yaml``'s ``<object: ...>``) with no object given for it. ``columns``: the
    prompt set's, where known without reading it (``setup.preflight``)."""
    problems = []
    for kw, key in SETTINGS.items():
        section, name = key.split(".")
        if is_marker(getattr(getattr(cfg, section), name)) and getattr(inputs, kw) is None:
            problems.append(f"{key}={getattr(getattr(cfg, section), name)!r} stands for an object that the run was "
                            f"given from Python ({kw}=...), and none is given now: pass the same object again "
                            f"(oppo.train(cfg, {kw}=...)), or set {key} to a path"
                            + (" or 'module:function'" if section == "reward" and name != "path" else "") + ".")
    if inputs.prompts is not None:
        from ..data import object_problems as data_problems

        problems += data_problems(inputs.prompts, cfg.data.field, cfg.data.split)
    tok = inputs.tokenizer
    if tok is not None:
        from ..models import tokenizer_from_object

        try:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the pad-token warning comes when the run builds it)
                tok = tokenizer_from_object(tok)
        except ModelLoadError as e:
            problems.append(str(e))
            tok = None
    elif inputs.policy is not None:
        problems.append("policy= was given as an object, so give its tokenizer too (tokenizer=AutoTokenizer."
                        "from_pretrained(...)): oppo tokenises the prompts and decodes the responses with it.")
    for key, obj in (("reward.function", inputs.reward_fn), ("reward.judge", inputs.judge)):
        if obj is not None:
            problems += function_problems(key, None, obj, columns, keyword=keyword_of(key))
    problems += _term_object_problems(cfg.reward.terms, inputs.reward_terms, columns)
    models = [(role, kw, m) for kw, role in (("policy", "policy"), ("reference", "reference"), ("critic", "critic"),
                                              ("reward_model", "reward")) if (m := getattr(inputs, kw)) is not None]
    if models:
        from ..models import model_problems
        from ..models import object_problems as model_object_problems

        for role, kw, m in models:
            problems += model_object_problems(tok, role, m, kw) if tok is not None else model_problems(role, kw, m)
    problems += _shared_objects(models)
    return problems


def _term_object_problems(terms_cfg: Any, given: dict[str, Any], columns: list[str] | None) -> list[str]:
    """``reward.terms`` given as callables: each marker has its callable, and each callable takes
    the prompts, the responses and the columns it asks for (with the term's kwargs bound)."""
    from ..rewards.terms import parse_terms

    try:
        terms = parse_terms(terms_cfg) if terms_cfg else []
    except ValueError:
        return []  # (validation says how)
    problems = []
    for i, term in enumerate(terms):
        if not (term.function and is_marker(term.function)):
            continue
        obj = given.get(term.name)
        if obj is None:
            problems.append(f"reward.terms[{i}] (term {term.name!r}) is {term.function!r}: a callable the run was "
                            f"given from Python, and none is given now: pass the config with the same callable as "
                            f"the term's function, or name it as 'package.module:function'.")
        else:
            problems += function_problems(f"reward.terms[{i}].function", None, obj, columns, bound=term.kwargs)
    return problems


# why one model object cannot serve two roles (kw pair -> what would go wrong, and the fix)
_SHARED = {
    ("policy", "reference"): "the policy trains in place, so the reference would move with it (its KL would "
                             "stay 0). Leave reference= out: the run makes a frozen copy of the initial policy",
    ("policy", "critic"): "both train, as two models. Leave critic= out (the critic starts from a copy of the "
                          "reward model, else of the policy), or give a separately loaded one-label model",
    ("policy", "reward_model"): "the policy trains in place and the reward model stays frozen",
    ("reference", "critic"): "the critic trains in place and the reference stays frozen",
    ("reference", "reward_model"): "they are different kinds of model (a causal LM and a one-label classifier)",
    ("critic", "reward_model"): "the critic trains in place, so the reward would move with it. Leave critic= out: "
                                "the run starts the critic from a copy of the reward model",
}


def _shared_objects(models: list[tuple[str, str, Any]]) -> list[str]:
    """One problem per pair of roles given the same model object (``models``: (role, keyword,
    object)), named by keyword, before anything loads: otherwise one role's update or freeze
    lands on the other, and fails later in PyTorch, naming neither."""
    out = []
    for i, (_, kw_a, a) in enumerate(models):
        for _, kw_b, b in models[i + 1:]:
            if a is b:
                why = _SHARED.get((kw_a, kw_b), "each role needs its own model")
                fix = "" if ". " in why else "; give each its own object (e.g. copy.deepcopy, or load it again)"
                out.append(f"{kw_a}= and {kw_b}= are the same object ({type(a).__name__}): {why}{fix}.")
    return out


__all__ = ["Inputs", "is_marker", "keyword_of", "marker", "needs_saving", "object_problems",
           "save_for_elsewhere", "split_inputs"]
