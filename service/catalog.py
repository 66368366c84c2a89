"""What the endpoints read besides attribution: documents, prototype rows and their top contexts.

Documents come from the shards' Parquet files by row group, top contexts from each shard's
per-prototype top tokens, both through the engine's reader (memory maps); the prototype table
(one row per prototype) is small and held in memory. User SQL never runs here
(``service/sqlpool.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow.parquet as pq

from prism_tda.engine.reader import IndexReader

ORDERS = {"mass": "mass", "n_tokens": "n_tokens", "proto_id": "proto_id"}


class Catalog:
    def __init__(self, reader: IndexReader) -> None:
        self.reader = reader
        t = pq.read_table(reader.dir / "prototypes.parquet",
                          columns=["proto_id", "n_tokens", "mass", "mean_act", "top_tokens", "label"])
        self.protos = t.to_pydict()
        self.total_mass = float(np.sum(self.protos["mass"])) or 1.0

    def documents(self, doc_ids: list[int]) -> dict[int, dict[str, Any]]:
        out = {}
        for d in dict.fromkeys(doc_ids):
            if 0 <= d < self.reader.n_docs:
                rec = self.reader.document(d)
                out[d] = {k: rec[k] for k in ("doc_id", "external_id", "source", "title", "url", "text", "n_tokens")}
        return out

    def _row(self, i: int) -> dict[str, Any]:
        return {k: v[i] for k, v in self.protos.items()}

    def prototype(self, proto_id: int) -> dict[str, Any] | None:
        if not 0 <= proto_id < len(self.protos["proto_id"]):
            return None
        row = self._row(proto_id)
        row["share"] = row["mass"] / self.total_mass
        return row

    def prototypes(self, limit: int, offset: int, order: str) -> tuple[int, list[dict[str, Any]]]:
        key = np.asarray(self.protos[ORDERS[order]])
        ids = np.asarray(self.protos["proto_id"])
        idx = np.lexsort((ids, key if order == "proto_id" else -key))
        return len(ids), [self._row(int(i)) for i in idx[offset : offset + limit]]

    def top_contexts(self, proto_id: int, n: int) -> list[dict[str, Any]]:
        """The ``n`` training tokens that activate ``proto_id`` most, with their sequence's tokens."""
        out = []
        for row, act in self.reader.top_contexts(proto_id, n):
            seq = int(self.reader.seq_of_tokens(np.array([row]))[0])
            lo, _, _ = self.reader.seq_span(seq)
            tokens, _ = self.reader.sequence_tokens(seq)
            out.append({"seq_id": seq, "pos": row - lo, "act": act,
                        "doc_id": int(self.reader.doc_of_seqs(np.array([seq]))[0]), "token_ids": tokens})
        return out
