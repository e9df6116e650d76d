"""Sentiment scores from two third-party lexicon scorers (the ``[sentiment]`` extra), for the
``sentiment`` recipe: one to train on, the other to judge by.

- :func:`vader_sentiment`: VADER's compound score (the ``vaderSentiment`` package: a rule-based
  scorer over a crowd-rated lexicon of about 7,500 words, emoticons and slang, with rules for
  negation, intensifiers, "but", capitals and exclamation marks), in [-1, 1]; the recipe's reward.
- :func:`afinn_sentiment`: AFINN's comparative score (the ``afinn`` package: Finn Aarup Nielsen's
  list of about 3,400 English words rated -5 to +5, AFINN-165), the sum of the response's word ratings
  over its word count; the recipe's judge (``reward.judge``), never trained on.

Both ship their lexicons inside the package and download nothing. They are different lexicons
and different rules, so the judge sees what the reward's own quirks reward (punctuation,
capitals, boosters), though not a policy that repeats plain positive words: both count those.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

from .terms import RewardTermSpec, optional_module


@lru_cache(maxsize=1)
def _vader():  # (reads its lexicon files once; scoring only reads them)
    return optional_module("vaderSentiment.vaderSentiment", "vader_sentiment", "vaderSentiment",
                           "sentiment").SentimentIntensityAnalyzer()


@lru_cache(maxsize=1)
def _afinn():
    return optional_module("afinn", "afinn_sentiment", "afinn", "sentiment").Afinn(language="en")


def _number(name: str, key: str, v: Any) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ValueError(f"{name}: {key} must be a number, got {v!r}.")
    return float(v)


def vader_sentiment(prompts: Sequence[str], responses: Sequence[str], empty: float = -1.0, **_: Any) -> list[float]:
    """VADER's compound sentiment of each response, in [-1, 1] (-1 most negative, +1 most
    positive; about 0 for neutral text). ``empty``: the score of a response with no word characters
    (VADER rates it 0, neutral, which a policy whose replies score below 0 would learn to reach by
    saying nothing)."""
    empty = _number("vader_sentiment", "empty", empty)
    if not responses:
        return []
    analyzer = _vader()
    return [float(analyzer.polarity_scores(r)["compound"]) if any(c.isalnum() for c in r) else empty
            for r in responses]


def afinn_sentiment(prompts: Sequence[str], responses: Sequence[str], empty: float = 0.0, **_: Any) -> list[float]:
    """AFINN's comparative sentiment of each response: the sum of its words' AFINN-165 ratings
    (-5 to +5; most words are unrated, 0) over its number of words (``\\w+`` runs), so a longer
    reply is not scored higher for its length. ``empty``: the score of a response with no words."""
    empty = _number("afinn_sentiment", "empty", empty)
    if not responses:
        return []
    afinn = _afinn()
    out = []
    for r in responses:
        words = afinn.split(r)
        out.append(float(afinn.score(r)) / len(words) if words else empty)
    return out


VADER_SENTIMENT = RewardTermSpec("vader_sentiment", "VADER's compound sentiment of the response in [-1, 1] "
                                                    "(vaderSentiment)", vader_sentiment)
AFINN_SENTIMENT = RewardTermSpec("afinn_sentiment", "AFINN-165's summed word ratings over the word count "
                                                    "(afinn)", afinn_sentiment)
