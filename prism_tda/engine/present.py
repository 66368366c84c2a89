"""What a returned document shows: a snippet around its best token, the training tokens to
highlight, and the prototypes that carry its score."""

from __future__ import annotations

import dataclasses

import numpy as np
from tokenizers import Tokenizer

from .reads import Reads
from .scoring import TokenScores
from .types import Highlight, ProtoShare, ScoredDocument

WINDOW = 24  # tokens of snippet on each side of the best token
MAX_HIGHLIGHTS = 8


def scored_document(reader: Reads, tokenizer: Tokenizer, scores: TokenScores, best: int, score: float,
                    rank: int, *, opponents: bool) -> ScoredDocument:
    """The document whose best token is ``scores.tok[best]``: the snippet is the predicted tokens of
    the rows around it; highlights are the snippet's scored tokens that push the same way, weighted
    by their influence relative to the best token."""
    sign = -1.0 if opponents else 1.0
    t_best = int(scores.tok[best])
    seq = int(reader.seq_of_tokens(np.array([t_best]))[0])
    t0, t1, start = reader.seq_span(seq)
    lo, hi = max(t0, t_best - WINDOW), min(t1, t_best + WINDOW + 1)
    _, targets = reader.sequence_tokens(seq)
    ids = targets[lo - t0 : hi - t0]  # the best row's target sits inside the snippet
    offsets = [len(tokenizer.decode(ids[:n])) for n in range(len(ids) + 1)]
    snippet = tokenizer.decode(ids)
    tok, raw = scores.tok, scores.raw
    best_raw = abs(raw[best]) or 1.0
    near = np.nonzero((tok >= lo) & (tok < hi) & (sign * raw > 0))[0]
    near = near[np.argsort(-(sign * raw[near]))][:MAX_HIGHLIGHTS]
    highlights = []
    for c in sorted(near, key=lambda c: tok[c]):
        n = int(tok[c]) - lo
        a, b = offsets[n], offsets[n + 1]
        if b > a:
            highlights.append(Highlight(a, b, snippet[a:b], float(sign * raw[c] / best_raw), int(tok[c])))
    vals = sign * scores.slot_val[best]
    total = float(np.abs(vals).sum()) or 1.0
    carry = sorted((ProtoShare(int(p), float(v / total)) for p, v in zip(scores.protos[best], vals, strict=True)
                    if v != 0), key=lambda d: -d.share)
    doc = int(reader.doc_of_seqs(np.array([seq]))[0])
    return ScoredDocument(rank=rank, doc_id=doc, external_id=reader.external_id(doc), score=score,
                          raw_influence=float(raw[best]), trained=bool(reader.trained(np.array([doc]))[0]),
                          seq_id=seq, token_row=t_best,
                          position=start + t_best - t0, snippet=snippet, highlights=highlights, prototypes=carry)


def left_out_opposed(docs: list[ScoredDocument], effect: list[float]) -> tuple[list[ScoredDocument], int]:
    """``docs`` less those whose ``effect`` (a value signed so that positive drives the output the way
    asked) is <= 0, ranked again in their order; and how many were left out."""
    kept = [d for d, e in zip(docs, effect, strict=True) if e > 0]
    return [dataclasses.replace(d, rank=r) for r, d in enumerate(kept, 1)], len(docs) - len(kept)
