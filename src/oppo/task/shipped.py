"""The built-in task's prepared models, shipped with the package, so that a fresh machine's first
``oppo train`` starts at once instead of building them.

``oppo/task/shipped/<task>/`` holds one ``prepare`` build of the default seed and sizes, each
``model.safetensors`` stored as float16 (nothing lost: the build rounds its weights to float16);
:func:`install` restores exactly the float32 files the build wrote. Refresh after a change that
makes it stale (``tests/test_task.py`` fails while it is)::

    OPPO_HOME=/tmp/home oppo prepare --force
    python -m oppo.task.shipped /tmp/home/positive     # writes src/oppo/task/shipped/positive/

Design notes: docs/task.md, "The shipped build"."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "shipped"
"""Where the package keeps the shipped builds, one directory per task."""

WEIGHTS = "model.safetensors"
WEIGHTS_FP16 = "model.fp16.safetensors"


def shipped_build(task: str, fp: str, where: Path | None = None) -> Path | None:
    """The shipped build of ``task`` if its fingerprint is ``fp``, else None."""
    root = (where or SHIPPED) / task
    try:
        info = json.loads((root / "prepare.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return root if info.get("fingerprint") == fp else None


def install(src: Path, out: Path) -> None:
    """Copy the shipped build ``src`` into the (empty) directory ``out`` as a ``prepare`` cache:
    every file as it is, float16 weights back to the float32 ``model.safetensors`` the build wrote.
    ``prepare.json`` says where the cache came from (``installed_from``)."""
    import torch
    from safetensors.torch import save_file

    for f, dest in _files(src, out):
        if f.name == WEIGHTS_FP16:
            tensors, metadata = _read_weights(f)
            save_file({k: t.to(torch.float32) for k, t in tensors.items()}, str(dest.with_name(WEIGHTS)),
                      metadata=metadata)
        elif f.name != "prepare.json":
            shutil.copyfile(f, dest)
    info = json.loads((src / "prepare.json").read_text())
    info["installed_from"] = f"the package's shipped build ({src.name}), weights stored as float16"
    (out / "prepare.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def export(root: Path, dest: Path) -> None:
    """Write the cache ``root`` (a ``prepare`` build) as a shipped build into ``dest``, replacing
    what is there: weights as float16. Refuses weights that float16 does not hold exactly (a cache
    built before ``PREPARE_VERSION`` 2 rounded them)."""
    import torch
    from safetensors.torch import save_file

    if not (root / "prepare.json").is_file():
        raise FileNotFoundError(f"{root} holds no prepare.json: give a cache directory that oppo prepare built")
    tmp = dest.with_name(f".{dest.name}.export")
    shutil.rmtree(tmp, ignore_errors=True)
    for f, out in _files(root, tmp):
        if f.name == WEIGHTS:
            tensors, metadata = _read_weights(f)
            half = {k: t.to(torch.float16) for k, t in tensors.items()}
            lossy = [k for k, t in tensors.items() if not torch.equal(half[k].to(t.dtype), t)]
            if lossy:
                shutil.rmtree(tmp, ignore_errors=True)
                raise ValueError(f"{f}: {len(lossy)} tensors (first {lossy[0]}) are not float16 values: rebuild "
                                 f"the cache with this version (oppo prepare --force), which rounds them")
            save_file(half, str(out.with_name(WEIGHTS_FP16)), metadata=metadata)
        else:
            shutil.copyfile(f, out)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def _files(src: Path, out: Path):
    """(file, its place under ``out``) for every file under ``src``, in order, the place's folder made."""
    for f in sorted(src.rglob("*")):
        if f.is_file():
            dest = out / f.relative_to(src)
            dest.parent.mkdir(parents=True, exist_ok=True)
            yield f, dest


def _read_weights(f: Path) -> tuple[dict, dict | None]:
    """A safetensors file's tensors, by name, and its metadata."""
    from safetensors import safe_open

    with safe_open(str(f), "pt") as h:
        return {k: h.get_tensor(k) for k in h.keys()}, h.metadata()


def main(argv: list[str]) -> int:
    """``python -m oppo.task.shipped CACHE_DIR [DEST]``: export a cache (default destination: the
    package's ``shipped/<task>``)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    root = Path(argv[0])
    dest = Path(argv[1]) if len(argv) > 1 else SHIPPED / json.loads((root / "prepare.json").read_text())["task"]
    export(root, dest)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"wrote {dest} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
