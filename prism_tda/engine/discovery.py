"""A discovery's report, as the service and the command line show it: each discovered prototype with
its label, ratio, support and strongest topic contexts as text (``engine/steering.py`` ranks them)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .attributor import Attributor
from .catalog import Catalog
from .reads import token_context


def context_text(tok: Any, ids: list[int], pos: int) -> dict[str, str]:
    """The token at ``pos`` of ``ids`` and a little of the text around it, as a context is shown."""
    return {"before": tok.decode(ids[max(0, pos - 12): pos]), "token": tok.decode(ids[pos: pos + 1]),
            "after": tok.decode(ids[pos + 1: pos + 6])}


def discover_report(att: Attributor, catalog: Catalog, *, topic: dict[str, Any], contrast: dict[str, Any] | None,
                    top_n: int = 20, min_support: int = 5, min_docs: int = 2, smoothing: float = 0.5,
                    include_untrained: bool = False, contexts: int = 3, measure: str = "activation",
                    max_tokens: int | None = None, stop: threading.Event | None = None) -> dict[str, Any]:
    """Prototypes that carry a topic (``engine/steering.py``), with evidence; for the API and the CLI.
    ``topic``/``contrast``: {"texts": [...]} or {"doc_ids": [...]} (SQL resolved to ids by the caller)."""
    tok = att.tokenizer
    ranked, t_mass, c_mass, what = att.discover(
        topic_texts=topic.get("texts"), topic_docs=topic.get("doc_ids"),
        contrast_texts=(contrast or {}).get("texts"), contrast_docs=(contrast or {}).get("doc_ids"),
        include_untrained=include_untrained, n=top_n, min_support=min_support, min_docs=min_docs,
        smoothing=smoothing, measure=measure, max_tokens=max_tokens, stop=stop)
    texts = topic.get("texts")
    encoded = [tok.encode(t).ids for t in texts] if texts is not None else None
    out = []
    for d in ranked:
        ctx = []
        for act, where in d.contexts[:contexts]:
            if encoded is not None:
                assert isinstance(where, tuple)
                text_index, pos = int(where[0]), int(where[1])
                ids, doc = encoded[text_index], None
            else:
                assert isinstance(where, int | np.integer)  # a global token row
                _, doc, pos, ids = token_context(att.reader, int(where))
                text_index = None
            ctx.append({"act": float(act), "doc_id": doc, "text_index": text_index, **context_text(tok, ids, pos)})
        info = catalog.prototype(d.proto_id) or {}
        out.append({"proto_id": d.proto_id, "label": info.get("label"), "score": d.score,
                    "ratio": float(np.exp(d.score)), "topic_share": d.topic_share,
                    "topic_support": d.topic_support, "topic_docs": d.topic_docs,
                    "contrast_support": d.contrast_support, "contexts": ctx})
    t_src = "texts" if texts is not None else "documents"
    return {"measure": measure, "topic": {"source": t_src, "tokens": t_mass.n_tokens, "documents": t_mass.n_docs},
            "contrast": {"source": what, "tokens": c_mass.n_tokens, "documents": c_mass.n_docs},
            "prototypes": out}


