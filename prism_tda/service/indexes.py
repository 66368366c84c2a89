"""The indexes a server holds: each one's attributor (model, curvature, FAISS), store and limits.

Everything here is loaded once at start-up and read-only afterwards, so concurrent requests can
share it; the methods are synchronous and CPU-bound, and the routes run them in worker threads.

A served index can be replaced while the server runs (:meth:`Registry.swap`): the new version is
loaded beside the old one, checked to come from the same checkpoint and tokenizer, and then the
registry's mapping is replaced in one assignment. A request holds the ``LoadedIndex`` it looked up
for its whole life, so in-flight requests finish on the old version; its DuckDB store is closed
when the last of them lets go of it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prism_tda.engine import Attribution, Attributor, QueryOptions, QuerySpec
from prism_tda.engine.catalog import Catalog
from prism_tda.engine.discovery import context_text, discover_report
from prism_tda.engine.layout import IndexManifest
from prism_tda.engine.reads import read_complete_manifest
from prism_tda.errors import PrismError
from prism_tda.model.generate import Generation, generate

from . import problems
from .settings import Settings
from .sqlengine import TABLES
from .sqlpool import SqlLimits, SqlPool

log = logging.getLogger("prism.service")


@dataclass
class LoadedIndex:
    name: str
    dir: Path
    attributor: Attributor
    catalog: Catalog
    sql: SqlPool
    load_seconds: float

    @classmethod
    def load(cls, name: str, index_dir: Path, settings: Settings) -> LoadedIndex:
        t0 = time.perf_counter()
        att = Attributor.open(index_dir, exact_token_limit=settings.exact_max_tokens, cluster=settings.cluster())
        sql = SqlPool(index_dir, SqlLimits.from_settings(settings), settings.state_dir / "state.sqlite3")
        ix = cls(name, Path(index_dir), att, Catalog(att.reader, att.model, att.tokenizer), sql, time.perf_counter() - t0)
        log.info("index loaded", extra={"index": name, "dir": str(index_dir), "seconds": round(ix.load_seconds, 2),
                                        "documents": ix.n_documents, "prototypes": ix.n_prototypes})
        return ix

    # ------------------------------------------------------------------------ facts
    @property
    def manifest(self) -> IndexManifest:
        return self.attributor.manifest

    @property
    def n_prototypes(self) -> int:
        return self.attributor.model.cfg.n_prototypes

    @property
    def n_documents(self) -> int:
        return self.manifest.documents

    def info(self) -> dict[str, Any]:
        m = self.manifest
        return {"name": self.name, "documents": m.documents, "sequences": m.sequences, "tokens": m.tokens,
                "prototypes": self.n_prototypes, "context": self.attributor.encoder.context,
                "vocab_size": self.attributor.model.cfg.vocab_size, "tables": list(TABLES),
                "shards": len(self.manifest.shards),
                "shard_holders": len(getattr(self.attributor.shards, "groups", [None]))}

    # ------------------------------------------------------------------------ checks
    def check_query(self, spec: QuerySpec) -> None:
        """Refuse a query that cannot succeed before any work (QueryError -> 422)."""
        self.attributor.encoder.check(spec)

    def check_prototypes(self, ids: list[int], field: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.n_prototypes]
        if bad:
            raise problems.InvalidPrototype(f"{field}: prototype id(s) {bad[:10]} out of range "
                                            f"[0, {self.n_prototypes})")

    # ------------------------------------------------------------------------ work
    def attribute(self, spec: QuerySpec, options: QueryOptions, stop: threading.Event | None = None) -> Attribution:
        return self.attributor.attribute(spec, options, stop=stop)

    def check_exact_time(self, limit_s: float, *, audit: bool = False) -> None:
        """Refuse ``mode: exact`` for one request (``audit``: for each item of an audit) when its estimate is
        over ``limit_s`` seconds, with the estimate and the way to run it anyway (an audit, in the background)."""
        self.attributor.check_exact()
        est = self.attributor.exact_estimate()
        if est.seconds > limit_s and audit:
            raise problems.InvalidQuery(
                f"mode: 'exact' recomputes all {est.tokens:,} training tokens of index {self.name!r}, about "
                f"{est.seconds:,.0f} s an item at this server's measured {est.tokens_per_s:,.0f} tokens/s: over its "
                f"limit of {limit_s:g} s for one audit item (audit_item_max_s). Use mode 'fast'")
        if est.seconds > limit_s:
            raise problems.InvalidQuery(
                f"mode: 'exact' recomputes all {est.tokens:,} training tokens of index {self.name!r}, about "
                f"{est.seconds:,.0f} s at this server's measured {est.tokens_per_s:,.0f} tokens/s: over its limit "
                f"of {limit_s:g} s for one request. Submit the same query as an audit item (POST /v1/audits) "
                "to run it in the background, or use mode 'fast'")

    def generate(self, prompt: str, *, max_new_tokens: int, temperature: float, sample_top_k: int | None,
                 seed: int, scale: dict[int, float], gate: float | None = None,
                 gate_window: int = 16, stop: threading.Event | None = None) -> tuple[Generation, int]:
        """A continuation of ``prompt`` and the prompt's length in tokens; ``scale``: prototype id -> the
        factor its activations are multiplied by (with ``gate``, only where the context carries them)."""
        tokens = self.attributor.encoder.check(QuerySpec(prompt))
        gen = generate(self.attributor.model, self.attributor.tokenizer, tokens.prompt, max_new_tokens,
                       temperature=temperature, sample_top_k=sample_top_k, seed=seed, suppress=scale, gate=gate,
                       gate_window=gate_window, stop=stop)
        return gen, len(tokens.prompt)

    def discover(self, **kw: Any) -> dict[str, Any]:
        """Prototypes that carry a topic, with evidence (:func:`discover_report`)."""
        return discover_report(self.attributor, self.catalog, **kw)

    def prototype(self, proto_id: int, n_contexts: int, n_signature: int) -> dict[str, Any]:
        if not 0 <= proto_id < self.n_prototypes:
            raise problems.PrototypeNotFound(f"prototype {proto_id} does not exist in index {self.name!r} "
                                             f"(ids 0..{self.n_prototypes - 1})")
        row = self.catalog.prototype(proto_id)
        if row is None:
            raise problems.PrototypeNotFound(f"prototype {proto_id} has no row in index {self.name!r}")
        model, tok = self.attributor.model, self.attributor.tokenizer
        vals, idx = model.signatures(torch.tensor([proto_id]), n_signature)
        signature = [{"token_id": int(i), "token": tok.decode([int(i)]), "logit": float(v)}
                     for v, i in zip(vals[0], idx[0], strict=True)]
        contexts = []
        for c in self.catalog.top_contexts(proto_id, n_contexts) if n_contexts else []:
            contexts.append({"doc_id": c["doc_id"], "seq_id": c["seq_id"], "pos": c["pos"], "act": float(c["act"]),
                             **context_text(tok, c["token_ids"], c["pos"])})
        return {"proto_id": proto_id, "label": row["label"], "n_tokens": int(row["n_tokens"]),
                "mass": float(row["mass"]), "share": float(row["share"] or 0.0), "mean_act": float(row["mean_act"]),
                "top_tokens": list(row["top_tokens"] or []), "signature": signature, "top_contexts": contexts}

    def close(self) -> None:
        self.sql.close()
        self.attributor.close()


def _close_parts(sql: SqlPool, attributor: Attributor) -> None:
    sql.close()
    attributor.close()


# What must stay equal between the served index and its replacement: the model and its tokenizer.
SWAP_IDENTITY = ("checkpoint_sha256", "tokenizer_sha256")


def read_identity(index_dir: Path) -> dict[str, Any]:
    """The manifest identity of a complete index directory, or :class:`InvalidIndex`."""
    try:
        return dict(read_complete_manifest(index_dir).identity)
    except (OSError, ValueError, PrismError) as e:
        raise problems.InvalidIndex(f"dir: {e}") from None


class Registry:
    """The loaded indexes by name, and the default one.

    ``indexes`` is never changed in place: a swap assigns a new dict, so a reader always sees one
    consistent mapping without taking a lock.
    """

    def __init__(self, indexes: dict[str, LoadedIndex], default: str, settings: Settings | None = None) -> None:
        self.indexes, self.default = indexes, default
        self.settings = settings
        self._swap_lock = threading.Lock()

    @classmethod
    def load(cls, settings: Settings) -> Registry:
        loaded = {name: LoadedIndex.load(name, Path(d), settings) for name, d in settings.indexes.items()}
        return cls(loaded, settings.default or next(iter(loaded)), settings)

    def get(self, name: str | None) -> LoadedIndex:
        ix = self.indexes.get(name or self.default)
        if ix is None:
            raise problems.UnknownIndex(f"index: {name!r} is not served here; choose one of {sorted(self.indexes)}")
        return ix

    def swap(self, name: str, new_dir: str | Path | None = None) -> tuple[LoadedIndex, LoadedIndex]:
        """Load a new version of index ``name`` (from ``new_dir``, default: the directory it is served
        from, read again) and put it in place; return (old, new). Swaps run one at a time; requests
        keep being answered by the old version until the assignment, and the old version keeps
        serving when anything goes wrong."""
        assert self.settings is not None, "a registry built without settings cannot load indexes"
        with self._swap_lock:
            old = self.get(name)
            target = Path(new_dir) if new_dir is not None else old.dir
            target = target if target.is_absolute() else Path.cwd() / target
            served = {k: old.manifest.identity.get(k) for k in SWAP_IDENTITY}
            ident = read_identity(target)
            diff = {k: (served[k], ident.get(k)) for k in SWAP_IDENTITY if ident.get(k) != served[k]}
            if diff:
                raise problems.IndexMismatch(
                    f"dir: {target} was built from another model than index {name!r} serves "
                    + "; ".join(f"{k}: served {a}, new {b}" for k, (a, b) in diff.items())
                    + ". A swap keeps the model; serve an index of another model under another name or restart.")
            try:
                new = LoadedIndex.load(name, target, self.settings)
            except PrismError as e:
                raise problems.InvalidIndex(f"dir: {target} cannot be loaded: {e}") from None
            self.indexes = {**self.indexes, name: new}
            # The old version's store closes once no in-flight request holds the old object.
            # (the callback must not hold ``old`` itself, or it would never be collected)
            weakref.finalize(old, _close_parts, old.sql, old.attributor)
        log.info("index swapped", extra={"index": name, "old_dir": str(old.dir), "new_dir": str(new.dir),
                                         "documents": new.n_documents, "seconds": round(new.load_seconds, 2)})
        return old, new

    def close(self) -> None:
        for ix in self.indexes.values():
            ix.close()
