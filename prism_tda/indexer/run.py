"""The indexing job: plan work units -> calibrate -> build shards (local or Ray) -> reduce.

- **plan** (driver, from file sizes and Parquet footers only): the corpus's work units;
- **calibrate** (driver, one pass over a sample): curvature, codec, cells, FAISS template;
- **shards** (one per unit; this process or Ray workers): read, tokenise, one forward pass, write;
- **reduce** (driver, small): sum the shards' statistics, write the prototype and vocabulary tables
  and the summary.

Every stage resumes from what is on disk: a shard is complete once its ``shard.json`` exists, and
a rerun builds only the others. ``append`` adds the documents of another corpus as new shards
under the same calibration, leaving the existing shards as they are.
"""

from __future__ import annotations

import contextlib
import json
import logging
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from prism_tda import demo_corpus_path
from prism_tda.corpus import CorpusStats, Fields, WorkUnit, fingerprint, plan_units
from prism_tda.engine import layout
from prism_tda.engine.calibration import IndexCalibration
from prism_tda.engine.curvature import CurvatureStats, finalize
from prism_tda.engine.layout import CALIBRATION, FAISS_TEMPLATE, IDENTITY_FIELDS, IndexConfig, IndexManifest
from prism_tda.errors import PrismError
from prism_tda.model import checkpoint as ckpt
from prism_tda.model.device import autocast_for, pick_device
from prism_tda.model.metrics import usage_stats
from prism_tda.model.record import TrainingRecord

from .calibrate import calibrate
from .estimate import compare, estimate, peak_rss_bytes
from .shard import ShardBuilder

log = logging.getLogger(__name__)

SHARD_STATS = layout.STATS  # a shard's additive statistics, until the reduce folds them


class IndexMismatchError(PrismError):
    """An existing index was built from another model, tokenizer, corpus or config."""


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "pyarrow", "faiss-cpu", "faiss-gpu", "tokenizers", "safetensors", "ray", "prism-tda"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    return out


def identity(ck_config: dict, corpus: list[str], cfg: IndexConfig, fields: Fields | None = None) -> dict[str, Any]:
    out = {
        "checkpoint_sha256": ck_config["files"]["model.safetensors"],
        "tokenizer_sha256": ck_config["files"]["tokenizer.json"],
        "corpus_fingerprint": fingerprint(corpus),
        "block_size": ck_config["model"]["block_size"],
        **{f"index.{k}": getattr(cfg, k) for k in IDENTITY_FIELDS},
    }
    if fields is not None and not fields.is_default:  # absent for the default: older indexes still match
        out["corpus_fields"] = fields.to_dict()
    return out


def training_corpus(record: TrainingRecord | None) -> tuple[list[str], Fields] | None:
    """The corpus files (and their fields) a checkpoint's training record says the run read; None when
    the checkpoint has no record of them."""
    if record is None or not record.corpus.get("corpus_files"):
        return None
    f = record.corpus.get("corpus_fields") or {}
    return [_relocated(c) for c in record.corpus["corpus_files"]], Fields(f.get("text_field", "text"), f.get("id_field"))


def _relocated(path: str) -> str:
    """A recorded corpus file, or the bundled demo corpus of this installation when the record names the
    bundled corpus of another one (the bundled demo model was trained where the package was then)."""
    bundled = Path(demo_corpus_path())
    if not Path(path).exists() and Path(path).parts[-3:] == bundled.parts[-3:]:
        return str(bundled)
    return path


class Indexer:
    """Indexes ``corpus`` (default: the corpus the checkpoint's training record names; the bundled demo
    corpus for a checkpoint without a record) with a PRISM checkpoint into ``out``."""

    def __init__(self, checkpoint: str | Path, corpus: list[str] | None, out: str | Path,
                 cfg: IndexConfig | None = None, *, progress: bool = True, fields: Fields | None = None) -> None:
        self.ck_path = ckpt.resolve(checkpoint).absolute()
        self.record = ckpt.load_record(self.ck_path)
        trained_on = training_corpus(self.record)
        if corpus is None:
            if trained_on is None:
                corpus = [str(demo_corpus_path())]
                log.warning("the checkpoint records no training corpus: indexing the bundled demo corpus",
                            extra={"checkpoint": str(self.ck_path)})
            else:
                corpus, fields = trained_on[0], fields or trained_on[1]
                missing = [c for c in corpus if not Path(c).exists()]
                if missing:
                    raise PrismError(f"{self.ck_path}: the corpus it was trained on is not here ({missing}); "
                                     "pass --corpus")
        self.corpus = [str(Path(c).absolute()) for c in corpus]
        self.fields = fields or Fields()
        if trained_on is not None and self.record is not None:
            fp = fingerprint(self.corpus)
            if fp != self.record.corpus.get("corpus_fingerprint"):
                log.warning("this corpus is not the one the checkpoint was trained on: documents outside its "
                            "training record are indexed as untrained",
                            extra={"corpus": self.corpus, "trained_on": trained_on[0]})
        self.out = Path(out)
        self.cfg = cfg or IndexConfig()
        self.progress = progress
        self.device = pick_device()
        self.model, self.tokenizer, self.ck_config = ckpt.load_checkpoint(self.ck_path, device=self.device)
        if self.model.head is None:
            raise PrismError(f"{self.ck_path}: a dense-baseline checkpoint has no prototypes to index")
        self.autocast = autocast_for(self.device, self.cfg.dtype)
        train = self.ck_config.get("training", {}).get("train_config") or {}
        self.val_fraction: float | None = train.get("val_fraction")
        if self.record is None:
            log.warning("the checkpoint has no training record (it predates them): whether a document was "
                        "trained on is inferred from its validation split", extra={"checkpoint": str(self.ck_path)})

    # ------------------------------------------------------------------------------ manifest
    def _open_manifest(self, *, append: bool = False) -> IndexManifest:
        ident = identity(self.ck_config, self.corpus, self.cfg, self.fields)
        m = layout.read_manifest(self.out)
        if m is None:
            if append:
                raise PrismError(f"{self.out}: no index to append to (manifest.json is missing)")
            return IndexManifest(identity=ident, checkpoint=str(self.ck_path), corpus=self.corpus, config=self.cfg,
                                 model=self.ck_config["model"], versions=_versions())
        must = {k: v for k, v in ident.items() if not (append and k == "corpus_fingerprint")}
        stored = {f"index.{k}": v for k, v in layout.OLDER_CONFIG.items()} | m.identity  # older indexes
        diff = {k: (stored.get(k), v) for k, v in must.items() if stored.get(k) != v}
        if diff:
            raise IndexMismatchError(
                f"{self.out / layout.MANIFEST}: this index was built with different inputs (stored, given): "
                f"{diff}. Use another --out, or delete the index to rebuild it.")
        return m

    def _save(self, m: IndexManifest) -> None:
        layout.write_manifest(self.out, m)

    # ------------------------------------------------------------------------------ stages
    def _calibrate(self, m: IndexManifest) -> IndexCalibration:
        path = self.out / CALIBRATION
        if m.calibration is not None and path.is_file() and (self.out / FAISS_TEMPLATE).is_file():
            return IndexCalibration.load(path)
        calib, info = calibrate(self.model, self.tokenizer, m.units, self.cfg, self.out, device=self.device,
                                autocast=self.autocast)
        calib.save(path)
        m.calibration = info
        m.timings["calibrate_s"] = info.seconds
        self._save(m)
        return calib

    def builder(self, calib: IndexCalibration) -> ShardBuilder:
        return ShardBuilder(self.model, self.tokenizer, calib, self.cfg, self.out / FAISS_TEMPLATE,
                            device=self.device, autocast=self.autocast, record=self.record,
                            val_fraction=self.val_fraction)

    def _pending(self, m: IndexManifest) -> list[WorkUnit]:
        """Units without a complete shard; shards completed but not yet in the manifest (a run killed
        between a shard's last write and the manifest's) are adopted."""
        done = {s.unit for s in m.shards}
        pending = []
        for u in m.units:
            if u.unit in done:
                continue
            info = layout.read_shard_info(layout.shard_dir(self.out, u.unit))
            if info is not None:
                m.add_shard(info)
            else:
                pending.append(u)
        return pending

    def complete(self, m: IndexManifest, info: layout.ShardInfo) -> None:
        m.add_shard(info)
        self._save(m)
        log.debug("shard complete", extra={"unit": info.unit, "tokens": info.n_tokens, "seconds": info.seconds})

    def _build_local(self, m: IndexManifest, calib: IndexCalibration, pending: list[WorkUnit]) -> None:
        builder = self.builder(calib)
        with tqdm(total=sum(u.bytes for u in pending), desc="index", unit="B", unit_scale=True,
                  disable=not self.progress, dynamic_ncols=True) as bar:
            for u in pending:
                self.complete(m, builder.build(self.out, u))
                bar.update(u.bytes)

    def _reduce(self, m: IndexManifest, calib: IndexCalibration) -> CurvatureStats:
        """Fold the shards' statistics into the index's (``stats.safetensors``), then drop theirs.

        The file records which units it holds (``units``), in the same atomic write as the sums, so a
        run killed anywhere folds every shard exactly once; an append folds only the new shards."""
        mc = self.model.cfg
        path = self.out / layout.STATS
        total = CurvatureStats(mc.n_prototypes, mc.d_model)
        folded: set[int] = set()
        compacted = None  # (unit, generation) rewrites already subtracted (indexer/compact.py)
        if path.is_file():
            t = load_file(str(path))
            compacted = t.pop("compacted", None)
            folded = {int(u) for u in t.pop("units", torch.zeros(0)).tolist()}
            if folded:
                total = CurvatureStats.from_tensors(t)
        new = [s for s in m.shards if s.unit not in folded]
        for s in new:
            total.merge(CurvatureStats.from_tensors(load_file(str(s.dir(self.out) /
                                                                  SHARD_STATS))))
        units = torch.tensor(sorted(folded | {s.unit for s in m.shards}), dtype=torch.int64)
        layout.atomic_write_bytes(path, save({**{k: v.contiguous() for k, v in total.tensors().items()},
                                              "units": units, **({} if compacted is None else {"compacted": compacted})}))
        n_lists = mc.n_prototypes * calib.cells.shape[0]
        layout.write_array(self.out / layout.POST_SIZES, layout.posting_list_sizes(
            [np.load(layout.array_file(s.dir(self.out), "post_offsets"), mmap_mode="r") for s in m.shards],
            n_lists))
        for s in m.shards:  # folded: the shards' own copies are no longer needed
            (s.dir(self.out) / SHARD_STATS).unlink(missing_ok=True)
        self._tables(total, calib)
        return total

    def _tables(self, total: CurvatureStats, calib: IndexCalibration) -> None:
        write_tables(self.out, self.model, self.tokenizer, total, calib)

    # ------------------------------------------------------------------------------ run
    def run(self, *, workers: int | None = None, ray_address: str | None = None, append: bool = False
            ) -> dict[str, Any]:
        """Build (or resume) the index; with ``append``, add the corpus to an existing index."""
        t_start = time.perf_counter()
        self.out.mkdir(parents=True, exist_ok=True)
        m = self._open_manifest(append=append)
        if append:
            known = {(u.file, u.start, u.stop, tuple(u.files or ())) for u in m.units}
            new = [u for u in plan_units(self.corpus, self.cfg.shard_bytes, first=len(m.units), fields=self.fields)
                   if (u.file, u.start, u.stop, tuple(u.files or ())) not in known]
            for i, u in enumerate(new):
                u.unit = len(m.units) + i
            if not new:
                log.info("nothing to append: every unit of the corpus is in the index")
            m.units += new
            m.corpus += [c for c in self.corpus if c not in m.corpus]
            m.complete = False
            self._save(m)
        elif m.complete and m.summary is not None:
            log.info("index already complete", extra={"index": str(self.out)})
            return m.summary
        est_file = self.out / layout.ESTIMATE
        est = json.loads(est_file.read_text()) if est_file.is_file() else None
        removed = layout.clean_temporaries(self.out)
        if removed:
            log.info("removed temporary files of an interrupted run", extra={"files": removed})
        if not m.units:
            t0 = time.perf_counter()
            m.units = plan_units(self.corpus, self.cfg.shard_bytes, fields=self.fields)
            if not m.units:
                raise PrismError(f"{self.corpus}: no corpus file to index")
            m.timings["plan_s"] = round(time.perf_counter() - t0, 3)
            self._save(m)
        if est is None and not append:
            est = estimate(self, m.units)
            layout.atomic_write_bytes(est_file, json.dumps(est, indent=2).encode())
        calib = self._calibrate(m)
        pending = self._pending(m)
        if pending:
            log.info("indexing", extra={"shards_pending": len(pending), "shards": len(m.units),
                                        "bytes": sum(u.bytes for u in pending)})
        t0 = time.perf_counter()
        if pending and (workers or ray_address):
            from .distributed import run_on_ray

            run_on_ray(self, m, pending, workers=workers or 0, address=ray_address)
        elif pending:
            self._build_local(m, calib, pending)
        m.timings["shards_s"] = round(m.timings.get("shards_s", 0) + time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        total = self._reduce(m, calib)
        m.timings["reduce_s"] = round(time.perf_counter() - t0, 3)
        m.timings["last_run_wall_s"] = round(time.perf_counter() - t_start, 3)
        summary = self._summary(m, total, calib)
        summary["peak_rss_bytes"] = peak_rss_bytes()
        if est is not None and not append:
            summary["estimate_vs_actual"] = compare(est, summary, m.timings["last_run_wall_s"],
                                                    summary["peak_rss_bytes"])
        m.summary, m.complete = summary, True
        self._save(m)
        return summary

    def _summary(self, m: IndexManifest, total: CurvatureStats, calib: IndexCalibration) -> dict[str, Any]:
        n_tok = m.tokens
        by_file: dict[str, int] = {}
        for s in m.shards:
            for name, b in s.bytes.items():
                if name != "stats":  # folded into the index's statistics and deleted by the reduce
                    by_file[name] = by_file.get(name, 0) + b
        for f in (layout.PROTOTYPES, layout.VOCAB, CALIBRATION, FAISS_TEMPLATE, layout.STATS):
            by_file[f] = layout.dir_bytes(self.out / f)
        corpus = CorpusStats()
        for s in m.shards:
            corpus.merge(CorpusStats.from_dict(s.corpus))
        # how far the calibration sample's curvature is from the whole corpus's
        full = finalize(calib.curvature.Q, total.lam, total.count, max(n_tok, 1), self.cfg.damping,
                        self.cfg.damping_scope)
        used = total.count > 0
        rel = (calib.curvature.lam[used] - full.lam[used]).norm() / full.lam[used].norm().clamp_min(1e-30)
        usage = usage_stats(total.mass)
        return {
            "documents": m.documents, "sequences": m.sequences, "tokens": n_tok, "shards": len(m.shards),
            "bad_records": corpus.n_bad, "bad_by_reason": dict(corpus.bad),
            "trained_documents": sum(int(s.corpus.get("trained_documents", 0)) for s in m.shards),
            "outside_record": sum(int(s.corpus.get("outside_record", 0)) for s in m.shards),
            "trained_from": "record" if self.record is not None else "validation split (no training record)",
            "bytes": by_file, "total_bytes": sum(by_file.values()),
            "bytes_per_token": {k: v / max(n_tok, 1) for k, v in by_file.items()},
            "total_bytes_per_token": sum(by_file.values()) / max(n_tok, 1),
            "mean_loss": float(total.scalars[1]) / max(n_tok, 1),
            # tokens whose codes are of their direction (confidently predicted: engine/codec.py)
            "direction_code_share": sum(int(s.stats.get("direction_codes", 0)) for s in m.shards) / max(n_tok, 1),
            "R1bar": float(total.max_cos.mean()), "R2": float(total.scalars[2]) / max(n_tok, 1),
            **usage, "damping": float(calib.curvature.damping.mean()), "damping_scope": self.cfg.damping_scope,
            "calibration": {"tokens": m.calibration.tokens if m.calibration else 0,
                            "corrections_relative_error_vs_corpus": float(rel),
                            "faiss_spec": m.calibration.faiss_spec if m.calibration else None},
            "timings": m.timings,
        }


def write_tables(out: Path, model: Any, tokenizer: Any, total: CurvatureStats, calib: IndexCalibration) -> None:
    """The prototype table (usage from the statistics, signature tokens, activation ranges) and the
    vocabulary table of an index."""
    sig = model.signatures(n=10)[1]  # (K, 10) top signature tokens of W p_i
    tok = tokenizer

    def text(i: int) -> str:
        return tok.decode([i])

    K = model.cfg.n_prototypes
    sch = layout.schemas(model.cfg.vocab_size, K)
    count, mass = total.count.numpy(), total.mass.numpy()
    protos = pa.Table.from_pydict({
        "proto_id": np.arange(K), "n_tokens": count.astype(np.int64), "mass": mass,
        "mean_act": np.where(count > 0, mass / np.maximum(count, 1), 0).astype(np.float32),
        "top_tokens": [[text(int(i)) for i in row] for row in sig.tolist()], "label": [None] * K,
        "act_lo": calib.act_lo.numpy(), "act_hi": calib.act_hi.numpy(),
    }, schema=sch["prototypes"])
    layout.write_table(out / layout.PROTOTYPES, protos)
    V = tok.get_vocab_size()
    vocab = pa.Table.from_pydict({"token_id": np.arange(V), "token": [text(i) for i in range(V)]},
                                 schema=sch["vocab"])
    layout.write_table(out / layout.VOCAB, vocab)


def build_index(checkpoint: str | Path, corpus: list[str] | None, out: str | Path, cfg: IndexConfig | None = None,
                *, workers: int | None = None, ray_address: str | None = None, progress: bool = True,
                append: bool = False, fields: Fields | None = None) -> dict[str, Any]:
    """Index ``corpus`` (None: the one the checkpoint was trained on) with the PRISM model at ``checkpoint``
    into ``out``; resumes a partial index; with ``append``, adds ``corpus`` to the existing index ``out``
    as new shards."""
    return Indexer(checkpoint, corpus, out, cfg, progress=progress, fields=fields).run(
        workers=workers, ray_address=ray_address, append=append)
