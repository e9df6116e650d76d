"""A reward function for the SmolLM2 PPO-step benchmark (``bench_engines.py --smollm``): a plain
Python scorer of the kind users plug in with ``reward.function=module:function``, standing in for a
third-party one. It prefers answers of about 25 words that end a sentence. Only the timings of
that benchmark are reported; what the policy learns from this reward is not the point."""

from __future__ import annotations


def concise(prompts: list[str], responses: list[str]) -> list[float]:
    out = []
    for text in responses:
        words = len(text.split())
        ended = text.rstrip().endswith((".", "!", "?"))
        out.append(1.0 - abs(words - 25) / 25 + (0.5 if ended else 0.0))
    return out
