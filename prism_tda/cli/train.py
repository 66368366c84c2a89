"""`prism train`, `prism generate` and `prism index`: configs from presets, files and overrides."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from prism_tda import demo_corpus_path

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


def merge_overrides(sections: dict[str, dict[str, Any]], config_file: str | None, sets: list[str], *,
                     also_ok: Collection[str] = ()) -> dict[str, dict[str, Any]]:
    """Apply a JSON config file's sections, then ``--set SECTION.NAME=VALUE`` items, to ``sections``."""
    from prism_tda.errors import ConfigError

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
    from prism_tda.errors import ConfigError
    from prism_tda.model.config import ModelConfig, TrainConfig

    if preset not in PRESETS:
        raise ConfigError(f"--preset must be one of {sorted(PRESETS)}, got {preset!r}")
    merged = merge_overrides({"model": dict(PRESETS[preset]["model"]), "train": dict(PRESETS[preset]["train"])},
                              config_file, sets, also_ok={"index"})
    if head is not None:
        merged["model"]["head"] = head
    return (ModelConfig.from_dict(merged["model"], where="model config"),
            TrainConfig.from_dict(merged["train"], where="train config"))


def corpus_fields(args: argparse.Namespace):
    """The --text-field / --id-field options as ``Fields`` (None when neither is given)."""
    from prism_tda.corpus import Fields

    if args.text_field is None and args.id_field is None:
        return None
    return Fields(args.text_field or "text", args.id_field)


def add_field_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text-field", help="the records' text field (default: text); a dotted path reaches into "
                                        "nested records, e.g. content.body")
    p.add_argument("--id-field", help="the records' id field, e.g. meta.id (default: id, else doc_id, else the "
                                      "file and row)")


def cmd_train(args: argparse.Namespace) -> int:
    from prism_tda.model.train import Trainer

    model_cfg, train_cfg = build_configs(args.preset, args.config, args.set, args.head)
    corpus = args.corpus or [demo_corpus_path()]
    trainer = Trainer(model_cfg, train_cfg, corpus, args.out, tokenizer_path=args.tokenizer,
                      progress=not args.no_progress, resume=not args.no_resume, fields=corpus_fields(args)).setup()
    try:
        path = trainer.fit()
    finally:
        trainer.close()
    if trainer.is_main:
        print(json.dumps({"checkpoint": str(path), **trainer.last_eval}, indent=2))
    return 0


def generate_texts(checkpoint: str, prompts: list[str], max_new_tokens: int, temperature: float,
                   sample_top_k: int | None, seed: int, scales: list[dict[int, float] | None] | None = None,
                   gate: float | None = None, gate_window: int = 16) -> list[str]:
    """Each prompt's continuation, once per entry of ``scales`` (prompt-major; default: the model as it
    is). A scale maps prototype id -> the factor its activations get (0 removes it); ``gate``: only where
    the context carries them (:meth:`PRISM.suppression_gate`)."""
    import torch

    from prism_tda.errors import QueryError
    from prism_tda.model.checkpoint import load_checkpoint
    from prism_tda.model.generate import generate

    model, tok, _ = load_checkpoint(checkpoint)
    scales = scales or [None]
    for scale in filter(None, scales):
        if model.head is None:
            raise QueryError(f"--suppress/--steer: {checkpoint} is the dense baseline, it has no prototypes")
        try:
            model.prototype_scale(torch.tensor(sorted(scale)), torch.tensor([scale[i] for i in sorted(scale)]))
        except ValueError as e:
            raise QueryError(f"--suppress/--steer: {e}") from None
    if gate is not None:
        from prism_tda.model.model import check_gate

        try:
            check_gate(gate, gate_window)
        except ValueError as e:
            raise QueryError(f"--gate: {e}") from None
    return [generate(model, tok, tok.encode(prompt).ids, max_new_tokens, temperature=temperature,
                     sample_top_k=sample_top_k, seed=seed, suppress=scale, gate=gate if scale else None,
                     gate_window=gate_window).text
            for prompt in prompts for scale in scales]


def steer_term(value: str) -> tuple[list[int], float]:
    """``IDS=ALPHA`` (ids separated by commas) for ``--steer``."""
    ids, sep, alpha = value.rpartition("=")
    try:
        if not sep:
            raise ValueError
        out = [int(i) for i in ids.replace(" ", "").split(",") if i], float(alpha)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected IDS=ALPHA such as 3,17,42=0.5, got {value!r}") from None
    if not out[0]:
        raise argparse.ArgumentTypeError(f"no prototype id in {value!r}")
    return out


def steering_of(args: argparse.Namespace) -> dict[int, float]:
    """prototype id -> alpha from ``--suppress``/``--alpha`` and every ``--steer``; an id given two
    different alphas is an error."""
    from prism_tda.errors import QueryError

    terms = ([(args.suppress, args.alpha)] if args.suppress else []) + list(args.steer or [])
    if args.controller:
        from prism_tda.engine.control import Controller

        terms += [([i], a) for i, a in Controller.load(args.controller).weights().items()]
    scale: dict[int, float] = {}
    for ids, alpha in terms:
        for i in ids:
            if scale.setdefault(i, alpha) != alpha:
                raise QueryError(f"prototype {i} is given alpha {alpha:g} and {scale[i]:g}")
    return scale


def cmd_generate(args: argparse.Namespace) -> int:
    scale = steering_of(args)
    if args.gate is not None and not scale:
        from prism_tda.errors import QueryError

        raise QueryError("--gate: needs prototypes to scale (--suppress, --steer or --controller)")
    both = bool(args.compare and scale)
    texts = generate_texts(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.sample_top_k,
                           args.seed, [scale, None] if both else [scale or None], args.gate, args.gate_window)
    for i, prompt in enumerate(args.prompt):
        if not both:
            text = texts[i]
            print(json.dumps({"prompt": prompt, "completion": text}) if args.json else prompt + text)
            continue
        text, base = texts[2 * i], texts[2 * i + 1]
        if args.json:
            print(json.dumps({"prompt": prompt, "completion": text, "default_completion": base}))
        else:
            print(f"default: {prompt}{base}\nsteered: {prompt}{text}")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    from prism_tda.engine.layout import IndexConfig
    from prism_tda.indexer.estimate import estimate, format_estimate
    from prism_tda.indexer.run import Indexer

    if args.remove or args.takedown_report or args.compact:
        return takedown(args)
    if args.upgrade:
        from prism_tda.indexer.upgrade import upgrade

        print(json.dumps(upgrade(args.out, progress=not args.no_progress), indent=2))
        return 0
    if args.influence and not args.checkpoint:  # an existing index: its influence curvature alone
        return fit_influence(args)
    if not args.checkpoint:
        from prism_tda.errors import ConfigError

        raise ConfigError("prism index: --checkpoint is required (except with --remove, --compact, "
                          "--takedown-report, --upgrade or --influence on a complete index)")
    overrides = merge_overrides({"index": {}}, args.config, args.set, also_ok={"model", "train"})["index"]
    cfg = IndexConfig.from_dict(overrides, where="index config")
    ix = Indexer(args.checkpoint, args.corpus, args.out, cfg, progress=not args.no_progress,
                 fields=corpus_fields(args))
    if args.corpus is None:
        print(f"indexing {', '.join(ix.corpus)}: the corpus the checkpoint was trained on", file=sys.stderr)
    if args.dry_run:
        est = estimate(ix)
        print(json.dumps(est, indent=2) if args.json else format_estimate(est))
        return 0
    summary = ix.run(workers=args.workers, ray_address=args.ray_address, append=args.append)
    print(json.dumps(summary, indent=2))
    return fit_influence(args) if args.influence else 0


def fit_influence(args: argparse.Namespace) -> int:
    """`prism index --out IDX --influence`: the full-model influence curvature of a complete index."""
    from prism_tda.engine.influence import fit_index

    print(json.dumps(fit_index(args.out, max_sequences=args.influence_sequences, progress=not args.no_progress),
                     indent=2))
    return 0



def takedown(args: argparse.Namespace) -> int:
    """`prism index --out IDX --remove IDS|FILE`, `--compact` and `--takedown-report`."""
    from dataclasses import asdict

    from prism_tda.engine.takedown import absence, read_ids, read_removals, remove_documents

    def public(r) -> dict[str, Any]:
        return {k: v for k, v in asdict(r).items() if k not in ("key", "grams", "gram_length")}

    if args.remove:
        res = remove_documents(args.out, read_ids(args.remove), by="cli", reason=args.reason or "")
        print(json.dumps({"removed": [public(r) for r in res.removed], "already_removed": res.already,
                          "not_found": res.not_found}, indent=2))
        if not (res.removed or res.already):
            return 1
    if args.compact:
        from prism_tda.indexer.compact import compact

        print(json.dumps(compact(args.out, progress=not args.no_progress), indent=2))
    if args.takedown_report:
        removals = read_removals(args.out)
        checks = absence(args.out)
        print(json.dumps({"index": str(args.out), "removed_documents": len(removals),
                          "removals": [{**public(r), **{k: c[k] for k in ("status", "document_in_store",
                                                                          "sequences_with_its_ngrams")}}
                                       for r, c in zip(removals, checks, strict=True)]}, indent=2))
    return 0


def register(sub: Any) -> None:
    t = sub.add_parser("train", help="train a PRISM model (or the dense baseline)",
                       description="Train a PRISM model. Run under `torchrun --nproc_per_node N` for DDP.")
    t.add_argument("--corpus", nargs="+", help="JSONL(.gz), Parquet, Arrow (a datasets save_to_disk folder) or "
                                               "folders of .txt (default: the bundled demo corpus)")
    add_field_options(t)
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
    g.add_argument("--sample-top-k", "--top-k", dest="sample_top_k", type=int, default=None,
                   help="sample from the k most likely tokens only")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--suppress", type=int, nargs="+", metavar="ID",
                   help="prototypes whose activations are scaled by --alpha (by default removed from the logits)")
    g.add_argument("--alpha", type=float, default=0.0,
                   help="strength of --suppress: 0 removes them, 1 leaves the model as it is, above 1 boosts")
    g.add_argument("--steer", type=steer_term, action="append", metavar="IDS=ALPHA",
                   help="more prototypes at their own strength, e.g. 3,17,42=0.5 (repeatable)")
    g.add_argument("--controller", help="a controller file of `prism control fit`: its strength per prototype")
    g.add_argument("--gate", type=float, default=None, metavar="SHARE",
                   help="conditional steering: scale the prototypes above only where their share of the "
                        "activation mass, averaged over the last --gate-window positions, is at least SHARE (0-1)")
    g.add_argument("--gate-window", type=int, default=16, help="positions the --gate share is averaged over")
    g.add_argument("--compare", action="store_true", help="with --suppress/--steer/--controller: also the model's "
                                                          "own output")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.set_defaults(fn=cmd_generate)

    ix = sub.add_parser("index", help="index a training corpus with a PRISM checkpoint",
                        description="Run a PRISM model over its training corpus and write a sharded index "
                                    "(per-token activations and compressed attribution vectors, posting "
                                    "lists, documents, a FAISS part per shard). Re-running resumes a "
                                    "partial index; --append adds documents as new shards.")
    ix.add_argument("--checkpoint", help="checkpoint or run directory (required to build or append)")
    ix.add_argument("--corpus", nargs="+", help="JSONL(.gz), Parquet, Arrow (a datasets save_to_disk folder) or "
                                                "folders of .txt (default: the corpus the checkpoint was trained "
                                                "on, from its training record)")
    add_field_options(ix)
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
    ix.add_argument("--remove", metavar="IDS|FILE",
                    help="take documents down from the index --out: comma-separated corpus ids, or a file with one "
                         "per line; a running server stops showing them at its next request")
    ix.add_argument("--reason", help="with --remove: why (kept in the takedown report)")
    ix.add_argument("--compact", action="store_true",
                    help="rewrite the shards of the index --out that hold documents taken down, without them "
                         "(crash-safe: run it again to finish); reload a running server afterwards")
    ix.add_argument("--takedown-report", action="store_true",
                    help="print what was taken down from the index --out (which documents, when, by whom, why) and "
                         "check each one's absence: 'absent' (not in the store: neither its text nor its token "
                         "n-grams), 'filtered' (never served; stored until --compact), 'present'")
    ix.add_argument("--upgrade", action="store_true",
                    help="bring the shards of the index --out, built by an earlier version, to what this version "
                         "writes, from what they store (no model pass over the corpus; crash-safe: run it again "
                         "to finish); reload a running server afterwards")
    ix.add_argument("--influence", action="store_true",
                    help="fit the full-model influence curvature of the index --out (what the query option "
                         "`influence` needs): after building it, or alone on a complete index without --checkpoint")
    ix.add_argument("--influence-sequences", type=int, default=8192, metavar="N",
                    help="with --influence: fit on at most N of the trained sequences (a seeded sample)")
    ix.add_argument("--dry-run", action="store_true",
                    help="print estimated disk, indexing memory and time, and serving memory; write nothing")
    ix.add_argument("--json", action="store_true", help="with --dry-run: print JSON")
    ix.add_argument("--no-progress", action="store_true")
    ix.set_defaults(fn=cmd_index)

