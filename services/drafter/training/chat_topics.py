"""Open chat prompts about everyday words (`treeserve make-prompts`, source wordnet-chat).

The rest of the corpus asks about a snippet of code or a passage of documentation; people also ask a server open
questions with no text attached (what is, how do I, write a poem about, compare, list). WordNet's database, a
Debian package, gives the topics: its common words (those with a sense count in its tagged corpus), each word's
first (most common) sense, the kind of thing it is (its lexicographer file: food, animal, act, person, place...),
its siblings under one hypernym (for comparisons), its hyponyms (for lists), and adjectives' antonyms. Each topic
is worded by a few instructions drawn for its kind. The target writes the answers, so the prompts only need to
cover what users ask about, not to be good questions.

Words of the held-out chat prompts are never topics, so that set measures answers to topics the drafter never saw.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

PARTS_OF_SPEECH = ("noun", "verb", "adj")
# WordNet's lexicographer files by number: the kind of thing a noun names.
NOUN_FILES = {4: "act", 5: "animal", 6: "artifact", 7: "attribute", 8: "body", 9: "cognition", 10: "communication",
              11: "event", 12: "feeling", 13: "food", 14: "group", 15: "location", 16: "motive", 17: "object",
              18: "person", 19: "phenomenon", 20: "plant", 21: "possession", 22: "process", 23: "quantity",
              26: "state", 27: "substance", 28: "time"}
COUNTABLE = {"animal", "artifact", "body", "object", "person", "plant"}  # take "a"/"an": what is a violin?

# Instructions by kind; {w} is the topic, {a} and {t} the topic with "a"/"an" and "the" where it is countable
# ("a violin", "the violin"; "water").
ANY_NOUN = ("What is {a}?", "Explain what {a} is in simple terms.", "Tell me about {t}.",
            "Give me three interesting facts about {t}.", "Write a short paragraph about {t}.",
            "Why does {t} matter?", "Explain {t} to a ten-year-old.", "What should everyone know about {t}?")
CREATIVE = ("Write a haiku about {t}.", "Write a short poem about {t}.", "Write a four-line rhyme about {t}.",
            "Write a very short story that involves {a}.", "Write a short, friendly email to a coworker about {t}.",
            "Write a tweet about {t}.", "Write a one-minute speech about {t}.", "Write a limerick about {t}.")
BY_KIND = {
    "food": ("How do I make {w} at home?", "Give me a simple recipe that uses {w}.", "Is {w} healthy? Be brief.",
             "What does {w} taste like, and what is it served with?"),
    "act": ("Give me some tips for getting better at {w}.", "What are the benefits of {w}?",
            "How do I get started with {w}?", "What are common mistakes beginners make with {w}?"),
    "animal": ("Where does the {w} live, and what does it eat?", "Tell a child three facts about the {w}.",
               "How does the {w} survive in the wild?"),
    "person": ("What does {a} do in a typical day?", "What skills does {a} need?",
               "How do I become {a}?", "Describe the life of {a}."),
    "artifact": ("How does {a} work?", "What is {a} used for?", "How do I choose a good {w}?",
                 "Describe {a} to someone who has never seen one.", "Write a product description for {a}."),
    "cognition": ("Explain the idea of {w} to a beginner.", "What are common misconceptions about {w}?",
                  "How would you teach {w} in one lesson?"),
    "communication": ("Explain {w} with an everyday example.", "What is the purpose of {a}?"),
    "feeling": ("How can someone deal with {w}?", "Write a short letter to a friend about {w}.",
                "What causes {w}, and is it normal?"),
    "state": ("How can someone deal with {w}?", "What are the signs of {w}?", "What leads to {w}?"),
    "event": ("What happens during {a}?", "What causes {w}?", "Describe {a} in five sentences."),
    "phenomenon": ("What causes {w}?", "Explain how {w} happens.", "Where can you see {w} in everyday life?"),
    "process": ("Explain how {w} works, step by step.", "Why is {w} important?"),
    "plant": ("How do I grow {w}?", "What is {w} good for?", "Describe the {w} and where it grows."),
    "substance": ("What is {w} made of, and what is it used for?", "Is {w} dangerous? Explain briefly."),
    "location": ("What is {w} like?", "Give a traveller three tips for {w}."),
    "body": ("What does the {w} do in the human body?", "How do I keep my {w} healthy?"),
    "time": ("What usually happens during {w}?", "Write a short description of {w}."),
}
PLACE = ("What is {w} known for?", "Give a traveller three tips for visiting {w}.", "Describe {w} in a paragraph.",
         "What is the history of {w}, briefly?")
FAMOUS_PERSON = ("Who was {w}?", "Why is {w} remembered?", "Summarize the life of {w} in five sentences.")
COMPARE = ("What is the difference between {a} and {b}?", "Compare {a} and {b} in a short list.",
           "{A} or {b}: how do I choose between them?")
KINDS_OF = ("List five kinds of {w}.", "Name a few types of {w} and say what each is like.")
VERB = ("What does it mean to {w}? Give an example sentence.", "Explain how to {w}, step by step.",
        "Give me tips on how to {w} well.")
ADJECTIVE = ("Describe a place that is {w}.", "Write three sentences using the word \"{w}\".",
             "What are some synonyms for \"{w}\"?")
ANTONYM = ("What is the difference between \"{w}\" and \"{b}\"?", "Write a short poem contrasting {w} and {b} things.")
DEFINITION = ("Rewrite this definition in plain words: {gloss}", "Explain this definition with an example: {gloss}")
# Added to questions (not to writing tasks): how long or in what form to answer.
SUFFIXES = ("", "", "", " Keep it brief.", " Answer in two short paragraphs.", " Use a short list.",
            " Answer in one sentence.", " Give an example.", " Explain it simply.")
# Words no prompt is about: answers to them teach the drafter nothing it needs.
UNWANTED = {"rape", "kill", "murder", "kidnap", "torture", "suicide", "slaughter", "assassinate", "molest",
            "fuck", "shit", "bitch", "bastard", "whore", "nigger", "faggot", "cunt", "porn", "pornography"}

WORD = re.compile(r"[a-z]+")


@dataclass(frozen=True)
class Synset:
    offset: str
    pos: str
    kind: str | None  # the noun's lexicographer kind (NOUN_FILES); None for verbs and adjectives
    words: tuple[str, ...]
    hypernyms: tuple[str, ...]
    hyponyms: tuple[str, ...]
    antonyms: tuple[str, ...]
    instance: bool  # an instance of its hypernym: a named person or place
    gloss: str


def parse_synset(line: str, pos: str) -> Synset | None:
    """One line of data.noun / data.verb / data.adj (wndb(5)): offset, lexicographer file, words, pointers, gloss."""
    head, _, gloss = line.partition(" | ")
    fields = head.split()
    if len(fields) < 4 or not fields[0].isdigit():
        return None
    count = int(fields[3], 16)
    words = tuple(re.sub(r"\(\w+\)$", "", w).replace("_", " ") for w in fields[4:4 + 2 * count:2])
    at = 4 + 2 * count
    pointers = [fields[at + 1 + 4 * i:at + 5 + 4 * i] for i in range(int(fields[at]))]
    kind = NOUN_FILES.get(int(fields[1])) if pos == "noun" else None
    return Synset(fields[0], pos, kind, words,
                  tuple(p[1] for p in pointers if p[0] in ("@", "@i")), tuple(p[1] for p in pointers if p[0] == "~"),
                  tuple(p[1] for p in pointers if p[0] == "!"), any(p[0] == "@i" for p in pointers),
                  gloss.strip())


def common_first_senses(index: Path) -> dict[str, str]:
    """lemma -> the offset of its first sense, for lemmas WordNet's tagged corpus saw (tagsense_cnt > 0)."""
    senses = {}
    for line in index.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith(" "):
            continue
        fields = line.split()
        pointer_count = int(fields[3])
        tagged, offsets = int(fields[5 + pointer_count]), fields[6 + pointer_count:]
        if tagged > 0 and offsets:
            senses[fields[0]] = offsets[0]
    return senses


def with_article(word: str, countable: bool) -> str:
    if not countable or word[:1].isupper():
        return word
    return ("an " if word[0] in "aeiou" else "a ") + word


class Topics:
    """WordNet's synsets in one folder (the data.* and index.* files of wordnet-base)."""

    def __init__(self, folder: Path):
        self.synsets: dict[tuple[str, str], Synset] = {}
        self.common: dict[str, dict[str, str]] = {}
        for pos in PARTS_OF_SPEECH:
            for line in (folder / f"data.{pos}").read_text(encoding="utf-8", errors="replace").splitlines():
                synset = parse_synset(line, pos) if not line.startswith(" ") else None
                if synset is not None:
                    self.synsets[(pos, synset.offset)] = synset
            self.common[pos] = common_first_senses(folder / f"index.{pos}")

    def is_common(self, synset: Synset, word: str) -> bool:
        return self.common[synset.pos].get(word.lower().replace(" ", "_")) == synset.offset

    def common_word(self, pos: str, offset: str) -> str | None:
        synset = self.synsets.get((pos, offset))
        return next((w for w in synset.words if self.is_common(synset, w)), None) if synset else None


def wording(rng: random.Random, templates: tuple[str, ...], question: bool = True, **names) -> str:
    text = rng.choice(templates).format(**names)
    return text[0].upper() + text[1:] + (rng.choice(SUFFIXES) if question else "")


def two_wordings(rng: random.Random, templates: tuple[str, ...], **names) -> list[str]:
    """Two different instructions from `templates` for one topic."""
    return [wording(rng, (template,), **names) for template in rng.sample(templates, min(2, len(templates)))]


def synset_prompts(topics: Topics, synset: Synset, word: str, rng: random.Random) -> list[tuple[str, str]]:
    """(kind, prompt) for one common word, in the instructions its part of speech and kind allow."""
    prompts = []
    if synset.pos == "noun":
        countable = synset.kind in COUNTABLE and not word[:1].isupper()
        a, t = with_article(word, countable), f"the {word}" if countable else word
        if synset.instance:
            famous = PLACE if synset.kind == "location" else FAMOUS_PERSON
            prompts += [("ask-about", text) for text in two_wordings(rng, famous, w=word)]
        else:
            prompts += [("ask-about", text) for text in two_wordings(rng, ANY_NOUN, w=word, a=a, t=t)]
            if synset.kind in BY_KIND:
                prompts += [("how-to", text) for text in two_wordings(rng, BY_KIND[synset.kind], w=word, a=a)]
        prompts.append(("creative", wording(rng, CREATIVE, question=False, w=word, a=a, t=t)))
        siblings = [w for hypernym in synset.hypernyms
                    for offset in topics.synsets[("noun", hypernym)].hyponyms if offset != synset.offset
                    if (w := topics.common_word("noun", offset)) is not None]
        if siblings and not synset.instance:
            other = rng.choice(siblings)
            b = with_article(other, synset.kind in COUNTABLE)
            prompts.append(("compare", wording(rng, COMPARE, a=a, b=b, A=a[0].upper() + a[1:])))
        kinds = [w for offset in synset.hyponyms if (w := topics.common_word("noun", offset)) is not None]
        if len(kinds) >= 3:
            prompts.append(("list", wording(rng, KINDS_OF, w=word)))
    elif synset.pos == "verb":
        prompts.append(("how-to", wording(rng, VERB, w=word)))
    else:
        prompts.append(("describe", wording(rng, ADJECTIVE, question=False, w=word)))
        opposite = next((w for offset in synset.antonyms if (w := topics.common_word("adj", offset))), None)
        if opposite is not None:
            prompts.append(("compare", wording(rng, ANTONYM, question=False, w=word, b=opposite)))
    definition = synset.gloss.split(";")[0].strip()
    if len(definition) >= 30 and rng.random() < 0.25:
        prompts.append(("rewrite", wording(rng, DEFINITION, question=False, gloss=f"{word}: {definition}.")))
    return prompts


def words_of(texts) -> set[str]:
    """Lower-case words of 4 letters or more, and their singulars: the topics to keep out."""
    words = {w for text in texts for w in WORD.findall(text.lower()) if len(w) >= 4}
    return words | {w[:-1] for w in words if w.endswith("s")}


def topic_prompts(folder: Path, seed: int, avoid: set[str]) -> list[tuple[dict, str]]:
    """(record, its prompt) for every common word of the WordNet folder, no word of it in `avoid`; deterministic
    for a seed. The source names the synset: wordnet-chat/noun:02084071."""
    topics = Topics(folder)
    found = []
    for (pos, offset), synset in sorted(topics.synsets.items()):
        word = next((w for w in synset.words if topics.is_common(synset, w)), None)
        if word is None or not WORD.fullmatch(word.lower().replace(" ", "").replace("-", "")) \
                or any(w in avoid or w in UNWANTED for w in WORD.findall(word.lower())):
            continue
        rng = random.Random(f"{seed}:{pos}:{offset}")
        for kind, prompt in synset_prompts(topics, synset, word, rng):
            record = {"prompt": prompt, "chat": True, "kind": kind, "source": f"wordnet-chat/{pos}:{offset}"}
            found.append((record, prompt))
    return found
