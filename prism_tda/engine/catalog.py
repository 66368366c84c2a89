"""What an index holds besides attribution: documents, prototype rows (with labels) and their top
contexts, for the service's endpoints and the command line.

Documents come from the shards' Parquet files by row group, top contexts from each shard's
per-prototype top tokens, both through the reader (``engine/reads.py``); the prototype table
(one row per prototype) is small and held in memory.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from . import layout
from .reads import Reads, token_context

ORDERS = {"mass": "mass", "n_tokens": "n_tokens", "proto_id": "proto_id"}


class Catalog:
    def __init__(self, reader: Reads, model: Any = None, tokenizer: Any = None) -> None:
        """``model`` and ``tokenizer``: to name prototypes without a stored label (``prototype_labels``,
        computed on first use and kept)."""
        self.reader, self.model, self.tokenizer = reader, model, tokenizer
        self._labels: dict[int, str] | None = None
        self._labels_sig: tuple[int, int, int] | None = None
        self._labels_lock = threading.Lock()
        t = pq.read_table(reader.dir / layout.PROTOTYPES,
                          columns=["proto_id", "n_tokens", "mass", "mean_act", "top_tokens", "label"])
        self.protos = t.to_pydict()
        self.total_mass = float(np.sum(self.protos["mass"])) or 1.0

    def documents(self, doc_ids: list[int]) -> dict[int, dict[str, Any]]:
        out = {}
        ids = np.array([d for d in dict.fromkeys(doc_ids) if 0 <= d < self.reader.n_docs], np.int64)
        for d in ids[~self.reader.removed(ids)].tolist():  # documents taken down are not read
            rec = self.reader.document(d)
            out[d] = {k: rec[k] for k in ("doc_id", "external_id", "source", "title", "url", "text", "n_tokens")}
        return out

    def labels(self) -> dict[int, str]:
        """Each prototype's label: the stored one, else a few words from its contexts and signature."""
        sig = self.reader.takedown.signature()  # contexts of removed documents never name a prototype
        if self._labels is None or sig != self._labels_sig:
            with self._labels_lock:
                if self._labels is None or sig != self._labels_sig:
                    self._labels_sig = sig
                    made: dict[int, str] = {}
                    if self.model is not None and self.tokenizer is not None:
                        from prism_tda.engine.steering import prototype_labels

                        made = prototype_labels(self.reader, self.model, self.tokenizer)
                    stored = {int(i): lab for i, lab in zip(self.protos["proto_id"], self.protos["label"], strict=True)
                              if lab}
                    self._labels = {**made, **stored}
        return self._labels

    def _row(self, i: int) -> dict[str, Any]:
        row = {k: v[i] for k, v in self.protos.items()}
        row["label"] = self.labels().get(int(row["proto_id"]), row["label"])
        return row

    def prototype(self, proto_id: int) -> dict[str, Any] | None:
        if not 0 <= proto_id < len(self.protos["proto_id"]):
            return None
        row = self._row(proto_id)
        row["share"] = row["mass"] / self.total_mass
        return row

    def prototypes(self, limit: int, offset: int, order: str, q: str | None = None) -> tuple[int, list[dict[str, Any]]]:
        """A page of prototypes in ``order``; with ``q``, only those whose label or top tokens contain
        every word of it (case-insensitive); the total counts the matches."""
        key = np.asarray(self.protos[ORDERS[order]])
        ids = np.asarray(self.protos["proto_id"])
        idx = np.lexsort((ids, key if order == "proto_id" else -key))
        if q:
            labels = self.labels()
            want = q.lower().split()

            def hit(i: int) -> bool:
                text = " ".join([labels.get(int(ids[i]), "") or "", *(self.protos["top_tokens"][i] or [])]).lower()
                return all(w in text for w in want)

            idx = np.array([i for i in idx if hit(int(i))], dtype=np.int64)
        return len(idx), [self._row(int(i)) for i in idx[offset : offset + limit]]

    def top_contexts(self, proto_id: int, n: int) -> list[dict[str, Any]]:
        """The ``n`` training tokens that activate ``proto_id`` most, with their sequence's tokens."""
        out = []
        for row, act in self.reader.top_contexts(proto_id, n):
            seq, doc, pos, tokens = token_context(self.reader, row)
            out.append({"seq_id": seq, "pos": pos, "act": act, "doc_id": doc, "token_ids": tokens})
        return out
