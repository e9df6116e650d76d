"""The built-in ``positive`` task: continue short reviews and notes, be positive about it.

Nothing is downloaded: the texts come from a small grammar over the word lists in ``lexicon.py``
(an opener, then body sentences whose number is heavy-tailed: ``TaskParams``), and the ground
truth is ``judge`` / ``judge_score``, a fast lexicon-based scorer with penalties for the usual
reward hacks::

    score = sentiment - repetition - malformed - cutoff,   clipped to [-3, 1]

(an empty response scores -2; natural corpus text gets no penalty).

Design notes (the corpus and each term of the judge): docs/task.md, "The corpus and the judge in
full"."""

from __future__ import annotations

import functools
import math
import random
from collections import Counter
from dataclasses import asdict, dataclass

from oppo.task import lexicon as L
from oppo.task.text import detokenize, split

# --- the generator ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskParams:
    """Knobs of the ``positive`` corpus (part of the cache fingerprint)."""

    short_mean: float = 1.0
    """Mean number of body sentences after the first, in the common (geometric) mode."""
    tail_prob: float = 0.1
    """Share of texts in the rare long mode: the response-length tail. 0 disables it."""
    long_median: float = 6.0
    """Median number of body sentences after the first, in the long mode (lognormal)."""
    long_sigma: float = 0.5
    """Log-space spread of the long mode."""
    opinion_prob: float = 0.75
    """Share of body sentences that carry sentiment; the rest are neutral remarks."""
    long_style: float = 0.5
    """In the long mode, the share of sentences after the first that open with a connective
    ("then ,", "later ,", ...): long texts read like stories, so a model can tell, a sentence
    or two in, that it is writing a long one (as real long answers have their own style)."""

    def __post_init__(self) -> None:
        if self.short_mean < 0:
            raise ValueError(f"short_mean must be >= 0, got {self.short_mean}")
        if not 0.0 <= self.tail_prob <= 1.0:
            raise ValueError(f"tail_prob must be in [0, 1], got {self.tail_prob}")
        if self.long_median < 1:
            raise ValueError(f"long_median must be >= 1, got {self.long_median}")
        if self.long_sigma < 0:
            raise ValueError(f"long_sigma must be >= 0, got {self.long_sigma}")
        if not 0.0 <= self.opinion_prob <= 1.0:
            raise ValueError(f"opinion_prob must be in [0, 1], got {self.opinion_prob}")
        if not 0.0 <= self.long_style <= 1.0:
            raise ValueError(f"long_style must be in [0, 1], got {self.long_style}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Example:
    """One generated text, split into prompt and response tokens (no special tokens)."""

    prompt_tokens: tuple[str, ...]
    response_tokens: tuple[str, ...]
    mood: float
    """Probability that an opinion sentence of this text is positive."""

    @property
    def prompt(self) -> str:
        return detokenize(self.prompt_tokens)

    @property
    def response(self) -> str:
        return detokenize(self.response_tokens)


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


class _Writer:
    """Sentence templates for one text (one domain, one mood). Each method returns tokens."""

    def __init__(self, rng: random.Random, domain: str, mood: float) -> None:
        self.rng = rng
        self.domain = domain
        self.d = L.DOMAINS[domain]
        self.place = rng.choice(self.d["places"])
        self.mood = mood

    def c(self, words):
        """One random choice (short: the templates call it a lot)."""
        return self.rng.choice(words)

    def opener(self) -> list[str]:
        c, p = self.c, self.place
        visit = ("restaurant", "hotel", "trip")
        own = ("gadget", "book")
        options = [
            (visit, lambda: ["we", "went", "to", "the", p, "on", c(L.WEEKDAYS), "."]),
            (visit, lambda: ["i", "visited", "the", p, "with", c(L.NAMES), "on", c(L.WEEKDAYS), "."]),
            (visit, lambda: ["dear", "diary", ",", "today", "we", "went", "to", "the", p, "."]),
            (("hotel", "trip"),
             lambda: ["my", c(L.RELATIVES), "and", "i", "spent", "the", "day", "at", "the", p, "."]),
            (("restaurant",),
             lambda: ["my", c(L.RELATIVES), "and", "i", "had", "dinner", "at", "the", p, "."]),
            (("hotel",), lambda: ["we", "stayed", "at", "the", p, "for", c(L.NUMBERS), "nights", "."]),
            (("hotel",), lambda: ["i", "booked", "the", p, "last", c(("week", "month")), "."]),
            (("movie",), lambda: ["i", "watched", "the", p, "with", "my", c(L.RELATIVES), "."]),
            (("movie",), lambda: ["we", "saw", "the", p, "on", c(L.WEEKDAYS),
                                  c(("morning", "afternoon", "evening", "night")), "."]),
            (("movie",), lambda: [c(L.NAMES), "and", "i", "went", "to", "see", "the", p, "."]),
            (own, lambda: ["i", "bought", "this", p, "last", c(("week", "month")), "."]),
            (own, lambda: ["my", c(L.RELATIVES), "gave", "me", _article(p), p, "for", "my",
                           "birthday", "."]),
            (("gadget",), lambda: ["i", "have", "used", "the", p, "for", c(L.NUMBERS), "weeks", "."]),
            (("book",), lambda: ["i", "read", "the", p, "in", c(L.NUMBERS), "days", "."]),
            (("book",), lambda: [c(L.NAMES), "lent", "me", "the", p, "on", c(L.WEEKDAYS), "."]),
        ]
        return c([make for domains, make in options if self.domain in domains])()

    def _adj(self, pos: bool) -> str:
        return self.c(L.POS_ADJ if pos else L.NEG_ADJ)

    def opinion(self, pos: bool) -> list[str]:
        c, d, adj = self.c, self.d, self._adj
        n, n2 = self.rng.sample(d["nouns"], 2)
        a = adj(pos)
        g = c(L.GENERIC_NOUNS)
        options = [
            lambda: ["the", n, "was", a, "."],
            lambda: ["the", n, "was", c(L.INTENSIFIERS), a, "."],
            lambda: ["the", n, "and", "the", n2, "were", a, "."],
            lambda: ["the", n, "was", a, "and", adj(pos), "."],
            lambda: ["i", c(L.POS_VERB if pos else L.NEG_VERB), "the", n, "."],
            lambda: ["it", "was", _article(a), a, g, "."],
            lambda: [c(L.NAMES), "thought", "the", n, "was", a, "."],
            lambda: ["my", c(L.RELATIVES), "said", "the", n, "was", c(L.INTENSIFIERS), a, "."],
            lambda: ["what", _article(a), a, n, "!"],
            lambda: ["the", n, c(L.POS_AFFECT if pos else L.NEG_AFFECT), "me", "."],
            lambda: ["we", "felt", c(L.POS_FEEL if pos else L.NEG_FEEL), c(("afterwards", "later")), "."],
            lambda: [c(L.POS_ADV if pos else L.NEG_ADV), ",", "the", n, "was", a, "."],
            lambda: (["i", "would", "recommend", "this", self.place, "to", "my", c(L.RELATIVES), "."]
                     if pos else
                     ["i", "would", "warn", "my", c(L.RELATIVES), "about", "this", self.place, "."]),
            lambda: ["the", n, "was", a, ",", "but", "the", n2, "was", adj(not pos), "."],
        ]
        return c(options)()

    def neutral(self) -> list[str]:
        c, d = self.c, self.d
        n = c(d["nouns"])
        options = [
            lambda: ["we", c(d["actions"]), "the", n, "on", c(L.WEEKDAYS), "."],
            lambda: [c(L.NAMES), c(d["actions"]), "the", n, "."],
            lambda: ["there", "were", c(L.NUMBERS), c(d["plural"]), "near", "the", n, "."],
            lambda: ["it", "was", c(L.WEATHER), "outside", "."],
            lambda: ["after", "that", ",", "we", c(("went", "came", "walked")), "home", "."],
            lambda: ["the", n, "had", c(L.NUMBERS), c(d["plural"]), "."],
            lambda: ["we", "waited", "for", c(L.NUMBERS), "minutes", "."],
            lambda: ["i", "talked", "to", c(L.NAMES), "about", "the", n, c(L.TIMES), "."],
            lambda: ["we", "returned", "in", "the", c(("morning", "afternoon", "evening")), "."],
        ]
        return c(options)()

    def body(self, opinion_prob: float) -> list[str]:
        if self.rng.random() < opinion_prob:
            return self.opinion(self.rng.random() < self.mood)
        return self.neutral()


def _extra_sentences(rng: random.Random, p: TaskParams) -> tuple[int, bool]:
    """Number of body sentences after the first -- geometric, or (rarely) lognormal -- and
    whether the text is in the long mode."""
    if rng.random() < p.tail_prob:
        k = round(rng.lognormvariate(math.log(p.long_median), p.long_sigma))
        return min(max(1, k), int(4 * p.long_median)), True  # no absurd outliers
    if p.short_mean <= 0:
        return 0, False
    stop = 1.0 / (1.0 + p.short_mean)  # geometric on {0, 1, ...} with this mean
    k = 0
    while rng.random() > stop:
        k += 1
    return k, False


def generate_example(rng: random.Random, params: TaskParams) -> Example:
    domain = rng.choice(sorted(L.DOMAINS))
    mood = rng.choice((0.1, 0.3, 0.5, 0.7, 0.9))
    w = _Writer(rng, domain, mood)
    opener = w.opener()
    first = w.body(params.opinion_prob)
    k = rng.randint(0, min(3, len(first) - 2))  # leave at least one word and the terminator
    rest: list[str] = first[k:]
    seen = {tuple(first)}
    n_extra, long_mode = _extra_sentences(rng, params)
    for _ in range(n_extra):
        sent = w.body(params.opinion_prob)
        for _retry in range(3):  # a text rarely says the same sentence twice
            if tuple(sent) not in seen:
                break
            sent = w.body(params.opinion_prob)
        seen.add(tuple(sent))
        if long_mode and rng.random() < params.long_style:
            rest += [rng.choice(L.CONNECTIVES), ","]
        rest += sent
    return Example(tuple(opener + first[:k]), tuple(rest), mood)


def generate(n: int, seed: int, params: TaskParams | None = None) -> list[Example]:
    """``n`` examples, deterministic in ``seed`` (and ``params``)."""
    params = params or TaskParams()
    rng = random.Random(f"oppo-positive-{seed}")
    return [generate_example(rng, params) for _ in range(n)]


def make_prompts(n: int, seed: int, params: TaskParams | None = None) -> list[str]:
    """``n`` prompt strings (openings of generated texts), deterministic in ``seed``."""
    return [ex.prompt for ex in generate(n, seed, params)]


def vocabulary() -> list[str]:
    return L.all_words()


DEFAULT_MAX_NEW_TOKENS = 128
"""``suggest_max_new_tokens()`` for the default ``TaskParams`` (a test keeps them equal)."""


def suggest_max_new_tokens(params: TaskParams | None = None, quantile: float = 0.995) -> int:
    """Generation budget that leaves the corpus tail mostly untruncated: the ``quantile`` of
    corpus response lengths (tokens, + 1 for EOS), rounded up to a multiple of 16."""
    return _suggest(params or TaskParams(), quantile)


@functools.lru_cache(maxsize=32)
def _suggest(params: TaskParams, quantile: float) -> int:
    lengths = sorted(len(ex.response_tokens) + 1 for ex in generate(20_000, 12345, params))
    q = lengths[min(len(lengths) - 1, int(quantile * len(lengths)))]
    return int(math.ceil(q / 16) * 16)


# --- the judge ----------------------------------------------------------------------------------

EMPTY_SCORE = -2.0
CUTOFF_PENALTY = 1.0
SENTIMENT_SCALE = 1.5
DUP_TOLERANCE = 0.25
DUP_WEIGHT = 2.0
WORD_REPEAT_WEIGHT = 0.5
MAX_SENTENCE_TOKENS = 40
MALFORMED_PENALTY = 1.0
MAX_MALFORMED = 2.0
SCORE_MIN, SCORE_MAX = -3.0, 1.0

_POS, _NEG = L.POSITIVE_WORDS, L.NEGATIVE_WORDS
_SENTIMENT = _POS | _NEG
_FUNCTION = frozenset(L.FUNCTION_WORDS) | {"i", "we", "my", "me"}
_TERMINATORS = L.TERMINATORS
_PUNCT = frozenset({".", ",", "!", "?", ";", ":"})


def _is_word(tok: str) -> bool:
    return tok[0].isalnum()


def judge_parts(prompt: str, response: str) -> dict[str, float]:
    """The judge's terms for one response (see the module docstring); ``score`` is the total."""
    toks = split(response)
    words = [t for t in toks if _is_word(t)]
    if not words:
        return {"score": EMPTY_SCORE, "sentiment": 0.0, "repetition": 0.0, "malformed": 0.0,
                "cutoff": 0.0, "empty": 1.0}
    n = len(words)
    pos = sum(1 for w in words if w in _POS)
    neg = sum(1 for w in words if w in _NEG)
    sentiment = math.tanh(SENTIMENT_SCALE * (pos - neg) / math.sqrt(n))

    # Repetition: repeated token 4-grams, and one content word used over and over.
    repetition = 0.0
    if len(toks) >= 8:
        grams = list(zip(toks, toks[1:], toks[2:], toks[3:]))
        dup = 1.0 - len(set(grams)) / len(grams)
        repetition += DUP_WEIGHT * max(0.0, dup - DUP_TOLERANCE)
    counts = Counter(w for w in words if w not in _FUNCTION)
    if counts:
        top = counts.most_common(1)[0][1]
        repetition += WORD_REPEAT_WEIGHT * max(0, top - max(3, int(0.15 * n)))

    # Malformed sentences; the prompt's unfinished sentence continues into the response.
    head: list[str] = []
    for t in reversed(split(prompt)):
        if t in _TERMINATORS:
            break
        head.append(t)
    head.reverse()
    sentences: list[list[str]] = []
    cur = head
    for t in toks:
        cur.append(t)
        if t in _TERMINATORS:
            sentences.append(cur)
            cur = []
    if cur:
        sentences.append(cur)
    bad = 0
    for s in sentences:
        sw = [t for t in s if _is_word(t)]
        n_sent = sum(1 for t in sw if t in _SENTIMENT)
        if len(sw) < 3 or len(s) > MAX_SENTENCE_TOKENS or 2 * n_sent > len(sw):
            bad += 1
    malformed = min(MAX_MALFORMED, MALFORMED_PENALTY * bad)

    cutoff = 0.0 if toks[-1] in _TERMINATORS else CUTOFF_PENALTY
    score = sentiment - repetition - malformed - cutoff
    score = min(SCORE_MAX, max(SCORE_MIN, score))
    return {"score": score, "sentiment": sentiment, "repetition": repetition,
            "malformed": malformed, "cutoff": cutoff, "empty": 0.0}


def judge(prompts: list[str], responses: list[str]) -> list[float]:
    """Ground-truth score of each (prompt, response); higher is better, in [-3, 1]."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    return [judge_parts(p, r)["score"] for p, r in zip(prompts, responses)]


def judge_score(prompts: list[str], responses: list[str]) -> list[float]:
    """``judge`` under a reward-function name: ``"oppo.task.positive:judge_score"``."""
    return judge(prompts, responses)


# --- degenerate responses, for the reward model's training pairs --------------------------------


def corrupt(rng: random.Random, response: tuple[str, ...]) -> tuple[str, ...]:
    """A degenerate variant of a response (tokens) that the judge penalises: repeated phrases,
    a repeated word, a cut-off (no terminator), word salad of sentiment words, or empty."""
    r = list(response) or ["."]
    kind = rng.randrange(6)
    if kind == 0:  # loop one sentence (or fragment) many times
        sent = r[: r.index(".") + 1] if "." in r else r
        out = sent * rng.randint(3, 8)
    elif kind == 1:  # one word again and again, sometimes closed with a period
        w = rng.choice([t for t in r if _is_word(t)] + list(L.POS_ADJ[:10]))
        out = [w] * rng.randint(6, 30) + ([".", ] if rng.random() < 0.5 else [])
    elif kind == 2:  # cut off mid-sentence
        cut = rng.randint(1, max(1, len(r) - 1))
        out = r[:cut]
        while out and out[-1] in _TERMINATORS:
            out = out[:-1]
        if not out:
            out = [rng.choice(L.POS_ADJ)]
    elif kind == 3:  # positive word salad
        out = rng.sample(L.POS_ADJ, rng.randint(3, 12)) + ["."]
    elif kind == 4:  # empty
        out = []
    else:  # phrase loop inside a longer response, then cut off
        sent = r[: r.index(".") + 1] if "." in r else r
        out = r + sent * rng.randint(2, 6) + sent[: max(1, len(sent) // 2)]
    return tuple(out)


_FLIP_GROUPS = [
    (L.POS_ADJ, L.NEG_ADJ), (L.POS_VERB, L.NEG_VERB), (L.POS_AFFECT, L.NEG_AFFECT),
    (L.POS_FEEL, L.NEG_FEEL), (L.POS_ADV, L.NEG_ADV), (L.POS_RECOMMEND, L.NEG_RECOMMEND),
]
_OPPOSITES: dict[str, tuple[str, ...]] = {}
for _pos, _neg in _FLIP_GROUPS:
    for _w in _pos:
        _OPPOSITES.setdefault(_w, _neg)
    for _w in _neg:
        _OPPOSITES.setdefault(_w, _pos)


def flip_sentiment(rng: random.Random, tokens: tuple[str, ...]) -> tuple[str, ...]:
    """``tokens`` with some sentiment words (each with probability 1/2, at least one when there
    is one) swapped for a word of the opposite polarity: a pair that differs only in sentiment."""
    where = [i for i, t in enumerate(tokens) if t in _OPPOSITES]
    if not where:
        return tokens
    chosen = [i for i in where if rng.random() < 0.5] or [rng.choice(where)]
    out = list(tokens)
    for i in chosen:
        out[i] = rng.choice(_OPPOSITES[out[i]])
    return tuple(out)
