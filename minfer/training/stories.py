"""Simple stories from a small probabilistic grammar, and a recogniser for its sentences.

The training text of minfer-tiny (train_tiny.py). It is written here, not downloaded, so it is
available offline and redistributable under the project's licence (MIT), and a seed makes it
exactly reproducible. It imitates TinyStories (Eldan and Li, 2023): short stories in words a
small child knows, which a model of a few million parameters can learn to write well.

A story is a fixed run of parts (an opening, what the hero likes, one day's outing, a find, a
problem, what was said, how it was solved, an ending). Each part picks one of its sentence
templates; a template's {slots} are filled from the story's cast (hero, friend, object...), so a
story keeps its names, pronouns and things from the first sentence to the last.

`parses(sentence)` says whether a sentence is one the grammar can make. It checks each sentence
alone: slots match any of their fillers, so it does not check that a story keeps its cast.
"""

from __future__ import annotations

import random
import re
from functools import lru_cache

NAMES_GIRL = "Lily Mia Sue Anna Lucy Emma Zoe Ella Rosa Amy Kate Nina Jane Ruby Sara".split()
NAMES_BOY = "Tom Ben Max Sam Tim Jack Leo Finn Jake Dan Bob Joe Ted Ned Paul".split()
KINDS_GIRL = ["girl"]
KINDS_BOY = ["boy"]
KINDS_ANIMAL = "cat dog bunny bird bear fox duck frog mouse puppy".split()

# slot -> its fillers. A filler may hold slots of its own (filled in turn).
WORDS = {
    "size": "little small kind happy brave shy curious funny".split(),
    "town": "small quiet sunny busy".split(),
    "place": ["the park", "the forest", "the garden", "the beach", "the big hill", "the farm",
              "the river", "the lake", "the zoo", "the woods"],
    "color": "red blue green yellow pink shiny big little old soft".split(),
    "obj": ["ball", "kite", "box", "hat", "toy car", "book", "flower", "shell", "stone", "key",
            "boat", "doll", "drum", "cup", "bell", "leaf", "feather", "balloon"],
    "spot": ["tree", "rock", "bush", "bench", "fence", "log"],
    "trap": ["tree", "bush", "mud", "hole", "pond", "fence"],
    "food": "apples cookies bread carrots honey cake soup berries pie grapes".split(),
    "activity": ["play outside", "run fast", "sing songs", "draw pictures", "jump high",
                 "read books", "dance", "climb trees", "look at the stars", "help {his} {parent}"],
    "parent": ["mom", "dad"],
    "animal": "dog bird cat monkey squirrel goat".split(),
    "sound": ["a soft cry", "a loud noise", "a funny song", "a little bark", "a quiet sound"],
    "good": "happy glad proud excited".split(),
    "bad": "sad scared worried tired".split(),
    "verb": ["play with", "look at", "keep", "share", "show {friend}"],
    "lesson": ["sharing is good", "it is good to help friends", "being brave is important",
               "friends make everything better", "it is good to be kind", "asking for help is good"],
}

# The parts of a story, in order: (chance the part is there, [(weight, template), ...]).
PARTS = [
    (1.0, [(3, "Once upon a time, there was a {size} {kind} named {name}."),
           (2, "Once upon a time, in a {town} town, there lived a {size} {kind} named {name}."),
           (1, "There was once a {size} {kind} named {name}."),
           (1, "{name} was a {size} {kind} who lived near {place}.")]),
    (1.0, [(3, "{He} liked to {activity} every day."),
           (2, "{He} loved {food} more than anything."),
           (2, "{He} had a {color} {obj} that {he} loved very much."),
           (2, "{His} best friend was a {kind2} named {friend}.")]),
    (0.5, [(1, "Every morning, {he} ate {food} with {his} {parent}."),
           (1, "{His} {parent} always said, \"Be kind to your friends.\"")]),
    (1.0, [(3, "One day, {name} went to {place} with {his} {parent}."),
           (3, "One day, {name} and {friend} went to {place} to play."),
           (2, "One sunny morning, {name} woke up and went to {place}.")]),
    (1.0, [(3, "{He} saw a {color} {obj} under a {spot}."),
           (2, "At {place}, {he} found a {color} {obj} near a {spot}."),
           (2, "{He} heard {sound} behind a {spot} and found a {color} {obj} there.")]),
    (1.0, [(2, "But the {obj} was stuck in the {trap}."),
           (2, "Then a {animal} came and took the {obj} away."),
           (1, "Then it started to rain, and {name} felt {bad}."),
           (1, "But the {obj} was too high for {him} to reach.")]),
    (1.0, [(2, "{name} said, \"I want to {verb} the {obj}!\""),
           (2, "{name} said, \"Can you help me, {friend}?\""),
           (1, "{name} was {bad} and said, \"Please give me my {obj}!\""),
           (1, "{He} said, \"Let us try together!\"")]),
    (1.0, [(3, "{friend} came and helped {him} get the {obj}."),
           (2, "{His} {parent} smiled and said, \"Do not worry, I will help you.\""),
           (2, "They worked together and got the {obj} back."),
           (1, "{name} tried again and again, and at last {he} got the {obj}.")]),
    (1.0, [(2, "{name} was very {good}."),
           (2, "{name} and {friend} played with the {obj} all day."),
           (1, "{He} gave {friend} a big hug and said, \"Thank you!\""),
           (1, "{He} felt {good} and shared {food} with {friend}.")]),
    (0.6, [(1, "{name} learned that {lesson}.")]),
    (1.0, [(3, "The end."),
           (2, "From that day on, {name} and {friend} were best friends."),
           (1, "That night, {name} went to bed with a big smile.")]),
]
PRONOUNS = {"girl": dict(he="she", his="her", him="her"), "boy": dict(he="he", his="his", him="him")}
SLOT = re.compile(r"\{(\w+)\}")


def _cast(rng: random.Random) -> dict[str, str]:
    """One story's fixed choices: hero and friend with their kinds and pronouns, one object."""
    gender = rng.choice(("girl", "boy"))
    kind = rng.choice((KINDS_GIRL if gender == "girl" else KINDS_BOY) * 3 + KINDS_ANIMAL)
    names = NAMES_GIRL if gender == "girl" else NAMES_BOY
    name = rng.choice(names)
    friend = rng.choice([n for n in NAMES_GIRL + NAMES_BOY if n != name])
    friend_kind = rng.choice(["girl" if friend in NAMES_GIRL else "boy"] * 2 + KINDS_ANIMAL)
    cast = dict(name=name, kind=kind, friend=friend, kind2=friend_kind, **PRONOUNS[gender])
    cast.update({k.capitalize(): v.capitalize() for k, v in PRONOUNS[gender].items()})
    for slot in ("place", "obj", "parent", "food"):  # the same one wherever the story names it
        cast[slot] = rng.choice(WORDS[slot])
    return cast


def _fill(template: str, cast: dict[str, str], rng: random.Random) -> str:
    def one(m: re.Match) -> str:
        slot = m.group(1)
        return cast[slot] if slot in cast else _fill(rng.choice(WORDS[slot]), cast, rng)

    return SLOT.sub(one, template)


def story(rng: random.Random) -> str:
    """One story: a paragraph of sentences on one line."""
    cast = _cast(rng)
    sentences = []
    for chance, templates in PARTS:
        if chance < 1.0 and rng.random() >= chance:
            continue
        weights, texts = zip(*templates)
        sentences.append(_fill(rng.choices(texts, weights)[0], cast, rng))
    return " ".join(sentences)


def stories(seed: int | str, count: int) -> list[str]:
    """`count` stories, the same ones for the same seed (Python's random.Random is stable across versions
    and platforms, for int and str seeds)."""
    rng = random.Random(seed)
    return [story(rng) for _ in range(count)]


# --- recognising sentences -----------------------------------------------------------------------


@lru_cache(maxsize=None)
def _slot_pattern(slot: str) -> str:
    """A regular expression matching every way the grammar can fill `slot`."""
    if slot in ("name", "friend"):
        fillers = NAMES_GIRL + NAMES_BOY
    elif slot in ("kind", "kind2"):
        fillers = KINDS_GIRL + KINDS_BOY + KINDS_ANIMAL
    elif slot in ("he", "his", "him", "He", "His", "Him"):
        fillers = [p[slot.lower()] for p in PRONOUNS.values()]
        fillers = [f.capitalize() for f in fillers] if slot[0].isupper() else fillers
    else:
        fillers = WORDS[slot]
    return "(?:" + "|".join(_template_pattern(f) for f in sorted(fillers, key=len, reverse=True)) + ")"


def _template_pattern(template: str) -> str:
    parts, last = [], 0
    for m in SLOT.finditer(template):
        parts += [re.escape(template[last : m.start()]), _slot_pattern(m.group(1))]
        last = m.end()
    return "".join(parts) + re.escape(template[last:])


@lru_cache(maxsize=1)
def _sentence_regex() -> re.Pattern:
    templates = [t for _, part in PARTS for _, t in part]
    return re.compile("|".join(f"(?:{_template_pattern(t)})" for t in templates))


def parses(sentence: str) -> bool:
    """Whether the grammar can make this sentence (on its own: see the module's docstring)."""
    return _sentence_regex().fullmatch(sentence.strip()) is not None


def split_sentences(text: str) -> tuple[list[str], str]:
    """(the complete sentences of `text`, what is left after the last one). A sentence ends at
    . ! or ? outside quotes, or at a closing quote right after one of them."""
    sentences, start, quoted = [], 0, False
    for i, ch in enumerate(text):
        if ch == '"':
            quoted = not quoted
            if not quoted and i > 0 and text[i - 1] in ".!?":
                sentences.append(text[start : i + 1].strip())
                start = i + 1
        elif ch in ".!?" and not quoted and not (i + 1 < len(text) and text[i + 1] == '"'):
            sentences.append(text[start : i + 1].strip())
            start = i + 1
    return [s for s in sentences if s], text[start:]


# --- retellings: text that repeats itself, so a model learns to copy -------------------------------


def with_retellings(texts: list[str], fraction: float, seed: int | str, max_back: int = 3) -> list[str]:
    """`texts` with verbatim repeats mixed in: after each story, with chance `fraction`, one of the last
    `max_back` stories (itself included) is told again, word for word, as a story of its own.

    Real text repeats itself (quotes, edits, code), and that is how language models learn to copy from
    their context (induction); stories that never repeat teach none of it. A repeat follows its original
    within a story or three, so both fit in a training window of 512 tokens, and it begins like any story:
    the model learns that a story opening like one it just read goes on like that one. The originals keep
    their order, and fraction 0 gives `texts` back; the repeats draw from their own seed stream."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the retelling fraction must be in [0, 1], got {fraction}")
    rng, out = random.Random(f"retell-{seed}"), []
    for i, text in enumerate(texts):
        out.append(text)
        if fraction and rng.random() < fraction:
            out.append(texts[i - rng.randrange(min(max_back, i + 1))])
    return out
