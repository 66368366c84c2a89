"""Could the `influence` option's gain be served without a pass over the returned documents? A direction
check of per-document gradient sketches of the last block, stored as an index would store them.

``influence_layers.py`` found the option's LDS gain in the MLP layers, most of it in the last block
alone; every exact form of it needs a forward pass over the returned documents' windows. Here each
document instead keeps, per tracked layer of the last block, a ``r x r`` sketch of its summed
gradient in the layer's EK-FAC eigenbasis,

    K(x) = A_S D_S^-1/2 Q_S^T (sum_t g_t a_t^T) Q_A D_A^-1/2 A_A^T

(``A_S``, ``A_A``: seeded Gaussian ``r x d`` matrices scaled by ``1/sqrt(r)``; ``D_S``, ``D_A``: the row and
column means of the layer's corrected eigenvalues, a separable half of the whitening, so that both
sides of the product carry a similar norm). Per token it is an outer product of two short vectors,
so an indexer that kept ``a_t`` and ``g_t`` of the last block could accumulate it per document. A
query's value of a document is ``sum_l <A_S D_S^1/2 R_l(q) / (Lambda_l + lambda_l) D_A^1/2 A_A^T, K_l(x)>``,
``R_l(q)`` its gradient in the eigenbasis: without the sketch (r = d) exactly the option's value over
those layers, with it an unbiased estimate.

For each LDS query of the split, the first ``--k`` documents by score (the option's rule), their
values by each sketch size (the documents whose value opposes the output left out), beside the exact
value over the same layers and over every layer, the score, and EK-FAC over every document. One pass
with a backward over every window of the corpus builds the sketches (timed: the cost an indexer would
add on top of its forward). A check first: at full rank and without projection the sketch's values
equal the exact ones on the first query's documents.

    python -m bench.attribution.gradient_sketch --work runs/bench_lds_tune9 --subsets 16 --split all --seed 9
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench._common import finish
from bench.attribution.influence_layers import tracking_only
from bench.attribution.influence_lds import reference
from bench.attribution.lds_report import add_folder_args, against


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_folder_args(ap)
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--served-damping", type=float, default=0.01)
    ap.add_argument("--ranks", default="8,16,32", help="sketch sizes r (r x r numbers per layer and document)")
    ap.add_argument("--layers", default="last_block_output_projections",
                    help="last_block_output_projections or last_block")
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--sketch-seed", type=int, default=0)
    ap.add_argument("--kind", choices=("random", "top"), default="random",
                    help="random: Gaussian sketches; top: the r eigen-directions of each factor with the largest "
                         "mean corrected eigenvalue (a truncation, no noise)")
    ap.add_argument("--out", default="bench/results/attribution_gradient_sketch_tune9.json")
    args = ap.parse_args(argv)
    import torch

    import prism_tda.engine.influence as inf
    from prism_tda.engine import Attributor, QueryOptions, QuerySpec
    from prism_tda.engine.arrays import index_in

    torch.set_num_threads(2)
    work, queries, E, split = reference(args)
    n_docs = E.shape[1]
    att = Attributor.open(work / "index")
    ek, reader, model = att.ekfac(), att.local_reader("sketch"), att.model
    last = max(int(n.split(".")[1]) for n in ek.qa)
    layers = [n for n in sorted(ek.qa) if n.startswith(f"blocks.{last}.")
              and (args.layers == "last_block" or n.endswith(".proj"))]
    ranks = sorted(int(r) for r in args.ranks.split(","))
    rmax = ranks[-1]
    gen = torch.Generator().manual_seed(args.sketch_seed)
    half, A = {}, {}
    for n in layers:
        lam = ek.lam[n].double()
        half[n] = (lam.mean(1).clamp_min(1e-30).sqrt(), lam.mean(0).clamp_min(1e-30).sqrt())  # D_S^1/2, D_A^1/2
        if args.kind == "random":
            A[n] = (torch.randn(rmax, lam.shape[0], generator=gen, dtype=torch.float64),
                    torch.randn(rmax, lam.shape[1], generator=gen, dtype=torch.float64))
        else:  # the eigen-directions of largest mean corrected eigenvalue, rows of the identity (no scaling)
            A[n] = tuple(torch.eye(len(m), dtype=torch.float64)[torch.argsort(m, descending=True)[:rmax]]
                         * np.sqrt(rmax) for m in (lam.mean(1), lam.mean(0)))

    def whitened(n: str, g: torch.Tensor, a: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's output gradients (B, T, d_out) and inputs (B, T, d_in) of layer ``n`` at its real
        positions, in the layer's eigenbasis and half-whitened (``D_S^-1/2 Q_S^T g``, ``D_A^-1/2 Q_A^T a``)."""
        w = mask[..., None].to(torch.float64)
        ds, da = half[n]
        return (g.double() * w @ ek.qs[n].double()) / ds, (a.double() * w @ ek.qa[n].double()) / da

    def query_side(n: str, G: torch.Tensor, r: int | None, damping: float) -> torch.Tensor:
        qa, qs, lam = ek.qa[n].double(), ek.qs[n].double(), ek.lam[n].double()
        R = qs.T @ G.double() @ qa / (lam + damping * lam.mean())
        ds, da = half[n]
        W = ds[:, None] * R * da[None, :]
        return W if r is None else (A[n][0][:r] @ W @ A[n][1][:r].T) / r

    # the sketches of every document: one pass with a backward over every window of the corpus
    t0 = time.perf_counter()
    all_seqs = np.arange(reader.n_seqs)
    of_seq = reader.doc_of_seqs(all_seqs)
    K = {r: {n: torch.zeros(n_docs, r, r, dtype=torch.float64) for n in layers} for r in ranks}
    with tracking_only(layers), inf.captured(model) as cap, torch.enable_grad():
        for x, y, mask, at in inf._batches(reader, all_seqs, 32 * model.cfg.block_size):
            cap.backward(inf._loss(model, x, y, mask))
            d = torch.from_numpy(of_seq[at])
            for n in layers:
                gw, aw = whitened(n, cap.g[n], cap.a[n], mask)
                sg, sa = gw @ A[n][0].T, aw @ A[n][1].T  # the largest sketch; smaller ones are its leading rows
                for r in ranks:
                    K[r][n].index_add_(0, d, torch.einsum("bti,btj->bij", sg[..., :r], sa[..., :r]) / r)
    build_s = time.perf_counter() - t0

    opt = QueryOptions(n_documents=args.k, exact_rerank=max(32, args.k), damping=args.served_damping,
                       keep_opposed=True)
    S = np.zeros((len(queries), n_docs))
    exact_sub, exact_all = np.zeros_like(S), np.zeros_like(S)
    sk = {r: np.zeros_like(S) for r in ranks}
    returned = np.zeros(S.shape, dtype=bool)
    check = None
    for n_q, i in enumerate(split.queries):
        q = queries[i]
        spec = QuerySpec(q["prompt"], q["completion"])
        plain = att.attribute(spec, opt)
        docs = np.array([d.doc_id for d in plain.documents], np.int64)
        for d in plain.documents:
            S[i, d.doc_id] = d.score
        returned[i, docs] = True
        enc = att.encode(spec)
        G = inf.query_gradient(model, enc.token_ids, enc.target_positions, enc.target_ids)
        P = ek.precondition(G, inf.DEFAULT_DAMPING)
        seqs, of = inf.document_sequences(reader, docs)
        rows = inf.sequence_influence(model, [{n: P[n] for n in layers}, P], reader, seqs)
        for out, r_ in zip((exact_sub, exact_all), rows, strict=True):
            per = np.zeros(len(docs))
            np.add.at(per, index_in(docs, of), r_)
            out[i, docs] = per
        dd = torch.from_numpy(docs)
        for r in ranks:
            v = sum((K[r][n][dd] * query_side(n, G[n], r, inf.DEFAULT_DAMPING)).sum((1, 2)) for n in layers)
            sk[r][i, docs] = v.numpy()
        if check is None:  # full rank, no projection: the sketch's algebra gives the exact value
            with tracking_only(layers), inf.captured(model) as cap, torch.enable_grad():
                full = np.zeros(len(docs))
                for x, y, mask, at in inf._batches(reader, seqs, 32 * model.cfg.block_size):
                    cap.backward(inf._loss(model, x, y, mask))
                    v = sum((torch.einsum("bti,btj->bij", *whitened(n, cap.g[n], cap.a[n], mask))
                             * query_side(n, G[n], None, inf.DEFAULT_DAMPING)).sum((1, 2)) for n in layers)
                    np.add.at(full, index_in(docs, of[at]), v.numpy())
            scale = float(np.abs(exact_sub[i, docs]).max())
            check = float(np.abs(full - exact_sub[i, docs]).max() / scale)
            if check > 1e-4:
                raise SystemExit(f"the sketch's algebra does not give the exact value: relative error {check:.2e}")
        if n_q % 20 == 0:
            print(f"{n_q}/{len(split.queries)} queries", flush=True)
    row = against(split, E, args.boot, args.seed + 11)

    def served(V: np.ndarray) -> np.ndarray:
        return np.where(returned & (V > 0), V, 0.0)

    vs_sub = against(split, served(exact_sub), args.boot, args.seed + 11)
    by_rank = {}
    for r in ranks:
        rr = row(served(sk[r]))
        agree = [float(np.corrcoef(sk[r][i, returned[i]], exact_sub[i, returned[i]])[0, 1]) for i in split.queries
                 if returned[i].sum() > 2]
        by_rank[str(r)] = {"numbers_per_document": r * r * len(layers), **rr,
                           "diff_vs_exact_same_layers": vs_sub(served(sk[r]))["diff_vs_ekfac_all"],
                           "pearson_with_exact_median": round(float(np.median(agree)), 4)}
    res = {"work": str(work), "split": args.split, "subsets": len(split.L), "queries": len(split.queries),
           "returned": args.k, "layers": layers, "ranks": ranks, "full_rank_check_rel_err": check,
           "score": row(S), "ekfac_all": row(E), "exact_every_layer": row(served(exact_all)),
           "exact_same_layers": row(served(exact_sub)), "sketch": by_rank,
           "sketch_build_seconds": round(build_s, 1), "corpus_tokens": int(reader.n_tokens)}
    return finish(res, "attribution/gradient_sketch.py", argv, args.out)


if __name__ == "__main__":
    main()
