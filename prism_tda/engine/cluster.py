"""Serving an index from a Ray cluster: shard holders as Ray actors, one coordinator that merges.

Each actor (:class:`ShardActor`) opens some of the index's shards through the same memory maps a
single process uses (a :class:`~.shards.ShardWorker`), placed by size so every actor holds about
as many tokens. The coordinator (the API process) keeps the model and the index-wide parts, sends a
query's gradient to every actor at each step and merges their answers (``engine/shards.py``), so a
cluster returns the single-process answer. The actors need the index directory at the same path
(shared storage); the coordinator reads only its index-wide files and what the actors send.

Failure: actors are restarted by Ray (``max_restarts=-1``). A call that fails because its actor
died is sent once more (Ray holds it until the actor is back); if that fails too, or an actor does
not answer within ``call_timeout_s``, the query fails with :class:`ShardUnavailable` naming the
shards (the service answers 503), unless the caller allowed a partial answer, which then says
which shards are missing.
"""

from __future__ import annotations

import collections
import functools
import logging
import operator
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prism_tda.errors import PrismError, ShardUnavailable, check_stop

from .arrays import unique
from .candidates import PostingPlan
from .query import Targets
from .reads import IndexWide, read_complete_manifest
from .scoring import Preconditioner, PreconditionerCache
from .shards import (
    CallContext,
    CallStats,
    Sequences,
    ShardWorker,
    Shortlist,
    merge_best_tokens,
    merge_document_sums,
    merge_search,
    merge_shortlists,
    place_shards,
)
from .steering import PrototypeMass
from .types import Aggregation

log = logging.getLogger("prism.cluster")

SEQ_CACHE = 16384  # sequences the coordinator keeps of what the actors sent (about 1 KB each)
SEQ_BLOCK = 256  # sequences fetched at once when the coordinator reads sequences in order

# a Ray started by this process stops when the last RayShards using it closes (not at the first:
# a swapped index's new version opens before the old one closes)
_ray_users = 0
_ray_started_here = False
_ray_lock = threading.Lock()


@dataclass(frozen=True)
class ClusterSpec:
    """Where and how to hold the shards."""

    address: str | None = None  # a Ray address ("auto", "ray://head:10001"); None: a Ray started here
    actors: int | None = None  # shard holders; None: one per shard
    num_cpus: float = 0.5  # CPUs reserved per actor (fractional: whole-CPU actors starve small machines)
    threads: int = 1  # torch threads per actor
    call_timeout_s: float = 30.0  # longest wait for one actor's answer (a restart included)
    start_timeout_s: float = 120.0  # longest wait for every actor to open its shards
    namespace: str = "prism"

    def __post_init__(self) -> None:
        if self.actors is not None and self.actors < 1:
            raise ValueError(f"actors: must be >= 1, got {self.actors}")
        if not self.num_cpus > 0:
            raise ValueError(f"num_cpus: must be > 0, got {self.num_cpus}")
        if not self.call_timeout_s > 0:
            raise ValueError(f"call_timeout_s: must be > 0, got {self.call_timeout_s}")


def unembedding(checkpoint: str | Path) -> torch.Tensor:
    """The unembedding ``W`` (V, d) of a checkpoint, read alone from its weights file."""
    from safetensors import safe_open

    from prism_tda.model import checkpoint as ckpt

    path = ckpt.resolve(checkpoint) / ckpt.WEIGHTS
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("wte.weight")


class ShardActor:
    """A Ray actor around a :class:`ShardWorker`: every call returns (result, its statistics). It
    reads what it needs from the index and the checkpoint itself, so Ray can restart it anywhere."""

    # the calls whose curvature crosses the Ray edge as its damping (a float), and where it stands
    PRECONDITIONED = {"first_stages": 4, "shortlist": 1, "document_values": 1}

    def __init__(self, index_dir: str, checkpoint: str, shards: list[int], threads: int) -> None:
        torch.set_num_threads(max(1, threads))
        self.worker = ShardWorker.open(index_dir, unembedding(checkpoint), shards)
        self.pre = PreconditionerCache(self.worker.reader)  # this process's one cache

    def call(self, method: str, *args: Any, **kw: Any) -> tuple[Any, CallStats | None]:
        self.worker.last = None
        at = self.PRECONDITIONED.get(method)
        if at is not None:
            args = (*args[:at], self.pre.get(args[at]), *args[at + 1:])
        out = getattr(self.worker, method)(*args, **kw)
        return out, self.worker.last

    def pid(self) -> int:
        return os.getpid()


Observer = Callable[[int, str, float, CallStats], None]  # (holder, method, queue seconds, stats)


class RayShards:
    """The shards of one index held by Ray actors; each method fans out and merges."""

    def __init__(self, index_dir: str | Path, checkpoint: str | Path, spec: ClusterSpec) -> None:
        """``checkpoint``: the model the index was built from (the actors read its unembedding)."""
        import ray

        self.spec = spec
        self.dir = Path(index_dir).resolve()
        manifest = read_complete_manifest(self.dir)
        infos = manifest.shards
        if not infos:
            raise PrismError(f"{self.dir}: the index has no shards to serve")
        global _ray_users, _ray_started_here
        with _ray_lock:
            if not ray.is_initialized():
                if spec.address:
                    ray.init(address=spec.address, namespace=spec.namespace, log_to_driver=False)
                else:
                    ray.init(include_dashboard=False, log_to_driver=False, namespace=spec.namespace,
                             object_store_memory=128 * 1024**2)
                _ray_started_here = True
            _ray_users += 1
        self._closed = False
        self.groups = place_shards([s.n_tokens for s in infos], spec.actors or len(infos))
        self.holder_of_shard = np.zeros(len(infos), dtype=np.int64)
        for g, shards in enumerate(self.groups):
            self.holder_of_shard[shards] = g
        self.tok_base, self.seq_base, self.doc_base = manifest.bases()
        actor_cls: Any = ray.remote(ShardActor)
        ck = str(Path(checkpoint).resolve())
        self.actors = [actor_cls.options(num_cpus=spec.num_cpus, max_restarts=-1, max_task_retries=0)
                       .remote(str(self.dir), ck, shards, spec.threads) for shards in self.groups]
        self.observer: Observer | None = None
        try:
            ray.get([a.pid.remote() for a in self.actors], timeout=spec.start_timeout_s)
        except Exception as e:
            self.close()
            raise PrismError(f"{self.dir}: the shard actors did not start within {spec.start_timeout_s:g} s: {e}") from e
        log.info("shard actors ready", extra={"index": str(self.dir), "actors": len(self.actors),
                                              "shards": [list(g) for g in self.groups]})

    # ------------------------------------------------------------------------ routing
    def holders_of(self, ids: np.ndarray, base: np.ndarray) -> np.ndarray:
        """The holder of each global id (tokens, sequences or documents by ``base``)."""
        shard = np.searchsorted(base, np.asarray(ids, np.int64), side="right") - 1
        if len(shard) and (shard.min() < 0 or shard.max() >= len(self.holder_of_shard)):
            raise PrismError(f"{self.dir}: ids out of range of the index")
        return self.holder_of_shard[shard]

    def split(self, ids: np.ndarray, base: np.ndarray) -> dict[int, np.ndarray]:
        """``ids`` by holder (each part in the order given)."""
        ids = np.asarray(ids, np.int64)
        h = self.holders_of(ids, base)
        return {int(g): ids[h == g] for g in unique(h)}

    # ------------------------------------------------------------------------ calls
    def call(self, calls: dict[int, tuple[str, tuple, dict]], ctx: CallContext | None = None) -> dict[int, Any]:
        """Run ``{holder: (method, args, kwargs)}`` at once; each failure is retried once; results by
        holder. A holder that fails twice raises :class:`ShardUnavailable`, or with a partial context
        is left out and its shards recorded as missing."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        def send(g: int) -> tuple[Any, float]:
            method, args, kw = calls[g]
            return self.actors[g].call.remote(method, *args, **kw), time.time()

        sent = {g: send(g) for g in calls}
        out, failed = {}, {}
        for g in calls:
            for attempt in (0, 1):
                ref, t_sent = sent[g]
                try:
                    result, stats = ray.get(ref, timeout=self.spec.call_timeout_s)
                except (RayActorError, GetTimeoutError) as e:
                    if attempt == 0:
                        log.warning("shard call failed, retrying once",
                                    extra={"holder": g, "shards": self.groups[g], "method": calls[g][0],
                                           "error": type(e).__name__})
                        sent[g] = send(g)
                        continue
                    failed[g] = type(e).__name__
                    break
                if stats is not None and self.observer is not None:
                    self.observer(g, calls[g][0], max(0.0, stats.started - t_sent), stats)
                out[g] = result
                break
        if failed:
            shards = sorted(s for g in failed for s in self.groups[g])
            if ctx is not None and ctx.partial:
                ctx.missing.update(shards)
            else:
                raise ShardUnavailable(shards, ", ".join(sorted(set(failed.values()))))
        return out

    def everyone(self, method: str, *args: Any, ctx: CallContext | None = None, **kw: Any) -> list[Any]:
        return list(self.call({g: (method, args, kw) for g in range(len(self.actors))}, ctx).values())

    # ------------------------------------------------------------------------ the query's steps
    def first_stages(self, e: np.ndarray | None, n: int, nprobe: int | None, G: torch.Tensor, pre: Preconditioner,
                     plan: PostingPlan | None, n_tokens: int, ctx: CallContext | None = None,
                     sums: str | None = None, n_summed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        parts = self.everyone("first_stages", e, n, nprobe, G, pre.damping, plan, n_tokens, sums, ctx=ctx)
        return (merge_search([p[0] for p in parts], n), merge_best_tokens([p[1] for p in parts], n_tokens),
                merge_document_sums([p[2] for p in parts], n_summed))

    def shortlist(self, G: torch.Tensor, pre: Preconditioner, seqs: np.ndarray, aggregation: Aggregation, *,
                  opponents: bool, n: int, m: int | None, match: Targets | None, include_untrained: bool,
                  ctx: CallContext | None = None, whole: bool = True) -> Shortlist:
        kw = dict(opponents=opponents, n=n, m=m, match=match, include_untrained=include_untrained, whole=whole)
        parts = self.call({g: ("shortlist", (G, pre.damping, s, aggregation), kw)
                           for g, s in self.split(unique(seqs), self.seq_base).items()}, ctx)
        return merge_shortlists(list(parts.values()), n, -1.0 if opponents else 1.0)

    def document_values(self, G: torch.Tensor, pre: Preconditioner, docs: np.ndarray, skip: np.ndarray,
                        ctx: CallContext | None = None) -> np.ndarray:
        """Each holder values its own documents (the rows of ``skip`` it holds left out)."""
        docs = np.asarray(docs, np.int64)
        out = np.zeros((len(docs), 2))
        if not len(docs):
            return out
        holder = self.holders_of(docs, self.doc_base)
        rows = self.split(skip, self.tok_base)
        parts = self.call({g: ("document_values", (G, pre.damping, docs[holder == g], rows.get(g, np.zeros(0, np.int64))),
                               {}) for g in unique(holder).tolist()}, ctx)
        for g, v in parts.items():
            out[holder == g] = v
        return out

    def prototype_mass(self, docs: np.ndarray, measure: str = "activation",
                       signature: torch.Tensor | None = None, stop: threading.Event | None = None) -> PrototypeMass:
        """Summed over the holders, which run in parallel (``stop`` is checked before the calls only: a
        running actor call is not interrupted)."""
        check_stop(stop, "prototype discovery")
        parts = self.call({g: ("prototype_mass", (d, measure, signature), {})
                           for g, d in self.split(unique(docs), self.doc_base).items()})
        if not parts:
            raise PrismError(f"{self.dir}: no documents given")
        return functools.reduce(operator.add, parts.values())  # holders' documents are disjoint: counts add up

    def pids(self) -> list[int]:
        """Each actor's process id (for operators and tests)."""
        import ray

        return ray.get([a.pid.remote() for a in self.actors], timeout=self.spec.call_timeout_s)

    def close(self) -> None:
        import ray

        for a in getattr(self, "actors", []):
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001  (an actor already gone)
                pass
        self.actors = []
        global _ray_users, _ray_started_here
        with _ray_lock:
            if self._closed:
                return
            self._closed = True
            _ray_users -= 1
            if _ray_users == 0 and _ray_started_here and ray.is_initialized():
                ray.shutdown()
                _ray_started_here = False


class RemoteReader(IndexWide):
    """The coordinator's reads (``engine/reads.py``) of an index whose shards Ray actors hold: the
    index-wide parts read here, everything of a shard asked from the actor holding it and cached
    (bounded) for the queries that follow."""

    def __init__(self, index_dir: str | Path, W: torch.Tensor, remote: RayShards) -> None:
        super().__init__(index_dir, W)
        self.remote = remote
        self._lock = threading.Lock()
        self._seqs: collections.OrderedDict[int, tuple[int, int, int, int, np.ndarray, np.ndarray]] = \
            collections.OrderedDict()
        self._docs: collections.OrderedDict[int, tuple[str, bool]] = collections.OrderedDict()

    # ------------------------------------------------------------------------ cache
    def _store(self, got: Sequences) -> None:
        with self._lock:
            for i, s in enumerate(got.seq):
                self._seqs[int(s)] = (int(got.first[i]), int(got.end[i]), int(got.start[i]), int(got.doc[i]),
                                      got.tokens[i], got.targets[i])
            for d, ext, tr in zip(got.doc_ids, got.external_id, got.trained, strict=True):
                self._docs[int(d)] = (ext, bool(tr))
            while len(self._seqs) > SEQ_CACHE:
                self._seqs.popitem(last=False)
            while len(self._docs) > SEQ_CACHE:
                self._docs.popitem(last=False)

    def _fetch(self, seqs: np.ndarray, ctx: CallContext | None = None) -> None:
        parts = self.remote.call({g: ("sequences", (s,), {}) for g, s in self.remote.split(seqs, self.seq_base).items()},
                                 ctx)
        for got in parts.values():
            self._store(got)

    def _ask(self, method: str, ids: np.ndarray, base: np.ndarray) -> np.ndarray:
        """``method`` of each id's holder for the ids ``ids`` (global, by ``base``), in their order."""
        by = self.remote.split(ids, base)
        parts = self.remote.call({g: (method, (part,), {}) for g, part in by.items()})
        lookup = {i: v for g, part in by.items() for i, v in zip(part.tolist(), np.asarray(parts[g]).tolist(), strict=True)}
        return np.array([lookup[int(i)] for i in ids])

    def prefetch(self, seqs: np.ndarray, ctx: CallContext | None = None) -> None:
        seqs = unique(np.asarray(seqs, np.int64))
        missing = np.array([s for s in seqs if int(s) not in self._seqs], dtype=np.int64)
        if len(missing):
            self._fetch(missing, ctx)

    def _seq(self, seq: int) -> tuple[int, int, int, int, np.ndarray, np.ndarray]:
        got = self._seqs.get(seq)
        if got is None:
            # reading in order (the exact path's pass): the next block of the same shard at once
            shard = int(np.searchsorted(self.seq_base, seq, side="right") - 1)
            self._fetch(np.arange(seq, min(seq + SEQ_BLOCK, int(self.seq_base[shard + 1])), dtype=np.int64))
            got = self._seqs.get(seq)
            if got is None:
                raise PrismError(f"{self.dir}: sequence {seq} could not be read from its shard")
        return got

    @functools.cached_property
    def list_sizes(self) -> np.ndarray:
        """As the reduce wrote them, or (an index without the file) its holders' sums."""
        sizes = self.stored_list_sizes()
        return sizes if sizes is not None else np.sum(self.remote.everyone("list_sizes"), axis=0)

    def close(self) -> None:
        with self._lock:
            self._seqs.clear()
            self._docs.clear()

    # ------------------------------------------------------------------------ the reads
    def seq_span(self, seq: int) -> tuple[int, int, int]:
        first, end, start, _, _, _ = self._seq(int(seq))
        return first, end, start

    def sequence_tokens(self, seq: int) -> tuple[list[int], list[int]]:
        _, _, _, _, tokens, targets = self._seq(int(seq))
        return tokens.astype(np.int64).tolist(), targets.astype(np.int64).tolist()

    def sequences_tokens(self, seqs: np.ndarray) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        got = [self._seq(int(s)) for s in np.asarray(seqs, np.int64)]
        return (np.array([g[0] for g in got], dtype=np.int64),
                [(g[4].astype(np.int64), g[5].astype(np.int64)) for g in got])

    def doc_of_seqs(self, seqs: np.ndarray) -> np.ndarray:
        return np.array([self._seq(int(s))[3] for s in seqs], dtype=np.int64)

    def seq_of_tokens(self, tok: np.ndarray) -> np.ndarray:
        tok = np.asarray(tok, np.int64)
        with self._lock:
            known = np.array([(v[0], v[1], s) for s, v in self._seqs.items()], dtype=np.int64).reshape(-1, 3)
        known = known[np.argsort(known[:, 0])]
        at = np.searchsorted(known[:, 0], tok, side="right") - 1
        ok = (at >= 0) & (tok < known[np.maximum(at, 0), 1]) if len(known) else np.zeros(len(tok), bool)
        out = np.where(ok, known[np.maximum(at, 0), 2] if len(known) else 0, -1)
        if not ok.all():
            out[~ok] = self._ask("seq_of_tokens", tok[~ok], self.tok_base)
        return out.astype(np.int64)

    def sequences_of_documents(self, docs: np.ndarray) -> np.ndarray:
        by = self.remote.split(unique(np.asarray(docs, np.int64)), self.doc_base)
        parts = self.remote.call({g: ("sequences_of_documents", (part,), {}) for g, part in by.items()})
        return np.sort(np.concatenate([np.zeros(0, np.int64), *(np.asarray(v, np.int64) for v in parts.values())]))

    def trained(self, docs: np.ndarray) -> np.ndarray:
        docs = np.asarray(docs, np.int64)
        out = np.ones(len(docs), dtype=bool)
        known = np.array([int(d) in self._docs for d in docs], dtype=bool)
        out[known] = [self._docs[int(d)][1] for d in docs[known]]
        if not known.all():
            out[~known] = self._ask("trained", docs[~known], self.doc_base)
        return out

    def external_id(self, doc: int) -> str:
        got = self._docs.get(int(doc))
        return got[0] if got is not None else str(self.document(doc)["external_id"])

    def document(self, doc: int) -> dict:
        if not 0 <= doc < self.n_docs:
            raise KeyError(doc)
        g = int(self.remote.holders_of(np.array([doc]), self.doc_base)[0])
        return self.remote.call({g: ("document", (int(doc),), {})})[g]

    def top_contexts(self, proto: int, n: int) -> list[tuple[int, float]]:
        parts = [p for p in self.remote.everyone("top_contexts", int(proto), int(n)) if p]
        if not parts:
            return []
        r = np.array([row for p in parts for row, _ in p], dtype=np.int64)
        a = np.array([act for p in parts for _, act in p])
        order = np.lexsort((r, -a))[:n]
        return [(int(r[i]), float(a[i])) for i in order]

