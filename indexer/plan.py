"""Plan: read the corpus, tokenize, cut documents into windows, write documents and sequences.

Deterministic: the same corpus, tokenizer, block size and config give the same shards, ids and
rows, which is what lets a killed run resume and lets Ray workers share the work.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from prism_tda.corpus import CorpusStats, Document, read_corpus
from prism_tda.engine.layout import IndexConfig, ShardEntry, part_name, write_table
from prism_tda.model.tokenizer import eos_id


@dataclass
class Window:
    doc_id: int
    start: int
    token_ids: list[int]
    target_ids: list[int]


def windows(ids: list[int], eos: int, block: int, stride: int) -> Iterator[tuple[int, list[int], list[int]]]:
    """(start, tokens, next-token targets) windows over one document; the last target is EOS."""
    targets = ids[1:] + [eos]
    for start in range(0, len(ids), stride):
        yield start, ids[start : start + block], targets[start : start + block]
        if start + block >= len(ids):
            break


def _chunks(docs: Iterator[Document], size: int) -> Iterator[list[Document]]:
    buf: list[Document] = []
    for d in docs:
        buf.append(d)
        if len(buf) == size:
            yield buf
            buf = []
    if buf:
        yield buf


def plan_shards(
    corpus: list[str], tokenizer: Tokenizer, block: int, cfg: IndexConfig, schemas: dict[str, pa.Schema],
    out: Path | None, *, progress: bool = True, max_documents: int | None = None,
) -> tuple[list[ShardEntry], CorpusStats]:
    """Write ``documents`` and ``sequences`` parts (unless ``out`` is None); return shard entries."""
    stats = CorpusStats()
    eos = eos_id(tokenizer)
    stride = cfg.stride or block
    shards: list[ShardEntry] = []
    doc0 = seq0 = 0
    docs = read_corpus(corpus, stats)
    bar = tqdm(desc="plan", unit="doc", disable=not progress, dynamic_ncols=True)
    for shard, chunk in enumerate(_chunks(docs, cfg.shard_documents)):
        if max_documents is not None and doc0 >= max_documents:
            break
        encs = tokenizer.encode_batch([d.text for d in chunk])
        doc_rows: dict[str, list] = {k: [] for k in schemas["documents"].names}
        seq_rows: dict[str, list] = {k: [] for k in schemas["sequences"].names}
        n_tok = 0
        for j, (doc, enc) in enumerate(zip(chunk, encs, strict=True)):
            doc_id = doc0 + j
            ids = enc.ids or [eos]
            for k, v in (("doc_id", doc_id), ("external_id", doc.doc_id), ("source", doc.source),
                         ("title", doc.title), ("url", doc.url), ("text", doc.text), ("n_tokens", len(ids))):
                doc_rows[k].append(v)
            for start, toks, tgts in windows(ids, eos, block, stride):
                seq_rows["seq_id"].append(seq0 + len(seq_rows["seq_id"]))
                seq_rows["doc_id"].append(doc_id)
                seq_rows["start_token"].append(start)
                seq_rows["n_tokens"].append(len(toks))
                seq_rows["token_ids"].append(toks)
                seq_rows["target_ids"].append(tgts)
                n_tok += len(toks)
        n_seq = len(seq_rows["seq_id"])
        entry = ShardEntry(shard=shard, doc_start=doc0, n_docs=len(chunk), seq_start=seq0, n_seqs=n_seq,
                           n_tokens=n_tok)
        if out is not None:
            for name, rows in (("documents", doc_rows), ("sequences", seq_rows)):
                write_table(out / name / part_name(shard), pa.Table.from_pydict(rows, schema=schemas[name]))
        shards.append(entry)
        doc0 += len(chunk)
        seq0 += n_seq
        bar.update(len(chunk))
    bar.close()
    return shards, stats
