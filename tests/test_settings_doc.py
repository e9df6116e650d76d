"""docs/settings.md is generated from the config (python -m oppo.settings_doc docs/settings.md):
it names every setting with its current default and help, and a change to the config that is not
regenerated fails here."""

from __future__ import annotations

from pathlib import Path

from oppo import settings_doc
from oppo.config import all_keys, help_text

DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"


def test_settings_doc_is_generated_from_the_config():
    doc = DOC.read_text()
    assert settings_doc.render(doc) == doc, "regenerate: python -m oppo.settings_doc docs/settings.md"
    for key in all_keys():
        assert f"| `{key}` |" in doc, key


def test_the_doc_says_what_the_help_says():
    """Each setting's help text (as `oppo train --help` prints it) is in its row."""
    table = settings_doc.markdown()
    help_lines = help_text().splitlines()
    for i, line in enumerate(help_lines):
        if line.startswith("  ") and " = " in line and not line.startswith("      "):
            key = line.split()[0]
            text = " ".join(help_lines[i + 1].split()).replace("|", "\\|")
            row = next(r for r in table.splitlines() if r.startswith(f"| `{key}` |"))
            assert text in row, key


def test_the_doc_is_the_same_whatever_is_installed_or_registered():
    """A plugin registered at run time (as an installed one is, through its entry point) adds no
    section to the page, and a built-in whose package is absent (vLLM) keeps its own."""
    import dataclasses

    from oppo.parts import BACKENDS, REWARD_TERMS, setting
    from oppo.rewards import RewardTermSpec
    from oppo.rollout import registry

    @dataclasses.dataclass
    class Own:
        knob: int = setting(3, "a plugin's knob")

    before = settings_doc.markdown()
    BACKENDS.register(registry.BackendSpec("docplug", "a plugin's backend", lambda request: None, settings=Own))
    REWARD_TERMS.register(RewardTermSpec("docplug_term", "a plugin's term", lambda p, r: [0.0] * len(r)))
    try:
        assert "docplug" in help_text()  # the help lists what is registered here ...
        assert settings_doc.markdown() == before  # ... the page only oppo's own
    finally:
        BACKENDS.unregister("docplug")
        REWARD_TERMS.unregister("docplug_term")
    assert "## rollout.vllm" in before and "`rollout.vllm.lora_sync`" in before
    assert "math_accuracy" in before  # the built-in reward terms are listed (reward.terms)
