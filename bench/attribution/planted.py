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


def make_facts(n: int, copies: int, seed: int = 0) -> list[Fact]:
    rng = random.Random(seed)
    facts, seen = [], set()
    while len(facts) < n:
        e = _name(rng)
        if e in seen:
            continue
        seen.add(e)
        fact, prompt, para = rng.choice(TEMPLATES)
        a = rng.choice(ANSWERS)
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
