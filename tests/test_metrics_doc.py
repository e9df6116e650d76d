"""docs/metrics.md against the package: every metric name written in ``src/oppo`` is in the glossary,
and every name the glossary's tables list is written somewhere. No model runs: the source is parsed
(string literals, and f-strings with ``{...}`` standing for any name part, as ``<n>`` in the doc)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "metrics.md"
# the sections of metric names; other "a/b" strings in the source are paths and hub names
SECTIONS = {"reward", "judge", "task", "kl", "loss", "ppo", "value", "returns", "adv", "group",
            "response_length", "overlap", "pipeline", "time", "perf", "memory", "guard", "data",
            "grad_norm", "mismatch", "bench"}
# patterns that read, not write: bench/summaries.py's f"time/{k}" would otherwise vouch for any time/* name
READ_PATTERNS = {"time/*"}
NAME = re.compile(r"([a-z_]+)/[a-z0-9_*]+(/[a-z0-9_*]+)?")


def _source_names() -> set[str]:
    """Metric-shaped string literals of the package; an f-string's fields become ``*``."""
    names = set()
    for path in (ROOT / "src" / "oppo").rglob("*.py"):
        nodes = list(ast.walk(ast.parse(path.read_text(encoding="utf-8"))))
        parts = {id(v) for n in nodes if isinstance(n, ast.JoinedStr) for v in n.values}  # an f-string's pieces
        for node in nodes:
            if id(node) in parts:
                continue
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "*" for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            m = NAME.fullmatch(text)
            if m and m.group(1) in SECTIONS:
                names.add(text)
    return names - READ_PATTERNS


def _doc_names(table_rows_only: bool) -> set[str]:
    """Names in backticks in the glossary (``<n>``-style parts become ``*``); with
    ``table_rows_only``, just the name each table row defines."""
    text = DOC.read_text(encoding="utf-8")
    if table_rows_only:
        found = re.findall(r"^\| `([^`]+)` \|", text, flags=re.M)
    else:
        found = re.findall(r"`([^`]+)`", text)
    names = {re.sub(r"<[a-z]+>", "*", n) for n in found}
    return {n for n in names if (m := NAME.fullmatch(n)) and m.group(1) in SECTIONS}


def _covered(name: str, others: set[str]) -> bool:
    """``name`` is among ``others``, or a pattern (``*``) that one of them matches, or matches one."""
    if name in others:
        return True
    rx = lambda n: re.compile(re.escape(n).replace(r"\*", "[a-z0-9_]+"))  # noqa: E731
    return any(rx(name).fullmatch(o) or rx(o).fullmatch(name) for o in others)


def test_every_metric_the_package_writes_is_in_the_glossary():
    source, doc = _source_names(), _doc_names(table_rows_only=False)
    assert len(source) > 60, sorted(source)  # the parse found the metrics (not a vacuous pass)
    missing = sorted(n for n in source if not _covered(n, doc))
    assert not missing, f"metric names written in src/oppo but not in docs/metrics.md: {missing}"


def test_every_metric_the_glossary_defines_is_written_by_the_package():
    source, rows = _source_names(), _doc_names(table_rows_only=True)
    assert {"reward/mean", "kl/mean", "loss/policy", "ppo/clipfrac", "overlap/tuner_exploring"} <= rows
    invented = sorted(n for n in rows if not _covered(n, source))
    assert not invented, f"docs/metrics.md defines names that src/oppo never writes: {invented}"


def test_the_check_can_fail():
    assert not _covered("loss/made_up", _doc_names(table_rows_only=False))
    assert _covered("memory/cuda*_peak_mb", {"memory/cuda*_peak_mb"})
    assert _covered("grad_norm/*", {"grad_norm/actor"}) and _covered("grad_norm/critic", {"grad_norm/*"})
