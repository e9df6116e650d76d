"""The shape of the package that issue 52 set, held by the code itself: short module docstrings
(the design notes live in docs/), few top-level modules (the rest in their rooms), and a config
that does not travel (parts and roles receive their own settings records). Measured by reading
the source, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

import oppo

SRC = Path(oppo.__file__).parent
MODULES = sorted(SRC.rglob("*.py"))


def _tree(p: Path) -> ast.Module:
    return ast.parse(p.read_text(encoding="utf-8"), filename=str(p))


def test_module_docstrings_say_what_a_module_is_for_in_a_few_lines():
    long = {}
    for p in MODULES:
        doc = ast.get_docstring(_tree(p), clean=False)
        if doc and len(doc.strip().splitlines()) > 15:
            long[str(p.relative_to(SRC))] = len(doc.strip().splitlines())
    assert not long, f"module docstrings over 15 lines (move the design notes to docs/): {long}"


def test_at_most_24_top_level_modules():
    top = sorted(p.name for p in SRC.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 24, f"{len(top)} top-level modules in oppo/ (put new ones in the package they serve): {top}"


def _takes_whole_config(f: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for a in [*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs]:
        ann = ast.unparse(a.annotation).strip("'\"") if a.annotation is not None else ""
        if a.arg == "cfg" or ann in ("Config", "config.Config"):
            return True
    return False


def _part_hook(f: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A part spec's hook, whose shape gives it the config beside its own settings (``checks(own,
    cfg)``, ``decide(cfg, own, facts)``: cross-section rules): every new part adds one by design."""
    return "own" in {a.arg for a in [*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs]}


def test_the_config_does_not_travel():
    """At most 80 functions take the whole config (a parameter named ``cfg`` or typed ``Config``),
    the parts' hooks aside (a contributor's new part must not break this): the config package
    itself, the setup that reads it, and what writes the whole config out. Everything else takes
    the sections or settings records it reads."""
    found = [f"{p.relative_to(SRC)}:{n.lineno}:{n.name}" for p in MODULES for n in ast.walk(_tree(p))
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _takes_whole_config(n)
             and not _part_hook(n)]
    assert len(found) <= 80, f"{len(found)} functions take the whole config:\n" + "\n".join(found)


def test_the_measure_counts_what_it_says():
    """The measure above is not vacuous: it sees a function that takes the config by either sign."""
    tree = ast.parse("def a(cfg): pass\ndef b(x: Config): pass\ndef c(ppo: PPOConfig): pass\n"
                     "def checks(own, cfg): pass\n")
    assert [f.name for f in tree.body if _takes_whole_config(f)] == ["a", "b", "checks"]
    assert [f.name for f in tree.body if _part_hook(f)] == ["checks"]


def test_the_ppo_maths_imports_only_torch_and_itself():
    """``algo/masks.py``, ``losses.py`` and ``advantages.py`` import torch, the standard library and each
    other (and ``algo.choices``' names), nothing else of oppo: an allow-list, so a new algorithm's
    module is kept out as the import rules' named list (pyproject.toml) keeps out the ones it names."""
    allowed = {"masks", "losses", "advantages", "choices"}
    for name in ("masks", "losses", "advantages"):
        tree = _tree(SRC / "algo" / f"{name}.py")
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.level:  # relative: within oppo
                target = (n.module or "").split(".")[0]
                assert n.level == 1 and target in allowed, f"algo/{name}.py imports {'.' * n.level}{n.module}"
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
                for m in mods:
                    assert not m.startswith("oppo"), f"algo/{name}.py imports {m}"
