"""Rewriting shards: one shard that concatenates an index's shards (what a build with larger work
units stores), and a shard copied under another work unit. Used to size serving at scale
(``bench/scale.py``) and to rewrite an index's shards."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from prism_tda.engine import layout


def ivf_entries(ivf):
    """(list, its inverted lists, ids, codes) of every non-empty list of an IVF index (copies)."""
    import faiss

    il = faiss.downcast_InvertedLists(ivf.invlists)
    for lst in range(ivf.nlist):
        n = il.list_size(lst)
        if n:
            yield (lst, il, faiss.rev_swig_ptr(il.get_ids(lst), n).copy(),
                   faiss.rev_swig_ptr(il.get_codes(lst), n * il.code_size).copy())


def reunit_faiss(template: Path, shard: Path, unit: int) -> None:
    """Rewrite a copied shard's FAISS ids to name its new work unit (``template``: its index's FAISS
    template)."""
    import faiss

    ix = layout.shard_index(template, shard)
    try:
        ivf = faiss.extract_index_ivf(ix)
    except RuntimeError:
        ids = faiss.vector_to_array(ix.id_map)  # an IndexIDMap
        faiss.copy_array_to_vector(layout.faiss_ids(unit, layout.split_faiss_ids(ids)[1]), ix.id_map)
    else:
        for lst, il, ids, codes in ivf_entries(ivf):
            new = layout.faiss_ids(unit, layout.split_faiss_ids(ids)[1])
            il.update_entries(lst, 0, len(ids), faiss.swig_ptr(new), faiss.swig_ptr(codes))
    layout.write_shard_faiss(ix, shard)


def merge_shards(real: Path, out_dir: Path, unit: int) -> layout.ShardInfo:
    """Every shard of the index ``real`` concatenated into one shard directory under work unit
    ``unit``: what a build with larger work units stores. Row order, ids and posting lists are those of
    the parts one after the other; within a (prototype, cell) list the parts' entries follow each
    other (each strongest first)."""
    import faiss
    import pyarrow as pa
    import pyarrow.parquet as pq

    from prism_tda.engine.reads import read_complete_manifest

    m = read_complete_manifest(real)
    parts = [s.dir(real) for s in m.shards]
    infos = m.shards
    out_dir.mkdir(parents=True)
    tok_off = np.cumsum([0] + [s.n_tokens for s in infos])
    seq_off = np.cumsum([0] + [s.n_seqs for s in infos])
    doc_off = np.cumsum([0] + [s.n_docs for s in infos])
    sizes: dict[str, int] = {}

    def load(name: str) -> list[np.ndarray]:
        return [np.load(layout.array_file(d, name)) for d in parts]

    for name in ("tokens", "protos", "acts", "codes", "seq_start", "seq_last_target"):
        sizes[name] = layout.write_array(layout.array_file(out_dir, name), np.concatenate(load(name)))
    dirs = [np.unpackbits(np.load(f), count=s.n_tokens).astype(bool) if (f := layout.array_file(d, "code_dir")).is_file()
            else np.zeros(s.n_tokens, dtype=bool) for d, s in zip(parts, infos, strict=True)]
    sizes["code_dir"] = layout.write_array(layout.array_file(out_dir, "code_dir"), np.packbits(np.concatenate(dirs)))
    scale = infos[0].self_scale
    sizes["self"] = layout.write_array(layout.array_file(out_dir, "self"), np.concatenate(
        [(a.astype(np.float32) * (s.self_scale / scale)).astype(np.float16) for a, s in zip(load("self"), infos, strict=True)]))
    sizes["seq_doc"] = layout.write_array(layout.array_file(out_dir, "seq_doc"), np.concatenate(
        [a + o for a, o in zip(load("seq_doc"), doc_off, strict=False)]).astype(np.int32))
    tok0 = [a[:-1] + o for a, o in zip(load("seq_tok0"), tok_off, strict=False)] + [np.array([tok_off[-1]])]
    sizes["seq_tok0"] = layout.write_array(layout.array_file(out_dir, "seq_tok0"), np.concatenate(tok0).astype(np.int64))
    # posting lists: group of every entry, then a stable sort by group keeps each part's order
    groups, entries = [], []
    for off_a, tok_a, o in zip(load("post_offsets"), load("post_tokens"), tok_off, strict=False):
        groups.append(np.repeat(np.arange(len(off_a) - 1), np.diff(off_a.astype(np.int64)).astype(np.int64)))
        entries.append(tok_a.astype(np.int64) + o)
    g, e = np.concatenate(groups), np.concatenate(entries)
    order = np.argsort(g, kind="stable")
    n_groups = len(load("post_offsets")[0]) - 1
    sizes["post_tokens"] = layout.write_array(layout.array_file(out_dir, "post_tokens"), e[order].astype(np.uint32))
    sizes["post_offsets"] = layout.write_array(layout.array_file(out_dir, "post_offsets"),
                                               np.searchsorted(g[order], np.arange(n_groups + 1)).astype(np.uint32))
    # each prototype's top contexts: the first part's (prototype pages only)
    top = load("proto_top")[0]
    sizes["proto_top"] = layout.write_array(layout.array_file(out_dir, "proto_top"), top)
    docs = [pq.read_table(d / layout.DOCUMENTS) for d in parts]
    docs = [t.set_column(0, "doc", pa.array(np.asarray(t.column("doc")) + o, pa.int32()))
            for t, o in zip(docs, doc_off, strict=False)]
    sizes["documents"] = layout.write_table(out_dir / layout.DOCUMENTS, pa.concat_tables(docs),
                                            row_group_size=layout.DOC_ROW_GROUP)
    seqs = []
    for d, so, do, to in zip(parts, seq_off, doc_off, tok_off, strict=False):
        t = pq.read_table(d / layout.SEQUENCES)
        for col, o in (("seq", so), ("doc", do), ("tok0", to)):
            i = t.schema.get_field_index(col)
            t = t.set_column(i, t.schema.field(i), pa.array(np.asarray(t.column(col)) + o, t.schema.field(i).type))
        seqs.append(t)
    sizes["sequences"] = layout.write_table(out_dir / layout.SEQUENCES, pa.concat_tables(seqs))
    # FAISS: the parts' entries, ids renumbered to the merged shard (IVF: their lists' codes; a flat
    # index: its vectors)
    merged = faiss.read_index(str(real / layout.FAISS_TEMPLATE))
    try:
        ivf = faiss.extract_index_ivf(merged)
    except RuntimeError:
        ivf = None
    for d, so in zip(parts, seq_off, strict=False):
        whole = layout.shard_index(real / layout.FAISS_TEMPLATE, d)  # kept: the IVF part below points into it
        if ivf is None:
            ids = faiss.vector_to_array(whole.id_map)  # an IndexIDMap
            vecs = faiss.downcast_index(whole.index).reconstruct_n(0, whole.ntotal)
            merged.add_with_ids(vecs, layout.faiss_ids(unit, layout.split_faiss_ids(ids)[1] + so))
            continue
        il = faiss.downcast_InvertedLists(ivf.invlists)  # type: ignore[arg-type]
        part = faiss.extract_index_ivf(whole)
        for lst, _, ids, codes in ivf_entries(part):
            new = layout.faiss_ids(unit, layout.split_faiss_ids(ids)[1] + so)
            il.add_entries(lst, len(ids), faiss.swig_ptr(new), faiss.swig_ptr(codes))
        ivf.ntotal += part.ntotal
        merged.ntotal = ivf.ntotal
    sizes["faiss"] = layout.write_shard_faiss(merged, out_dir)
    if (parts[0] / layout.STATS).is_file():  # until the reduce folds them into the index's
        shutil.copy2(parts[0] / layout.STATS, out_dir / layout.STATS)
        sizes["stats"] = (out_dir / layout.STATS).stat().st_size
    info = layout.ShardInfo(unit=unit, n_docs=int(doc_off[-1]), n_seqs=int(seq_off[-1]), n_tokens=int(tok_off[-1]),
                            self_scale=scale, bytes=sizes, corpus={}, seconds=sum(s.seconds for s in infos),
                            stats={"direction_codes": int(sum(int(d.sum()) for d in dirs))},
                            self_of=infos[0].self_of if len({s.self_of for s in infos}) == 1 else "mixed")
    layout.write_shard_info(out_dir, info)
    return info




def copy_shard(src: Path, dst: Path, unit: int, template: Path) -> layout.ShardInfo:
    """A copy of the shard directory ``src`` as work unit ``unit`` at ``dst`` (its FAISS ids renamed;
    ``template``: the index's FAISS template)."""
    info = layout.read_shard_info(src)
    if info is None:
        raise FileNotFoundError(f"{src}: not a complete shard (no shard.json)")
    shutil.copytree(src, dst)
    reunit_faiss(template, dst, unit)
    out = layout.ShardInfo(**{**info.__dict__, "unit": unit})
    layout.write_shard_info(dst, out)
    return out


def merge_index(real: Path, out: Path, copies: int = 1,
                progress: Callable[[int, float], object] | None = None) -> Path:
    """An index at ``out`` of ``copies`` copies (files copied, not linked) of one shard that merges
    every shard of the index ``real`` (one copy: the same index in one shard). Done already when
    ``out`` holds as many; ``progress(copy, seconds)`` after each copy."""
    from prism_tda.engine.reads import read_complete_manifest

    m = read_complete_manifest(real)
    done = layout.read_manifest(out) if (out / layout.MANIFEST).exists() else None
    if done is not None and len(done.shards) == copies:
        return out
    if out.exists():
        shutil.rmtree(out)
    (out / layout.SHARDS).mkdir(parents=True)
    for name in layout.INDEX_FILES[1:]:
        if (real / name).exists():
            shutil.copy2(real / name, out / name)
    t0 = time.perf_counter()
    shards = [merge_shards(real, layout.shard_dir(out, 0), 0)]
    for c in range(1, copies):
        shards.append(copy_shard(layout.shard_dir(out, 0), layout.shard_dir(out, c), c, out / layout.FAISS_TEMPLATE))
        if progress is not None:
            progress(c + 1, time.perf_counter() - t0)
    m.shards = shards
    m.units = [dataclasses.replace(m.units[0], unit=c, file=f"copy {c} of the merged shards") for c in range(copies)]
    m.summary = {**(m.summary or {}), "merged": f"{copies} copies of one shard merging every shard of {real}"}
    (out / layout.MANIFEST).write_text(json.dumps(m.to_dict(), indent=2))
    return out
