"""Which training tokens a query scores: the fast path's first stages (DESIGN §2, "Cached / fast").

Two stages, united, both sublinear in the corpus:

- **posting lists**: the query's heaviest prototypes (by their part of ``I(q, q)``) and, inside
  each, the cells of token-vector direction closest to the query's column for that prototype;
  (prototype, cell) lists are visited best first and read strongest-first, under a row budget that
  is checked against the lists' sizes (read from their offsets) before anything is read. The read
  tokens are scored approximately and the sequences of the best ``token_candidates`` join the
  candidates: this finds documents whose one token matches while the rest of the window does not.
- **FAISS**: the ``n_candidates`` sequences nearest to the query by the sketch of a whole window's
  gradient, searched in every shard's FAISS part (``nprobe`` cells of an IVF index).

The candidates' tokens are then scored approximately, the best documents shortlisted, and those
re-ranked exactly (``engine/attributor.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .arrays import best_first, unique
from .reader import IndexReader, ranges
from .reads import Reads
from .scoring import Preconditioner, approx_scores


@dataclass(frozen=True)
class FirstStages:
    """Settings of the token-level first stage; ``proto_candidates=0`` turns it off."""

    proto_candidates: int = 64  # heaviest query prototypes whose lists are read
    token_candidates: int = 512  # best tokens whose sequences become candidates
    row_budget: int = 1 << 15  # posting entries read at most, over every shard
    # the best cell of each of this many heaviest query prototypes is read first, whatever its priority:
    # a heavy prototype whose query column lies between cells ranks its best list below lighter
    # prototypes', and the tokens that match the query best can sit there (docs/benchmarks.md, "The
    # heaviest prototypes' best cells first"); 0: priority order only
    best_cells: int = 8


@dataclass(frozen=True)
class PostingPlan:
    """Which posting lists one query reads, decided from the lists' sizes over the whole index before
    anything is read: ``lists`` best first, the first ``n_full`` whole; of the last (when
    ``len(lists) > n_full``) each shard reads the strongest ``room / last_total`` of its part."""

    lists: np.ndarray  # (L,) (prototype, cell) list ids
    n_full: int
    room: int
    last_total: int


def posting_plan(reader: Reads, G: torch.Tensor, pre: Preconditioner, stages: FirstStages) -> PostingPlan | None:
    """The lists the token stage reads for one query (None: none), from the index-wide parts only."""
    weight = (G * G * pre.inv).sum(1)  # each prototype's part of I(q, q)
    heavy = torch.argsort(weight, descending=True)[: stages.proto_candidates]
    heavy = heavy[weight[heavy] > 0]
    if len(heavy) == 0 or not len(reader.manifest.shards):
        return None
    # the query's direction for each heavy prototype, in the space the cells live in
    dirs = (G[heavy] * pre.inv[heavy]).float() / reader.calib.codec_scale
    dirs = dirs / dirs.norm(dim=1, keepdim=True).clamp_min(1e-12)
    priority = (weight[heavy].sqrt()[:, None] * (dirs @ reader.calib.cells.T)).numpy()  # (P, C)
    C = reader.n_cells
    groups = (heavy.numpy()[:, None] * C + np.arange(C)[None, :]).reshape(-1)  # (P * C,) list ids
    ranked = groups[np.argsort(-priority.reshape(-1), kind="stable")]
    if stages.best_cells > 0:  # the heaviest prototypes' best cells first, heaviest first (``heavy`` is by weight)
        first = heavy.numpy()[: stages.best_cells] * C + np.argmax(priority[: stages.best_cells], axis=1)
        ranked = np.concatenate([first, ranked[~np.isin(ranked, first)]])
    # lists best first, as many as the budget holds: their lengths over the whole index are known
    # before anything is read (``reader.list_sizes``)
    total = reader.list_sizes[ranked]
    upto = np.cumsum(total)
    n_full = int(np.searchsorted(upto, stages.row_budget, side="right"))  # lists read whole
    room = stages.row_budget - (int(upto[n_full - 1]) if n_full else 0)
    g = ranked[: n_full + (1 if n_full < len(ranked) and room > 0 else 0)]
    return PostingPlan(g, n_full, room, int(total[n_full]) if len(g) > n_full else 0)


def read_postings(reader: IndexReader, plan: PostingPlan | None) -> np.ndarray:
    """The entries (global token rows, ascending) of the planned lists in the reader's open shards."""
    if plan is None or not reader.shards:
        return np.zeros(0, np.int64)
    g, n_full = plan.lists, plan.n_full
    parts = []
    for s, sh in reader.held_shards():
        take = sh.post_offsets[g + 1].astype(np.int64) - sh.post_offsets[g]
        if len(g) > n_full:  # the last list: the strongest entries of each shard's part, in proportion
            take[-1] = int(np.floor(take[-1] * plan.room / max(plan.last_total, 1)))
        live = take > 0
        if live.any():
            start = sh.post_offsets[g[live]].astype(np.int64)
            idx = ranges(start, start + take[live])
            parts.append(reader.tok_base[s] + sh.post_tokens[idx].astype(np.int64))
    return unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


def best_posting_tokens(reader: IndexReader, G: torch.Tensor, pre: Preconditioner, plan: PostingPlan | None,
                        n: int, sums: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rows, approximate cosines) of the ``n`` best-scoring tokens of the planned lists in the open
    shards, best first (equal cosines: lower row first, so parts read apart merge into one answer); and
    with ``sums`` ("raw" or "cosine"), every document's sum of those scores over the rows read (documents
    ascending, their sums), else two empty arrays."""
    tok = read_postings(reader, plan)
    none = np.zeros(0, np.int64), np.zeros(0)
    if not len(tok):
        return tok, np.zeros(0), *none
    s = approx_scores(reader, G, pre, tok)
    top = best_first(s.cos, s.tok, n)
    if sums is None:
        return s.tok[top], s.cos[top], *none
    docs, at = np.unique(reader.doc_of_seqs(reader.seq_of_tokens(s.tok)), return_inverse=True)
    return s.tok[top], s.cos[top], docs, np.bincount(at, weights=s.raw if sums == "raw" else s.cos, minlength=len(docs))
