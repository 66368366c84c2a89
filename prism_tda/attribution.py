"""Attribution engine: which training documents drove an output (DESIGN §2).

One forward pass over the query gives its prototype-space gradient
``G(q) = sum_{t in targets} (Q^T u_t) a_t^T``. A training token t scores

    s_t = sum_{i in K_t} a_{t,i} (G_i(q) / (lambda_i + lam)) . (Q^T u_t)

(the prototype-space influence of that token under the EK-FAC-style local curvature), normalised
to a cosine by ``sqrt(I(q, q) I(t, t))``; a document scores the max over its tokens. The exact
path scores every training token that shares a prototype with the query (posting lists by
prototype); the fast path asks FAISS for candidate sequences with the per-sequence embeddings and
re-ranks only their tokens, exactly. Nothing on either path runs the model over training data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from .errors import PrismError
from .indexer import store
from .indexer.config import IndexConfig
from .indexer.curvature import Curvature
from .indexer.embed import Sketch, normalise, open_faiss
from .indexer.forward import run_batch
from .model import checkpoint as ckpt
from .model.tokenizer import eos_id


def pc_max(col) -> int:
    return pc.max(col).as_py() if len(col) else -1


class QueryError(PrismError, ValueError):
    """A query is empty, too long, or asks for a target that does not exist."""


@dataclass
class Query:
    token_ids: list[int]  # prompt + target, as run through the model
    n_prompt: int
    target_positions: list[int]  # positions whose next token is a target token
    target_ids: list[int]
    G: torch.Tensor  # (K, u_dim) prototype-space gradient in the Q basis
    self_influence: float  # I(q, q)
    per_token: list[dict[str, Any]] = field(default_factory=list)


class Attributor:
    """Opens an index (and the checkpoint it was built from) and answers attribution queries."""

    def __init__(self, index_dir: str | Path, *, checkpoint: str | Path | None = None, proto_candidates: int = 8,
                 token_candidates: int = 128, row_budget: int = 1 << 15) -> None:
        """``proto_candidates``, ``token_candidates``, ``row_budget``: the fast path's token-level
        first stage (see :meth:`candidate_rows`); 0 turns it off."""
        self.dir = Path(index_dir)
        self.proto_candidates, self.token_candidates, self.row_budget = proto_candidates, token_candidates, row_budget
        m = store.read_manifest(self.dir)
        if m is None or not m.get("complete"):
            raise PrismError(f"{self.dir}: not a complete index (manifest.json missing or incomplete)")
        self.manifest = m
        self.cfg = IndexConfig.from_dict(m["config"])
        self.model, self.tokenizer, ck_config = ckpt.load_checkpoint(checkpoint or m["checkpoint"])
        if ck_config["files"]["model.safetensors"] != m["identity"]["checkpoint_sha256"]:
            raise PrismError(f"{self.dir}: index was built from another checkpoint than {checkpoint or m['checkpoint']}")
        self.curv = Curvature.load(self.dir / "curvature.safetensors")
        self.inv = self.curv.inv()  # (K, u_dim)
        mc = self.model.cfg
        self.sketch = Sketch(mc.n_prototypes, self.curv.u_dim, self.cfg.embed_dim, self.cfg.sketch_buckets,
                             self.cfg.seed)
        self.faiss = open_faiss(self.dir)
        self._load_tokens()

    @classmethod
    def open(cls, index_dir: str | Path, **kw) -> Attributor:
        return cls(index_dir, **kw)

    # --------------------------------------------------------------------------- loading
    def _load_tokens(self) -> None:
        t0 = time.perf_counter()
        parts = sorted((self.dir / "token_grads").glob("part-*.parquet"))
        self.n_tokens = sum(pq.read_metadata(f).num_rows for f in parts)
        # Q^T u_t of every training token, read batch by batch into one array (reading the whole
        # table at once held several copies of it in the Arrow memory pool)
        self.u = np.empty((self.n_tokens, self.curv.u_dim), dtype=np.float16)
        tok_seq = np.empty(self.n_tokens, dtype=np.int64)
        tok_pos = np.empty(self.n_tokens, dtype=np.int64)
        k = 0
        for f in parts:
            for b in pq.ParquetFile(f).iter_batches(batch_size=1 << 14, columns=["seq_id", "pos", "u"],
                                                    use_threads=False):
                n = b.num_rows
                self.u[k : k + n] = b.column(2).flatten().to_numpy(zero_copy_only=False).reshape(n, -1)
                tok_seq[k : k + n] = b.column(0).to_numpy()
                tok_pos[k : k + n] = b.column(1).to_numpy()
                k += n
        tok_key = tok_seq * 65536 + tok_pos
        seqs = pq.read_table(sorted((self.dir / "sequences").glob("part-*.parquet")),
                             columns=["seq_id", "doc_id", "start_token", "n_tokens", "target_ids"])
        self.seq_doc = seqs["doc_id"].to_numpy()
        self.seq_start = seqs["start_token"].to_numpy()
        # flat per token row: the token it predicts (what the row's gradient learns)
        self.tok_target = seqs["target_ids"].combine_chunks().flatten().to_numpy()
        docs = pq.read_table(sorted((self.dir / "documents").glob("part-*.parquet")), columns=["doc_id", "external_id"])
        self.doc_external = np.empty(int(pc_max(docs["doc_id"])) + 1, dtype=object)
        self.doc_external[docs["doc_id"].to_numpy()] = docs["external_id"].to_numpy(zero_copy_only=False)
        self.n_docs = len(self.doc_external)
        n_seq = len(self.seq_doc)
        self.seq_tok0 = np.zeros(n_seq + 1, dtype=np.int64)  # token rows of sequence s: [tok0[s], tok0[s+1])
        np.cumsum(seqs["n_tokens"].to_numpy(), out=self.seq_tok0[1:])
        self.tok_seq = tok_seq
        acts = pq.read_table(sorted((self.dir / "activations").glob("part-*.parquet")),
                             columns=["seq_id", "pos", "proto_id", "act"])
        a_key = acts["seq_id"].to_numpy().astype(np.int64) * 65536 + acts["pos"].to_numpy()
        self.row_tok = np.searchsorted(tok_key, a_key)  # activation row -> token row
        self.row_proto = acts["proto_id"].to_numpy().astype(np.int64)
        self.row_act = acts["act"].to_numpy().astype(np.float32)
        self.seq_row0 = np.searchsorted(self.row_tok, self.seq_tok0)  # activation rows of each sequence
        # posting lists: activation rows grouped by prototype
        order = np.argsort(self.row_proto, kind="stable")
        self.post_rows = order
        K = self.model.cfg.n_prototypes
        self.post_start = np.searchsorted(self.row_proto[order], np.arange(K + 1))
        # I(t, t) for every training token: sum_i a^2 sum_j u_j^2 / (lam_ij + lam)
        # (in chunks of 32k rows: a few MB of temporaries instead of a copy of every row's gradient)
        self.tok_self = np.zeros(self.n_tokens, dtype=np.float64)
        for c in range(0, len(self.row_tok), 1 << 15):
            sl = slice(c, c + (1 << 15))
            u = torch.from_numpy(self.u[self.row_tok[sl]]).float()
            val = self.row_act[sl] ** 2 * (u * u * self.inv[torch.from_numpy(self.row_proto[sl])]).sum(1).numpy()
            self.tok_self += np.bincount(self.row_tok[sl], weights=val, minlength=self.n_tokens)
        self.load_seconds = time.perf_counter() - t0

    # --------------------------------------------------------------------------- queries
    def encode_query(self, prompt: str, completion: str | None = None, *, max_new_tokens: int | None = None,
                     target_index: int | None = None) -> Query:
        tok, model = self.tokenizer, self.model
        block = model.cfg.block_size
        p_ids = tok.encode(prompt).ids if prompt else []
        if not p_ids:
            raise QueryError("prompt is empty")
        if completion is not None:
            c_ids = tok.encode(completion).ids
            if not c_ids:
                raise QueryError("completion is empty")
        elif max_new_tokens:
            x = torch.tensor([p_ids[-block:]])
            y = model.generate(x, max_new_tokens, stop_token=eos_id(tok))
            c_ids = y[0, x.shape[1]:].tolist()
        else:
            c_ids = []
        ids = p_ids + c_ids
        if len(ids) > block + 1:
            raise QueryError(f"prompt + completion is {len(ids)} tokens; the model's context is {block}")
        if c_ids:
            positions = list(range(len(p_ids) - 1, len(ids) - 1))
        else:  # no target: the prompt's own next-token predictions
            positions = list(range(len(ids) - 1)) or [0]
            if len(ids) == 1:
                ids = ids + [eos_id(tok)]
        if target_index is not None:
            if not 0 <= target_index < len(positions):
                raise QueryError(f"target_index {target_index} out of range [0, {len(positions)})")
            positions = [positions[target_index]]
        inp, tgt = ids[:-1], ids[1:]
        tb = run_batch(model, [inp], [tgt])
        sel = torch.tensor(positions)
        ut = (tb.u[sel] @ self.curv.Q)[:, : self.curv.u_dim]  # (n, u_dim)
        a, idx = tb.acts[sel], tb.proto_idx[sel]
        K = model.cfg.n_prototypes
        G = torch.zeros(K, self.curv.u_dim)
        for j in range(idx.shape[1]):
            G.index_add_(0, idx[:, j], a[:, j : j + 1] * ut)
        self_inf = float((G * G * self.inv).sum())
        q = Query(ids, len(p_ids), positions, [tgt[p] for p in positions], G, self_inf)
        q.per_token = self._per_token(ids, positions, [tgt[p] for p in positions])
        return q

    def _per_token(self, ids: list[int], positions: list[int], targets: list[int]) -> list[dict[str, Any]]:
        d = self.model.decompose(torch.tensor(ids[:-1]), positions=torch.tensor(positions),
                                 tokens=torch.tensor(targets))
        out = []
        for n, (pos, y) in enumerate(zip(positions, targets, strict=True)):
            protos = [{"proto_id": int(p), "act": float(a), "contribution": float(c)}
                      for p, a, c in zip(d.proto_idx[n], d.acts[n], d.contrib[n], strict=True) if a > 0]
            out.append({"position": pos, "token_id": y, "token": self.tokenizer.decode([y]),
                        "logit": float(d.logit[n]), "residual": float(d.residual[n]), "prototypes": protos})
        return out

    # --------------------------------------------------------------------------- scoring
    def _score_rows(self, q: Query, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per-token influence for the given activation rows.

        Returns (token rows, summed influence per token, per activation row value, activation row ->
        index into the token rows)."""
        active = (q.G.abs().sum(1) > 0).nonzero().flatten()
        Wq = (q.G[active] * self.inv[active]).float()  # (P, u_dim) preconditioned query columns
        col = np.full(len(q.G), -1, dtype=np.int64)
        col[active.numpy()] = np.arange(len(active))
        tok = self.row_tok[rows]
        uniq, inv_idx = np.unique(tok, return_inverse=True)
        c = col[self.row_proto[rows]]
        hit = c >= 0
        val = np.zeros(len(rows), dtype=np.float32)
        if len(uniq) * len(active) <= 8 * len(rows):
            # many rows per token (a candidate's whole sequences): one product per token and prototype
            M = (torch.from_numpy(self.u[uniq]).float() @ Wq.T).numpy()  # (n_tok, P)
            val[hit] = self.row_act[rows[hit]] * M[inv_idx[hit], c[hit]]
        else:  # about one row per token (posting lists): one dot per row, in chunks to bound memory
            idx = np.nonzero(hit)[0]
            for k in range(0, len(idx), 1 << 16):
                sl = idx[k : k + (1 << 16)]
                u = torch.from_numpy(self.u[tok[sl]]).float()
                val[sl] = self.row_act[rows[sl]] * (u * Wq[torch.from_numpy(c[sl])]).sum(1).numpy()
        score = np.bincount(inv_idx, weights=val, minlength=len(uniq))
        return uniq, score, val, inv_idx

    def _token_cosines(self, q: Query, raw: np.ndarray, tok: np.ndarray) -> np.ndarray:
        return raw / np.sqrt(max(q.self_influence, 1e-30) * np.maximum(self.tok_self[tok], 1e-30))

    def document_scores(self, q: Query, mode: str = "exact", n_candidates: int = 256) -> dict[str, np.ndarray]:
        """Scores of every document for one query (0 where a document has no scored token), under
        several aggregations of its token scores.

        ``cosine_max``: the served score (best token's cosine); ``cosine_sum``: sum of the token
        cosines; ``raw_sum``: summed raw influence of the document's tokens (the classical additive
        influence of the document); ``raw_max``: the best token's raw influence."""
        rows = self.query_rows(q) if mode == "exact" else self.candidate_rows(q, n_candidates)[1]
        tok, raw, _, _ = self._score_rows(q, rows)
        cos = self._token_cosines(q, raw, tok)
        docs = self.seq_doc[self.tok_seq[tok]].astype(np.int64)
        out = {}
        for name, v in (("cosine", cos), ("raw", raw)):
            best = np.full(self.n_docs, -np.inf)
            np.maximum.at(best, docs, v)
            best[~np.isfinite(best)] = 0.0
            out[f"{name}_max"] = best
            out[f"{name}_sum"] = np.bincount(docs, weights=v, minlength=self.n_docs)
        return out

    def query_rows(self, q: Query) -> np.ndarray:
        """Activation rows of every training token sharing a prototype with the query."""
        protos = (q.G.abs().sum(1) > 0).nonzero().flatten().numpy()
        return np.concatenate([self.post_rows[self.post_start[p] : self.post_start[p + 1]] for p in protos]
                              or [np.zeros(0, np.int64)])

    def candidate_rows(self, q: Query, n_candidates: int) -> tuple[np.ndarray, np.ndarray]:
        """Candidate sequences of the fast path and their activation rows.

        Two first stages, united: FAISS's ``n_candidates`` nearest sequences by the sketch embedding
        (a whole window's gradient), and the sequences of the ``token_candidates`` best single tokens
        found in the posting lists of the query's heaviest prototypes (by their part of ``I(q, q)``,
        at most ``proto_candidates`` of them and ``row_budget`` rows). The second stage finds documents
        whose one token matches strongly while the rest of the window does not, which the window-level
        sketch ranks poorly."""
        e = self.sketch.embed_rows(torch.zeros(len(q.G), dtype=torch.long), torch.arange(len(q.G)),
                                   q.G * self.curv.inv_sqrt(), 1).numpy()
        _, ids = self.faiss.search(normalise(e), min(n_candidates, self.faiss.ntotal))
        seqs = ids[0][ids[0] >= 0]
        if self.proto_candidates > 0 and self.token_candidates > 0:
            weight = (q.G * q.G * self.inv).sum(1)  # each prototype's part of I(q, q)
            heavy = torch.argsort(weight, descending=True)[: self.proto_candidates]
            lists, n = [], 0
            for p in heavy[weight[heavy] > 0].tolist():
                rows_p = self.post_rows[self.post_start[p] : self.post_start[p + 1]]
                if lists and n + len(rows_p) > self.row_budget:
                    continue
                lists.append(rows_p)
                n += len(rows_p)
            if lists:
                tok, raw, _, _ = self._score_rows(q, np.concatenate(lists))
                cos = self._token_cosines(q, raw, tok)
                best = tok[np.argsort(-cos, kind="stable")[: self.token_candidates]]
                seqs = np.concatenate([seqs, self.tok_seq[best]])
        seqs = np.unique(seqs)
        rows = [np.arange(self.seq_row0[s], self.seq_row0[s + 1]) for s in seqs]
        return seqs, np.concatenate(rows or [np.zeros(0, np.int64)])

    def attribute(self, prompt: str, completion: str | None = None, *, max_new_tokens: int | None = None,
                  target_index: int | None = None, top_k: int = 10, mode: str = "fast",
                  n_candidates: int = 256, opponents: bool = False) -> dict[str, Any]:
        """Top training documents for one query. ``mode``: ``fast`` (FAISS + exact re-rank) or ``exact``."""
        t0 = time.perf_counter()
        q = self.encode_query(prompt, completion, max_new_tokens=max_new_tokens, target_index=target_index)
        t1 = time.perf_counter()
        if mode == "exact":
            rows = self.query_rows(q)
        elif mode == "fast":
            _, rows = self.candidate_rows(q, n_candidates)
        else:
            raise QueryError(f"mode must be 'fast' or 'exact', got {mode!r}")
        t2 = time.perf_counter()
        tok, raw, row_val, row_tok_idx = self._score_rows(q, rows)
        cos = self._token_cosines(q, raw, tok)
        sign = -1.0 if opponents else 1.0
        docs = self.seq_doc[self.tok_seq[tok]]
        order = np.lexsort((-(sign * cos), docs))  # by doc, best token first
        first = np.ones(len(order), dtype=bool)
        first[1:] = docs[order][1:] != docs[order][:-1]
        best = order[first]  # best token per document
        best = best[np.argsort(-(sign * cos[best]), kind="stable")][:top_k]
        t3 = time.perf_counter()
        results = [self._document_result(b, tok, cos, raw, docs, rows, row_val, row_tok_idx, sign) for b in best]
        return {"query": {"token_ids": q.token_ids, "n_prompt": q.n_prompt, "target_ids": q.target_ids,
                          "target_text": self.tokenizer.decode(q.target_ids)},
                "documents": results, "per_token": q.per_token,
                "timings_ms": {"query_forward": 1e3 * (t1 - t0), "candidates": 1e3 * (t2 - t1),
                               "score": 1e3 * (t3 - t2), "details": 1e3 * (time.perf_counter() - t3),
                               "total": 1e3 * (time.perf_counter() - t0)},
                "mode": mode, "rows_scored": int(len(rows))}

    # --------------------------------------------------------------------------- presentation
    def _document_result(self, b: int, tok: np.ndarray, cos: np.ndarray, raw: np.ndarray, docs: np.ndarray,
                         rows: np.ndarray, row_val: np.ndarray, row_tok_idx: np.ndarray, sign: float,
                         window: int = 24, max_highlights: int = 8) -> dict[str, Any]:
        """One ranked document: score, a snippet around its best token, the training tokens to
        highlight (tokens of the snippet that share prototypes with the query, weighted by their
        influence relative to the best token) and the prototypes that carry the best token's score."""
        t_best = int(tok[b])
        seq = int(self.tok_seq[t_best])
        t0, t1 = int(self.seq_tok0[seq]), int(self.seq_tok0[seq + 1])
        lo, hi = max(t0, t_best - window), min(t1, t_best + window + 1)
        # the snippet is the predicted tokens of rows [lo, hi): the best row's target sits inside it
        ids = self.tok_target[lo:hi].tolist()
        offsets = [len(self.tokenizer.decode(ids[:n])) for n in range(len(ids) + 1)]
        snippet = self.tokenizer.decode(ids)
        in_doc = (tok >= lo) & (tok < hi)
        best_raw = abs(raw[b]) or 1.0
        cand = np.nonzero(in_doc & (sign * raw > 0))[0]
        cand = cand[np.argsort(-(sign * raw[cand]))][:max_highlights]
        highlights = []
        for c in sorted(cand, key=lambda c: tok[c]):
            n = int(tok[c]) - lo
            start, end = offsets[n], offsets[n + 1]
            if end > start:
                highlights.append({"start": start, "end": end, "text": snippet[start:end],
                                   "weight": float(sign * raw[c] / best_raw), "token_row": int(tok[c])})
        mine = row_tok_idx == b
        protos = self.row_proto[rows[mine]]
        vals = sign * row_val[mine]
        total = float(np.abs(vals).sum()) or 1.0
        carry = sorted(({"proto_id": int(p), "share": float(v / total)} for p, v in zip(protos, vals, strict=True)),
                       key=lambda d: -d["share"])
        doc = int(docs[b])
        return {"doc_id": doc, "external_id": str(self.doc_external[doc]), "score": float(cos[b]),
                "raw_influence": float(raw[b]), "seq_id": seq, "token_row": t_best,
                "position": int(self.seq_start[seq]) + t_best - t0,
                "snippet": snippet, "highlights": highlights, "prototypes": carry}
