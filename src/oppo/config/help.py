"""``oppo train --help``'s settings text: every section's settings with their defaults, allowed
values and help."""

from __future__ import annotations


from ..parts import BACKENDS, LEARNERS, PLACEMENTS
from .schema import TASK_PRESETS, Config, choices_of, fields_of, sections


def _heading(name: str) -> str:
    """A section's heading; a part's own (``rollout.<backend>``, ``placement.<name>``,
    ``learner.<engine>``) names the setting that picks it."""
    kind, _, part = name.partition(".")
    chosen_by = {r.section: r.chosen_by for r in (BACKENDS, PLACEMENTS, LEARNERS)}.get(kind)
    return f"{name}: (the settings of {chosen_by}={part})" if part and chosen_by else f"{name}:"


def help_text(cfg: Config | None = None, source: str = "") -> str:
    """The settings with their values in ``cfg`` (default: the defaults); ``source`` names where
    ``cfg``'s values come from (``recipe 'hh'``), and a value that is not the default says so."""
    lines = ["Settings (override with section.key=value, or put them in a YAML file for --config):", ""]
    for task, preset in TASK_PRESETS.items():
        shown = ", ".join(f"{k}={v}" for k, v in preset.items())
        lines.append(f"With no models named, the built-in task {task!r} sets, unless you do: {shown}")
    lines.append("")
    defaults = dict(sections(Config()))
    if cfg is None:
        cfg = Config()
    elif source:
        lines += [f"The values shown are those of {source}; one that is not the default is marked '<- {source}'.", ""]
    for name, section in sections(cfg):
        lines.append(_heading(name))
        for f in fields_of(section):
            default = getattr(section, f.name)
            shown = "(empty)" if default is None else repr(default) if isinstance(default, str) else default
            extra = f" [{'|'.join(map(str, choices_of(f)))}]" if f.metadata.get("choices") else ""
            base = getattr(defaults[name], f.name) if name in defaults else default
            mark = f"   <- {source} (default: {base!r})" if source and default != base else ""
            lines.append(f"  {name}.{f.name} = {shown}{extra}{mark}")
            lines.append(f"      {f.metadata.get('help', '')}")
            lines += [f"        {line}" for line in (f.metadata["more"]() if "more" in f.metadata else [])]
        lines.append("")
    return "\n".join(lines)
