"""Planted-fact recall split by whether a fact's answer is its own: which misses are a method's, which
are the benchmark's.

``planted.py`` draws each fact's answer from 12 phrases and its sentence from 3 templates, so most of
30 facts share their answer with another fact, and many share the whole sentence but for the invented
name ("The official emblem of Pimvelrho is the copper lantern." beside "... of Rhoixquor is the copper
lantern."). A paraphrased prompt ("Pimvelrho has as its official emblem the") is then about as far
from its own fact's copies as from the other fact's: only the name tells them apart. This script
reads a ``run_eval.py`` work folder's per-method score matrices (``scores_*.npy``, every query x
every training document) and reports, per method and query kind, recall at 1 and 10 over every fact,
over the facts whose answer no other fact has, and over those whose answer another fact has; and for
each paraphrase missed, what filled its top 10 (copies of facts with the same answer, the same
sentence but for the name, or other documents).

    python -m bench.attribution.planted_answers --work runs/bench_lds_seed3 --work runs/bench_lds_seed4 \\
        --work runs/bench_lds_fresh      # -> bench/results/planted_answers.json

The matrices are the ones ``run_eval.py`` wrote (its ``canary_recall_*`` keys come from the same
``rank_of``). ``--exact cosine_max,cosine_match`` also scores the planted queries exactly with the
work folder's index under those served aggregations (one exact pass over the corpus for all of them;
``run_eval.py`` keeps only ``cosine_max`` among the served ones) and saves them beside the others as
``scores_prism_exact_<aggregation>.npy`` (held-out rows left 0: not used here).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np

from bench._common import finish
from bench.attribution.run_eval import rank_of, summarise

METHODS = {"prism_fast": "scores_prism_fast.npy", "prism_exact": "scores_prism_exact.npy",
           "prism_exact_cosine_max": "scores_prism_exact_cosine_max.npy",
           "prism_exact_cosine_match": "scores_prism_exact_cosine_match.npy",
           "ekfac": "scores_ekfac.npy", "bm25": "scores_bm25.npy", "trak": "scores_trak.npy",
           "bergson": "scores_bergson.npy"}


def exact_planted(work: Path, aggregations: list[str]) -> None:
    """Each planted query's exact document scores under ``aggregations``, from the work folder's index
    (columns: its document ids, the order of ``train.jsonl``), saved as ``scores_prism_exact_<agg>.npy``."""
    from prism_tda.engine import Attributor, QuerySpec

    queries = json.loads((work / "queries.json").read_text())
    att = Attributor.open(work / "index")
    rows = [i for i, q in enumerate(queries) if q["kind"] in ("verbatim", "paraphrase")]
    enc = [att.encode(QuerySpec(queries[i]["prompt"], queries[i]["completion"])) for i in rows]
    scores = att.exact_document_scores(enc, match="cosine_match" in aggregations)
    for agg in aggregations:
        S = np.zeros((len(queries), att.reader.n_docs))
        for i, sc in zip(rows, scores, strict=True):
            S[i] = sc[agg]
        np.save(work / f"scores_prism_exact_{agg}.npy", S)


def fact_of(doc_id: str) -> str | None:
    """The planted fact a document is a copy of (``planted/007#3`` -> ``planted/007``), else None."""
    return doc_id.split("#")[0] if doc_id.startswith("planted/") else None


def sentence_key(text: str, name: str) -> str:
    """A fact's sentence with its invented name blanked: equal keys differ only by the name."""
    return re.sub(re.escape(name), "{e}", text)


def analyse(work: Path) -> dict:
    queries = json.loads((work / "queries.json").read_text())
    ids = [json.loads(line)["id"] for line in (work / "train.jsonl").open()]
    texts = {}
    for line in (work / "corpus.jsonl").open():
        d = json.loads(line)
        if d["id"].startswith("planted/"):
            texts[d["id"]] = d["text"]
    col = {d: i for i, d in enumerate(ids)}
    facts = {q["fact"]: q for q in queries if q["kind"] == "verbatim"}
    answer = {f: q["completion"] for f, q in facts.items()}
    n_answer = Counter(answer.values())
    # the invented name: the verbatim prompt's word that the paraphrase prompt also holds, capitalised
    key = {}
    for f, q in facts.items():
        para = next(p for p in queries if p["kind"] == "paraphrase" and p["fact"] == f)
        names = [w.strip(",.") for w in q["prompt"].split() if w[:1].isupper() and w.strip(",.") in para["prompt"]
                 and w.strip(",.") not in ("The", "In", "At")]
        text = texts[q["planted"][0]]
        key[f] = sentence_key(text, names[-1]) if names else text
    n_key = Counter(key.values())
    out: dict = {"work": str(work), "facts": len(facts),
                 "facts_with_a_shared_answer": sum(n_answer[a] > 1 for a in answer.values()),
                 "facts_with_a_shared_sentence": sum(n_key[k] > 1 for k in key.values()),
                 "methods": {}}
    for method, fname in METHODS.items():
        path = work / fname
        if not path.exists():
            continue
        S = np.load(path)
        if S.shape != (len(queries), len(ids)):
            continue
        res: dict = {}
        misses = []
        for kind in ("verbatim", "paraphrase"):
            groups: dict[str, list] = {"all": [], "answer_unique": [], "answer_shared": []}
            for i, q in enumerate(queries):
                if q["kind"] != kind:
                    continue
                r = rank_of(S[i], {col[e] for e in q["planted"] if e in col})
                groups["all"].append(r)
                groups["answer_shared" if n_answer[answer[q["fact"]]] > 1 else "answer_unique"].append(r)
                if kind == "paraphrase" and (r is None or r > 10):
                    top = [ids[j] for j in np.argsort(-S[i], kind="stable")[:10]]
                    same_answer = [d for d in top if fact_of(d) and fact_of(d) != q["fact"]
                                   and answer.get(fact_of(d) or "") == q["completion"]]
                    same_sentence = [d for d in same_answer if key.get(fact_of(d) or "") == key[q["fact"]]]
                    misses.append({"fact": q["fact"], "prompt": q["prompt"], "completion": q["completion"],
                                   "rank": r, "top10_same_answer_other_fact": len(same_answer),
                                   "top10_same_sentence_other_name": len(same_sentence)})
            res[kind] = {g: summarise(v) if v else None for g, v in groups.items()}  # None: no such fact
        res["paraphrase_misses"] = misses
        res["paraphrase_misses_whose_top10_is_other_facts_with_its_answer"] = sum(
            m["top10_same_answer_other_fact"] == 10 for m in misses)
        out["methods"][method] = res
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", action="append", required=True, help="a run_eval.py work folder (repeatable)")
    ap.add_argument("--out", default="bench/results/planted_answers.json")
    ap.add_argument("--exact", default="", help="served aggregations to score the planted queries exactly with "
                                                "each folder's index first, comma-separated (e.g. cosine_max,cosine_match)")
    args = ap.parse_args(argv)
    if args.exact:
        for w in args.work:
            exact_planted(Path(w), args.exact.split(","))
    res = {"splits": [analyse(Path(w)) for w in args.work]}
    return finish(res, "attribution/planted_answers.py", argv, args.out, hide=("splits",))


if __name__ == "__main__":
    main()
