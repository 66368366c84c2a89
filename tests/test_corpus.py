"""Corpus readers: every format, every kind of bad record counted with its file and row."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prism_tda.corpus import CorpusStats, fingerprint, is_validation, read_corpus
from prism_tda.errors import CorpusError


def test_jsonl_bad_records_are_counted_by_reason(tmp_path):
    f = tmp_path / "c.jsonl"
    lines = [
        json.dumps({"id": "a", "text": "good one"}).encode(),
        json.dumps({"id": "b"}).encode(),  # no text
        json.dumps({"id": "c", "text": 42}).encode(),  # wrong type
        json.dumps({"id": "d", "text": "   "}).encode(),  # empty
        b'{"id": "e", "text": "\xff\xfe broken"}',  # undecodable bytes
        b"{not json",
        b"[1, 2]",
        json.dumps({"text": "no id, still fine", "url": "http://x"}).encode(),
    ]
    f.write_bytes(b"\n".join(lines) + b"\n")
    stats = CorpusStats()
    docs = list(read_corpus([f], stats))
    assert [d.doc_id for d in docs] == ["a", "c.jsonl:7"]
    assert docs[1].url == "http://x"
    assert dict(stats.bad) == {"missing_text": 1, "text_not_string": 1, "empty_text": 1, "undecodable_bytes": 1,
                               "invalid_json": 1, "record_not_object": 1}
    rows = sorted((e["row"], e["reason"]) for e in stats.examples)
    assert rows == [(1, "missing_text"), (2, "text_not_string"), (3, "empty_text"), (4, "undecodable_bytes"),
                    (5, "invalid_json"), (6, "record_not_object")]
    assert all(e["file"] == str(f) for e in stats.examples)


def test_parquet_fineweb_layout_and_missing_column(tmp_path):
    good = tmp_path / "fw.parquet"
    pq.write_table(pa.table({"text": ["hello world", None, "bye"], "id": ["x", "y", "z"],
                             "url": ["u1", "u2", "u3"], "dump": ["CC", "CC", "CC"]}), good)
    bad = tmp_path / "nocol.parquet"
    pq.write_table(pa.table({"content": ["a"]}), bad)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty)
    stats = CorpusStats()
    docs = list(read_corpus([tmp_path], stats))
    assert [(d.doc_id, d.url) for d in docs] == [("x", "u1"), ("z", "u3")]
    assert dict(stats.bad) == {"missing_text": 1, "missing_text_column": 1, "empty_file": 1}


def test_text_folder_gzip_and_errors(tmp_path):
    d = tmp_path / "txt"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("first document")
    (d / "sub" / "b.txt").write_text("second document")
    (d / "empty.txt").write_text("")
    (d / "bin.txt").write_bytes(b"\xff\xfe\xfa")
    with gzip.open(tmp_path / "z.jsonl.gz", "wt") as fh:
        fh.write(json.dumps({"id": "g", "text": "zipped"}) + "\n")
    stats = CorpusStats()
    docs = list(read_corpus([d, tmp_path / "z.jsonl.gz"], stats))
    assert sorted(x.doc_id for x in docs) == ["a.txt", "g", "sub/b.txt"]
    assert dict(stats.bad) == {"empty_file": 1, "undecodable_bytes": 1}
    with pytest.raises(CorpusError, match="does not exist"):
        list(read_corpus([tmp_path / "nope"]))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(CorpusError, match="unsupported corpus file type"):
        list(read_corpus([tmp_path / "x.csv"]))


def test_fingerprint_and_split_are_stable(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text(json.dumps({"id": "1", "text": "t"}) + "\n")
    a = fingerprint([f])
    assert a == fingerprint([f])
    f.write_text(json.dumps({"id": "1", "text": "u"}) + "\n")
    assert fingerprint([f]) != a
    share = sum(is_validation(str(i), 0.1) for i in range(10000)) / 10000
    assert 0.08 < share < 0.12


def test_fields_reach_nested_records_in_every_columnar_and_line_format(tmp_path):
    from prism_tda.corpus import Fields

    recs = [{"content": "first text", "meta": {"doc": "m1", "lang": "en"}},
            {"content": "second text", "meta": {"doc": "m2"}},
            {"content": "no id here", "meta": {"lang": "fr"}},
            {"meta": {"doc": "m4"}}]
    fields = Fields(text="content", id="meta.doc")
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "p").mkdir()
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "p" / "train-00000-of-00001.parquet")
    (tmp_path / "a").mkdir()
    with pa.OSFile(str(tmp_path / "a" / "c.arrow"), "wb") as sink, \
            pa.ipc.new_file(sink, pa.Table.from_pylist(recs).schema) as w:  # the random-access format
        w.write_table(pa.Table.from_pylist(recs))
    for kind in ("j", "p", "a"):
        stats = CorpusStats()
        docs = list(read_corpus([tmp_path / kind], stats, fields))
        assert [(d.doc_id, d.text) for d in docs] == [("m1", "first text"), ("m2", "second text")], kind
        assert dict(stats.bad) == {"missing_id": 1, "missing_text": 1}, kind
        assert sorted((e["row"], e["reason"]) for e in stats.examples) == [(2, "missing_id"), (3, "missing_text")]
    stats = CorpusStats()
    assert list(read_corpus([tmp_path / "p"], stats)) == []  # no `text` column without --text-field
    assert dict(stats.bad) == {"missing_text_column": 1} and "content" in stats.examples[0]["detail"]
    with pytest.raises(CorpusError, match="dotted path"):
        Fields(text="meta.")


def test_datasets_save_to_disk_folder_is_read_through_a_memory_map_in_batch_units(tmp_path):
    datasets = pytest.importorskip("datasets")
    from prism_tda.corpus import Fields, plan_units, read_unit

    n = 300
    ds = datasets.Dataset.from_dict({"body": [f"document number {i} " * 20 for i in range(n)],
                                     "info": [{"key": f"k{i}"} for i in range(n)]})
    ds.save_to_disk(str(tmp_path / "ds"), max_shard_size="20KB")  # several .arrow files
    assert len(list((tmp_path / "ds").glob("*.arrow"))) > 1
    fields = Fields(text="body", id="info.key")
    stats = CorpusStats()
    docs = list(read_corpus([tmp_path / "ds"], stats, fields))
    assert [d.doc_id for d in docs] == [f"k{i}" for i in range(n)] and stats.n_bad == 0
    assert docs[7].text == ds[7]["body"]
    units = plan_units([tmp_path / "ds"], 4_000, fields=fields)
    assert {u.kind for u in units} == {"arrow"}
    assert [d.doc_id for u in units for d in read_unit(u, CorpusStats())] == [f"k{i}" for i in range(n)]
    # a stream file of many record batches (the format `datasets` writes) is cut between batches
    table = pa.Table.from_pylist([{"text": f"row {i} " * 30, "id": str(i)} for i in range(n)])
    with pa.OSFile(str(tmp_path / "s.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        for b in table.to_batches(max_chunksize=25):
            w.write_batch(b)
    units = plan_units([tmp_path / "s.arrow"], 4_000)
    assert len(units) > 3 and all(u.stop - u.start < 12 for u in units)
    stats = CorpusStats()
    assert [d.doc_id for u in units for d in read_unit(u, stats)] == [str(i) for i in range(n)]
    assert stats.n_documents == n and stats.n_bad == 0
    # a DatasetDict: one split must be chosen
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(CorpusError, match=r"DatasetDict with splits \['test', 'train'\]"):
        list(read_corpus([tmp_path / "dd"]))
    assert len(list(read_corpus([tmp_path / "dd" / "test"], None, fields))) == 3
