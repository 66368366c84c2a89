"""The ``prism`` command line: one entry point, one sub-command per job."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from . import demo_corpus_path
from .errors import PrismError
from .logs import setup_logging

log = logging.getLogger("prism")

# Named starting points for `prism train --preset`; --config and --set override them.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # The demo model: trains in a few minutes on 2 CPU cores.
    "tiny": {
        "model": {"vocab_size": 4096, "block_size": 128, "n_layer": 4, "n_head": 4, "d_model": 128,
                  "n_prototypes": 512, "n_active": 8},
        "train": {"batch_size": 16, "max_steps": 1000, "lr": 2e-3, "min_lr": 2e-4, "warmup_steps": 50,
                  "eval_every": 250, "ckpt_every": 250, "eval_tokens": 32768},
    },
    # The benchmark model of bench/train_throughput.py (d=256, K=1024, k=8).
    "small": {
        "model": {"vocab_size": 8192, "block_size": 128, "n_layer": 4, "n_head": 4, "d_model": 256,
                  "n_prototypes": 1024, "n_active": 8},
        "train": {"batch_size": 16, "max_steps": 2000, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 100},
    },
    # GPT-2-small scale, for a GPU.
    "gpt2-small": {
        "model": {"vocab_size": 32768, "block_size": 1024, "n_layer": 12, "n_head": 12, "d_model": 768,
                  "n_prototypes": 8192, "n_active": 8},
        "train": {"batch_size": 16, "max_steps": 5000, "lr": 6e-4, "min_lr": 6e-5, "warmup_steps": 200},
    },
}


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _merge_overrides(sections: dict[str, dict[str, Any]], config_file: str | None, sets: list[str], *,
                     also_ok: Collection[str] = ()) -> dict[str, dict[str, Any]]:
    """Apply a JSON config file's sections, then ``--set SECTION.NAME=VALUE`` items, to ``sections``."""
    from .errors import ConfigError

    if config_file:
        try:
            data = json.loads(Path(config_file).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{config_file}: {e}") from e
        unknown = set(data) - set(sections) - set(also_ok)
        if unknown:
            raise ConfigError(f"{config_file}: unknown section(s) {sorted(unknown)}; use {sorted(sections)}")
        for name in sections:
            sections[name].update(data.get(name, {}))
    for item in sets:
        key, sep, raw = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or section not in sections:
            raise ConfigError(f"--set {item!r}: expected " + " or ".join(f"{k}.NAME=VALUE" for k in sections))
        sections[section][name] = _parse_value(raw)
    return sections


def build_configs(preset: str, config_file: str | None, sets: list[str], head: str | None = None):
    from .errors import ConfigError
    from .model.config import ModelConfig, TrainConfig

    if preset not in PRESETS:
        raise ConfigError(f"--preset must be one of {sorted(PRESETS)}, got {preset!r}")
    merged = _merge_overrides({"model": dict(PRESETS[preset]["model"]), "train": dict(PRESETS[preset]["train"])},
                              config_file, sets, also_ok={"index"})
    if head is not None:
        merged["model"]["head"] = head
    return (ModelConfig.from_dict(merged["model"], where="model config"),
            TrainConfig.from_dict(merged["train"], where="train config"))


# ---------------------------------------------------------------------------- sub-commands
def cmd_train(args: argparse.Namespace) -> int:
    from .model.train import Trainer

    model_cfg, train_cfg = build_configs(args.preset, args.config, args.set, args.head)
    corpus = args.corpus or [demo_corpus_path()]
    trainer = Trainer(model_cfg, train_cfg, corpus, args.out, tokenizer_path=args.tokenizer,
                      progress=not args.no_progress, resume=not args.no_resume).setup()
    try:
        path = trainer.fit()
    finally:
        trainer.close()
    if trainer.is_main:
        print(json.dumps({"checkpoint": str(path), **trainer.last_eval}, indent=2))
    return 0


def _generate(checkpoint: str, prompts: list[str], max_new_tokens: int, temperature: float,
              sample_top_k: int | None, seed: int) -> list[str]:
    from .model.checkpoint import load_checkpoint
    from .model.generate import generate

    model, tok, _ = load_checkpoint(checkpoint)
    return [generate(model, tok, tok.encode(prompt).ids, max_new_tokens, temperature=temperature,
                     sample_top_k=sample_top_k, seed=seed).text for prompt in prompts]


def cmd_generate(args: argparse.Namespace) -> int:
    for prompt, text in zip(args.prompt, _generate(args.checkpoint, args.prompt, args.max_new_tokens,
                                                     args.temperature, args.top_k, args.seed), strict=True):
        print(json.dumps({"prompt": prompt, "completion": text}) if args.json else prompt + text)
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    from .engine.layout import IndexConfig
    from .indexer.estimate import estimate, format_estimate
    from .indexer.run import Indexer

    overrides = _merge_overrides({"index": {}}, args.config, args.set, also_ok={"model", "train"})["index"]
    cfg = IndexConfig.from_dict(overrides, where="index config")
    ix = Indexer(args.checkpoint, args.corpus or [demo_corpus_path()], args.out, cfg, progress=not args.no_progress)
    if args.dry_run:
        est = estimate(ix)
        print(json.dumps(est, indent=2) if args.json else format_estimate(est))
        return 0
    summary = ix.run(workers=args.workers, ray_address=args.ray_address, append=args.append)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_attribute(args: argparse.Namespace) -> int:
    import dataclasses

    from .engine import Attributor, QueryOptions, QuerySpec

    att = Attributor.open(args.index)
    res = att.attribute(QuerySpec(args.prompt, args.completion, args.max_new_tokens, args.target_index),
                        QueryOptions(n_documents=args.top_k, mode=args.mode, opponents=args.opponents,
                                     damping=args.damping, aggregation=args.aggregation,
                                     include_untrained=args.include_untrained))
    if args.json:
        print(json.dumps(dataclasses.asdict(res), indent=2))
        return 0
    print(f"target: {res.query.target_text!r}   ({res.mode}, {res.timings_ms.total:.0f} ms)")
    for d in res.documents:
        snippet = " ".join(d.snippet.split())[:110]
        mark = "" if d.trained else "  [not trained on]"
        print(f"{d.rank:3d}. {d.score:+.3f}  {d.external_id:<22s} {snippet}{mark}")
    return 0


DEMO_PROMPTS = ["The only way to", "A computer", "Love is", "Never trust"]


def _drop_outdated_index(index_dir: Path) -> None:
    """The demo rebuilds its index when an older version of the project wrote it (or another config)."""
    import shutil

    from .engine import layout

    try:
        layout.read_manifest(index_dir)
    except PrismError as e:
        log.info("rebuilding the demo index", extra={"reason": str(e)})
        shutil.rmtree(index_dir)


def cmd_demo(args: argparse.Namespace) -> int:
    """Train (or reuse) the tiny demo model on the bundled corpus, index the corpus, show samples."""
    from .engine.layout import IndexConfig
    from .indexer.run import build_index
    from .model import checkpoint as ckpt
    from .model.train import Trainer

    out = Path(args.out)
    index_sets = [s for s in args.set if s.startswith("index.")]
    model_cfg, train_cfg = build_configs("tiny", None, [s for s in args.set if s not in index_sets])
    index_cfg = IndexConfig.from_dict(_merge_overrides({"index": {}}, None, index_sets)["index"], where="index config")
    done = False
    if (out / "latest").is_file():
        try:
            cfg = ckpt.read_config(ckpt.resolve(out))
            done = cfg["training"].get("step", 0) >= train_cfg.max_steps
        except PrismError:
            done = False
    t0 = time.perf_counter()
    if done:
        log.info("reusing the demo model", extra={"run": str(out)})
    else:
        log.info("training the demo model", extra={"run": str(out), "max_steps": train_cfg.max_steps})
        trainer = Trainer(model_cfg, train_cfg, [demo_corpus_path()], out, progress=not args.no_progress).setup()
        trainer.fit()
    ckpt_path = ckpt.resolve(out)
    training = ckpt.read_config(ckpt_path)["training"]
    t_train = time.perf_counter() - t0
    index_dir = out / "index"
    _drop_outdated_index(index_dir)
    index = build_index(ckpt_path, [demo_corpus_path()], index_dir, index_cfg, progress=not args.no_progress)
    summary = {
        "checkpoint": str(ckpt_path), "index": str(out / "index"),
        "train_seconds": round(t_train, 1), "total_seconds": round(time.perf_counter() - t0, 1),
        "model": {k: training.get("eval", {}).get(k) for k in ("val_loss", "R1bar", "R2", "effective_prototypes",
                                                              "dead_prototypes")},
        "index_summary": {k: index[k] for k in ("documents", "sequences", "tokens", "shards", "bad_records",
                                                "total_bytes", "total_bytes_per_token")},
    }
    print(json.dumps(summary, indent=2))
    for prompt, text in zip(DEMO_PROMPTS, _generate(str(ckpt_path), DEMO_PROMPTS, 40, 0.8, 40, 0)):
        print(f"\n>>> {prompt}{text}")
    print("\nWhich training documents drove ' is a machine' after 'A computer'?")
    rc = cmd_attribute(argparse.Namespace(index=str(out / "index"), prompt="A computer", completion=" is a machine",
                                          max_new_tokens=None, target_index=None, top_k=5, mode="fast",
                                          opponents=False, damping=None, aggregation="cosine_max", include_untrained=False,
                                          json=False))
    if rc or args.no_serve:
        return rc
    print(f"\nServing the demo index on http://127.0.0.1:{args.port} (docs at /docs; Ctrl-C stops)", flush=True)
    return cmd_serve(argparse.Namespace(index=[f"demo={out / 'index'}"], default_index=None, host="127.0.0.1",
                                        port=args.port, workers=1, state_dir=None,
                                        log_level=args.log_level, log_format=args.log_format))


# ---------------------------------------------------------------------------- service
def _index_args(items: list[str]) -> dict[str, str]:
    """``--index DIR`` or ``--index NAME=DIR`` items as {name: dir}; a bare DIR is named after its folder
    (its parent's name when the folder is called ``index``, e.g. runs/demo/index -> demo)."""
    from .errors import ConfigError

    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            p = Path(item).resolve()
            name, path = (p.parent.name if p.name == "index" else p.name), item
        if not name or name in out:
            raise ConfigError(f"--index {item!r}: " + ("empty name" if not name else f"name {name!r} given twice"))
        out[name] = str(Path(path).absolute())  # not resolved: a reload follows a moved symlink
    return out


def _check_index_dir(name: str, path: Path) -> None:
    """A clear one-line error for an index directory that cannot be served."""
    from .engine import layout

    hint = f"build it with `prism index --checkpoint RUN --out {path}` (or `prism demo` for runs/demo/index)"
    if not path.is_dir():
        raise PrismError(f"--index {name}: {path} does not exist; {hint}")
    m = layout.read_manifest(path)
    if m is None or not m.complete:
        raise PrismError(f"--index {name}: {path} is not a complete index (manifest.json missing or incomplete); "
                         f"{hint}, or run the same `prism index` command again to finish it")


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from .errors import ConfigError
    from .service.settings import Settings

    indexes = _index_args(args.index)
    for name, path in indexes.items():
        _check_index_dir(name, Path(path))
    # the options override the PRISM_* environment; everything is validated here, once
    given: dict[str, Any] = {"indexes": indexes, "host": args.host, "port": args.port, "workers": args.workers,
                             "log_level": args.log_level, "log_format": args.log_format}
    if args.default_index:
        given["default_index"] = args.default_index
    if args.state_dir:
        given["state_dir"] = Path(args.state_dir).resolve()
    if getattr(args, "ray_address", None):
        given["ray_address"] = args.ray_address
    if getattr(args, "ray_actors", None):
        given["ray_actors"] = args.ray_actors
    try:
        settings = Settings(**given)
        settings.check_serving()
    except ValidationError as e:
        raise ConfigError("; ".join(f"PRISM_{'.'.join(map(str, x['loc'])).upper()}: {x['msg']}"
                                    for x in e.errors())) from None
    from .service.app import server_options

    run = server_options(settings)
    if settings.workers == 1:
        from .service import create_app

        uvicorn.run(create_app(settings), **run)
        return 0
    # uvicorn's worker processes import the app by name: the environment is their only channel
    os.environ.update({"PRISM_INDEXES": json.dumps(indexes), "PRISM_STATE_DIR": str(settings.state_dir),
                       "PRISM_LOG_LEVEL": settings.log_level, "PRISM_LOG_FORMAT": settings.log_format,
                       **({"PRISM_DEFAULT_INDEX": settings.default_index} if settings.default_index else {}),
                       **({"PRISM_RAY_ADDRESS": settings.ray_address} if settings.ray_address else {}),
                       **({"PRISM_RAY_ACTORS": str(settings.ray_actors)} if settings.ray_actors else {})})
    uvicorn.run("prism_tda.service.app:create_app_from_env", factory=True, workers=settings.workers, **run)
    return 0


def default_state_dir() -> Path:
    """The one default of the service state (audits, prototype sets) for demo, serve and sql."""
    return Path(os.environ.get("PRISM_STATE_DIR") or "prism-state")


def _sql_doc_ids(index_dir: Path, name: str, sql: str, field: str) -> list[int]:
    """Document ids from one read-only statement whose first column is doc_id (the SQL pool's limits)."""
    from .service.sqlengine import SqlRefusal
    from .service.sqlpool import SqlLimits, SqlPool

    pool = SqlPool(index_dir, SqlLimits(timeout_s=30.0, max_rows=1_000_000, max_result_bytes=256 * 2**20,
                                        memory_limit_bytes=2**30, workers=1), None)
    try:
        return pool.doc_ids(sql, {"index_name": name, "principal": None}, field=field)
    except SqlRefusal as e:
        raise PrismError(f"{field}: {e.kind}: {e.detail}") from None
    finally:
        pool.close()


def cmd_discover(args: argparse.Namespace) -> int:
    from .engine import Attributor
    from .service.catalog import Catalog
    from .service.indexes import discover_report

    (name, index_dir), = _index_args([args.index]).items()
    _check_index_dir(name, Path(index_dir))

    def source(texts: list[str] | None, files: list[str] | None, sql: str | None, prefix: str | None,
               field: str) -> dict | None:
        if files:
            texts = (texts or []) + [Path(f).read_text() for f in files]
        if prefix is not None:
            sql = f"SELECT doc_id FROM documents WHERE starts_with(external_id, '{prefix.replace(chr(39), chr(39) * 2)}')"
        given = [x for x in (texts, sql) if x]
        if len(given) > 1:
            raise PrismError(f"{field}: give texts, a SQL statement or an id prefix (one of them)")
        if texts:
            return {"texts": texts}
        if sql:
            return {"doc_ids": _sql_doc_ids(Path(index_dir), name, sql, f"--{field}-sql")}
        return None

    topic = source(args.text, args.text_file, args.sql, args.doc_prefix, "topic")
    if topic is None:
        raise PrismError("give the topic: --text, --text-file, --sql or --doc-prefix")
    contrast = source(args.contrast_text, None, args.contrast_sql, args.contrast_doc_prefix, "contrast")
    att = Attributor.open(index_dir)
    res = discover_report(att, Catalog(att.reader, att.model, att.tokenizer), topic=topic, contrast=contrast, top_n=args.top,
                          min_support=args.min_support, min_docs=args.min_docs, smoothing=args.smoothing,
                          include_untrained=args.include_untrained, contexts=args.contexts, measure=args.measure)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    t, c = res["topic"], res["contrast"]
    print(f"topic: {t['tokens']:,} tokens of {t['documents']:,} {t['source']}; contrast: {c['tokens']:,} tokens "
          f"of {c['source']}")
    print(f"{'proto':>6} {'ratio':>7} {'share':>7} {'support':>8} {'docs':>6}  strongest topic context")
    for p in res["prototypes"]:
        ctx = p["contexts"][0] if p["contexts"] else None
        shown = f"{ctx['before'][-30:]}[{ctx['token']}]{ctx['after'][:20]}".replace("\n", " ") if ctx else ""
        print(f"{p['proto_id']:>6} {p['ratio']:>7.2f} {p['topic_share']:>7.4f} {p['topic_support']:>8} "
              f"{p['topic_docs']:>6}  {shown}")
    ids = ",".join(str(p["proto_id"]) for p in res["prototypes"])
    print(f"\nsave as a set: curl -X PUT .../v1/prototype-sets/NAME -d '{{\"prototypes\": [{ids}]}}'")
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    from .service.settings import parse_bytes
    from .service.sqlengine import SqlRefusal
    from .service.sqlpool import SqlLimits, SqlPool

    (name, index_dir), = _index_args([args.index]).items()
    _check_index_dir(name, Path(index_dir))
    state = Path(args.state_dir or default_state_dir()) / "state.sqlite3"
    limits = SqlLimits(timeout_s=args.timeout, max_rows=args.max_rows, max_result_bytes=args.max_result_bytes,
                       memory_limit_bytes=parse_bytes(args.memory_limit), workers=1)
    pool = SqlPool(Path(index_dir), limits, state if state.is_file() else None)
    try:
        header, rows = pool.query(args.sql, {"index_name": name, "principal": None})
    except SqlRefusal as e:
        raise PrismError(f"{e.kind}: {e.detail}") from None
    finally:
        pool.close()
    res = {"columns": header["columns"], "rows": json.loads(rows), "row_count": header["row_count"]}
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    names = [c["name"] for c in res["columns"]]
    def cell(v: Any) -> str:
        if v is None:
            return "NULL"
        return v if isinstance(v, str) and v.isprintable() else json.dumps(v, ensure_ascii=False)

    cells = [[cell(v) for v in row] for row in res["rows"]]
    widths = [min(60, max([len(n)] + [len(r[i]) for r in cells])) for i, n in enumerate(names)]
    print("  ".join(n.ljust(w) for n, w in zip(names, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v[:w].ljust(w) for v, w in zip(r, widths)))
    print(f"({res['row_count']} rows)", file=sys.stderr)
    return 0


def _write_generated(text: str, path: Path, check: bool, command: str) -> int:
    """Write a file generated from the code, or with ``check`` only say whether it is up to date."""
    if check:
        if not path.is_file() or path.read_text() != text:
            print(f"{path} is out of date; run `{command}` to regenerate it", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(path)
    return 0


def cmd_openapi(args: argparse.Namespace) -> int:
    from .service.openapi import DEFAULT_PATH, render

    return _write_generated(render(), Path(args.out) if args.out else DEFAULT_PATH, args.check, "prism openapi")


def cmd_settings_doc(args: argparse.Namespace) -> int:
    from .service.settings_doc import DEFAULT_PATH, render

    return _write_generated(render(), Path(args.out) if args.out else DEFAULT_PATH, args.check,
                            "prism settings-doc")


# ---------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prism", description="PRISM-TDA: training-data attribution for PRISM models.")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", choices=["text", "json"],
                   help="json: one object per line (default for `serve`); text: for terminals (default otherwise)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser("train", help="train a PRISM model (or the dense baseline)",
                       description="Train a PRISM model. Run under `torchrun --nproc_per_node N` for DDP.")
    t.add_argument("--corpus", nargs="+", help="JSONL(.gz), Parquet (text column) or folders of .txt "
                                               "(default: the bundled demo corpus)")
    t.add_argument("--out", required=True, help="run directory (resumed when it has a checkpoint)")
    t.add_argument("--preset", default="tiny", help=f"starting config: {', '.join(PRESETS)}")
    t.add_argument("--config", help="JSON file with 'model' and 'train' sections overriding the preset")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.NAME=VALUE",
                   help="override one field, e.g. --set model.d_model=256 --set train.max_steps=500")
    t.add_argument("--head", choices=["prism", "dense"], help="shortcut for --set model.head=...")
    t.add_argument("--tokenizer", help="use this tokenizer.json instead of training one")
    t.add_argument("--no-resume", action="store_true", help="start over even if --out has a checkpoint")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(fn=cmd_train)

    g = sub.add_parser("generate", help="generate text from a checkpoint")
    g.add_argument("--checkpoint", required=True, help="checkpoint or run directory")
    g.add_argument("--prompt", nargs="+", required=True)
    g.add_argument("--max-new-tokens", type=int, default=50)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens only")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.set_defaults(fn=cmd_generate)

    ix = sub.add_parser("index", help="index a training corpus with a PRISM checkpoint",
                        description="Run a PRISM model over its training corpus and write a sharded index "
                                    "(per-token activations and compressed attribution vectors, posting "
                                    "lists, documents, a FAISS part per shard). Re-running resumes a "
                                    "partial index; --append adds documents as new shards.")
    ix.add_argument("--checkpoint", required=True, help="checkpoint or run directory")
    ix.add_argument("--corpus", nargs="+", help="JSONL(.gz), Parquet or .txt folders (default: the demo corpus)")
    ix.add_argument("--out", required=True, help="index directory")
    ix.add_argument("--config", help="JSON file with an 'index' section")
    ix.add_argument("--set", action="append", default=[], metavar="index.NAME=VALUE",
                    help="override one field of the index config, e.g. --set index.embed_dim=128")
    where = ix.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, help="run the forward stage on a local Ray cluster of N workers")
    where.add_argument("--ray-address", help="run the forward stage on this Ray cluster (e.g. ray://head:10001)")
    ix.add_argument("--append", action="store_true",
                    help="add the corpus's documents to the existing index --out as new shards (same model, "
                         "same calibration; the existing shards are left as they are)")
    ix.add_argument("--dry-run", action="store_true",
                    help="print estimated disk, indexing memory and time, and serving memory; write nothing")
    ix.add_argument("--json", action="store_true", help="with --dry-run: print JSON")
    ix.add_argument("--no-progress", action="store_true")
    ix.set_defaults(fn=cmd_index)

    a = sub.add_parser("attribute", help="which training documents drove an output",
                       description="Attribute a prompt's completion (given, generated, or the prompt's own "
                                   "next-token predictions) to training documents of an index.")
    a.add_argument("--index", required=True, help="index directory (built by `prism index`)")
    a.add_argument("--prompt", required=True)
    tgt = a.add_mutually_exclusive_group()
    tgt.add_argument("--completion", help="the output to attribute (the target tokens)")
    tgt.add_argument("--max-new-tokens", type=int, help="generate this many tokens greedily and attribute them")
    a.add_argument("--target-index", type=int, help="attribute only this target token (0-based)")
    a.add_argument("--top-k", type=int, default=10, help="documents to return")
    a.add_argument("--mode", choices=["fast", "exact"], default="fast",
                   help="fast: FAISS candidates + exact re-rank; exact: every token sharing a prototype")
    a.add_argument("--opponents", action="store_true", help="documents that most oppose the output")
    a.add_argument("--damping", type=float, help="curvature damping, x the mean eigenvalue (default: the index's)")
    a.add_argument("--aggregation", default="cosine_max", choices=["cosine_max", "cosine_sum", "raw_max", "raw_sum", "cosine_match"],
                   help="how a document's token scores make its score (default: the best token's cosine)")
    a.add_argument("--include-untrained", action="store_true",
                   help="also return documents the checkpoint did not train on (its validation split), marked")
    a.add_argument("--json", action="store_true")
    a.set_defaults(fn=cmd_attribute)

    dv = sub.add_parser("discover", help="find the prototypes that carry a topic (for suppression and audit flags)",
                        description="Rank prototypes by how specifically they carry a topic (example texts, or "
                                    "documents of the index chosen by SQL or id prefix) against a contrast "
                                    "(default: the rest of the corpus), with their evidence.")
    dv.add_argument("--index", required=True, metavar="[NAME=]DIR", help="index directory")
    dv.add_argument("--text", action="append", help="an example text of the topic (repeat)")
    dv.add_argument("--text-file", action="append", help="a file holding one example text (repeat)")
    dv.add_argument("--sql", help="topic documents: SELECT doc_id FROM documents WHERE ...")
    dv.add_argument("--doc-prefix", help="topic documents: those whose external id starts with this")
    dv.add_argument("--contrast-text", action="append", help="a contrast text (repeat; default: the corpus)")
    dv.add_argument("--contrast-sql", help="contrast documents by SQL")
    dv.add_argument("--contrast-doc-prefix", help="contrast documents by external id prefix")
    dv.add_argument("--top", type=int, default=20, help="prototypes to show (default 20)")
    dv.add_argument("--min-support", type=int, default=5, help="least topic tokens a prototype is active on")
    dv.add_argument("--min-docs", type=int, default=2, help="least topic documents it is active in")
    dv.add_argument("--smoothing", type=float, default=0.5, help="tokens of mean activation added to both sides")
    dv.add_argument("--contexts", type=int, default=3, help="topic contexts per prototype (JSON output)")
    dv.add_argument("--include-untrained", action="store_true", help="also count documents not trained on")
    dv.add_argument("--measure", choices=["activation", "logit"], default="activation",
                    help="what a token counts for a prototype: its activation (default) or its positive share of "
                         "the next token's logit")
    dv.add_argument("--json", action="store_true")
    dv.set_defaults(fn=cmd_discover)

    d = sub.add_parser("demo", help="the main job: train the tiny demo model and index the bundled corpus",
                       description="Train (or reuse) a tiny PRISM model on the bundled demo corpus, index "
                                   "the corpus with it, and print sample generations.")
    d.add_argument("--out", default="runs/demo", help="run directory (default: runs/demo)")
    d.add_argument("--set", action="append", default=[], metavar="SECTION.NAME=VALUE")
    d.add_argument("--no-progress", action="store_true")
    d.add_argument("--no-serve", action="store_true", help="end after the example instead of serving the index")
    d.add_argument("--port", type=int, default=8000, help="port of the demo server (default 8000)")
    d.set_defaults(fn=cmd_demo)

    sv = sub.add_parser("serve", help="serve indexes over HTTP (attribution, audits, SQL, prototypes, generation)",
                        description="Serve one or more indexes with the PRISM-TDA HTTP API. Further settings "
                                    "come from PRISM_* environment variables (docs/service.md).")
    sv.add_argument("--index", action="append", required=True, metavar="[NAME=]DIR",
                    help="index directory, optionally named; repeat to serve several (the first is the default)")
    sv.add_argument("--default-index", help="name of the index used when a request names none")
    sv.add_argument("--host", default="127.0.0.1", help="bind address (beyond loopback PRISM_API_KEYS is required)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--workers", type=int, default=1, help="server processes (each loads every index)")
    sv.add_argument("--state-dir", help="audit and prototype-set database directory (default: PRISM_STATE_DIR "
                                        "or ./prism-state, as for `prism sql` and `prism demo`)")
    sv.add_argument("--ray-address", metavar="ADDR",
                    help="serve the shards from Ray actors of this cluster (auto, ray://HOST:10001, or local: a "
                         "Ray started here); the index directory must be at the same path on every node "
                         "(default: PRISM_RAY_ADDRESS, else this process holds every shard)")
    sv.add_argument("--ray-actors", type=int, metavar="N",
                    help="shard-holding actors per index (default: PRISM_RAY_ACTORS, else one per shard)")
    sv.set_defaults(fn=cmd_serve)

    q = sub.add_parser("sql", help="read-only SQL over an index's tables (the service's locked engine)",
                       description="Run one SELECT over documents, sequences, tokens, activations, shards, "
                                   "prototypes, vocab (and audit_results with --state-dir).")
    q.add_argument("--index", required=True, metavar="[NAME=]DIR", help="index directory")
    q.add_argument("sql", help='one SELECT statement, e.g. "SELECT count(*) FROM activations"')
    q.add_argument("--state-dir", help="service state directory, for audit_results (default: PRISM_STATE_DIR "
                                       "or ./prism-state, as for `prism serve` and `prism demo`)")
    q.add_argument("--timeout", type=float, default=30.0, help="seconds before the query is stopped")
    q.add_argument("--max-rows", type=int, default=10_000)
    q.add_argument("--max-result-bytes", type=int, default=64 * 2**20, help="largest result, in bytes of JSON")
    q.add_argument("--memory-limit", default="1GB", help="memory the statement may use (e.g. 512MB)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(fn=cmd_sql)

    o = sub.add_parser("openapi", help="write openapi.yaml from the service app")
    o.add_argument("--out", help="output path (default: openapi.yaml at the repository top)")
    o.add_argument("--check", action="store_true", help="exit 1 when the file differs from the app")
    o.set_defaults(fn=cmd_openapi)

    sd = sub.add_parser("settings-doc", help="write docs/settings.md (every PRISM_* setting) from the settings class")
    sd.add_argument("--out", help="output path (default: docs/settings.md at the repository top)")
    sd.add_argument("--check", action="store_true", help="exit 1 when the file differs from the settings class")
    sd.set_defaults(fn=cmd_settings_doc)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.log_format is None:
        args.log_format = "json" if args.command == "serve" else "text"
    setup_logging(args.log_level, args.log_format)
    try:
        return args.fn(args)
    except PrismError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
