"""Checks that need no model: they run before ``oppo prepare`` and before any model loads.

It runs once per run, whichever way the run starts, and nothing checks a path or an object again
after it: ``oppo train`` and :func:`oppo.train` call :func:`input_problems` (``run.plan_run``, with
the run directory's checks), and a Trainer built in code (``oppo.Trainer(cfg)``) calls
:func:`check_inputs` (the same checks but the run directory's and the logging's, which a Trainer
has not got). Either reports every problem it finds in one message, so a user fixes them all in
one go instead of one per attempt, each attempt costing a model load:

- the settings (:func:`oppo.config.validate`, raised at once: a Config made in code is checked as
  the CLI's is; one from ``load_config``, validated there, is not validated again:
  ``config.parse.validate_once``) and ``run.out_dir``: a directory or creatable as one, writable;
- the prompt set: given when the models are the user's, present, not empty, its first record
  readable with the configured field;
- model paths: each local one a directory with ``config.json`` (the policy's also with its
  tokenizer; a reward model with one label); each hub name cached locally or the hub reachable;
- ``reward.function`` and ``reward.judge``: importable, and callable as ``fn(prompts, responses)``;
  a column they ask for by keyword (``scoring.reward_fn``) present in the prompt set, where its
  columns can be known without reading it (objects, a JSONL file's first record, a CSV header);
- objects given from Python in place of paths (``inputs.Inputs``: :func:`object_problems`): the
  same rules, read from the objects (a model's class and config, a data set's columns);
- devices: CUDA present when asked for; TensorBoard / W&B installed when asked for;
- ``generation.backend``: the rollout backend installed and able to serve the policy (its
  ``BackendSpec.problems`` in ``rollout.registry``: e.g. an architecture or head size it lacks).

The network: a hub name (``org/model``) that is not in the local Hugging Face cache needs the
hub. One TCP connection to the hub endpoint, with a short timeout, tells within seconds whether
it is reachable; when it is not, every hub name missing from the cache is one clear line about
the network (instead of Hugging Face's long retries and then a message about a missing
tokenizer), and when all of them are cached, offline mode is switched on so that the loaders go
straight to the cache (:func:`hub_reachable`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from typing import Any

from .config import Config
from .config.parse import validate_once
from .errors import ModelLoadError
from .inputs import Inputs, keyword_of
from .marker import is_marker
from .rewards import function_spec, parse_terms

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt")
_OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


class PreflightError(ModelLoadError):
    """One or more problems found before anything expensive ran; the message lists them all. A
    :class:`~oppo.models.ModelLoadError` (so a ``ValueError``): what loading the run's inputs would
    have raised, found before anything loads, whichever way the run started."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        if len(self.problems) == 1:
            msg = self.problems[0]
        else:
            msg = (f"{len(self.problems)} problems, found before loading anything:\n"
                   + "\n".join(f"  - {p}" for p in self.problems))
        super().__init__(msg)


def raise_if(problems: list[str]) -> None:
    if problems:
        raise PreflightError(problems)


# --------------------------------------------------------------------------- the network

_REACHABLE: dict[str, bool] = {}


def _offline_env() -> bool:
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on") for k in _OFFLINE_ENV)


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub endpoint opens within ``timeout`` seconds (cached per
    endpoint for the process). False at once in offline mode (``HF_HUB_OFFLINE=1``).

    Name resolution has no timeout of its own, so the probe runs on a daemon thread and is given
    up on after ``timeout``: a machine without network answers in seconds either way.
    """
    if _offline_env():
        return False
    endpoint = hub_endpoint()
    if endpoint in _REACHABLE:
        return _REACHABLE[endpoint]
    url = urlparse(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    t = threading.Thread(target=probe, name="oppo-hub-probe", daemon=True)
    t.start()
    t.join(timeout + 0.5)
    _REACHABLE[endpoint] = bool(result and result[0])
    return _REACHABLE[endpoint]


def go_offline() -> None:
    """Make Hugging Face read only its local cache, in this process and in the ones it starts."""
    for k in _OFFLINE_ENV:
        os.environ[k] = "1"
    try:
        import huggingface_hub.constants as hc

        hc.HF_HUB_OFFLINE = True  # read at call time by huggingface_hub and transformers
    except ImportError:  # pragma: no cover - transformers depends on it
        pass


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover
        return False
    try:
        hit = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an invalid repo id, an unreadable cache: not cached
        return False
    return isinstance(hit, str)


# --------------------------------------------------------------------------- the checks

def _looks_local(path: str) -> bool:
    from .models import looks_local  # one definition of "a local path"

    return looks_local(path)


def _not_a_classifier(architectures) -> str:
    from .models import not_a_classifier

    return not_a_classifier(architectures if isinstance(architectures, list) else None)


def _model_problems(role: str, key: str, path: str, hub_names: list[tuple[str, str]],
                    new_head: bool = False) -> list[str]:
    """A model directory's problems found without loading it. ``new_head``: a causal LM is a
    reward model too (``reward.new_head``)."""
    if not _looks_local(path):
        hub_names.append((key, path))
        return []
    from .models.paths import model_dir_config  # (the one rule for a model path)

    conf, problem = model_dir_config(path, f"{key}={path!r}")
    if problem is not None:
        return [problem]
    assert conf is not None  # (a directory with a config.json read)
    p = Path(path).expanduser()
    out = []
    if role == "policy" and not any((p / f).is_file() for f in TOKENIZER_FILES):
        out.append(f"{key}={path!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES[:2])}, ...); "
                   f"save it beside the model with tokenizer.save_pretrained(dir).")
    if role == "reward" and (why := _not_a_classifier(conf.get("architectures"))):
        if not new_head:
            out.append(f"{key}={path!r} {why}")
    elif role == "reward":
        labels = len(conf["id2label"]) if isinstance(conf.get("id2label"), dict) else conf.get("num_labels")
        if isinstance(labels, int) and labels != 1:
            out.append(f"{key}={path!r} has {labels} labels; PPO needs a scalar reward "
                       f"(AutoModelForSequenceClassification with num_labels=1).")
    return out


def out_dir_problems(out_dir: str | os.PathLike) -> list[str]:
    """``run.out_dir`` must be a directory, or creatable as one: not a file, not under a file, and
    writable. (Found here, before the models load, not by the first write after them.)"""
    key = f"run.out_dir={str(out_dir)!r}"
    p = Path(out_dir).expanduser()
    if p.is_symlink() and not p.exists():
        return []  # a dangling 'latest' link: the run points it at its new directory
    if p.exists() and not p.is_dir():
        return [f"{key} is a file, not a directory. Set run.out_dir to a directory (created if missing), or move "
                f"the file {p} away."]
    existing = p
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return [f"{key}: {existing} is a file, so no directory can be made under it. Set run.out_dir to a path "
                f"outside it (e.g. {existing.parent / 'runs'}), or move the file away."]
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "the run directory" if existing == p else f"its nearest existing parent, {existing},"
        return [f"{key}: {what} is not writable by this user. Set run.out_dir to a writable directory, or fix "
                f"the permissions."]
    return []


def _prompt_problems(source: str, field: str) -> tuple[list[str], bool]:
    """(problems, is a hub dataset name)."""
    p = Path(source).expanduser()
    local = p.exists() or source.startswith(("/", "./", "../", "~")) or p.suffix in (
        ".jsonl", ".json", ".csv", ".parquet", ".txt")
    if not local:
        return [], True
    if not p.exists():
        return [f"data.prompts={source!r}: no such file or directory. Set data.prompts to an existing "
                f"prompt file (JSONL with a {field!r} field per line)."], False
    if p.is_dir():
        if not any(p.iterdir()):
            return [f"data.prompts={source!r} is an empty directory."], False
        return [], False
    if p.suffix not in (".jsonl", ".json", ".csv", ".parquet", ".txt"):
        return [f"data.prompts={source!r}: cannot tell its format from the name; use .jsonl (one "
                f"{{\"{field}\": ...}} object per line), .json, .csv, .parquet or .txt."], False
    if p.suffix == ".parquet":
        return [], False  # binary: the reader checks it
    first = None
    with open(p, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                first = (lineno, line)
                break
    if first is None:
        return [f"data.prompts={source!r} is empty. Give a file with at least one prompt."], False
    if p.suffix == ".jsonl" or (p.suffix == ".json" and first[1].lstrip().startswith("{")):
        lineno, line = first
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            return [f"{source}:{lineno}: not valid JSON ({e.msg}). Each line must be one JSON object such as "
                    f"{{\"{field}\": \"...\"}}."], False
        if not isinstance(rec, dict) or field not in rec:
            keys = ", ".join(map(repr, rec)) if isinstance(rec, dict) else "none"
            return [f"{source}:{lineno}: no field {field!r} (the record has {keys}). Set data.field to the name "
                    f"of the prompt field."], False
    return [], False


def _term_object_problems(cfg: Config, inputs: Inputs) -> list[str]:
    """``reward.terms`` given as callables: each marker has its callable, and each callable takes
    the prompts, the responses and the columns it asks for (with the term's kwargs bound)."""
    from .rewards.terms import parse_terms

    try:
        terms = parse_terms(cfg.reward.terms) if cfg.reward.terms else []
    except ValueError:
        return []  # (validation says how)
    problems = []
    for i, term in enumerate(terms):
        if not (term.function and is_marker(term.function)):
            continue
        obj = inputs.reward_terms.get(term.name)
        if obj is None:
            problems.append(f"reward.terms[{i}] (term {term.name!r}) is {term.function!r}: a callable the run was "
                            f"given from Python, and none is given now: pass the config with the same callable as "
                            f"the term's function, or name it as 'package.module:function'.")
        else:
            problems += _function_problems(f"reward.terms[{i}].function", None, obj, _known_columns(cfg, inputs),
                                           bound=term.kwargs)
    return problems


def _function_problems(key: str, spec: str | None, obj: Any, columns: list[str] | None,
                       bound: dict | None = None) -> list[str]:
    """``spec`` importable (or ``obj`` callable) as a reward function, asking for no column the
    prompt set lacks (``columns``: its columns, None where not known yet; ``bound``: a reward
    term's settings, given to the function, not asked of the data)."""
    from .models import load_function
    from .scoring.reward_fn import signature_problems

    if obj is None:
        assert spec is not None
        try:
            obj = load_function(spec, key)
        except ModelLoadError as e:
            return [str(e)]
    elif not callable(obj):
        return [f"{keyword_of(key)}= must be a function fn(prompts, responses) -> list[float], got "
                f"{type(obj).__name__}."]
    if bound:
        import functools

        obj = functools.partial(obj, **bound)
    return signature_problems(key, obj, columns)


def _known_columns(cfg: Config, inputs: Inputs) -> list[str] | None:
    """The prompt set's columns where they are known without reading it: an object's, a JSONL
    file's first record's keys, a CSV file's header, the built-in task's prompts; else None."""
    from .data import object_columns
    from .data import object_problems as data_problems

    d = cfg.data
    if inputs.prompts is not None:
        return None if data_problems(inputs.prompts, d.field, d.split) else object_columns(inputs.prompts, d.field,
                                                                                           d.split)
    if d.prompts is None:
        return [d.field] if cfg.uses_builtin_task else None
    p = Path(d.prompts).expanduser()
    if not p.is_file() or p.suffix not in (".jsonl", ".json", ".csv"):
        return None
    try:
        with open(p, encoding="utf-8", errors="replace") as f:
            first = next((line for line in f if line.strip()), "")
        if p.suffix == ".csv":
            import csv

            return next(csv.reader([first]), [])
        rec = json.loads(first)
    except (OSError, ValueError):
        return None
    return list(rec) if isinstance(rec, dict) else None


def object_problems(cfg: Config, inputs: Inputs) -> list[str]:
    """What is wrong with the objects given from Python (``oppo.Trainer(cfg, policy=...)``), by the
    rules a path or spec is checked with: each model of its role's kind (the policy a causal LM,
    the reward model a one-label sequence classifier, ...) reading the tokenizer's ids, the
    tokenizer given with a policy object, the prompts a data set or list with the prompt field.
    Also a marker (``config.yaml``'s ``<object: ...>``) with no object given for it."""
    from .inputs import SETTINGS

    problems = []
    for kw, key in SETTINGS.items():
        section, name = key.split(".")
        if is_marker(getattr(getattr(cfg, section), name)) and getattr(inputs, kw) is None:
            problems.append(f"{key}={getattr(getattr(cfg, section), name)!r} stands for an object that the run was "
                            f"given from Python ({kw}=...), and none is given now: pass the same object again "
                            f"(oppo.train(cfg, {kw}=...)), or set {key} to a path"
                            + (" or 'module:function'" if section == "reward" and name != "path" else "") + ".")
    if inputs.prompts is not None:
        from .data import object_problems as data_problems

        problems += data_problems(inputs.prompts, cfg.data.field, cfg.data.split)
    tok = inputs.tokenizer
    if tok is not None:
        from .models import tokenizer_from_object

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
            problems += _function_problems(key, None, obj, _known_columns(cfg, inputs))
    problems += _term_object_problems(cfg, inputs)
    models = [(role, kw, m) for kw, role in (("policy", "policy"), ("reference", "reference"), ("critic", "critic"),
                                              ("reward_model", "reward")) if (m := getattr(inputs, kw)) is not None]
    if models:
        from .models import model_problems
        from .models import object_problems as model_object_problems

        for role, kw, m in models:
            problems += model_object_problems(tok, role, m, kw) if tok is not None else model_problems(role, kw, m)
    problems += _shared_objects(models)
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


def check_inputs(cfg: Config, inputs: Inputs | None = None) -> None:
    """The preflight of a Trainer built in code (``oppo.Trainer(cfg, ...)``), which has no run
    directory: the settings validated (unless :func:`load_config` did, for these very settings),
    then every path and object the roles are built from checked (:func:`role_problems`), as
    ``oppo.train``'s preflight (:func:`input_problems`) checks them, before any model loads.
    Raises ConfigError or :class:`PreflightError`."""
    validate_once(cfg)
    raise_if(role_problems(cfg, inputs or Inputs()))



def input_problems(cfg: Config, inputs: Inputs | None = None) -> list[str]:
    """Everything wrong with the run's inputs that can be found without loading a model: the run
    directory's and the logging's problems, and the roles' (:func:`role_problems`). ``inputs``:
    the objects given from Python in place of paths (their settings hold markers)."""
    validate_once(cfg)  # a Config built or changed in code (oppo.train(cfg)) is checked as the CLI's is
    return out_dir_problems(cfg.run.out_dir) + role_problems(cfg, inputs or Inputs()) + _logging_problems(cfg)


def role_problems(cfg: Config, inputs: Inputs) -> list[str]:
    """What the roles are built from, checked without loading it: the objects, the task or the
    prompt set, each model path, the reward's functions and models, the devices, the rollout
    backend, the hub names. The one place a path is checked in a run.

    Also switches Hugging Face to offline mode when the hub is unreachable and every hub name is
    cached (so loading goes straight to the cache)."""
    problems = object_problems(cfg, inputs)
    hub_names: list[tuple[str, str]] = []  # (setting, hub name) of each model that is not a local path
    problems += _model_path_problems(cfg, inputs, hub_names)
    found, hub_dataset = _prompts_problems(cfg)
    problems += found
    problems += _reward_problems(cfg, inputs, hub_names)
    problems += _environment_problems(cfg)
    problems += _hub_problems(cfg, hub_names, hub_dataset)
    return problems


def _model_path_problems(cfg: Config, inputs: Inputs, hub_names: list[tuple[str, str]]) -> list[str]:
    """The task or prompt set a run needs, and each role's model directory (hub names collected)."""
    problems = []
    if cfg.uses_builtin_task:
        from .task import TASKS

        if cfg.data.task not in TASKS:
            problems.append(f"data.task={cfg.data.task!r} is not a built-in task; known: {', '.join(sorted(TASKS))}.")
    elif cfg.data.prompts is None:
        problems.append("policy.path is set but data.prompts is not: give a prompt set (data.prompts=path.jsonl).")
    for role in ("policy", "reward", "critic", "reference"):
        path = getattr(cfg, role).path
        if path and not is_marker(path):
            found = _model_problems(role, f"{role}.path", path, hub_names,
                                    new_head=role == "reward" and cfg.reward.new_head)
            if role == "policy" and inputs.tokenizer is not None:  # (the tokenizer given as an object is used)
                found = [p for p in found if "holds no tokenizer" not in p]
            problems += found
    return problems


def _prompts_problems(cfg: Config) -> tuple[list[str], bool]:
    """``data.prompts``' problems, and whether it names a hub dataset."""
    prompts = cfg.data.prompts
    if prompts and not is_marker(prompts) and prompts.lstrip().startswith("["):
        return [f"data.prompts={prompts!r} looks like a list of prompts, but data.prompts names a file or "
                f"data set. Write the prompts to a JSONL file (one {{\"{cfg.data.field}\": ...}} per line), "
                f"or, from Python, pass the list: oppo.train(cfg, prompts=[...])."], False
    if prompts and not is_marker(prompts):
        return _prompt_problems(prompts, cfg.data.field)
    return [], False


def _reward_problems(cfg: Config, inputs: Inputs, hub_names: list[tuple[str, str]]) -> list[str]:
    """``reward.function``, ``reward.judge`` and each ``reward.terms`` term named by path or spec
    (objects: :func:`object_problems`)."""
    problems = []
    columns = _known_columns(cfg, inputs)  # (read once: a file's first record or header)
    for key, spec in (("reward.function", cfg.reward.function), ("reward.judge", cfg.reward.judge)):
        if spec and not is_marker(spec):  # (objects: object_problems)
            problems += _function_problems(key, function_spec(spec) if key == "reward.function" else spec, None,
                                           columns)
    for i, term in enumerate(parse_terms(cfg.reward.terms) if cfg.reward.terms else []):  # (validated above)
        if term.path:
            problems += _model_problems("reward", f"reward.terms[{i}].path", term.path, hub_names)
        elif term.function and not is_marker(term.function):  # (a callable: object_problems)
            problems += _function_problems(f"reward.terms[{i}].function", term.function, None, columns,
                                           bound=term.kwargs)
    return problems


def _environment_problems(cfg: Config) -> list[str]:
    """CUDA where a role asks for it, the rollout backend able to serve the policy."""
    problems = []
    for role in ("policy", "reward", "critic", "reference"):
        dev = getattr(cfg, role).device
        if dev.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                problems.append(f"{role}.device={dev!r} but CUDA is not available here; use cpu or auto.")
    if cfg.generation.backend != "auto":  # installed, and able to serve a local policy (its config only)
        from .rollout import registry

        backend = registry.get(cfg.generation.backend)
        policy = None if is_marker(cfg.policy.path) else cfg.policy.path  # (an object: checked once saved)
        problems += backend.problems(policy, cfg.policy.device) if backend.problems else []
    return problems


def _logging_problems(cfg: Config) -> list[str]:
    """The logging packages a run directory's logs ask for (a Trainer built in code logs nothing)."""
    problems = []
    for flag, package, extra in ((cfg.log.tensorboard, "tensorboard", "tensorboard"), (cfg.log.wandb, "wandb", "wandb")):
        if flag and importlib.util.find_spec(package) is None:
            problems.append(f"log.{package}=true but the '{package}' package is not installed: "
                            f"pip install 'oppo[{extra}]', or set log.{package}=false.")
    return problems


def _hub_problems(cfg: Config, hub_names: list[tuple[str, str]], hub_dataset: bool) -> list[str]:
    """Hub names not in the local cache when the hub cannot be reached; offline mode switched on
    when it cannot and every hub model is cached."""
    problems = []
    missing = [(k, name) for k, name in hub_names if not _in_hub_cache(name)]
    if (missing or hub_dataset) and not hub_reachable():
        why = ("offline mode is on (HF_HUB_OFFLINE)" if _offline_env()
               else f"no network: {hub_endpoint()} cannot be reached")
        for key, name in missing:
            problems.append(f"{key}={name!r} is a hub name that is not in the local Hugging Face cache, and {why}. "
                            f"Download it where there is network (hf download {name} --local-dir DIR) and give "
                            f"the local directory: {key}=/local/dir.")
        if hub_dataset:
            problems.append(f"data.prompts={cfg.data.prompts!r} is not a local file, so it would be a hub dataset, "
                            f"and {why}. Give a local JSONL file (data.prompts=/local/prompts.jsonl).")
    elif hub_names and not missing and not hub_reachable():
        go_offline()  # every hub model is cached: load from the cache without retrying the network
    return problems
