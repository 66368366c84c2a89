"""`prism attribute`, `prism discover` and `prism sql`: questions to a built index.

`prism attribute`'s options are the engine's ``QuerySpec`` and ``QueryOptions`` fields, looped over
(``prism_tda.fields``): every option the engine takes is a flag of the same name, described once.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import typing
from pathlib import Path
from typing import Any

from prism_tda.errors import PrismError
from prism_tda.fields import field_specs

from .common import default_state_dir, index_arg


# ---------------------------------------------------------------------------- attribute
def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_fields(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = (),
               aliases: dict[str, str] | None = None, group: Any = None) -> None:
    """One flag per field of dataclass ``cls`` (``--n-documents`` for ``n_documents``), typed, with its
    default and its description."""
    for f in field_specs(cls):
        if f.name in skip:
            continue
        flags = [_flag(f.name), *([aliases[f.name]] if aliases and f.name in aliases else [])]
        tp, optional = f.type, False
        args = typing.get_args(tp)
        if typing.get_origin(tp) is not typing.Literal and type(None) in args:
            tp, optional = next(a for a in args if a is not type(None)), True
        kw: dict[str, Any] = {"dest": f.name, "help": " ".join(f.description.split()).replace("%", "%%")}
        if f.default is not dataclasses.MISSING:
            kw["default"] = f.default
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) is typing.Literal:
            kw["choices"] = list(typing.get_args(tp))
        elif optional and f.default is not None:  # a default to override with nothing: `none`
            kw["type"] = functools.partial(_or_none, tp)
            kw["help"] += " ('none' for null)"
        else:
            kw["type"] = tp
        (group or parser).add_argument(*flags, **kw)


def _or_none(tp: Any, text: str) -> Any:
    return None if text.lower() in ("none", "null") else tp(text)


def spec_and_options(args: argparse.Namespace) -> tuple[Any, Any]:
    """The engine's ``QuerySpec`` and ``QueryOptions`` of parsed `prism attribute` arguments."""
    from prism_tda.engine import QueryOptions, QuerySpec

    return (QuerySpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(QuerySpec)}),
            QueryOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(QueryOptions)}))


def print_attribution(index_dir: str | Path, spec: Any, options: Any, as_json: bool = False) -> int:
    from prism_tda.engine import Attributor

    att = Attributor.open(index_dir)
    if options.mode == "exact":
        att.check_exact()
        est = att.exact_estimate()
        print(f"exact mode: recomputes all {est.tokens:,} training tokens, about {est.seconds:,.0f} s at "
              f"{est.tokens_per_s:,.0f} tokens/s here", file=sys.stderr, flush=True)
    res = att.attribute(spec, options, progress=options.mode == "exact" and sys.stderr.isatty())
    if as_json:
        print(json.dumps(dataclasses.asdict(res), indent=2))
        return 0
    print(f"target: {res.query.target_text!r}   ({res.mode}, {res.timings_ms.total:.0f} ms)")
    for d in res.documents:
        snippet = " ".join(d.snippet.split())[:110]
        mark = "" if d.trained else "  [not trained on]"
        effect = "" if d.influence is None else f"  effect {d.influence:+.3g} "
        print(f"{d.rank:3d}. {d.score:+.3f}  value {d.value:+.3g}{effect}  {d.external_id:<22s} {snippet}{mark}")
    if res.opposed_by_influence:
        print(f"     {res.opposed_by_influence} of the first {options.n_documents} by score left out: their full-model "
              "influence pushes the other way")
    if res.opposed_by_value:
        print(f"     {res.opposed_by_value} of the first {options.n_documents} by score left out: their value (the whole "
              "document's influence) pushes the other way (keep them: --keep-opposed)")
    if res.tied_beyond_last:
        scope = "" if res.mode == "exact" else " (at least: among the documents re-ranked)"
        how = ("; of the tied ones, those whose tokens' cosines sum highest are shown" if options.tie_break == "cosine_sum"
               else "")
        same = (f" ({res.unsettled_beyond_last} of them not separated by that either)"
                if res.unsettled_beyond_last else "")
        print(f"     {res.tied_beyond_last} more documents score within 0.1% of the n-th best{scope}{how}{same}")
    return 0


def cmd_attribute(args: argparse.Namespace) -> int:
    spec, options = spec_and_options(args)
    return print_attribution(args.index, spec, options, args.json)


# ---------------------------------------------------------------------------- sql and discover
def sql_pool(index_dir: Path, args: argparse.Namespace, state: Path | None = None) -> Any:
    """One SQL worker over an index, with the limits given on the command line."""
    from prism_tda.service.settings import parse_bytes
    from prism_tda.service.sqlpool import SqlLimits, SqlPool

    limits = SqlLimits(timeout_s=args.timeout, max_rows=args.max_rows, max_result_bytes=args.max_result_bytes,
                       memory_limit_bytes=parse_bytes(args.memory_limit), workers=1)
    return SqlPool(index_dir, limits, state)


def _sql_arguments(p: argparse.ArgumentParser, max_rows: int, max_result_bytes: int) -> None:
    p.add_argument("--timeout", type=float, default=30.0, help="seconds before a statement is stopped")
    p.add_argument("--max-rows", type=int, default=max_rows)
    p.add_argument("--max-result-bytes", type=int, default=max_result_bytes, help="largest result, in bytes of JSON")
    p.add_argument("--memory-limit", default="1GB", help="memory a statement may use (e.g. 512MB)")


def _doc_ids(pool: Any, name: str, sql: str, params: list[Any], field: str) -> list[int]:
    from prism_tda.service.sqlengine import SqlRefusal

    try:
        return pool.doc_ids(sql, {"index_name": name, "principal": None}, field=field, params=params)
    except SqlRefusal as e:
        raise PrismError(f"{field}: {e.kind}: {e.detail}") from None


PREFIX_SQL = "SELECT doc_id FROM documents WHERE starts_with(external_id, $1)"


def cmd_discover(args: argparse.Namespace) -> int:
    from prism_tda.engine import Attributor
    from prism_tda.engine.catalog import Catalog
    from prism_tda.engine.discovery import discover_report

    name, index_dir = index_arg(args.index)
    pool = None

    def source(texts: list[str] | None, files: list[str] | None, sql: str | None, prefix: str | None,
               field: str) -> dict | None:
        nonlocal pool
        if files:
            texts = (texts or []) + [Path(f).read_text() for f in files]
        given = [x for x in (texts, sql, prefix) if x]
        if len(given) > 1:
            raise PrismError(f"{field}: give texts, a SQL statement or an id prefix (one of them)")
        if texts:
            return {"texts": texts}
        if sql or prefix is not None:
            pool = pool or sql_pool(index_dir, args)
            query, params = (sql, []) if sql else (PREFIX_SQL, [prefix])
            return {"doc_ids": _doc_ids(pool, name, query, params, f"--{field}-sql" if sql else f"--{field}-doc-prefix")}
        return None

    try:
        topic = source(args.text, args.text_file, args.sql, args.doc_prefix, "topic")
        if topic is None:
            raise PrismError("give the topic: --text, --text-file, --sql or --doc-prefix")
        contrast = source(args.contrast_text, None, args.contrast_sql, args.contrast_doc_prefix, "contrast")
    finally:
        if pool is not None:
            pool.close()
    att = Attributor.open(index_dir)
    res = discover_report(att, Catalog(att.reader, att.model, att.tokenizer), topic=topic, contrast=contrast,
                          top_n=args.top, min_support=args.min_support, min_docs=args.min_docs,
                          smoothing=args.smoothing, include_untrained=args.include_untrained, contexts=args.contexts,
                          measure=args.measure, select=args.select, max_selected=args.max_selected,
                          max_ppl_ratio=args.max_ppl_ratio)
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
    chosen = [p["proto_id"] for p in res["prototypes"]]
    sel = res["selection"]
    if sel is not None:
        chosen = sel["prototypes"]
        print(f"\nselected by effect ({len(chosen)} of {sel['candidates']}, budget {sel['budget']}; contrast: "
              f"{sel['contrast']}; {sel['seconds']:.1f} s):")
        for st in sel["steps"]:
            print(f"  + {st['proto_id']:>5}  effect {st['effect']:.4f} nats/token  (topic +{st['topic_loss_increase']:.4f},"
                  f" contrast +{st['contrast_loss_increase']:.4f}; contrast perplexity x{st['contrast_ppl_ratio']:.4f})")
        for c in sel.get("cost_by_text", []):
            where = f"document {c['doc_id']}" if c["doc_id"] is not None else f"contrast text {c['text_index'] + 1}"
            print(f"  cost {c['share']:.0%} on {where} ({c['tokens']} tokens): {c['snippet']!r}")
        eff0 = next((r["effect"] for r in sel.get("strengths", []) if r["alpha"] == 0), None)
        for r in sel.get("strengths", []):
            kept = f", {r['effect'] / eff0:.0%} of the loss effect at x0" if eff0 and eff0 > 0 and r["alpha"] else ""
            print(f"  at strength x{r['alpha']:.2f}: effect {r['effect']:.4f} nats/token{kept}; contrast perplexity "
                  f"x{r['contrast_ppl_ratio']:.4f}")
    ids = ",".join(str(i) for i in chosen)
    print(f"\nsave as a set: curl -X PUT .../v1/prototype-sets/NAME -d '{{\"prototypes\": [{ids}]}}'")
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    from prism_tda.service.sqlengine import SqlRefusal

    name, index_dir = index_arg(args.index)
    state = Path(args.state_dir or default_state_dir()) / "state.sqlite3"
    pool = sql_pool(index_dir, args, state if state.is_file() else None)
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
    print("  ".join(n.ljust(w) for n, w in zip(names, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v[:w].ljust(w) for v, w in zip(r, widths, strict=True)))
    print(f"({res['row_count']} rows)", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------- parsers
def register(sub: Any) -> None:
    from prism_tda.engine.types import QueryOptions, QuerySpec

    a = sub.add_parser("attribute", help="which training documents drove an output",
                       description="Attribute a prompt's completion (given, generated, or the prompt's own "
                                   "next-token predictions) to training documents of an index. Every option "
                                   "is a field of the engine's QuerySpec or QueryOptions.")
    a.add_argument("--index", required=True, help="index directory (built by `prism index`)")
    a.add_argument("--prompt", required=True, help="the prompt text")
    target = a.add_mutually_exclusive_group()
    add_fields(a, QuerySpec, skip=("prompt", "target_index"), group=target)
    add_fields(a, QuerySpec, skip=("prompt", "completion", "max_new_tokens"))
    add_fields(a, QueryOptions, aliases={"n_documents": "--top-k"})
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
    dv.add_argument("--select", choices=["ratio", "effect"], default="ratio",
                    help="effect: also choose the set whose suppression most raises the model's loss on the topic "
                         "relative to the contrast (measured with the model)")
    dv.add_argument("--max-selected", type=int, default=None, help="with --select effect: the most prototypes "
                                                                    "chosen (default 2%% of the bank)")
    dv.add_argument("--max-ppl-ratio", type=float, default=1.02,
                    help="with --select effect: the largest contrast perplexity ratio a set may cost")
    _sql_arguments(dv, 1_000_000, 256 * 2**20)  # a document filter may select many documents
    dv.add_argument("--json", action="store_true")
    dv.set_defaults(fn=cmd_discover)

    q = sub.add_parser("sql", help="read-only SQL over an index's tables (the service's locked engine)",
                       description="Run one SELECT over documents, sequences, tokens, activations, shards, "
                                   "prototypes, vocab (and audit_results with --state-dir).")
    q.add_argument("--index", required=True, metavar="[NAME=]DIR", help="index directory")
    q.add_argument("sql", help='one SELECT statement, e.g. "SELECT count(*) FROM activations"')
    q.add_argument("--state-dir", help="service state directory, for audit_results (default: PRISM_STATE_DIR "
                                       "or ./prism-state, as for `prism serve` and `prism demo`)")
    _sql_arguments(q, 10_000, 64 * 2**20)
    q.add_argument("--json", action="store_true")
    q.set_defaults(fn=cmd_sql)
