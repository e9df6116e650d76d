"""``docs/settings.md``, generated from the config's dataclasses: every setting with its default,
allowed values and help text, as ``oppo train --help`` prints them, so that the page cannot drift
from the code. ``python -m oppo.settings_doc docs/settings.md`` rewrites the part between the
markers; a test checks the page equals what this module gives. Imports no torch."""

from __future__ import annotations

from .config import TASK_PRESETS, Config, choices_of, fields_of, sections

BEGIN = "<!-- settings (generated: python -m oppo.settings_doc docs/settings.md) -->"
END = "<!-- end settings -->"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def markdown() -> str:
    """The settings, one table per section: setting, default, meaning (allowed values included), for
    oppo's own parts only (``parts.BUILT_IN``): the page is the same whatever is installed."""
    from .parts import built_ins_only

    with built_ins_only():
        return _markdown()


def _markdown() -> str:
    cfg = Config()
    lines = ["With no models named, a built-in task runs, and sets these unless you do:", ""]
    lines += [f"- `{task}`: "
             + ", ".join(f"`{k}={v}`" for k, v in preset.items()) for task, preset in TASK_PRESETS.items()]
    for name, section in sections(cfg):
        lines += ["", f"## {name}", "", "| setting | default | meaning |", "|---|---|---|"]
        for f in fields_of(section):
            default = getattr(section, f.name)
            shown = "(empty)" if default is None else f"`{default!r}`" if isinstance(default, str) else f"`{default}`"
            meaning = f.metadata.get("help", "")
            if f.metadata.get("choices"):
                meaning += " One of: " + ", ".join(f"`{c}`" for c in choices_of(f)) + "."
            if "more" in f.metadata:
                meaning += " " + " ".join(f.metadata["more"]())
            lines.append(f"| `{name}.{f.name}` | {_cell(shown)} | {_cell(meaning)} |")
    return "\n".join(lines)


def render(doc: str) -> str:
    """``doc`` with the text between BEGIN and END replaced by :func:`markdown`."""
    head, sep, rest = doc.partition(BEGIN)
    if not sep:
        return doc
    _, sep2, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{markdown()}\n{END}{tail if sep2 else rest}"


if __name__ == "__main__":  # python -m oppo.settings_doc docs/settings.md
    import sys
    from pathlib import Path

    for arg in sys.argv[1:]:
        p = Path(arg)
        p.write_text(render(p.read_text()))
