"""Why exact top 10s tie at scale, and which document score separates them (issue: decisive rankings).

One exact pass of the model over every token of an index, for many queries at once, keeps every
token's exact score (``raw`` s_t, its cosine, ``I(t, t)``) where it is not zero, and per document the
norm of its whole gradient in prototype space (``I(D, D) = sum_i ||sum_{t in D} a_{t,i} Q^T u_t||^2``
under the curvature: the cross terms between the document's tokens included). From those it ranks
the documents under candidate scores:

- ``cosine_max`` (served default), ``cosine_sum``, ``raw_max``, ``raw_sum``: as served;
- ``cosine_top{m}``: the sum of a document's m best token cosines plus its m most negative ones;
- ``tau_cosine_max_q{p}``: the best token's ``s_t / sqrt(I(q, q) (I(t, t) + tau))``, tau the p-th
  percentile of ``I(t, t)``;
- ``document_cosine``: the cosine between the query gradient and the document's whole gradient,
  ``sum_t s_t / sqrt(I(q, q) I(D, D))`` (the document as one training example);
- ``document_cosine_diag``: the same with ``I(D, D)`` replaced by ``sum_t I(t, t)`` (cross terms
  dropped: what the index can compute from its stored values);

and the served default, ``cosine_max_settled``: ``cosine_max`` whose near-tie at the cut is settled by
the documents' ``cosine_sum`` (``engine/aggregate.py``, ``settle_near_ties``; a near-tie counts only where
the sums leave one), and reports, per score, the share of queries whose exact top 10 is a near-tie (more than 10
documents within 0.1% of the 10th-best score; counted over every document, and over one document
per distinct text), the overlap of its top 10 with ``cosine_max``'s, and for planted facts the rank
of the fact's first copy. It also checks the saturation hypothesis: the best token cosine a query
can reach with a token aligned to one target token j is ``<g_j, G> / (||g_j|| ||G||)``; it reports
the best document's cosine against the largest of those ceilings.

    python -m bench.attribution.near_ties --index runs/scale/prefix_0004 --heldout runs/scale/corpus/part-006.jsonl \\
        --out bench/results/near_ties.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from bench._common import finish, served_ranking
from bench.scale import held_out_queries
from prism_tda.engine import Attributor, QueryOptions, QuerySpec
from prism_tda.engine.exact import ExactBatch, exhaustive
from prism_tda.engine.reads import document_table
from prism_tda.engine.scoring import TargetColumns, match_cosines, score_tokens


def planted_queries(facts_file: Path, ext_ids: set[str], kinds: list[str], n: int | None) -> list[dict]:
    """Planted facts with copies in the index (the ``n`` with the most), each asked as ``kinds``."""
    facts = json.loads(facts_file.read_text())
    facts = sorted(facts, key=lambda f: -len(set(f["doc_ids"]) & ext_ids))[:n]
    out = []
    for f in facts:
        wanted = sorted(set(f["doc_ids"]) & ext_ids)
        if wanted:
            for kind, prompt in ((k, f["prompt"] if k == "verbatim" else f["paraphrase"]) for k in kinds):
                out.append({"id": f["fact_id"], "kind": kind, "prompt": prompt, "completion": f["answer"],
                            "wanted": wanted})
    return out


def exact_pass(att: Attributor, queries: list, batch_size: int = 32) -> tuple[list, np.ndarray, np.ndarray, tuple]:
    """Per query the non-zero tokens (doc, raw, cos, I(t, t)) and per document and target token the
    best cosine with that target token's gradient; per document I(D, D) and sum_t I(t, t)."""
    reader, model = att.reader, att.model
    pre = att.preconditioner(None)
    Q, inv = reader.curv.Q, pre.inv
    K = inv.shape[0]
    n_docs = reader.n_docs
    doc_norm2 = np.zeros(n_docs)
    doc_self_sum = np.zeros(n_docs)
    parts: list[list[tuple]] = [[] for _ in queries]
    match = [np.full((n_docs, q.n_targets), -np.inf) for q in queries]
    match_raw = [np.zeros((n_docs, q.n_targets)) for q in queries]  # per document and target: sum_t s_{t,j}
    cols = [TargetColumns.of(q, pre) for q in queries]
    pending: list[tuple[torch.Tensor, torch.Tensor]] = [(torch.zeros(0, dtype=torch.int64), torch.zeros(0, Q.shape[1]))]
    key_parts: list[tuple[np.ndarray, np.ndarray]] = []  # (document * K + prototype, its part of I(D, D))

    def flush(keys: torch.Tensor, vals: torch.Tensor) -> None:
        uk, invk = torch.unique(keys, return_inverse=True)
        acc = torch.zeros(len(uk), vals.shape[1]).index_add_(0, invk, vals)
        norm2 = ((acc * acc) * inv[uk % K]).sum(1).double().numpy()
        np.add.at(doc_norm2, (uk // K).numpy(), norm2)
        key_parts.append((uk.numpy(), norm2))

    def on(b: ExactBatch) -> None:
        docs, protos, acts, ut, t_self = b.docs, b.protos, b.acts, b.ut, b.t_self
        np.add.at(doc_self_sum, docs, t_self)
        # the documents' whole gradients: sum of a_{t,i} Q^T u_t per (document, prototype); the last
        # document of a batch may go on in the next one
        keys = torch.from_numpy(docs[:, None] * K + protos).flatten()
        vals = (torch.from_numpy(acts)[:, :, None] * ut.float()[:, None, :]).reshape(-1, ut.shape[1])
        keys, vals = torch.cat([pending[0][0], keys]), torch.cat([pending[0][1], vals])
        open_ = keys // K == int(docs[-1])
        flush(keys[~open_], vals[~open_])
        pending[0] = (keys[open_], vals[open_])
        for qi, q in enumerate(queries):
            s = score_tokens(b.rows, protos, acts, ut, t_self, q.G, pre, exact=True)
            nz = s.raw != 0
            parts[qi].append((docs[nz].astype(np.int32), s.raw[nz], s.cos[nz].astype(np.float32),
                              t_self[nz].astype(np.float32)))
            tc = match_cosines(protos, acts, ut, t_self, q, pre, cols[qi])
            np.maximum.at(match[qi], (docs[:, None], np.arange(q.n_targets)[None, :]), tc)
            tr = tc * np.sqrt(np.maximum(cols[qi].self_j, 1e-30)[None, :] * np.maximum(t_self, 1e-30)[:, None])
            np.add.at(match_raw[qi], docs, tr)

    with torch.no_grad():
        exhaustive(model, reader, [], pre, batch_size=batch_size, progress=True, inspect=on)
    flush(*pending[0])
    per_query = [(*(np.concatenate(c) for c in zip(*p, strict=True)), mt, mr, cl)
                 for p, mt, mr, cl in zip(parts, match, match_raw, cols, strict=True)]
    keys = np.concatenate([k for k, _ in key_parts])
    doc_proto = (keys // K, keys % K, np.concatenate([v for _, v in key_parts]))
    return per_query, doc_norm2, doc_self_sum, doc_proto


def group_max(docs: np.ndarray, v: np.ndarray, n: int) -> np.ndarray:
    out = np.full(n, -np.inf)
    np.maximum.at(out, docs, v)
    out[~np.isfinite(out)] = 0.0
    return out


def top_m_signed(docs: np.ndarray, cos: np.ndarray, n: int, m: int) -> np.ndarray:
    """Per document: its m best token cosines plus its m most negative ones (each only if of that sign)."""
    out = np.zeros(n)
    for sign in (1.0, -1.0):
        sel = sign * cos > 0
        d, c = docs[sel], sign * cos[sel]
        order = np.lexsort((-c, d))
        d, c = d[order], c[order]
        start = np.r_[0, np.nonzero(d[1:] != d[:-1])[0] + 1]
        rank = np.arange(len(d)) - np.repeat(start, np.diff(np.r_[start, len(d)]))
        keep = rank < m
        out += sign * np.bincount(d[keep], weights=c[keep], minlength=n)
    return out


def scores_of(tokens: tuple, I_q: float, doc_norm2: np.ndarray, doc_self_sum: np.ndarray, taus: dict,
              n: int, doc_proto: tuple, q_protos: np.ndarray) -> dict[str, np.ndarray]:
    docs, raw, cos, t_self, match, match_raw, cols = tokens
    raw_sum = np.bincount(docs, weights=raw, minlength=n)
    out = {"cosine_max": group_max(docs, cos, n), "cosine_sum": np.bincount(docs, weights=cos, minlength=n),
           "raw_max": group_max(docs, raw, n), "raw_sum": raw_sum}
    for m in (2, 4, 8):
        out[f"cosine_top{m}"] = top_m_signed(docs, cos.astype(np.float64), n, m)
    for name, tau in taus.items():
        out[f"tau_cosine_max_{name}"] = group_max(docs, raw / np.sqrt(I_q * (t_self + tau)), n)
    out["document_cosine"] = raw_sum / np.sqrt(I_q * np.maximum(doc_norm2, 1e-30))
    out["document_cosine_diag"] = raw_sum / np.sqrt(I_q * np.maximum(doc_self_sum, 1e-30))
    # the document's gradient within the query's prototypes only (the rows of G that are not 0)
    d_of, p_of, part = doc_proto
    sel = np.isin(p_of, q_protos)
    in_q = np.bincount(d_of[sel], weights=part[sel], minlength=n)
    out["document_cosine_query_prototypes"] = raw_sum / np.sqrt(I_q * np.maximum(in_q, 1e-30))
    # per target token j: the document's whole gradient within j's prototypes against g_j, averaged
    per_target = []
    for j in range(match_raw.shape[1]):
        pj = np.nonzero(cols.col[j] >= 0)[0]
        selj = np.isin(p_of, pj)
        nj = np.bincount(d_of[selj], weights=part[selj], minlength=n)
        per_target.append(match_raw[:, j] / np.sqrt(max(cols.self_j[j], 1e-30) * np.maximum(nj, 1e-30)))
    out["document_match"] = np.mean(per_target, axis=0)
    m = np.where(np.isfinite(match), match, 0.0)
    out["cosine_match"] = m.mean(1)
    # a token-level score with the whole document's agreement added at a small weight: documents that hold
    # equally well aligned tokens (the plateau) are ordered by how much of the rest of them supports the
    # output, while a document ahead on its tokens by more than the weight times the spread stays ahead
    for base in ("cosine_max", "cosine_match"):
        for lam in COMPOSITE_WEIGHTS:
            for doc in ("document_cosine", "document_cosine_diag"):
                out[f"{base}+{lam:g}*{doc}"] = out[base] + lam * out[doc]
    return out


COMPOSITE_WEIGHTS = (0.01, 0.05, 0.2)  # 0.05 the primary setting, fixed before the run


def near_ties(s: np.ndarray, keep: np.ndarray, k: int = 10) -> int:
    v = np.sort(np.where(keep, s, -np.inf))[::-1]
    kth = float(v[k - 1])
    return int((v >= kth - 1e-3 * abs(kth)).sum()) if np.isfinite(kth) and kth > 0 else 0


SETTLED = "cosine_max_settled"  # the served default: cosine_max, a near-tie at the cut settled by cosine_sum


def fast_overlap(att: Attributor, queries: list[dict], per_query: list[dict], aggregations: list[str],
                 n: int = 10, exact: np.lib.npyio.NpzFile | None = None, ext: np.ndarray | None = None,
                 **options) -> dict:
    """The fast path (as served: default settings unless ``options`` (QueryOptions fields) say
    otherwise, one query at a time, every document allowed) against the exact top 10 of each
    aggregation: strict overlap@10 per query kind, seconds per query and documents re-ranked. With
    ``exact`` (the per-document exact scores ``--arrays`` saved) also the tie-aware agreement: the share of
    the returned documents whose exact score is at least the exact 10th-best one less 0.1% (a document
    tied with the 10th counts as right, whichever of the tied ones either path keeps)."""
    out: dict = {}
    row_of = {str(e): i for i, e in enumerate(ext)} if ext is not None else {}
    for agg in aggregations:
        ov: dict[str, list[float]] = {}
        tied_ok: dict[str, list[float]] = {}
        secs, reranked = [], []
        # the served default (cosine_max, its near-tie at the cut settled) against exact mode's answer;
        # another aggregation by its score alone
        opts = dict(options) if agg == "cosine_max" else {"tie_break": "score", **options}
        ref = SETTLED if agg == "cosine_max" and opts.get("tie_break", "cosine_sum") == "cosine_sum" else agg
        for qi, (q, row) in enumerate(zip(queries, per_query, strict=True)):
            t0 = time.perf_counter()
            res = att.attribute(QuerySpec(q["prompt"], q["completion"]),
                                QueryOptions(n_documents=n, aggregation=agg, include_untrained=True,
                                             keep_opposed=True, **opts))  # the ranking
            secs.append(time.perf_counter() - t0)
            reranked.append(res.documents_reranked)
            got = {d.external_id for d in res.documents}
            ov.setdefault(q["kind"], []).append(len(got & set(row["top10"][ref])) / max(len(row["top10"][ref]), 1))
            if exact is not None and f"{qi}/{agg}" in exact:
                s = exact[f"{qi}/{agg}"]
                kth = float(np.sort(s)[::-1][n - 1])
                ok = [s[row_of[d.external_id]] >= kth - 1e-3 * abs(kth) for d in res.documents]
                tied_ok.setdefault(q["kind"], []).append(float(np.mean(ok)) if ok else 0.0)
        out[agg] = {"against": ref, "overlap_at_10": {k: round(float(np.mean(v)), 3) for k, v in ov.items()},
                    **({"tie_aware_at_10": {k: round(float(np.mean(v)), 3) for k, v in tied_ok.items()}}
                       if tied_ok else {}),
                    "seconds_per_query_median": round(float(np.median(secs)), 3),
                    "documents_reranked_mean": round(float(np.mean(reranked)), 2)}
    return out


def headline(res: dict) -> dict:
    """The issue's keys for the served default (``cosine_max``, a near-tie at the cut settled by the
    documents' summed cosines, when the run has it): the near-tie share over every query, and the fast
    path's strict overlap with exact on held-out queries (as ``bench/scale.py`` counts it)."""
    by_score = res["near_tie_query_share_by_score"]
    res["near_tie_query_share"] = by_score.get(SETTLED, by_score["cosine_max"])
    rows = res.get("per_query", [])
    if rows:  # 95% interval over queries (2,000 seeded resamples)
        name = SETTLED if SETTLED in by_score else "cosine_max"
        tied = np.array([r["near_ties"][name] > 10 for r in rows], dtype=float)
        boot = tied[np.random.default_rng(0).integers(0, len(tied), (2000, len(tied)))].mean(1)
        res["near_tie_query_share_ci95"] = [round(float(np.percentile(boot, q)), 3) for q in (2.5, 97.5)]
    fast = res.get("fast", {}).get("cosine_max")
    if fast and "held_out" in fast["overlap_at_10"]:
        res["overlap_at_10_fast_vs_exact"] = fast["overlap_at_10"]["held_out"]
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", required=True)
    ap.add_argument("--heldout", help="a JSONL file of documents not indexed: held-out queries from it")
    ap.add_argument("--n-heldout", type=int, default=24)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--facts", help="facts.json of planted facts: queries of those whose copies are indexed")
    ap.add_argument("--n-facts", type=int, default=None, help="at most this many facts (those with most copies)")
    ap.add_argument("--planted-kinds", default="verbatim,paraphrase")
    ap.add_argument("--fast", default="cosine_max,cosine_match",
                    help="aggregations to run the fast path with, against their exact top 10")
    ap.add_argument("--variants", type=json.loads, default={},
                    help='JSON {name: {QueryOptions field: value}}: the fast path again under each, beside the '
                         'served default (under "fast_variants")')
    ap.add_argument("--reuse", action="store_true",
                    help="take the exact results from --out (a run with the same arguments) and add the fast path")
    ap.add_argument("--out", default="bench/results/near_ties.json")
    ap.add_argument("--arrays", help="also save every query's per-document scores here (.npz), to try other "
                                     "combinations of them without another exact pass; with --reuse, read "
                                     "them to measure the fast path's tie-aware agreement")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    att = Attributor.open(args.index)
    reader = att.reader
    table = document_table(Path(args.index), ["external_id", "text"])
    ext = np.asarray(table.column("external_id").to_pylist(), dtype=object)
    texts = table.column("text").to_pylist()
    first_of_text = np.zeros(len(ext), dtype=bool)
    first_of_text[np.unique(np.asarray(texts, dtype=object), return_index=True)[1]] = True
    queries = []
    if args.heldout:
        tok_path = Path(att.manifest.checkpoint) / "tokenizer.json"
        queries += [dict(q, kind="held_out")
                    for q in held_out_queries(Path(args.heldout), tok_path, args.n_heldout, seed=args.seed)]
    if args.facts:
        queries += planted_queries(Path(args.facts), set(ext.tolist()), args.planted_kinds.split(","), args.n_facts)
    if args.reuse:
        res = json.loads(Path(args.out).read_text())
        assert [r["id"] for r in res["per_query"]] == [q["id"] for q in queries], "--reuse: other queries"
        saved = np.load(args.arrays) if args.arrays else None
        res["fast"] = fast_overlap(att, queries, res["per_query"], args.fast.split(","), exact=saved, ext=ext)
        res["fast_variants"] = {name: fast_overlap(att, queries, res["per_query"], args.fast.split(","),
                                                   exact=saved, ext=ext, **opts)
                                for name, opts in args.variants.items()}
        return finish(headline(res), "attribution/near_ties.py", argv, args.out, hide=("per_query",))
    encoded = [att.encode(QuerySpec(q["prompt"], q["completion"])) for q in queries]
    pre = att.preconditioner(None)
    t0 = time.perf_counter()
    tokens, doc_norm2, doc_self_sum, doc_proto = exact_pass(att, encoded)
    pass_s = time.perf_counter() - t0
    all_self = np.concatenate([t[3] for t in tokens[:1]])
    taus = {f"q{p}": float(np.percentile(all_self, p)) for p in (50, 90)}
    n = reader.n_docs
    per_query = []
    saved: dict[str, np.ndarray] = {}
    for qi, (q, enc, tok) in enumerate(zip(queries, encoded, tokens, strict=True)):
        I_q = pre.self_influence(enc.G)
        sc = scores_of(tok, I_q, doc_norm2, doc_self_sum, taus, n, doc_proto, enc.prototypes.numpy())
        if args.arrays:
            saved.update({f"{qi}/{name}": v.astype(np.float64) for name, v in sc.items() if "*" not in name})
        # the saturation ceiling: a token aligned with target token j reaches <g_j, G> / (|g_j| |G|)
        ceilings = []
        for j in range(enc.n_targets):
            gj = enc.target_G(j)
            Ij = pre.self_influence(gj)
            if Ij > 0:
                ceilings.append(float((gj * enc.G * pre.inv).sum()) / np.sqrt(Ij * I_q))
        keep_wanted = ~np.isin(ext, q.get("wanted", []))
        row: dict = {"id": q["id"], "kind": q["kind"], "best_cosine": float(sc["cosine_max"].max()),
                     "ceiling_max": max(ceilings) if ceilings else None,
                     "near_ties": {}, "near_ties_distinct": {}, "top10": {}, "rank_of_fact": {}}
        everything = np.ones(n, dtype=bool)
        for name, s in [*sc.items(), (SETTLED, sc["cosine_max"])]:
            if name == SETTLED:
                row["near_ties"][name] = served_ranking(s, sc["cosine_sum"], keep_wanted)[1]
                row["near_ties_distinct"][name] = served_ranking(s, sc["cosine_sum"], keep_wanted & first_of_text)[1]
                ranking = served_ranking(s, sc["cosine_sum"], everything)[0]
            else:
                row["near_ties"][name] = near_ties(s, keep_wanted)
                row["near_ties_distinct"][name] = near_ties(s, keep_wanted & first_of_text)
                ranking = np.argsort(-s, kind="stable")
            row["top10"][name] = [str(ext[d]) for d in ranking[:10] if s[d] > 0]
            if "wanted" in q:
                hits = np.nonzero(np.isin(ext[ranking[:1000]], q["wanted"]))[0]
                row["rank_of_fact"][name] = int(hits[0]) + 1 if len(hits) else None
        per_query.append(row)
    names = list(per_query[0]["near_ties"]) if per_query else []

    def share(key: str, kind: str | None = None) -> dict:
        rows = [r for r in per_query if kind is None or r["kind"] == kind]
        return {nm: round(float(np.mean([r[key][nm] > 10 for r in rows])), 3) for nm in names} if rows else {}

    def overlap_with(ref: str) -> dict:
        return {nm: round(float(np.mean([len(set(r["top10"][nm]) & set(r["top10"][ref])) / 10 for r in per_query])), 3)
                for nm in names}

    def recall(kind: str, k: int) -> dict | None:
        rows = [r for r in per_query if r["kind"] == kind]
        return {nm: round(float(np.mean([(r["rank_of_fact"][nm] or 10**9) <= k for r in rows])), 3)
                for nm in names} if rows else None

    if args.arrays:
        Path(args.arrays).parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(args.arrays, external_id=ext.astype(str), first_of_text=first_of_text,
                            queries=np.asarray(json.dumps([{k: q[k] for k in ("id", "kind", "wanted") if k in q}
                                                           for q in queries])), **saved)
    res = {
        "index": str(args.index), "tokens": reader.n_tokens, "documents": n, "queries": len(queries),
        "exact_pass_seconds": round(pass_s, 1), "taus": taus,
        "near_tie_query_share_by_score": share("near_ties"),
        "near_tie_query_share_distinct_texts": share("near_ties_distinct"),
        "near_tie_query_share_held_out": share("near_ties", "held_out"),
        "near_tie_query_share_distinct_texts_held_out": share("near_ties_distinct", "held_out"),
        "overlap_at_10_with_cosine_max": overlap_with("cosine_max"),
        "overlap_at_10_with_document_cosine": overlap_with("document_cosine"),
        **{f"{kind}_recall_at_{k}": recall(kind, k) for kind in ("verbatim", "paraphrase") for k in (1, 10)},
        "best_cosine_over_ceiling": [round(r["best_cosine"] / r["ceiling_max"], 4) for r in per_query
                                     if r["ceiling_max"]],
        "per_query": per_query,
    }
    if args.fast:
        res["fast"] = fast_overlap(att, queries, per_query, args.fast.split(","))
        res["fast_variants"] = {name: fast_overlap(att, queries, per_query, args.fast.split(","), **opts)
                                for name, opts in args.variants.items()}
    return finish(headline(res), "attribution/near_ties.py", argv, args.out, hide=("per_query",))


if __name__ == "__main__":
    main()
