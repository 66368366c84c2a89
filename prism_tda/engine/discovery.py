"""A discovery's report, as the service and the command line show it: each discovered prototype with
its label, ratio, support and strongest topic contexts as text (``engine/steering.py`` ranks them)."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from prism_tda.errors import QueryError

from .attributor import Attributor
from .catalog import Catalog
from .reads import token_context
from .steering import EffectTexts, select_by_effect

Progress = Callable[[str, int, int], None]  # (stage, done, total)


def context_text(tok: Any, ids: list[int], pos: int) -> dict[str, str]:
    """The token at ``pos`` of ``ids`` and a little of the text around it, as a context is shown."""
    return {"before": tok.decode(ids[max(0, pos - 12): pos]), "token": tok.decode(ids[pos: pos + 1]),
            "after": tok.decode(ids[pos + 1: pos + 6])}


def discover_report(att: Attributor, catalog: Catalog, *, topic: dict[str, Any], contrast: dict[str, Any] | None,
                    top_n: int = 20, min_support: int = 5, min_docs: int = 2, smoothing: float = 0.5,
                    include_untrained: bool = False, contexts: int = 3, measure: str = "activation",
                    max_tokens: int | None = None, stop: threading.Event | None = None,
                    select: str = "ratio", max_selected: int | None = None, max_ppl_ratio: float = 1.02,
                    progress: Progress | None = None) -> dict[str, Any]:
    """Prototypes that carry a topic (``engine/steering.py``), with evidence; for the API and the CLI.
    ``topic``/``contrast``: {"texts": [...]} or {"doc_ids": [...]} (SQL resolved to ids by the caller).
    ``select="effect"``: also choose, from the ranked prototypes, the set whose suppression most raises
    the model's loss on the topic relative to the contrast, within ``max_selected`` prototypes (default 2%
    of the bank) and a contrast perplexity ratio of ``max_ppl_ratio`` (:func:`effect_selection`).
    ``progress(stage, done, total)``: called as each stage advances (``ranking``, then with ``select="effect"``
    ``model`` over the selection's text windows and ``selection`` over candidate evaluations)."""
    if select not in SELECTIONS:
        raise QueryError(f"select: must be one of {list(SELECTIONS)}, got {select!r}")
    tok = att.tokenizer
    ranked, t_mass, c_mass, what = att.discover(
        topic_texts=topic.get("texts"), topic_docs=topic.get("doc_ids"),
        contrast_texts=(contrast or {}).get("texts"), contrast_docs=(contrast or {}).get("doc_ids"),
        include_untrained=include_untrained, n=top_n, min_support=min_support, min_docs=min_docs,
        smoothing=smoothing, measure=measure, max_tokens=max_tokens, stop=stop)
    if progress is not None:
        progress("ranking", 1, 1)
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
    res = {"measure": measure, "topic": {"source": t_src, "tokens": t_mass.n_tokens, "documents": t_mass.n_docs},
           "contrast": {"source": what, "tokens": c_mass.n_tokens, "documents": c_mass.n_docs},
           "prototypes": out, "selection": None}
    if select == "effect":
        budget = max_selected or max(1, int(0.02 * att.reader.n_prototypes))
        res["selection"] = effect_selection(att, encoded, topic.get("doc_ids"), contrast, [d.proto_id for d in ranked],
                                            budget=budget, max_ppl_ratio=max_ppl_ratio, max_tokens=max_tokens,
                                            stop=stop, include_untrained=include_untrained, progress=progress)
    return res


SELECTIONS = ("ratio", "effect")
EFFECT_CONTRAST_DOCS = 256  # documents sampled (seeded) from the rest of the corpus when no contrast is given
EFFECT_MAX_TOKENS = 50_000  # tokens per side run through the model for the selection (the first texts that fit)


def effect_selection(att: Attributor, topic_ids: list[list[int]] | None, topic_docs: Any, contrast: dict | None,
                     candidates: list[int], *, budget: int, max_ppl_ratio: float, max_tokens: int | None,
                     stop: threading.Event | None, include_untrained: bool = False,
                     progress: Progress | None = None) -> dict[str, Any]:
    """Greedy selection by measured effect (``engine/steering.py``, ``select_by_effect``) over ``candidates``:
    the topic's texts (or its documents' texts) against the contrast's texts, documents, or a seeded sample
    of the corpus's other trained documents; each side cut at ``EFFECT_MAX_TOKENS`` tokens."""
    tok, reader = att.tokenizer, att.reader
    cap = min(EFFECT_MAX_TOKENS, max_tokens or EFFECT_MAX_TOKENS)

    def doc_ids_tokens(docs: np.ndarray) -> list[list[int]]:  # each document read only while under the cap
        return capped(tok.encode(str(reader.document(int(d))["text"])).ids for d in docs)

    def capped(texts: Iterable[list[int]]) -> list[list[int]]:
        out, n = [], 0
        for ids in texts:
            if n >= cap:
                break
            out.append(ids)
            n += len(ids)
        return out

    t0 = time.perf_counter()
    if topic_ids is not None:
        side = capped(topic_ids)
    else:  # the documents discovery ranked from: not taken down, trained unless asked otherwise
        tdocs = np.asarray(topic_docs, np.int64)
        tdocs = tdocs[~reader.removed(tdocs) & (reader.trained(tdocs) | include_untrained)]
        side = doc_ids_tokens(tdocs)
    if contrast and contrast.get("texts") is not None:
        other, source = capped([tok.encode(t).ids for t in contrast["texts"]]), "texts"
        contrast_docs: np.ndarray | None = None
    else:
        if contrast and contrast.get("doc_ids") is not None:
            pool, source = np.asarray(contrast["doc_ids"], np.int64), "documents"
        else:
            docs = np.arange(reader.n_docs)
            keep = reader.trained(docs) & ~reader.removed(docs)
            if topic_docs is not None:
                keep &= ~np.isin(docs, np.asarray(topic_docs, np.int64))
            pool = docs[keep]
            pool = np.random.default_rng(0).permutation(pool)[:EFFECT_CONTRAST_DOCS]
            source = f"{len(pool)} documents sampled from the rest of the corpus"
        other = doc_ids_tokens(pool)
        contrast_docs = pool[: len(other)]  # ``capped`` keeps a prefix
    texts = EffectTexts.of(att.model, (side, [], other), stop=stop,
                           on_progress=None if progress is None else functools.partial(progress, "model"))
    steps = select_by_effect(att.model, texts, candidates, budget=budget, max_ppl_ratio=max_ppl_ratio, stop=stop,
                             on_progress=None if progress is None else functools.partial(progress, "selection"))
    chosen = [st.proto_id for st in steps]
    strengths = texts.strengths(att.model, chosen)
    cost = []
    for c in texts.cost_by_text(att.model, chosen):
        j = int(c["text"])
        ids = other[j]
        cost.append({"doc_id": int(contrast_docs[j]) if contrast_docs is not None else None,
                     "text_index": None if contrast_docs is not None else j, "tokens": c["tokens"],
                     "extra_nats": c["extra_nats"], "share": c["share"], "snippet": tok.decode(ids[:24])})
    return {"rule": "effect", "budget": budget, "max_ppl_ratio": max_ppl_ratio, "contrast": source,
            "topic_tokens": int((texts.group == 0).sum()), "contrast_tokens": int((texts.group == 2).sum()),
            "candidates": len(candidates), "seconds": round(time.perf_counter() - t0, 3),
            "prototypes": chosen,
            "steps": [{"proto_id": st.proto_id, "effect": st.effect, "topic_loss_increase": st.topic_loss_increase,
                       "contrast_loss_increase": st.other_loss_increase, "contrast_ppl_ratio": st.contrast_ppl_ratio}
                      for st in steps],
            "cost_by_text": cost, "strengths": strengths}


