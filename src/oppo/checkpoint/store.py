"""Checkpoints: written atomically, resumed exactly.

A checkpoint holds the models in Hugging Face format (a sharded learner: ``torch.distributed.checkpoint``
shards), both optimizers, every RNG state, the scheduler, the tuner, the sequences in flight with
their partial responses (``in_flight.json``), the run's settings and fingerprints of the models it
reads. It is written into a temporary directory and renamed into place, with a ``manifest.json`` of
sizes and hashes, so a resume never reads a half-written or damaged one, and checks before any
model loads that it resumes the same run on the same models. What a resume repeats exactly, and
what it cannot: ``docs/design.md``, "Checkpoints".
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import yaml

from ..learner.sharded import SHARDED_DIR, ShardedLearnerState

CKPT_DIR = "checkpoints"
CONFIG_FILE = "config.yaml"
IN_FLIGHT_FILE = "in_flight.json"
MANIFEST_FILE = "manifest.json"
MODELS_FILE = "models.json"
WEIGHTS_ONLY = "weights_only"  # state.json's mark of a checkpoint without optimizer state

# Settings that may differ between a checkpoint and the run resuming it: how long to run, where
# and how often to write, what to print, and where the work runs (placement changes neither the
# math nor the saved state). Every other setting changes what is trained or the shape of the saved
# state, so a resume with another value would not continue the same run.
RESUMABLE_CHANGES = frozenset({
    "run.steps", "run.out_dir", "run.save_every", "run.save_final", "run.save_every_minutes", "run.keep_checkpoints",
    "run.samples",
    "run.allow_changed_models",  # (the override itself: resuming with it is its purpose)
    "policy.device", "reference.device", "critic.device", "reward.device",
    "reward.retries", "reward.retry_backoff_s",  # (a run stopped by a flaky remote scorer resumes with retries)
    # the same math, other machinery: the rollout backend, a memory cap, activation recomputation
    "generation.backend", "generation.kv_budget_mb", "policy.gradient_checkpointing",
})
# placement: a checkpoint of a data-parallel Ray run resumes on another rank count or locally, a
# local one with other thread counts, the scorers in a thread or a process, the critic trained beside
# them or in the learner (the same weights and saved state either way)
RESUMABLE_SECTIONS = frozenset({"log", "placement"})


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.name.startswith("step_") and (p / "state.json").is_file()),
                  key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def checkpoint_step(ckpt: Path) -> int:
    """The step a checkpoint was saved at (the number of steps trained before it)."""
    return int(json.loads((Path(ckpt) / "state.json").read_text())["step"])


def checkpoint_settings(ckpt: Path) -> dict | None:
    """The settings a checkpoint was saved with, as nested dicts; None for checkpoints written
    before checkpoints held them (then the run directory's ``config.yaml`` is the best guess).
    Settings moved to another section since are under their new names (``config.upgrade_settings``)."""
    from ..config import upgrade_settings

    ckpt = Path(ckpt)
    for path in (ckpt / CONFIG_FILE, ckpt.parent.parent / CONFIG_FILE):
        if path.is_file():
            return upgrade_settings(yaml.safe_load(path.read_text()) or {})
    return None


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def settings_mismatches(saved: dict, now: dict) -> list[tuple[str, object, object]]:
    """(setting, value in the checkpoint, value now) for every setting that must match on resume
    and does not. Settings the checkpoint does not know (added to oppo since) are not compared; an
    empty ``ppo.kl_coef`` compares as the algorithm's default (``config.resolved_settings``)."""
    from ..config import resolved_settings, upgrade_settings

    a, b = _flat(resolved_settings(upgrade_settings(saved))), _flat(resolved_settings(now))
    out = []
    for key in sorted(a.keys() & b.keys()):
        if key in RESUMABLE_CHANGES or key.split(".")[0] in RESUMABLE_SECTIONS:
            continue
        if a[key] != b[key]:
            out.append((key, a[key], b[key]))
    return out


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written or read; the message names it (and, for a failed
    save, the disk and its free space)."""


def sha256_file(path: Path) -> str:
    """The sha256 hex digest of a file, read in 1 MiB blocks (checkpoint manifests, the built-in
    task's cache)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(ckpt: Path) -> dict:
    """{relative path: {"size", "sha256"}} of every file in ``ckpt`` (but the manifest and state.json)."""
    return {str(p.relative_to(ckpt)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name not in (MANIFEST_FILE, "state.json")}


def verify_checkpoint(ckpt: Path) -> str | None:
    """What is wrong with ``ckpt``'s files against its manifest (a truncated, missing or changed
    file), or None. A checkpoint written before manifests existed is not checked."""
    ckpt = Path(ckpt)
    path = ckpt / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"its {MANIFEST_FILE} is unreadable ({e})"
    for name, want in manifest.items():
        p = ckpt / name
        if not p.is_file():
            return f"{name} is missing"
        size = p.stat().st_size
        if size != want["size"]:
            return f"{name} is {size} bytes, {want['size']} when saved (truncated or changed)"
        if sha256_file(p) != want["sha256"]:
            return f"{name} differs from what was saved (sha256 mismatch)"
    return None


def _save_failed(root: Path, final: Path, tmp: Path, e: Exception) -> str:
    """Remove ``tmp``, the failed save's directory; the message: what failed, the disk, its space."""
    written = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file()) if tmp.is_dir() else 0
    try:
        full = shutil.disk_usage(root).free < (1 << 20)
    except OSError:
        full = False
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        usage = shutil.disk_usage(root)
        disk = f"{_mb(usage.free)} free of {_mb(usage.total)} once the partial checkpoint ({_mb(written)}) is removed"
    except OSError:
        disk = "free space unknown"
    previous = latest_checkpoint(root.parent)
    kept = (f"the previous checkpoint, {previous}, is intact" if previous is not None
            else "there is no earlier checkpoint")
    why = (e.strerror if isinstance(e, OSError) and e.strerror
           else str(e).splitlines()[0] if str(e) else type(e).__name__)
    if (full or getattr(e, "errno", None) == errno.ENOSPC) and "space" not in why.lower():
        why = f"the disk is full ({why})"
    then = (f"resume with: oppo train --resume {root.parent} (and the same settings)" if previous is not None
            else "start the run again")
    return (f"could not write checkpoint {final}: {why} (the disk of {root}: {disk}). The partial "
            f"checkpoint was removed; {kept}. Free space on that disk (or set run.keep_checkpoints lower, or "
            f"run.out_dir to another disk), then {then}.")


def _mb(n: int) -> str:
    return f"{n / 2**30:.1f} GB" if n >= 2**30 else f"{n / 2**20:.1f} MB"


def _write(trainer, state: dict, tmp: Path, weights_only: bool = False) -> None:
    tmp.mkdir()
    for name, model in trainer.models().items():  # critic-free algorithms have no critic
        model.save_pretrained(tmp / name)
    state["tokenizer"].save_pretrained(tmp / "policy")
    if weights_only:  # run.save_final=weights: no optimizer, RNG or sequences in flight; marked in state.json
        state = {**state, "state": {**state["state"], WEIGHTS_ONLY: True}, "in_flight": None}
    else:
        optim = state["optim"]
        if isinstance(optim, ShardedLearnerState):  # a sharded learner: every rank writes its shards (DCP)
            optim = optim.save(tmp / SHARDED_DIR)
        torch.save(optim, tmp / "optim.pt")
        torch.save(state["rng"], tmp / "rng.pt")
    if state.get("in_flight"):  # the sequences in flight, with their partial responses (docs/design.md, "Checkpoints")
        (tmp / IN_FLIGHT_FILE).write_text(json.dumps(state["in_flight"]))
    (tmp / CONFIG_FILE).write_text(yaml.safe_dump(state["config"], sort_keys=False))
    if state.get("models"):  # fingerprints of the models the run reads (fingerprint.py), checked on resume
        (tmp / MODELS_FILE).write_text(json.dumps(state["models"], indent=1))
    # sizes and hashes, checked on resume (verify_checkpoint): a truncated file is found before it is loaded
    (tmp / MANIFEST_FILE).write_text(json.dumps(_manifest(tmp), indent=1))
    (tmp / "state.json").write_text(json.dumps(state["state"], indent=1))  # written last: marks the checkpoint complete


def is_weights_only(ckpt: Path) -> bool:
    """Whether ``ckpt`` holds the models only (``run.save_final=weights``): not resumable."""
    return bool(json.loads((Path(ckpt) / "state.json").read_text()).get(WEIGHTS_ONLY))


def save_checkpoint(trainer, run_dir: Path, keep: int = 2, weights_only: bool = False) -> Path:
    """Write ``trainer``'s state (``Trainer.models`` and ``Trainer.state_dict``) as
    ``checkpoints/step_N/``, atomically: a temporary directory renamed into place, ``state.json``
    written last. Keeps the newest ``keep``. ``weights_only``: the models, tokenizer, settings and
    fingerprints, without ``optim.pt`` and ``rng.pt`` (``run.save_final=weights``)."""
    run_dir = Path(run_dir)
    root = run_dir / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    state = trainer.state_dict()  # with the sequences in flight; on Ray, brings the ranks' weights home
    step = state["state"]["step"]
    for leftover in root.glob(".tmp-step_*"):  # from an interrupted save: never a valid checkpoint
        shutil.rmtree(leftover, ignore_errors=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write(trainer, state, tmp, weights_only)
    except BaseException as e:  # a full disk, or a second signal mid-save: no half-written checkpoint stays
        if not isinstance(e, Exception):
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        # (torch.save and safetensors report a full disk as their own errors, not always as OSError)
        raise CheckpointError(_save_failed(root, final, tmp, e)) from e
    if final.exists():
        old = root / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    for stale in checkpoint_dirs(run_dir)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def load_checkpoint(trainer, ckpt: Path) -> None:
    """Restore a Trainer built from the same config to the state saved in ``ckpt``; any failure is
    a :class:`CheckpointError` naming ``ckpt``."""
    ckpt = Path(ckpt)
    if not (ckpt / "state.json").is_file():
        raise FileNotFoundError(f"{ckpt} is not a complete checkpoint (no state.json). Give a step_* directory "
                                f"under {CKPT_DIR}/, or --resume auto.")
    from .formats import FormatError
    from ..models import ModelLoadError

    try:
        _load(trainer, ckpt)
    except ModelLoadError:  # (weights of another shape: its own message names the checkpoint and the fix)
        raise
    except FormatError as e:  # (a resume finds it before any model loads: run.resume; this is Trainer's own load)
        raise CheckpointError(f"cannot resume from {ckpt}: {e}. To go on with this release instead, start a new run "
                              f"from its weights (policy.path={ckpt / 'policy'}, no --resume).") from e
    except Exception as e:  # a damaged file (an old checkpoint has no manifest to find it before this)
        raise CheckpointError(f"could not load checkpoint {ckpt}: {type(e).__name__}: {str(e).strip()[:500]}. "
                              f"Resume from an earlier checkpoint beside it ({ckpt.parent}) if there is one.") from e


def _load(trainer, ckpt: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from ..models import check_adapter_shapes, is_peft, load_weights

    state = json.loads((ckpt / "state.json").read_text())
    if state.get(WEIGHTS_ONLY):
        raise CheckpointError(f"{ckpt} holds the weights only (run.save_final=weights): no optimizer state to "
                              f"resume from. Start a new run from them: policy.path={ckpt / 'policy'}.")
    classes = {"policy": AutoModelForCausalLM, "critic": AutoModelForSequenceClassification}
    for sub, model in trainer.models().items():
        if is_peft(model):  # LoRA: the checkpoint holds the adapter (PeftModel.from_pretrained loads it)
            from peft import load_peft_weights, set_peft_model_state_dict

            device = str(next(model.parameters()).device)
            adapter = load_peft_weights(str(ckpt / sub), device=device)
            check_adapter_shapes(model, adapter, ckpt / sub)  # a base of another shape: one clear line
            set_peft_model_state_dict(model, adapter)
            continue
        saved = classes[sub].from_pretrained(ckpt / sub, dtype=next(model.parameters()).dtype)
        load_weights(model, saved.state_dict(), ckpt / sub)  # a model of another shape: one clear line
    # after the weights (a base of another shape has its own, clearer message), before any state is restored
    check_models(trainer, ckpt)
    optim = torch.load(ckpt / "optim.pt", weights_only=False)
    if "sharded" in optim:  # a sharded learner's (DCP): every learner reads it from here, whole or resharded
        optim = {"sharded": str(ckpt / optim["sharded"])}
    in_flight = json.loads((ckpt / IN_FLIGHT_FILE).read_text()) if (ckpt / IN_FLIGHT_FILE).is_file() else None
    trainer.load_state_dict({"state": state, "optim": optim, "in_flight": in_flight,
                             "rng": torch.load(ckpt / "rng.pt", weights_only=False)})


DATA_ROLES = ("prompts", "chat_template")
"""Entries of ``models.json`` that fingerprint the data, not a model (fingerprint.run_fingerprints)."""


def _builtin_task(changed: list) -> bool:
    """Whether every changed model of ``changed`` ((role, then, at) each) lies in the built-in task's
    cache (``oppo.task.prepare.default_home``'s rule, read here: the task imports this module)."""
    import os

    home = str(Path(os.environ.get("OPPO_HOME") or Path.home() / ".cache" / "oppo").resolve())
    return all(str(Path(at).resolve()).startswith(home + "/") for _, _, at in changed)


def check_models(trainer, ckpt: Path) -> None:
    """Refuse, with a :class:`~oppo.models.ModelLoadError` naming each one, its path and the fix, a
    resume whose reference model, reward model, critic initialisation, tokenizer, prompt set or
    chat template differs from the one the checkpoint's run started with (``models.json``;
    ``fingerprint.py``); with ``run.allow_changed_models`` warn and go on. Checkpoints written
    before fingerprints (or before the data's) resume unchecked (by what they lack)."""
    import warnings

    from ..fingerprint import changed_models
    from ..models import ModelLoadError

    path = Path(ckpt) / MODELS_FILE
    now = getattr(trainer, "fingerprints", None)
    if not path.is_file() or not now:
        return
    changed = changed_models(json.loads(path.read_text()), now)
    if not changed:
        return
    what = {"reference": "the reference model", "reward": "the reward model",
            "critic": "the critic's initialisation", "tokenizer": "the policy's tokenizer",
            "prompts": "the prompt set", "chat_template": "the chat template of the policy's tokenizer"}
    data = [c for c in changed if c[0] in DATA_ROLES]
    models = [c for c in changed if c[0] not in DATA_ROLES]

    def named(items) -> str:
        return "; ".join(f"{what.get(role, role)} at {at}" + (f" (was {then} when saved)" if then != at else "")
                         for role, then, at in items)

    names = named(changed)
    if trainer.cfg.run.allow_changed_models:
        warnings.warn(f"resuming from {ckpt} although these differ from when it was saved "
                      f"(run.allow_changed_models=true): {names}.", stacklevel=2)
        return
    said = []
    if models:
        objects = any(at.startswith("<object") for _, _, at in models)  # given from Python (setup/inputs.py)
        restore = ("Pass the models as they were when the run started (a policy object is trained in place: load "
                   "it again, e.g. with from_pretrained; the reference and the critic start from its initial "
                   "weights)" if objects else
                   "They are the built-in task's, which this release of oppo builds anew (oppo.task.prepare's "
                   "PREPARE_VERSION: the models it ships and the build that gives them whatever the load): the "
                   "checkpoint's run trained against the previous release's. To go on against the new ones, "
                   "resume with run.allow_changed_models=true; or start a new run" if _builtin_task(models) else
                   f"Restore the original files at {'that path' if len(models) == 1 else 'those paths'}")
        said.append(f"{named(models)} {'holds' if len(models) == 1 else 'hold'} other weights than when the "
                    f"checkpoint's run started (their fingerprints in {MODELS_FILE} differ), so the resumed run would "
                    f"train against other models (its KL, rewards and values would jump). {restore}")
    if data:
        said.append(f"{named(data)} {'differs' if len(data) == 1 else 'differ'} from when the checkpoint's run "
                    f"started (the fingerprint in {MODELS_FILE} differs: a prompt or a column added, removed or "
                    f"edited, or another template), so the checkpoint's data position would name other records: "
                    f"sequences in flight would be scored with another record's columns and the epoch would go on "
                    f"in another order. Restore the prompt set (the file, or the object given from Python) and the "
                    f"template as they were; to train on the new ones, start a new run from the checkpoint's "
                    f"weights (policy.path={Path(ckpt) / 'policy'}, no --resume)")
    raise ModelLoadError(
        f"cannot resume from {ckpt}: " + ". ".join(said) + ". If the change is deliberate, resume with "
        f"run.allow_changed_models=true. Nothing in the run directory was changed.")
