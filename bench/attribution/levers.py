"""LDS levers on the tuning split: damping, aggregation, more of the model (issue: LDS at or above EK-FAC).

Reads a finished ``run_eval.py`` work folder (its index, queries and retrained subsets) and scores
every (query, document) pair exactly under each lever, on the tuning split of ``lds_report.py``
only (its first ``--tune-subsets`` subsets and its tuning half of the LDS queries). One pass of the
model over the corpus keeps, for every training token:

- its prototype-space quantities, as the exact path computes them (``engine/tokens.py``): active
  prototypes, activations, ``Q^T u_t``;
- for each output projection of the last block (``mlp.proj`` and ``attn.proj``), the projection's
  input ``h_t`` and the gradient of the token's own loss at its output ``delta_t``. The token's
  gradient for that weight is the outer product ``delta_t h_t^T``: after the last block every
  operation is per position, so one backward of ``sum_t <u_t, z_t>`` gives every token's own
  ``delta_t`` at once (a served re-rank can get it in closed form: the final norm's and the MLP's
  Jacobians per position; here autograd computes it).

Each projection's curvature is EK-FAC over the training tokens (Kronecker eigenbases of
``E[h h^T]`` and ``E[delta delta^T]``, eigenvalues corrected with the tokens' own rank-one
gradients, ``Lambda_ab = mean_t (delta'_ta h'_tb)^2``), damped at 1.0 x its mean eigenvalue as the
prototype blocks are. Parameter groups are independent blocks of the curvature, so a token's score
and self-influence are sums over the groups, and every aggregation applies to them unchanged.

Levers, each with its primary setting fixed before any number was seen (the rest are its ablation):

1. damping: relative to each prototype's own mean eigenvalue, ``lambda_i = c m~_i``,
   ``m~_i = (n_i m_i + n0 m) / (n_i + n0)`` (``n_i`` tokens where prototype i is active, ``m`` the
   mean over used prototypes, ``n0`` a tenth of the mean ``n_i``): primary c = 0.03; also c = 0.01,
   0.1, and the global damping at 0.1, 0.3 (index default 1.0);
2. aggregation: signed top-m (the m best positive token cosines plus the m most negative), primary
   m = 4, also 2 and 8; training-side normalisation ``s_t / sqrt(I(q, q) (I(t, t) + tau))``, best
   token (primary) or summed, tau = the median ``I(t, t)`` (primary) or its 90th percentile;
3. more of the model: prototypes + the last block's MLP and attention output projections
   (primary), prototypes + MLP only;

each at the served default's other settings (damping 1.0, ``cosine_max``, every document scored),
against the default with a paired bootstrap over the tuning split's subsets and queries; and the
combination of the levers whose primary setting gained. Measured elsewhere: a checkpoint ensemble
(``ensemble.py``) and the closed-form true Fisher (``true_fisher.py``, from the per-token diagonals
this pass keeps).

    python -m bench.attribution.levers --work runs/bench_lds_fresh --seed 1

Writes ``bench/results/attribution_levers.json`` and caches every query's score matrices in the work folder
(``levers_<setting>.npz``, one array per aggregation) for ``lds_report.py``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from bench._common import finish
from bench.attribution.lds_report import interval, splits, top_only
from prism_tda.engine import Attributor, QuerySpec
from prism_tda.engine.curvature import damping_unit, self_influence
from prism_tda.engine.scoring import Preconditioner, TargetColumns, match_cosines, score_tokens
from prism_tda.engine.tokens import pad_batch, run_batch

PROJECTIONS = ("mlp", "attn")


# --------------------------------------------------------------------------- the last block's projections
def projection_grads(model, tokens: list[list[int]], targets: list[list[int]],
                     positions: list[list[int]] | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per valid token (in ``run_batch``'s order: sequence, then position): ``(delta_t, h_t)`` of the
    last block's ``mlp.proj`` and ``attn.proj``, the gradient of the token's own next-token loss at the
    projection's output and the projection's input. ``positions``: per sequence, the tokens wanted."""
    x, y, mask = pad_batch(tokens, targets)
    B, T = x.shape
    if positions is not None:
        mask[:] = False
        for b, p in enumerate(positions):
            mask[b, torch.as_tensor(p, dtype=torch.long)] = True
    last = model.blocks[-1]
    with torch.no_grad():
        h = model.drop(model.wte(x) + model.wpe(torch.arange(T)))
        for blk in model.blocks[:-1]:
            h = blk(h)
    cap: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [mod.register_forward_hook(lambda m, inp, out, name=name: cap.__setitem__(name, (inp[0], out)))
             for name, mod in (("mlp", last.mlp.proj), ("attn", last.attn.proj))]
    try:
        with torch.enable_grad():
            z = model.ln_f(last(h.detach()))
            with torch.no_grad():  # u_t = W^T (softmax(l_t) - onehot(y_t)): d loss_t / d z_t
                W = model.W.float()
                p = torch.softmax(z.float() @ W.T, dim=-1)
                p[torch.arange(B)[:, None], torch.arange(T)[None, :], y] -= 1.0
                u = (p @ W) * mask[..., None]
            outs = [cap[n][1] for n in PROJECTIONS]
            grads = torch.autograd.grad((z * u).sum(), outs)
    finally:
        for hk in hooks:
            hk.remove()
    rows, pos = mask.nonzero(as_tuple=True)
    return {n: (g[rows, pos].detach().float(), cap[n][0][rows, pos].detach().float())
            for n, g in zip(PROJECTIONS, grads, strict=True)}


@dataclass
class ProjectionCurvature:
    """EK-FAC of one projection: eigenbases of E[delta delta^T] and E[h h^T], corrected eigenvalues."""

    QS: torch.Tensor  # (do, do)
    QA: torch.Tensor  # (di, di)
    inv: torch.Tensor  # (do, di) 1 / (Lambda + damping)

    @classmethod
    def fit(cls, delta: torch.Tensor, h: torch.Tensor, damping: float = 1.0) -> ProjectionCurvature:
        n = len(delta)
        _, QS = torch.linalg.eigh((delta.T.double() @ delta.double()) / n)
        _, QA = torch.linalg.eigh((h.T.double() @ h.double()) / n)
        QS, QA = QS.float(), QA.float()
        d2, h2 = (delta @ QS).pow(2), (h @ QA).pow(2)
        lam = (d2.T.double() @ h2.double() / n).float()
        return cls(QS, QA, 1.0 / (lam + damping * lam.mean()))

    def rotate(self, delta: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return delta @ self.QS, h @ self.QA

    def self_influence(self, d_rot: torch.Tensor, h_rot: torch.Tensor) -> np.ndarray:
        return ((d_rot.pow(2) @ self.inv) * h_rot.pow(2)).sum(1).double().numpy()


# --------------------------------------------------------------------------- the corpus pass
@dataclass
class CorpusTokens:
    docs: np.ndarray  # (N,)
    protos: np.ndarray  # (N, k)
    acts: np.ndarray  # (N, k)
    ut: torch.Tensor  # (N, d) Q^T u_t
    proj: dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (delta_t, h_t)
    fisher: torch.Tensor  # (N, d) diagonal of Q^T W^T (diag p_t - p_t p_t^T) W Q: the true Fisher's, per token


def true_fisher_diag(z: torch.Tensor, W: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """(N, d) per token, the diagonal in the basis Q of the true Fisher of its next-token loss in
    ``u`` space, ``E_{y ~ p_t}[u u^T] = W^T (diag p_t - p_t p_t^T) W``: with ``B = W Q``, column j is
    ``p_t . B_j^2 - (p_t . B_j)^2``, the variance of ``B_j`` under the model's own prediction (V d per
    token, not V d^2: only the diagonal in Q is kept, as for the empirical corrections)."""
    B = (W.double() @ Q.double())  # (V, d)
    p = torch.softmax(z.double() @ W.double().T, dim=-1)  # (N, V)
    return (p @ B.pow(2) - (p @ B).pow(2)).clamp_min(0.0).float()


def corpus_pass(att: Attributor, batch_size: int = 32) -> CorpusTokens:
    reader, model = att.reader, att.model
    Q = reader.curv.Q
    docs, protos, acts, ut, fisher = [], [], [], [], []
    W = model.W.detach().float()
    proj: dict[str, list] = {n: [] for n in PROJECTIONS}
    with tqdm(total=reader.n_tokens, desc="corpus pass", unit="tok", unit_scale=True) as bar:
        for b in range(0, reader.n_seqs, batch_size):
            seqs = np.arange(b, min(b + batch_size, reader.n_seqs))
            toks, tgts = zip(*(reader.sequence_tokens(int(s)) for s in seqs), strict=True)
            tb = run_batch(model, list(toks), list(tgts))
            pg = projection_grads(model, list(toks), list(tgts))
            lo = reader.seq_span(int(seqs[0]))[0]
            rows = np.arange(lo, lo + len(tb.u))
            docs.append(reader.doc_of_seqs(reader.seq_of_tokens(rows)))
            protos.append(tb.proto_idx.numpy())
            acts.append(tb.acts.float().numpy())
            ut.append(tb.u @ Q)
            fisher.append(true_fisher_diag(tb.z, W, Q))
            for n in PROJECTIONS:
                proj[n].append(pg[n])
            bar.update(len(rows))
    return CorpusTokens(np.concatenate(docs), np.concatenate(protos), np.concatenate(acts), torch.cat(ut),
                        {n: (torch.cat([d for d, _ in v]), torch.cat([h for _, h in v])) for n, v in proj.items()},
                        torch.cat(fisher))


def query_projection_G(model, q) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per projection, the query's target tokens' ``(delta_j, h_j)`` (the gradient is their sum of outer products)."""
    ids = list(q.token_ids)
    return projection_grads(model, [ids], [ids[1:] + [ids[-1]]], [list(q.target_positions)])


# --------------------------------------------------------------------------- preconditioners
def per_prototype_inv(att: Attributor, counts: np.ndarray, c: float) -> torch.Tensor:
    """(K, d) 1 / (lam_i + c m~_i): damping relative to each prototype's own mean eigenvalue, shrunk
    toward the mean over used prototypes by a pseudo-count of a tenth of the mean usage."""
    lam = att.reader.curv.lam
    unit = damping_unit(lam, torch.from_numpy(counts), "prototype")  # the index's own rule (damping_scope)
    return (1.0 / (lam.double() + c * unit.double())).float()


def block_corrections(ct: CorpusTokens, K: int, per_token: torch.Tensor) -> torch.Tensor:
    """(K, d) per-prototype eigenvalue corrections ``(1/N) sum_t a_{t,i}^2 f_t`` of per-token diagonals
    ``f_t`` (N, d), normalised as the index's ``lam`` is: ``(Q^T u_t)^2`` gives the index's empirical
    corrections, ``ct.fisher`` the true Fisher's."""
    lam = torch.zeros(K, per_token.shape[1], dtype=torch.float64)
    a = torch.from_numpy(ct.acts).double()
    proto = torch.from_numpy(ct.protos).long()
    f = per_token.double()
    for j in range(a.shape[1]):
        lam.index_add_(0, proto[:, j], a[:, j : j + 1].pow(2) * f)
    return (lam / len(ct.docs)).float()


# --------------------------------------------------------------------------- scores of one setting
def token_scores(ct: CorpusTokens, queries: list, pre: Preconditioner, parts: tuple[str, ...],
                 proj_curv: dict[str, ProjectionCurvature], proj_q: list[dict], match: bool,
                 ) -> tuple[list[np.ndarray], list[float], np.ndarray, list[np.ndarray | None]]:
    """Per query every token's raw score s_t and I(q, q); every token's I(t, t) (the same for all
    queries); per query each token's best-matching cosines per target (``cosine_match``, prototypes only)."""
    rows = np.arange(len(ct.docs))
    t_self_proto = self_influence(ct.ut, ct.protos, ct.acts, pre.inv)
    t_self = t_self_proto.copy()
    rot = {}
    for n in parts:
        pc = proj_curv[n]
        rot[n] = pc.rotate(*ct.proj[n])
        t_self += pc.self_influence(*rot[n])
    raws, I_qs, matches = [], [], []
    for qi, q in enumerate(tqdm(queries, desc="queries", unit="q", leave=False)):
        s = score_tokens(rows, ct.protos, ct.acts, ct.ut, t_self_proto, q.G, pre, exact=True).raw.astype(np.float64)
        I_q = pre.self_influence(q.G)
        for n in parts:
            pc = proj_curv[n]
            dq, hq = pc.rotate(*proj_q[qi][n])
            Gq = dq.T @ hq  # (do, di) in the eigenbases
            M = Gq * pc.inv
            I_q += float((Gq * M).sum())
            d_rot, h_rot = rot[n]
            s += ((d_rot @ M) * h_rot).sum(1).double().numpy()
        raws.append(s)
        I_qs.append(I_q)
        if match:
            tc = match_cosines(ct.protos, ct.acts, ct.ut, t_self_proto, q, pre, TargetColumns.of(q, pre))
            matches.append(tc)
        else:
            matches.append(None)
    return raws, I_qs, t_self, matches


class Segments:
    """Documents as contiguous runs of the corpus's tokens (tokens are stored in document order)."""

    def __init__(self, docs: np.ndarray, n_docs: int) -> None:
        assert (np.diff(docs) >= 0).all(), "tokens are not in document order"
        self.start = np.r_[0, np.nonzero(np.diff(docs))[0] + 1]
        self.doc = docs[self.start]
        self.docs, self.n = docs, n_docs
        self.rank_base = np.repeat(self.start, np.diff(np.r_[self.start, len(docs)]))

    def max(self, v: np.ndarray) -> np.ndarray:
        out = np.zeros((self.n, *v.shape[1:]))
        out[self.doc] = np.maximum.reduceat(v, self.start, axis=0)
        return out

    def sum(self, v: np.ndarray) -> np.ndarray:
        return np.bincount(self.docs, weights=v, minlength=self.n)

    def top_m_signed(self, cos: np.ndarray, ms: tuple[int, ...]) -> dict[int, np.ndarray]:
        """Per document and m: its m best positive token cosines plus its m most negative ones."""
        out = {m: np.zeros(self.n) for m in ms}
        for sign in (1.0, -1.0):
            c = np.where(sign * cos > 0, sign * cos, 0.0)
            order = np.lexsort((-c, self.docs))  # by document, then descending
            rank = np.arange(len(c)) - self.rank_base
            cs = c[order]
            for m in ms:
                keep = rank < m
                out[m] += sign * np.bincount(self.docs[keep], weights=cs[keep], minlength=self.n)
        return out


def aggregate(seg: Segments, raw: np.ndarray, I_q: float, t_self: np.ndarray, taus: dict[str, float],
              match: np.ndarray | None) -> dict[str, np.ndarray]:
    cos = raw / np.sqrt(max(I_q, 1e-30) * np.maximum(t_self, 1e-30))
    out = {"cosine_max": seg.max(cos), "cosine_sum": seg.sum(cos), "raw_sum": seg.sum(raw)}
    for m, v in seg.top_m_signed(cos, (2, 4, 8)).items():
        out[f"cosine_top{m}"] = v
    for name, tau in taus.items():
        tc = raw / np.sqrt(max(I_q, 1e-30) * (t_self + tau))
        out[f"tau_{name}_max"] = seg.max(tc)
        out[f"tau_{name}_sum"] = seg.sum(tc)
    if match is not None:
        out["cosine_match"] = seg.max(np.where(np.isfinite(match), match, 0.0)).mean(1)
    return out


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="runs/bench_lds_fresh")
    ap.add_argument("--subsets", type=int, default=48)
    ap.add_argument("--tune-subsets", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1, help="as given to run_eval.py (subset draws)")
    ap.add_argument("--boot", type=int, default=1000)
    ap.add_argument("--out", default="bench/results/attribution_levers.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    work = Path(args.work)
    queries = json.loads((work / "queries.json").read_text())
    att = Attributor.open(work / "index")
    n_docs = att.reader.n_docs
    tune, _ = splits(work, queries, n_docs, args.subsets, args.tune_subsets, args.seed)
    # every query is scored (``lds_report.py`` reports the chosen setting from the cached scores); only
    # the tuning split's queries and subsets are evaluated here
    enc = [att.encode(QuerySpec(q["prompt"], q["completion"])) for q in queries]
    t0 = time.perf_counter()
    with torch.no_grad():
        ct = corpus_pass(att)
    pass_s = time.perf_counter() - t0
    proj_q = [query_projection_G(att.model, q) for q in enc]
    for q in enc:  # the query's target tokens as this pass runs them are the engine's
        ids = list(q.token_ids)
        tb = run_batch(att.model, [ids], [ids[1:] + [ids[-1]]], positions=[np.asarray(q.target_positions)])
        assert torch.allclose(tb.u @ att.reader.curv.Q, q.target_u.float(), atol=1e-4), "query targets differ"
    seg = Segments(ct.docs, n_docs)
    proj_curv = {n: ProjectionCurvature.fit(*ct.proj[n]) for n in PROJECTIONS}
    counts = np.bincount(ct.protos[ct.acts > 0].ravel(), minlength=att.reader.n_prototypes).astype(np.float64)

    def pre_of(kind: str, c: float) -> Preconditioner:
        if kind == "global":  # whatever the index's own scope: these settings were measured on a global one
            unit = damping_unit(att.reader.curv.lam, torch.from_numpy(counts), "global")
            return Preconditioner(c, (1.0 / (att.reader.curv.lam + c * unit)).float(), False)
        return Preconditioner(c, per_prototype_inv(att, counts, c), False)

    settings = {  # name -> (damping kind, c, model parts)
        "default": ("global", 1.0, ()),
        "damping_global_0.3": ("global", 0.3, ()), "damping_global_0.1": ("global", 0.1, ()),
        "damping_per_prototype_0.01": ("per_prototype", 0.01, ()),
        "damping_per_prototype_0.03": ("per_prototype", 0.03, ()),
        "damping_per_prototype_0.1": ("per_prototype", 0.1, ()),
        "model_mlp": ("global", 1.0, ("mlp",)), "model_mlp_attn": ("global", 1.0, ("mlp", "attn")),
    }
    sub = tune
    draws = sub.draws(args.boot, args.seed + 7)
    scores: dict[str, np.ndarray] = {}
    taus: dict[str, dict[str, float]] = {}
    timings = {}
    spec_path = work / "levers_settings.json"  # what each cached setting is, for lds_report.py
    specs = json.loads(spec_path.read_text()) if spec_path.exists() else {}

    def run_setting(name: str, kind: str, c: float, parts: tuple[str, ...]) -> None:
        specs[name] = {"damping": kind, "c": c, "parts": list(parts)}
        spec_path.write_text(json.dumps(specs, indent=1))
        path = work / f"levers_{name}.npz"
        if path.exists():
            z = np.load(path)
            for a in z.files:
                scores[f"{name}/{a}"] = z[a]
            return
        t1 = time.perf_counter()
        pre = pre_of(kind, c)
        raws, I_qs, t_self, matches = token_scores(ct, enc, pre, parts, proj_curv, proj_q, match=(name == "default"))
        # tau: quantiles of this setting's I(t, t) over the training tokens
        taus[name] = {"q50": float(np.percentile(t_self, 50)), "q90": float(np.percentile(t_self, 90))}
        per = [aggregate(seg, r, iq, t_self, taus[name], m)
               for r, iq, m in zip(raws, I_qs, matches, strict=True)]
        got = {a: np.stack([p[a] for p in per]).astype(np.float32) for a in per[0]}
        np.savez(path, **got)
        for a, v in got.items():
            scores[f"{name}/{a}"] = v
        timings[name] = round(time.perf_counter() - t1, 1)
        print(f"[{name}] {timings[name]} s", flush=True)

    for name, (kind, c, parts) in settings.items():
        run_setting(name, kind, c, parts)

    # LDS on the tuning split, each against the default with the same bootstrap draws
    base = scores["default/cosine_max"]
    boot_base = sub.boot(base, draws)
    table: list[dict] = []
    done: set[str] = set()

    def tabulate() -> None:
        for key, S in scores.items():
            if key in done:
                continue
            done.add(key)
            for k in (None, 128, 32):
                Sk = top_only(S, k)
                point = sub.lds(Sk)
                b = sub.boot(Sk, draws)
                table.append({"setting": key, "returned": k or "all", "lds_tune": interval(point, b),
                              "diff_vs_default": interval(point - sub.lds(base), b - boot_base)})

    tabulate()
    by = {(r["setting"], r["returned"]): r for r in table}
    primaries = {"damping": "damping_per_prototype_0.03/cosine_max", "aggregation_top_m": "default/cosine_top4",
                 "aggregation_tau": "default/tau_q50_max", "model": "model_mlp_attn/cosine_max"}
    # the combination of the levers whose primary setting gained (point estimate above the default's)
    gained = {lever for lever, key in primaries.items() if by[(key, "all")]["diff_vs_default"][0] > 0}
    aggs = [(by[(primaries[a], "all")]["lds_tune"][0], primaries[a].split("/")[1])
            for a in ("aggregation_top_m", "aggregation_tau") if a in gained]
    combined = ("per_prototype" if "damping" in gained else "global", 0.03 if "damping" in gained else 1.0,
                ("mlp", "attn") if "model" in gained else ())
    combined_agg = max(aggs)[1] if aggs else "cosine_max"
    if combined[0] != "global" or combined[2]:
        run_setting("combined", *combined)
        tabulate()
        by = {(r["setting"], r["returned"]): r for r in table}
        combined_key = f"combined/{combined_agg}"
    else:
        combined_key = f"default/{combined_agg}"
    res = {
        "work": str(work), "tokens": att.reader.n_tokens, "documents": n_docs,
        "tune_split": {"subsets": args.tune_subsets, "queries": len(tune.queries)},
        "corpus_pass_seconds": round(pass_s, 1), "setting_seconds": timings, "taus": taus,
        "primary": {lever: by[(key, "all")] for lever, key in primaries.items()},
        "levers_gained": sorted(gained),
        "combined": {"damping": combined[0], "c": combined[1], "parts": list(combined[2]),
                     "aggregation": combined_agg, **by[(combined_key, "all")]},
        "default": by[("default/cosine_max", "all")],
        "best_on_tuning_split": max(table, key=lambda r: r["lds_tune"][0]),
        "table": sorted(table, key=lambda r: -r["lds_tune"][0]),
    }
    return finish(res, "attribution/levers.py", argv, args.out, hide=("table",))


if __name__ == "__main__":
    main()
