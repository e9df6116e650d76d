"""The prompt set's fingerprint (``oppo.fingerprint.prompts_fingerprint``) is of a canonical form of
its values: the same whatever order a set iterates in, and unchanged for ordinary columns."""

import hashlib
import json
from types import SimpleNamespace

from oppo.fingerprint import prompts_fingerprint


def _prompt_set(**columns):
    return SimpleNamespace(raw=None, texts=["a", "b"], ids=[[5, 6], [7]], columns=columns)


def _two_orders():
    """Two equal sets that iterate in different orders: ints hash to themselves, so 8 and 16 share a
    slot of a small set's table, and whichever was added first comes first (as strings' order moves
    with PYTHONHASHSEED)."""
    first, second = set(), set()
    first.add(8), first.add(16)
    second.add(16), second.add(8)
    assert first == second and list(first) != list(second)
    return first, second


def test_a_set_valued_column_does_not_depend_on_its_iteration_order():
    first, second = _two_orders()
    a = prompts_fingerprint(_prompt_set(answers=[first, {"x"}]))
    b = prompts_fingerprint(_prompt_set(answers=[second, {"x"}]))
    assert a == b
    # ... at any depth: in a mapping, as a frozenset inside a set, and in the prompts themselves
    nested = [{"ok": frozenset(first), "n": 1}, {frozenset(first), "y"}]
    again = [{"n": 1, "ok": frozenset(second)}, {"y", frozenset(second)}]
    assert prompts_fingerprint(_prompt_set(meta=nested)) == prompts_fingerprint(_prompt_set(meta=again))
    raw = SimpleNamespace(raw=[{"content": "hi", "tags": first}], texts=[], ids=[[5]], columns={})
    assert prompts_fingerprint(raw) == prompts_fingerprint(
        SimpleNamespace(raw=[{"content": "hi", "tags": second}], texts=[], ids=[[5]], columns={}))
    assert prompts_fingerprint(_prompt_set(answers=[{8, 17}, {"x"}])) != a  # another value still counts


def test_ordinary_columns_keep_their_fingerprint():
    """Strings, numbers, lists and dicts hash as before the canonical form (issue 51), so runs
    checkpointed earlier resume: the scheme as it was, computed here by hand."""
    ps = _prompt_set(answer=["4", "7"], score=[1, 2.5], steps=[["a", "b"], []], meta=[{"b": 1, "a": 2}, {}])
    h = hashlib.sha256()
    h.update(json.dumps(ps.texts, default=str).encode())
    h.update(json.dumps(ps.ids).encode())
    for name in sorted(ps.columns):
        h.update(json.dumps([name, ps.columns[name]], default=str, sort_keys=True).encode())
    assert prompts_fingerprint(ps) == f"p1:{h.hexdigest()}"
