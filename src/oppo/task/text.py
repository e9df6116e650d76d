"""Tiny text helpers shared by the built-in tasks: one token convention for generator, judge
and tokenizer.

A *token* is a lower-case word or a single punctuation mark. Text is tokens joined by single
spaces, except that no space goes before ``.``, ``,``, ``!`` or ``?``; ``detokenize`` writes that
form and ``split`` reads it back (and also reads text with extra spaces or capitals). The word
level tokenizer (``tokenizer.py``) decodes to exactly the ``detokenize`` form, so
``detokenize(split(t)) == t`` for generator text and ``tokenizer.decode(tokenizer.encode(t)) == t``.
"""

from __future__ import annotations

import re

_TOKEN_RE = re.compile(r"[a-z0-9']+|[^\sa-z0-9']")
_NO_SPACE_BEFORE = (".", ",", "!", "?")


def split(text: str) -> list[str]:
    """Text -> tokens (lower-cased words and single punctuation marks)."""
    return _TOKEN_RE.findall(text.lower())


def detokenize(tokens: list[str] | tuple[str, ...]) -> str:
    """Tokens -> text: single spaces between tokens, none before punctuation."""
    text = " ".join(tokens)
    for mark in _NO_SPACE_BEFORE:
        text = text.replace(" " + mark, mark)
    return text


def join_prompt_response(prompt: str, response: str) -> str:
    """The text a reader sees: the prompt, a space unless the response opens with punctuation,
    then the response."""
    if not response:
        return prompt
    if not prompt or response[0] in _NO_SPACE_BEFORE:
        return prompt + response
    return prompt + " " + response
