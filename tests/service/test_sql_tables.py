"""The SQL tables are the index's data: every view agrees with what the engine reads from the shards."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prism_tda.engine.reader import IndexReader
from prism_tda.model import checkpoint as ckpt
from prism_tda.service.sqlengine import Engine, open_locked


@pytest.fixture(scope="module")
def sql(index):
    engine = Engine(open_locked(index, memory_limit="1GB", threads=2), timeout_s=60, max_rows=10**7,
                    max_result_bytes=1 << 30)
    return lambda q: json.loads(engine.run(q)[1])


@pytest.fixture(scope="module")
def reader(index, tiny_ckpt):
    model, _, _ = ckpt.load_checkpoint(tiny_ckpt)
    return IndexReader(index, model.W)


def test_tokens_and_sequences_follow_the_shards(sql, reader):
    rows = sql("SELECT seq_id, pos, token_id, doc_id FROM tokens ORDER BY seq_id, pos")
    assert len(rows) == reader.n_tokens
    seq, pos, tok, doc = (np.array(c) for c in zip(*rows, strict=True))
    all_rows = np.arange(reader.n_tokens)
    assert np.array_equal(seq, reader.seq_of_tokens(all_rows))
    assert np.array_equal(doc, reader.doc_of_seqs(seq))
    firsts = np.array([reader.seq_span(int(s))[0] for s in seq])
    assert np.array_equal(pos, all_rows - firsts)
    stored = np.concatenate([np.asarray(sh.tokens) for sh in reader.shards])
    assert np.array_equal(tok, stored)
    seqs = sql("SELECT seq_id, doc_id, start_token, n_tokens FROM sequences ORDER BY seq_id")
    assert [r[0] for r in seqs] == list(range(reader.n_seqs))
    assert [r[3] for r in seqs] == [reader.seq_span(s)[1] - reader.seq_span(s)[0] for s in range(reader.n_seqs)]


def test_activations_are_the_stored_active_prototypes(sql, reader):
    rows = sql("SELECT seq_id, pos, proto_id, act FROM activations WHERE seq_id % 7 = 3 ORDER BY seq_id, pos, proto_id")
    got: dict[tuple[int, int], dict[int, float]] = {}
    for s, p, proto, act in rows:
        got.setdefault((s, p), {})[proto] = act
    checked = 0
    for s in range(3, reader.n_seqs, 7):
        lo, hi, _ = reader.seq_span(s)
        data = reader.token_data(np.arange(lo, hi))
        for p in range(hi - lo):
            want = {int(j): float(a) for j, a in zip(data.protos[p], data.acts[p], strict=True) if a > 0}
            assert set(got.get((s, p), {})) == set(want)
            for j, a in want.items():
                assert got[(s, p)][j] == pytest.approx(a, rel=1e-5)
            checked += 1
    assert checked > 1000
    n_active = sum(int((np.asarray(sh.acts) > 0).sum()) for sh in reader.shards)
    assert sql("SELECT count(*) FROM activations") == [[n_active]]


def test_documents_and_shards(sql, reader):
    docs = sql("SELECT doc_id, external_id, n_tokens, trained FROM documents ORDER BY doc_id")
    assert [d[0] for d in docs] == list(range(reader.n_docs)) == list(range(600))
    for d in docs[::97]:
        rec = reader.document(d[0])
        assert (rec["external_id"], rec["n_tokens"], rec["trained"]) == (d[1], d[2], d[3])
    shards = sql("SELECT shard, n_tokens, token_base FROM shards ORDER BY shard")
    assert [s[2] for s in shards] == reader.tok_base[:-1].tolist()


def test_an_index_without_shards_is_empty_not_broken(index, tiny_ckpt, tmp_path):
    """A manifest over no shards (an index before its first append): every table exists, typed and
    empty, and a query finds no documents."""
    from prism_tda.engine import Attributor, QueryOptions, QuerySpec, layout

    empty = tmp_path / "empty"
    (empty / layout.SHARDS).mkdir(parents=True)
    for name in ("calibration.safetensors", "faiss_template.index", "prototypes.parquet", "vocab.parquet"):
        (empty / name).symlink_to(index / name)
    m = layout.read_manifest(index)
    m.shards, m.units = [], []
    (empty / layout.MANIFEST).write_text(json.dumps(m.to_dict()))
    engine = Engine(open_locked(empty, memory_limit="1GB", threads=2), timeout_s=60, max_rows=100,
                    max_result_bytes=1 << 20)
    for table in ("documents", "sequences", "tokens", "activations", "shards"):
        assert json.loads(engine.run(f"SELECT count(*) FROM {table}")[1]) == [[0]]
    assert json.loads(engine.run("SELECT count(*) FROM prototypes")[1]) == [[32]]
    res = Attributor.open(empty).attribute(QuerySpec("A computer", " is a"), QueryOptions(n_documents=5))
    assert res.documents == [] and res.tokens_scored == 0
