"""Word lists for the built-in ``positive`` task.

Everything the corpus generator can emit comes from this module, so the tokenizer's vocabulary
is exactly the union of these lists (plus punctuation and special tokens). All words are lower
case and contain no spaces. The two sentiment lexicons (``POSITIVE_WORDS`` / ``NEGATIVE_WORDS``)
are what the judge counts; every other list is sentiment-neutral on purpose, so that the only
way to raise the judge's sentiment term is to use the sentiment words.
"""

from __future__ import annotations


def _words(text: str) -> tuple[str, ...]:
    out = tuple(text.split())
    assert len(set(out)) == len(out), [w for w in out if out.count(w) > 1]
    return out


# --- sentiment words, by part of speech --------------------------------------------------------

POS_ADJ = _words("""
good great excellent wonderful lovely delightful pleasant superb fantastic brilliant
amazing charming friendly helpful beautiful perfect marvelous splendid terrific fabulous
cozy elegant fresh tasty delicious generous gorgeous graceful impressive inspiring joyful
kind memorable outstanding polished reliable relaxing remarkable satisfying smooth solid
stunning sweet thoughtful thrilling warmhearted welcoming cheerful clever comfortable
crisp dazzling enjoyable exquisite flawless glorious handy heartwarming honest magical
neat peaceful precious refreshing rich sparkling spotless stylish sublime superior tender
tidy uplifting vibrant wholesome witty calm sturdy spacious bright lively fun
""")

NEG_ADJ = _words("""
bad awful terrible horrible dreadful poor unpleasant mediocre disappointing boring
broken rude unhelpful ugly flawed miserable nasty noisy dirty stale bland greasy soggy
cramped shabby sloppy slow clumsy confusing dull flimsy gloomy grim harsh lousy messy
overpriced painful pathetic pointless rotten rusty sad sour stuffy tacky tasteless
tedious tiresome unbearable unreliable useless weak worn worthless annoying careless
chaotic cold crummy defective dismal filthy frustrating gross hostile inferior lame
moldy muddy offensive sluggish smelly sticky tense tragic upsetting wasteful wretched
mean cruel dreary
""")

POS_VERB = _words("""
loved enjoyed adored admired liked appreciated praised treasured savored cherished
""")

NEG_VERB = _words("""
hated disliked loathed regretted dreaded despised resented detested endured tolerated
""")

# "the noun <verb> me ."
POS_AFFECT = _words("""
delighted impressed pleased charmed amazed thrilled comforted inspired surprised
""")

NEG_AFFECT = _words("""
annoyed disappointed bored upset irritated angered confused frustrated worried
""")

# "we felt <feeling> afterwards ."
POS_FEEL = _words("happy glad grateful relaxed joyful content hopeful proud refreshed cheerful")

NEG_FEEL = _words("unhappy sorry tired anxious gloomy cheated ashamed exhausted restless bitter")

POS_ADV = _words("luckily thankfully happily fortunately wonderfully")

NEG_ADV = _words("sadly unfortunately regrettably annoyingly")

POS_RECOMMEND = _words("recommend")
NEG_RECOMMEND = _words("warn")

POSITIVE_WORDS: frozenset[str] = frozenset(
    POS_ADJ + POS_VERB + POS_AFFECT + POS_FEEL + POS_ADV + POS_RECOMMEND
)
NEGATIVE_WORDS: frozenset[str] = frozenset(
    NEG_ADJ + NEG_VERB + NEG_AFFECT + NEG_FEEL + NEG_ADV + NEG_RECOMMEND
)
assert not POSITIVE_WORDS & NEGATIVE_WORDS, POSITIVE_WORDS & NEGATIVE_WORDS

# --- neutral words ------------------------------------------------------------------------------

INTENSIFIERS = _words("very really quite truly rather so pretty fairly extremely somewhat")

NAMES = _words("""
anna ben clara david emma felix grace henry iris jack kate leo maya noah olive paul
rosa sam tara victor wendy zoe omar lucia
""")

RELATIVES = _words("sister brother mother father friend cousin neighbour partner aunt uncle")

TIMES = _words("""
yesterday today tonight later afterwards earlier again
""")

WEEKDAYS = _words("monday tuesday wednesday thursday friday saturday sunday")

PARTS_OF_DAY = _words("morning afternoon evening night noon weekend")

WEATHER = _words("cloudy sunny rainy windy foggy humid chilly snowy")

NUMBERS = _words("two three four five six seven eight nine ten twelve twenty")

GENERIC_NOUNS = _words("""
experience visit evening trip day choice time afternoon purchase idea
""")

# Each domain: the place / object of the text, the things one can judge, and neutral actions.
DOMAINS: dict[str, dict[str, tuple[str, ...]]] = {
    "restaurant": {
        "places": _words("restaurant cafe bistro diner bakery pizzeria"),
        "nouns": _words("""
            food soup pasta salad bread dessert coffee tea service waiter menu pizza
            sauce steak fish rice noodles cake wine music table kitchen chef portion
            """),
        "plural": _words("plates dishes glasses chairs candles tables"),
        "actions": _words("ordered tasted shared finished tried chose"),
    },
    "hotel": {
        "places": _words("hotel hostel inn lodge resort motel"),
        "nouns": _words("""
            room bed shower breakfast staff lobby pool view balcony carpet towel
            elevator receptionist pillow blanket window bathroom garden parking
            """),
        "plural": _words("rooms floors stairs lamps towels pillows"),
        "actions": _words("booked checked cleaned opened used visited"),
    },
    "movie": {
        "places": _words("movie film cinema theater documentary show"),
        "nouns": _words("""
            plot ending story soundtrack acting villain hero script dialogue scene
            camera costume director actor actress sequel trailer cast score
            """),
        "plural": _words("scenes actors songs seats minutes characters"),
        "actions": _words("watched followed discussed noticed remembered described"),
    },
    "gadget": {
        "places": _words("phone laptop camera tablet speaker watch"),
        "nouns": _words("""
            battery screen charger keyboard case button software sound lens app
            cable display speakerphone microphone design box manual update
            """),
        "plural": _words("buttons cables apps settings photos files"),
        "actions": _words("charged installed unpacked tested returned adjusted"),
    },
    "book": {
        "places": _words("book novel memoir cookbook biography anthology"),
        "nouns": _words("""
            chapter cover prose author narrator poem translation index prologue
            epilogue illustration paper font title argument recipe
            """),
        "plural": _words("pages chapters recipes poems pictures notes"),
        "actions": _words("read borrowed finished skimmed quoted studied"),
    },
    "trip": {
        "places": _words("park museum beach village market festival"),
        "nouns": _words("""
            trail guide tour crowd weather ticket bus train boat bridge path lake
            river castle statue gallery exhibit concert stall picnic
            """),
        "plural": _words("paintings streets trees shops boats hills"),
        "actions": _words("walked explored visited crossed photographed passed"),
    },
}

# Function words and fixed fragments used by the grammar templates (see ``positive.py``).
FUNCTION_WORDS = _words("""
the a an and but i we it was were my to at on with for this there had have me
about after that would what in of
""")

# Neutral verbs and fillers used by the openers and the neutral sentences.
NEUTRAL_MISC = _words("""
went visited had dinner stayed nights booked week month checked watched saw night see
bought last gave birthday used weeks read lent finished days spent day dear diary today
thought felt said talked waited minutes home came returned walked outside near
""")

# Sentence openers of long texts ("then , the soup was cold .").
CONNECTIVES = _words("then later next also meanwhile afterwards")

PUNCTUATION = (".", ",", "!")
TERMINATORS = frozenset({".", "!"})


def all_words() -> list[str]:
    """Every word and punctuation mark the generator can emit, deduplicated, in a fixed order."""
    lists: list[tuple[str, ...]] = [
        FUNCTION_WORDS, PUNCTUATION, NEUTRAL_MISC, CONNECTIVES, INTENSIFIERS, NAMES, RELATIVES,
        TIMES, WEEKDAYS, PARTS_OF_DAY, WEATHER, NUMBERS, GENERIC_NOUNS,
        POS_ADJ, NEG_ADJ, POS_VERB, NEG_VERB, POS_AFFECT, NEG_AFFECT, POS_FEEL, NEG_FEEL,
        POS_ADV, NEG_ADV, POS_RECOMMEND, NEG_RECOMMEND,
    ]
    for domain in DOMAINS.values():
        lists.extend(domain.values())
    seen: dict[str, None] = {}
    for words in lists:
        for w in words:
            seen.setdefault(w, None)
    return list(seen)
