"""LDS of the fast path's answer under rules for which documents keep their ``value``.

Every document an answer returns carries its ``value``: its tokens' raw prototype-space influences
summed over every token of it (docs/attribution.md, "A document's value"). ``influence_lds.py``
measures it at one answer size (64 documents). This measures the rules a served answer could apply
to those values, each from the same answers, one query at a time:

- ``value_k``: the first ``k`` documents by score, each with its value (0 elsewhere);
- ``value_pos_k``: the same, less the documents whose value is <= 0 (summed over the whole document,
  training on them raised the query's loss: not documents that drove the output);
- ``value_pos_fill_k``: the first ``k`` documents by score *whose value is positive*, read from the
  answer of the largest ``k`` asked (the same order, deeper), so the answer keeps ``k`` documents;
- ``score_k``: the first ``k`` documents' scores (as ``lds_prism_fast`` at ``k``).

Each row: LDS with its 95% interval, the paired difference against EK-FAC over every document, and
the paired difference against ``value_64`` (what an answer carries now), on the same draws. The
guard: the verbatim facts' planted copy first in each rule's order (the positive rules drop
documents, so a planted copy with a value <= 0 would lose its place), and every planted fact asked as
served (10 documents), verbatim and paraphrased, with the rule and with ``keep_opposed``.

    python -m bench.attribution.value_rules --work runs/bench_lds_tune9 --subsets 16 --split all --seed 9 \\
        --out runs/value_rules_tune9.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench._common import finish, index_documents
from bench.attribution.influence_lds import reference
from bench.attribution.lds_report import add_folder_args, interval


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_folder_args(ap)
    ap.add_argument("--ks", default="64,128,256", help="answer sizes (documents returned), comma-separated")
    ap.add_argument("--served-damping", type=float, default=0.01,
                    help="the fast path's curvature damping (the served setting)")
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--out", default="bench/results/attribution_value_rules.json")
    args = ap.parse_args(argv)
    import torch

    from prism_tda.engine import Attributor, QueryOptions, QuerySpec
    from prism_tda.engine.present import left_out_opposed

    torch.set_num_threads(2)
    ks = sorted({int(k) for k in args.ks.split(",")})
    work, queries, E, split = reference(args)
    n_q, n_docs = E.shape
    att = Attributor.open(work / "index")
    # per k: each query's answer (doc ids in the served order, scores, values)
    answers: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {k: [None] * n_q for k in ks}  # type: ignore[list-item]
    seconds: dict[int, list[float]] = {k: [] for k in ks}
    for n, i in enumerate(split.queries):
        spec = QuerySpec(queries[i]["prompt"], queries[i]["completion"])
        for k in ks:
            t0 = time.perf_counter()
            res = att.attribute(spec, QueryOptions(n_documents=k, exact_rerank=max(32, k), damping=args.served_damping,
                                                   keep_opposed=True))
            seconds[k].append(time.perf_counter() - t0)
            answers[k][i] = (np.array([d.doc_id for d in res.documents], np.int64),
                             np.array([d.score for d in res.documents]), np.array([d.value for d in res.documents]))
        if n % 50 == 0:
            print(f"{n}/{len(split.queries)} queries", flush=True)

    def matrix(pick) -> np.ndarray:
        """(queries, documents): ``pick(query)`` -> (document ids, entries) per query, 0 elsewhere."""
        M = np.zeros((n_q, n_docs))
        for i in split.queries:
            ids, vals = pick(i)
            M[i, ids] = vals
        return M

    rules: dict[str, np.ndarray] = {}
    deepest = ks[-1]
    for k in ks:
        rules[f"score_{k}"] = matrix(lambda i, k=k: answers[k][i][:2])
        rules[f"value_{k}"] = matrix(lambda i, k=k: (answers[k][i][0], answers[k][i][2]))
        rules[f"value_pos_{k}"] = matrix(lambda i, k=k: (answers[k][i][0], np.maximum(answers[k][i][2], 0.0)))
        if k < deepest:
            def fill(i: int, k: int = k) -> tuple[np.ndarray, np.ndarray]:
                ids, _, vals = answers[deepest][i]
                pos = np.flatnonzero(vals > 0)[:k]
                return ids[pos], vals[pos]
            rules[f"value_pos_fill_{k}"] = matrix(fill)

    draws = split.draws(args.boot, args.seed + 11)
    boots = {name: split.boot(M, draws) for name, M in rules.items()}
    points = {name: split.lds(M) for name, M in rules.items()}
    ref_point, ref_b = split.lds(E), split.boot(E, draws)
    base = f"value_{ks[0]}"
    rows = {name: {"lds": interval(points[name], boots[name]),
                   "diff_vs_ekfac_all": interval(points[name] - ref_point, boots[name] - ref_b),
                   f"diff_vs_{base}": interval(points[name] - points[base], boots[name] - boots[base])}
            for name in rules}

    # the guard: each verbatim fact's planted copy first in each rule's order
    docs_t = index_documents(work / "index", ["doc_id", "external_id"])
    ext_to_doc = dict(zip(docs_t["external_id"], docs_t["doc_id"], strict=True))
    verbatim = [i for i in split.queries if queries[i]["kind"] == "verbatim"]
    guard, planted_value_pos = {}, []
    for k in ks:
        first, first_pos = [], []
        for i in verbatim:
            ids, _, vals = answers[k][i]
            planted = {ext_to_doc[e] for e in queries[i]["planted"]}
            first.append(len(ids) > 0 and int(ids[0]) in planted)
            pos = ids[vals > 0]
            first_pos.append(len(pos) > 0 and int(pos[0]) in planted)
            if k == ks[0]:
                planted_value_pos += [bool(v > 0) for d, v in zip(ids, vals, strict=True) if int(d) in planted]
        guard[f"verbatim_r1_by_score_{k}"] = round(float(np.mean(first)), 4)
        guard[f"verbatim_r1_positive_only_{k}"] = round(float(np.mean(first_pos)), 4)
    guard["planted_copies_with_positive_value"] = round(float(np.mean(planted_value_pos)), 4)
    # planted facts asked as served (10 documents, the index's defaults), with and without the rule:
    # recall at 10 and the share of facts whose copy is first
    for kind in ("verbatim", "paraphrase"):
        asked = [q for q in queries if q["kind"] == kind]
        found: dict[str, list[tuple[bool, bool]]] = {"served": [], "keep_opposed": []}
        for q in asked:
            every = att.attribute(QuerySpec(q["prompt"], q["completion"]), QueryOptions(keep_opposed=True)).documents
            served, _ = left_out_opposed(every, [d.value for d in every])  # the served rule
            planted = {ext_to_doc[e] for e in q["planted"]}
            for rule, docs in (("served", served), ("keep_opposed", every)):
                ids = [d.doc_id for d in docs]
                found[rule].append((bool(planted & set(ids)), bool(ids) and ids[0] in planted))
        for rule, got in found.items():
            guard[f"canary_recall_at_10_{kind}_{rule}"] = round(float(np.mean([h for h, _ in got])), 4)
            guard[f"canary_r1_{kind}_{rule}"] = round(float(np.mean([f for _, f in got])), 4)
    negative_share = {k: round(float(np.mean([np.mean(answers[k][i][2] <= 0) for i in split.queries])), 4) for k in ks}
    res = {"work": str(work), "split": args.split, "subsets": len(split.L), "queries": len(split.queries),
           "documents": n_docs, "served_damping": args.served_damping, "ks": ks,
           "ekfac_all": {"lds": interval(ref_point, ref_b)}, "rules": rows, "guard": guard,
           "share_of_returned_with_value_le_0": negative_share,
           "seconds_per_query_median": {k: round(float(np.median(v)), 4) for k, v in seconds.items()}}
    return finish(res, "attribution/value_rules.py", argv, args.out)


if __name__ == "__main__":
    main()
