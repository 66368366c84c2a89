"""Which of the backbone's layers carry the `influence` option's LDS: the full-model value split by
layer, scored as subsets of the layers.

The option's value of a document is a sum over the tracked linear layers, ``I(q, x) = sum_l <P_l,
G_l(x)>`` (``engine/influence.py``), so one pass over the returned documents gives every layer's
term, and any subset of layers is a sum of those terms: the LDS a cheaper option would reach by
tracking fewer layers (a backward pass that stops at the earliest tracked block) is measured here
without building it. For each LDS query of the split, the first ``--k`` documents by score (the
``influence`` option's rule: none left out first), then per subset the documents whose subset value
opposes the output are left out, as the option does with the whole sum. Subsets: every layer (the
option as served), each block alone, the last ``n`` blocks, attention or MLP layers only, and none (the
score); with paired differences against every layer and against EK-FAC over every document. Then the cost:
the option's values timed tracking only each subset (``engine/influence.py``'s backward pass stops at
the earliest tracked layer), on ``--cost-queries`` queries of the split.

    python -m bench.attribution.influence_layers --work runs/bench_lds_tune9 --subsets 16 --split all --seed 9
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator

import numpy as np

from bench._common import finish
from bench.attribution.influence_lds import reference
from bench.attribution.lds_report import add_folder_args, against


def subsets_of(layers: list[str]) -> dict[str, list[str]]:
    """Named subsets of the tracked layers (``blocks.{b}.{attn.qkv,attn.proj,mlp.fc,mlp.proj}``)."""
    blocks = sorted({int(n.split(".")[1]) for n in layers})
    out = {"all": list(layers)}
    for b in blocks:
        out[f"block_{b}"] = [n for n in layers if int(n.split(".")[1]) == b]
    for n_last in range(2, len(blocks)):
        out[f"last_{n_last}_blocks"] = [n for n in layers if int(n.split(".")[1]) >= blocks[-n_last]]
    out["attention"] = [n for n in layers if ".attn." in n]
    out["mlp"] = [n for n in layers if ".mlp." in n]
    out["last_block_output_projections"] = [n for n in layers if int(n.split(".")[1]) == blocks[-1]
                                            and n.endswith(".proj")]
    return out


@contextlib.contextmanager
def tracking_only(names: list[str]) -> Iterator[None]:
    """``engine/influence.py`` tracking only the layers ``names``: its backward pass then stops at the
    earliest of them (autograd runs only what leads to the outputs it is asked for)."""
    import prism_tda.engine.influence as inf

    whole = inf.tracked
    inf.tracked = lambda model: {n: m for n, m in whole(model).items() if n in names}
    try:
        yield
    finally:
        inf.tracked = whole


def cost(att, ek, reader, queries: list[dict], split, returned: np.ndarray, subsets: dict[str, list[str]],
         n_queries: int) -> dict:
    """Milliseconds of the option's values of a query's returned documents tracking each subset of
    layers (``n_queries`` queries of the split, every subset once per query in an alternating order)."""
    from prism_tda.engine import QuerySpec
    from prism_tda.engine.influence import document_influence

    names = [k for k in subsets if k != "attention"]
    times: dict[str, list[float]] = {k: [] for k in names}
    for n, i in enumerate(split.queries[:n_queries]):
        enc = att.encode(QuerySpec(queries[i]["prompt"], queries[i]["completion"]))
        docs = np.nonzero(returned[i])[0]
        for k in names if n % 2 == 0 else names[::-1]:
            with tracking_only(subsets[k]):
                t0 = time.perf_counter()
                document_influence(att.model, ek, reader, enc.token_ids, enc.target_positions, enc.target_ids, docs)
                times[k].append(1e3 * (time.perf_counter() - t0))
    ref = np.asarray(times["all"])
    return {"queries": len(ref), "ms_p50": {k: round(float(np.median(v)), 1) for k, v in times.items()},
            "ratio_to_every_layer_p50": {k: round(float(np.median(np.asarray(v) / ref)), 3) for k, v in times.items()}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_folder_args(ap)
    ap.add_argument("--k", type=int, default=128, help="documents a query returns (the option's setting)")
    ap.add_argument("--served-damping", type=float, default=0.01)
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--cost-queries", type=int, default=24, help="queries timed per subset of layers")
    ap.add_argument("--out", default="bench/results/attribution_influence_layers_tune9.json")
    args = ap.parse_args(argv)
    import torch

    from prism_tda.engine import Attributor, QueryOptions, QuerySpec
    from prism_tda.engine import layout as store
    from prism_tda.engine.arrays import index_in
    from prism_tda.engine.influence import (
        DEFAULT_DAMPING,
        document_sequences,
        fit_index,
        query_gradient,
        sequence_influence,
    )

    torch.set_num_threads(2)
    work, queries, E, split = reference(args)
    n_docs = E.shape[1]
    if not (work / "index" / store.EKFAC).exists():
        fit_index(work / "index", progress=True)
    att = Attributor.open(work / "index")
    ek, reader = att.ekfac(), att.local_reader("influence")
    layers = sorted(ek.qa)
    subsets = subsets_of(layers)
    S = np.zeros((len(queries), n_docs))
    per_layer = {n: np.zeros((len(queries), n_docs)) for n in layers}
    returned = np.zeros((len(queries), n_docs), dtype=bool)
    opt = QueryOptions(n_documents=args.k, exact_rerank=max(32, args.k), damping=args.served_damping,
                       keep_opposed=True)
    t0 = time.perf_counter()
    for n, i in enumerate(split.queries):
        q = queries[i]
        spec = QuerySpec(q["prompt"], q["completion"])
        plain = att.attribute(spec, opt)  # the first k by score
        docs = np.array([d.doc_id for d in plain.documents], np.int64)
        for d in plain.documents:
            S[i, d.doc_id] = d.score
        returned[i, docs] = True
        enc = att.encode(spec)
        P = ek.precondition(query_gradient(att.model, enc.token_ids, enc.target_positions, enc.target_ids),
                            DEFAULT_DAMPING)
        seqs, of = document_sequences(reader, docs)
        rows = sequence_influence(att.model, [{name: P[name]} for name in layers], reader, seqs)  # (layers, seqs)
        for name, r in zip(layers, rows, strict=True):
            per_doc = np.zeros(len(docs))
            np.add.at(per_doc, index_in(docs, of), r)
            per_layer[name][i, docs] = per_doc
        if n % 20 == 0:
            print(f"{n}/{len(split.queries)} queries, {time.perf_counter() - t0:.0f} s", flush=True)
    row = against(split, E, args.boot, args.seed + 11)
    values = {name: sum(per_layer[n] for n in names) for name, names in subsets.items()}
    # each subset as the option would serve it: its own value, the documents it says oppose left out
    served = {name: np.where(returned & (V > 0), V, 0.0) for name, V in values.items()}
    vs_all = against(split, served["all"], args.boot, args.seed + 11)
    rows_out = {}
    for name, V in served.items():
        r, d = row(V), vs_all(V)
        rows_out[name] = {"layers": subsets[name], "lds": r["lds"], "diff_vs_ekfac_all": r["diff_vs_ekfac_all"],
                          "diff_vs_every_layer": d["diff_vs_ekfac_all"],
                          "opposed_share": round(float(((values[name] <= 0) & returned).sum() / returned.sum()), 4)}
    res = {"work": str(work), "split": args.split, "subsets": len(split.L), "queries": len(split.queries),
           "returned": args.k, "influence_damping": DEFAULT_DAMPING, "layers": layers,
           "score": row(S), "ekfac_all": row(E), "by_layers": rows_out,
           "seconds": round(time.perf_counter() - t0, 1),
           "cost": cost(att, ek, reader, queries, split, returned, subsets, args.cost_queries)}
    return finish(res, "attribution/influence_layers.py", argv, args.out)


if __name__ == "__main__":
    main()
