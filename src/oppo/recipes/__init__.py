"""Recipes: oppo config files shipped with the package, one per known public setup.

A recipe is an ordinary ``--config`` YAML file in this folder, named ``NAME.yaml``. Its leading
comment block says what it trains, with which public models and data sets, and what GPU and memory
it was sized for; the block's first line is the one-line description ``oppo recipes`` lists.
``oppo train --recipe NAME`` (``oppo.load_config(recipe=NAME)``) reads it first; a ``--config`` file
and ``key=value`` overrides apply on top. A recipe may ship its prompts as a file in this folder:
its ``data.prompts`` then names the bare file (``sentiment_prompts.jsonl``), which the config reads as
that file's path here (:func:`shipped_path`). Imports nothing of oppo's (the config module reads it).
"""

from __future__ import annotations

from pathlib import Path

DIR = Path(__file__).resolve().parent


def names() -> list[str]:
    """Every recipe here, sorted: each ``*.yaml`` file's name without the suffix."""
    return sorted(p.stem for p in DIR.glob("*.yaml"))


def find(name: str) -> Path | None:
    """The file of recipe ``name``, or None if there is none."""
    p = DIR / f"{name}.yaml"
    return p if name in names() else None


def shipped_path(value):
    """A recipe's ``data.prompts``: a bare file name of a file shipped in this folder, as that
    file's absolute path; any other value (a path of the user's, a hub name) as it is."""
    if isinstance(value, str) and value and Path(value).name == value and value.endswith((".jsonl", ".json", ".csv")):
        p = DIR / value
        if p.is_file():
            return str(p)
    return value


def description(name: str) -> str:
    """The first line of the recipe's leading comment block ("" if it has none)."""
    p = find(name)
    if p is None:
        raise KeyError(name)
    for line in p.read_text(encoding="utf-8").splitlines():
        s = line.strip()
        if not s:
            continue
        return s.lstrip("#").strip() if s.startswith("#") else ""
    return ""


def listing() -> str:
    """One line per recipe: its name and description (``oppo recipes``)."""
    known = names()
    if not known:
        return "no recipes are installed"
    width = max(map(len, known))
    lines = ["recipes (oppo train --recipe NAME [--config FILE] [section.key=value ...]):"]
    lines += [f"  {n:<{width}}  {description(n)}" for n in known]
    return "\n".join(lines)
