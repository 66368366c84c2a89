"""`prism demo`, `prism serve`, and the files generated from the service (`prism openapi`,
`prism settings-doc`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from prism_tda import demo_corpus_path, demo_model_path
from prism_tda.errors import ConfigError, PrismError

from .common import index_args
from .query import print_attribution
from .train import build_configs, generate_texts, merge_overrides

log = logging.getLogger("prism")

DEMO_PROMPTS = ["The only way to", "A computer", "Love is", "Never trust"]


def _drop_outdated_index(index_dir: Path, cfg: Any) -> None:
    """The demo rebuilds its index when an older version of the project wrote it, or with another
    config (``cfg``, an ``IndexConfig``; an older default, such as the damping, counts)."""
    import shutil

    from prism_tda.engine import layout

    try:
        m = layout.read_manifest(index_dir)
    except PrismError as e:
        log.info("rebuilding the demo index", extra={"reason": str(e)})
        shutil.rmtree(index_dir)
        return
    changed = [] if m is None else [f for f in layout.IDENTITY_FIELDS if getattr(m.config, f) != getattr(cfg, f)]
    if changed:
        log.info("rebuilding the demo index", extra={"reason": f"config changed: {changed}"})
        shutil.rmtree(index_dir)


def _bundled_into(out: Path) -> Path:
    """The bundled demo model as run directory ``out``'s checkpoint: copied (so the run directory stands
    alone), renamed into place, then named by ``latest``."""
    import shutil

    from prism_tda.fsutil import atomic_write_bytes
    from prism_tda.model import checkpoint as ckpt

    src = demo_model_path()
    assert src is not None, "cmd_demo trains when the installation bundles no model"
    step = int(ckpt.read_config(src)["training"].get("step", 0))
    dst = out / f"step_{step:07d}"
    if not (dst / "config.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{dst.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        shutil.rmtree(dst, ignore_errors=True)  # a copy a crash left half done
        os.replace(tmp, dst)
    atomic_write_bytes(out / "latest", dst.name.encode())
    return dst


def _is_bundled(path: Path) -> bool:
    """Whether checkpoint ``path`` holds the bundled demo model's files (by their recorded digests)."""
    from prism_tda.model import checkpoint as ckpt

    src = demo_model_path()
    return src is not None and ckpt.read_config(src)["files"] == ckpt.read_config(path)["files"]


#: windows the demo fits its influence curvature on (``prism index --influence`` takes up to 8,192)
DEMO_INFLUENCE_SEQUENCES = 1024


def cmd_demo(args: argparse.Namespace) -> int:
    """Index the bundled corpus with the bundled demo model (or, with --train, a model trained here), show
    samples, serve."""
    from prism_tda.engine import QueryOptions, QuerySpec
    from prism_tda.engine.layout import IndexConfig
    from prism_tda.indexer.run import build_index
    from prism_tda.model import checkpoint as ckpt
    from prism_tda.model.train import Trainer

    out = Path(args.out or ("runs/demo-train" if args.train else "runs/demo"))
    index_sets = [s for s in args.set if s.startswith("index.")]
    model_sets = [s for s in args.set if s not in index_sets]
    train = args.train or demo_model_path() is None
    if train and not args.train:
        log.info("this installation bundles no demo model: training the tiny one", extra={"run": str(out)})
    if model_sets and not train:
        raise ConfigError(f"--set {model_sets[0]}: model and training settings are for the model --train trains; "
                          "the bundled demo model is fixed (add --train)")
    model_cfg, train_cfg = build_configs("tiny", None, model_sets)
    index_cfg = IndexConfig.from_dict(merge_overrides({"index": {}}, None, index_sets)["index"], where="index config")
    t0 = time.perf_counter()
    if not train:
        if (out / "latest").is_file():
            log.info("reusing the demo model", extra={"run": str(out)})
        else:
            log.info("using the bundled demo model", extra={"run": str(out)})
            _bundled_into(out)
    else:
        done = False
        if (out / "latest").is_file():
            try:
                cfg = ckpt.read_config(ckpt.resolve(out))
                done = cfg["training"].get("step", 0) >= train_cfg.max_steps
            except PrismError:
                done = False
        if done:
            log.info("reusing the demo model", extra={"run": str(out)})
        else:
            log.info("training the demo model", extra={"run": str(out), "max_steps": train_cfg.max_steps})
            trainer = Trainer(model_cfg, train_cfg, [demo_corpus_path()], out, progress=not args.no_progress).setup()
            trainer.fit()
    ckpt_path = ckpt.resolve(out)
    training = ckpt.read_config(ckpt_path)["training"]
    t_train = time.perf_counter() - t0
    bundled = _is_bundled(ckpt_path)
    if not train and not bundled:
        log.warning(f"{out} holds a model trained here, not the bundled one: reusing it (remove {out}, or give "
                    "another --out, for the bundled model)")
    index_dir = out / "index"
    _drop_outdated_index(index_dir, index_cfg)
    index = build_index(ckpt_path, [demo_corpus_path()], index_dir, index_cfg, progress=not args.no_progress)
    summary = {
        "checkpoint": str(ckpt_path), "index": str(out / "index"), "bundled_model": bundled,
        "train_seconds": round(t_train, 1), "total_seconds": round(time.perf_counter() - t0, 1),
        "model": {k: training.get("eval", {}).get(k) for k in ("val_loss", "R1bar", "R2", "effective_prototypes",
                                                              "dead_prototypes")},
        "index_summary": {k: index[k] for k in ("documents", "sequences", "tokens", "shards", "bad_records",
                                                "total_bytes", "total_bytes_per_token")},
    }
    print(json.dumps(summary, indent=2))
    for prompt, text in zip(DEMO_PROMPTS, generate_texts(str(ckpt_path), DEMO_PROMPTS, 40, 0.8, 40, 0)):
        print(f"\n>>> {prompt}{text}")
    print("\nWhich training documents drove ' is a machine' after 'A computer'?")
    rc = print_attribution(out / "index", QuerySpec("A computer", " is a machine"), QueryOptions(n_documents=5))
    if rc:
        return rc
    # what the query option `influence` needs (a sample of the windows), after the first answer: that
    # answer does not need it, and the fit takes about a third as long as the indexing
    from prism_tda.engine.influence import fit_index, fitted_for

    if not fitted_for(index_dir):
        t_inf = time.perf_counter()
        fit_index(index_dir, max_sequences=DEMO_INFLUENCE_SEQUENCES, progress=not args.no_progress)
        log.info("fitted the influence curvature (the query option `influence`)",
                 extra={"index": str(index_dir), "seconds": round(time.perf_counter() - t_inf, 1)})
    if args.no_serve:
        return 0
    print(f"\nServing the demo index on http://127.0.0.1:{args.port} (docs at /docs; Ctrl-C stops)", flush=True)
    return serve({"indexes": {"demo": str((out / "index").absolute())}, "host": "127.0.0.1", "port": args.port,
                  "log_level": args.log_level, "log_format": args.log_format})



def cmd_serve(args: argparse.Namespace) -> int:
    # the options override the PRISM_* environment
    given: dict[str, Any] = {"indexes": index_args(args.index), "host": args.host, "port": args.port,
                             "workers": args.workers, "log_level": args.log_level, "log_format": args.log_format}
    if args.default_index:
        given["default_index"] = args.default_index
    if args.state_dir:
        given["state_dir"] = Path(args.state_dir).resolve()
    if args.ray_address:
        given["ray_address"] = args.ray_address
    if args.ray_actors:
        given["ray_actors"] = args.ray_actors
    return serve(given)


def serve(given: dict[str, Any]) -> int:
    """Serve with these settings over the ``PRISM_*`` environment's, validated here, once."""
    import uvicorn
    from pydantic import ValidationError

    from prism_tda.service.settings import Settings

    indexes = given["indexes"]
    try:
        settings = Settings(**given)
        settings.check_serving()
    except ValidationError as e:
        raise ConfigError("; ".join(f"PRISM_{'.'.join(map(str, x['loc'])).upper()}: {x['msg']}"
                                    for x in e.errors())) from None
    from prism_tda.service.app import server_options

    run = server_options(settings)
    if settings.workers == 1:
        from prism_tda.service import create_app

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


def write_generated(text: str, path: Path, check: bool, command: str) -> int:
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
    from prism_tda.service.openapi import DEFAULT_PATH, render

    return write_generated(render(), Path(args.out) if args.out else DEFAULT_PATH, args.check, "prism openapi")


def cmd_settings_doc(args: argparse.Namespace) -> int:
    from prism_tda.service.settings_doc import DEFAULT_PATH, render

    return write_generated(render(), Path(args.out) if args.out else DEFAULT_PATH, args.check,
                           "prism settings-doc")



def register(sub: Any) -> None:
    d = sub.add_parser("demo", help="the main job: a demo model (bundled, or trained here) indexes the bundled corpus, then serves it",
                       description="Index the bundled demo corpus with the bundled demo model when the "
                                   "installation has one (else, and with --train, a tiny model trained here), print "
                                   "sample generations and one attribution, and serve the index with its web page.")
    d.add_argument("--out", help="run directory (default: runs/demo, or runs/demo-train with --train)")
    d.add_argument("--train", action="store_true",
                   help="train the tiny demo model here from scratch (a few minutes) instead of using the bundled one; "
                        "--set model.* and train.* configure it")
    d.add_argument("--set", action="append", default=[], metavar="SECTION.NAME=VALUE",
                   help="index.* for the index; model.* and train.* with --train")
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

    o = sub.add_parser("openapi", help="write openapi.yaml from the service app")
    o.add_argument("--out", help="output path (default: openapi.yaml at the repository top)")
    o.add_argument("--check", action="store_true", help="exit 1 when the file differs from the app")
    o.set_defaults(fn=cmd_openapi)

    sd = sub.add_parser("settings-doc", help="write docs/settings.md (every PRISM_* setting) from the settings class")
    sd.add_argument("--out", help="output path (default: docs/settings.md at the repository top)")
    sd.add_argument("--check", action="store_true", help="exit 1 when the file differs from the settings class")
    sd.set_defaults(fn=cmd_settings_doc)
