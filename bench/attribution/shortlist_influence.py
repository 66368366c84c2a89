"""Does PRISM's shortlist hold the documents that carry EK-FAC's LDS? (the LDS issue: where the gap is)

PRISM ranks the training documents by the best token's cosine in prototype space (the guard: a
memorised fact's source first); its LDS stays below EK-FAC's. Two explanations predict different
fixes:

- the *set*: the documents that move the query's loss when removed are not among PRISM's best k, so
  no re-scoring of the shortlist can recover them;
- the *values*: they are among the best k, but PRISM's scores (a ranking score restricted to the
  prototype head) predict their effect worse than a full-model influence does; then a deeper value
  estimate computed for the shortlisted documents only (their gradients through the whole network,
  preconditioned as EK-FAC does) would recover EK-FAC's LDS at the cost of k documents, not N.

From a ``run_eval.py`` work folder (PRISM's exact scores at the index's settings and EK-FAC's, every
query x document pair) this measures LDS on the *tuning split* (the first ``--tune-subsets`` subsets
and the tuning half of the LDS queries, as ``lds_report.py`` splits them), or with ``--split all`` on
every subset and LDS query of a fresh folder that nothing was chosen on, for:

- ``ekfac_all``: EK-FAC's scores of every document (the reference);
- ``ekfac_own_top{k}``: EK-FAC's own best k keep their scores, the rest 0;
- ``ekfac_on_prism_top{k}``: **EK-FAC's scores of PRISM's best k** (the rest 0): the list as PRISM
  orders it, each document's value a full-model influence (primary setting: k = 64, what the fast path
  returns at its served setting, fixed before the run);
- ``prism_top{k}``: PRISM's own scores of its best k;
- ``prism_raw_on_prism_top{k}``: PRISM's summed raw influence (every token of the document, prototype
  head only) of its best k: a value the engine could compute for the shortlisted documents without
  going deeper into the model;

with paired bootstrap differences against ``ekfac_all`` (draws resample subsets and queries), the
overlap of the two methods' best k, and the guard (verbatim facts' planted copy ranked first by
PRISM's order, by EK-FAC's). With ``--time-queries N`` it also times what such a value costs: for N
tuning queries, EK-FAC (the work folder's fitted factors) scores one query against the sequences of
PRISM's best k documents only, against every sequence, and checks the restricted scores against
the full run's.

    python -m bench.attribution.shortlist_influence --work runs/bench_lds_fresh --subsets 16 --tune-subsets 16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from bench._common import finish, index_documents
from bench.attribution.lds_report import add_folder_args, against, folder_split, on_best, top_only
from bench.attribution.run_eval import rank_of

PRIMARY_K = 64


def overlap_at(a: np.ndarray, b: np.ndarray, k: int, rows: np.ndarray) -> float:
    ta = np.argsort(-a[rows], axis=1, kind="stable")[:, :k]
    tb = np.argsort(-b[rows], axis=1, kind="stable")[:, :k]
    return float(np.mean([len(set(x) & set(y)) / k for x, y in zip(ta, tb, strict=True)]))


def time_shortlist(work: Path, P: np.ndarray, queries: list[dict], rows: list[int], ks: list[int]) -> dict:
    """Seconds for EK-FAC to score one query against the sequences of PRISM's best k documents (and
    against all), from the factors ``run_eval.py`` fitted, and the largest difference of those
    documents' scores from the full run's (relative to the query's largest score)."""
    import time

    import torch
    from kronfluence.arguments import ScoreArguments
    from torch.utils.data import Subset

    from bench._common import index_sequences
    from bench.attribution.baselines import TokenDataset, ekfac_analyzer
    from prism_tda.engine import layout as store
    from prism_tda.model import checkpoint as ckpt

    torch.set_num_threads(2)
    index_dir = work / "index"
    manifest = store.read_manifest(index_dir)
    assert manifest is not None, index_dir
    model, _, _ = ckpt.load_checkpoint(manifest.checkpoint)
    seqs = index_sequences(index_dir)
    seq_doc = np.asarray(seqs["doc_id"])
    block = model.cfg.block_size
    train = TokenDataset.from_sequences(seqs["token_ids"], seqs["target_ids"], block)
    qds = TokenDataset.from_queries([(q["prompt_ids"], q["completion_ids"]) for q in queries], block)
    full = np.load(work / "scores_ekfac.npy")
    an = ekfac_analyzer(model, work / "ekfac_store")
    out: dict = {}
    for k in [*ks, None]:
        secs, errs, n_seqs = [], [], []
        for i in rows:
            docs = np.argsort(-P[i], kind="stable")[:k] if k else np.arange(P.shape[1])
            idx = np.nonzero(np.isin(seq_doc, docs))[0]
            t0 = time.perf_counter()
            an.compute_pairwise_scores("shortlist", "ekfac", Subset(qds, [i]), Subset(train, idx.tolist()),
                                       per_device_query_batch_size=1, per_device_train_batch_size=16,
                                       score_args=ScoreArguments(), overwrite_output_dir=True)
            secs.append(time.perf_counter() - t0)
            s = an.load_pairwise_scores("shortlist")["all_modules"].float().numpy()[0]
            doc_s = np.bincount(seq_doc[idx], weights=s, minlength=P.shape[1])
            errs.append(float(np.abs(doc_s[docs] - full[i, docs]).max() / max(np.abs(full[i]).max(), 1e-30)))
            n_seqs.append(len(idx))
        out[str(k or "all")] = {"seconds_per_query_median": round(float(np.median(secs)), 3),
                                "sequences_mean": float(np.mean(n_seqs)),
                                "max_relative_difference_from_full_run": float(np.max(errs))}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_folder_args(ap)
    ap.add_argument("--prism", default="scores_prism_exact.npy", help="PRISM's scores in the work folder")
    ap.add_argument("--ks", default="16,32,64,128,256")
    ap.add_argument("--boot", type=int, default=1000)
    ap.add_argument("--time-queries", type=int, default=0, help="time EK-FAC on the shortlist for this many queries")
    ap.add_argument("--out", default="bench/results/attribution_shortlist_influence.json")
    args = ap.parse_args(argv)
    work = Path(args.work)
    queries = json.loads((work / "queries.json").read_text())
    P = np.load(work / args.prism).astype(np.float64)
    E = np.load(work / "scores_ekfac.npy").astype(np.float64)
    R = np.load(work / "scores_prism_exact_raw_sum.npy").astype(np.float64)
    n_docs = P.shape[1]
    split = folder_split(work, queries, n_docs, args.subsets, args.tune_subsets, args.seed, args.split)
    row = against(split, E, args.boot, args.seed + 11)

    res: dict = {"work": str(work), "documents": n_docs,
                 "split": args.split,
                 "subsets": len(split.L), "queries": len(split.queries),
                 "primary": f"ekfac_on_prism_top{PRIMARY_K}", "ekfac_all": row(E), "by_k": {}}
    for k in (int(x) for x in args.ks.split(",")):
        res["by_k"][k] = {"ekfac_on_prism": row(on_best(E, P, k)), "ekfac_own": row(top_only(E, k)),
                          "prism": row(top_only(P, k)), "prism_raw_on_prism": row(on_best(R, P, k)),
                          "overlap_prism_ekfac": round(overlap_at(P, E, k, split.queries), 4)}
    # the guard, on the split's verbatim facts: the planted copy first in the list's order
    docs = index_documents(work / "index", ["doc_id", "external_id"])
    ext_to_doc = dict(zip(docs["external_id"], docs["doc_id"], strict=True))
    verbatim = [i for i in split.queries if queries[i]["kind"] == "verbatim"]
    for name, S in (("prism_order", P), ("ekfac_order", E)):
        res[f"verbatim_r1_{name}"] = float(np.mean([rank_of(S[i], {ext_to_doc[e] for e in queries[i]["planted"]}) == 1
                                                    for i in verbatim]))
    if args.time_queries:
        res["ekfac_on_shortlist_cost"] = time_shortlist(work, P, queries, split.queries[: args.time_queries].tolist(),
                                                        [PRIMARY_K, 128])
    return finish(res, "attribution/shortlist_influence.py", argv, args.out)


if __name__ == "__main__":
    main()
