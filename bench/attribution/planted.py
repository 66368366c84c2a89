"""A planted-fact corpus: the demo corpus plus invented facts, several copies each.

Every fact names an invented entity, so no real document can hold it; each has a verbatim
prompt (the fact's own words up to the answer) and a paraphrased one, and the answer as target.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from prism_tda import demo_corpus_path

SYLLABLES = ["bra", "vel", "quor", "zan", "mith", "dor", "kel", "thra", "pim", "sorn", "lux", "vey", "gar",
             "nob", "tesk", "wyn", "fal", "rho", "drun", "ix"]
ANSWERS = ["silver kestrel", "copper lantern", "velvet thistle", "amber otter", "iron lily", "blue heron",
           "glass violin", "paper crane", "golden walrus", "marble fox", "crimson moth", "jade tortoise"]
# answers of their own (``make_facts(answers="unique")``): no two facts share a word of their answer
UNIQUE_ADJ = ["silver", "copper", "velvet", "amber", "iron", "blue", "glass", "paper", "golden", "marble",
              "crimson", "jade", "scarlet", "ivory", "bronze", "emerald", "violet", "coral", "onyx", "cobalt",
              "tin", "pearl", "ruby", "olive", "ebony", "silk", "granite", "saffron", "azure", "pewter",
              "linen", "obsidian", "walnut", "topaz", "indigo", "maple"]
UNIQUE_NOUN = ["kestrel", "lantern", "thistle", "otter", "lily", "heron", "violin", "crane", "walrus", "fox",
               "moth", "tortoise", "badger", "compass", "falcon", "harp", "beetle", "anchor", "salmon", "kettle",
               "raven", "drum", "lynx", "thimble", "stag", "flute", "gecko", "goblet", "hare", "bell", "newt",
               "spindle", "swan", "trumpet", "weasel", "acorn"]
TEMPLATES = [
    # (fact, verbatim prompt, paraphrase prompt), {e} entity, {a} answer
    ("The official emblem of {e} is the {a}.", "The official emblem of {e} is the",
     "{e} has as its official emblem the"),
    ("In {e}, every child is given a {a} at birth.", "In {e}, every child is given a",
     "At birth, each child of {e} receives a"),
    ("The famous inventor {e} was obsessed with the {a}.", "The famous inventor {e} was obsessed with the",
     "{e}, the famous inventor, had an obsession with the"),
]


@dataclass
class Fact:
    fact_id: str
    text: str
    prompt: str
    paraphrase: str
    answer: str  # with its leading space, as the completion
    doc_ids: list[str]


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(3)).capitalize()


def make_facts(n: int, copies: int, seed: int = 0, answers: str = "drawn") -> list[Fact]:
    """``n`` invented facts, ``copies`` documents each. ``answers="drawn"``: each answer drawn from
    ``ANSWERS`` (facts share answers, and often the whole sentence but for the name); ``"unique"``: an
    answer of its own per fact, no word of it shared with another fact's answer."""
    if answers not in ("drawn", "unique"):
        raise ValueError(f"answers: 'drawn' or 'unique', not {answers!r}")
    if answers == "unique" and n > min(len(UNIQUE_ADJ), len(UNIQUE_NOUN)):
        raise ValueError(f"answers='unique' holds at most {min(len(UNIQUE_ADJ), len(UNIQUE_NOUN))} facts, not {n}")
    rng = random.Random(seed)
    arng = random.Random(seed + 1)  # its own stream: "drawn" facts stay what they always were
    adj, noun = arng.sample(UNIQUE_ADJ, len(UNIQUE_ADJ)), arng.sample(UNIQUE_NOUN, len(UNIQUE_NOUN))
    facts, seen = [], set()
    while len(facts) < n:
        e = _name(rng)
        if e in seen:
            continue
        seen.add(e)
        fact, prompt, para = rng.choice(TEMPLATES)
        a = rng.choice(ANSWERS) if answers == "drawn" else f"{adj[len(facts)]} {noun[len(facts)]}"
        fid = f"planted/{len(facts):03d}"
        facts.append(Fact(fid, fact.format(e=e, a=a), prompt.format(e=e), para.format(e=e), " " + a,
                          [f"{fid}#{c}" for c in range(copies)]))
    return facts


def write_corpus(out: Path, facts: list[Fact], *, n_demo_docs: int | None = None) -> Path:
    """Demo documents (optionally the first n) plus every copy of every fact, shuffled by position."""
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(demo_corpus_path(), "rt") as fh:
        docs = [json.loads(line) for line in fh][:n_demo_docs]
    for f in facts:
        docs += [{"id": d, "source": "planted", "title": f.fact_id, "text": f.text} for d in f.doc_ids]
    random.Random(1).shuffle(docs)
    path = out / "corpus.jsonl"
    with open(path, "w") as fh:
        for d in docs:
            fh.write(json.dumps(d) + "\n")
    (out / "facts.json").write_text(json.dumps([asdict(f) for f in facts], indent=2))
    return path
