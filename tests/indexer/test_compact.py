"""Compaction after a takedown: the shards holding removed documents are rewritten without them, every
kept document's rows are the ones the first build wrote, the statistics lose exactly the removed
documents' share, the absence check finds neither their text nor their token n-grams, and a
compaction killed (SIGKILL) at any point is finished by running it again."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from prism_tda.engine import Attributor, QueryOptions, QuerySpec, layout
from prism_tda.engine.reader import IndexReader
from prism_tda.engine.takedown import absence, read_removals, remove_documents
from prism_tda.indexer.compact import compact
from prism_tda.indexer.run import build_index
from tests.conftest import REPO, assert_same_float16

ARRAYS = ("tokens", "protos", "acts", "codes")  # bit for bit; I(t, t) ("self") to float16 precision


def _victims(index: Path) -> list[str]:
    """Two documents' ids, in two different shards (the second shard's first, the last shard's third)."""
    r = IndexReader(index)
    ids = [r.external_id(int(r.doc_base[1])), r.external_id(int(r.doc_base[-2]) + 2)]
    r.close()
    return ids


def _rows_by_document(index: Path) -> dict[tuple[str, str], dict[str, np.ndarray]]:
    """Every document's stored per-token rows, keyed by (external id, text)."""
    r = IndexReader(index)
    out = {}
    for s, sh in r.held_shards():
        arrays = {name: np.asarray(getattr(sh, name)) for name in ("tokens", "protos", "acts", "codes")}
        # I(t, t), stored as float16 of I / the shard's self_scale (which a rewrite may change)
        arrays["self16"] = np.load(layout.array_file(sh.path, "self"))
        arrays["self"] = arrays["self16"].astype(np.float64) * sh.info.self_scale
        arrays["self_scale"] = np.full(len(arrays["self16"]), sh.info.self_scale)
        base = int(r.doc_base[s])
        for local in range(sh.info.n_docs):
            doc = base + local
            rows = r.rows_of_documents(np.array([doc])) - int(r.tok_base[s])
            rec = r.document(doc)
            out[(rec["external_id"], rec["text"])] = {k: v[rows] for k, v in arrays.items()}
    r.close()
    return out


def _stats(index: Path) -> dict:
    t = load_file(str(index / layout.STATS))
    return {k: t[k].numpy() for k in ("S", "lam", "count", "mass", "scalars")}


@pytest.fixture(scope="module")
def removed_and_compacted(index, tmp_path_factory):
    """The test index, with two documents taken down, before and after compaction."""
    tmp = tmp_path_factory.mktemp("compact")
    before, after = tmp / "before", tmp / "after"
    shutil.copytree(index, before)
    ids = _victims(before)
    res = remove_documents(before, ids, by="test", reason="copyright")
    assert len(res.removed) == 2 and {r.unit for r in res.removed}.__len__() == 2
    shutil.copytree(before, after)
    summary = compact(after, progress=False)
    return before, after, ids, summary


def test_compaction_rewrites_the_shards_without_the_removed_documents(removed_and_compacted, index):
    before, after, ids, summary = removed_and_compacted
    assert summary["shards_rewritten"] == 2 and summary["documents_removed"] == 2
    m0, m1 = layout.read_manifest(before), layout.read_manifest(after)
    assert m1.documents == m0.documents - 2 and m1.complete
    assert sorted(sh.generation for sh in m1.shards)[-2:] == [1, 1]
    names = {d.name for d in (after / layout.SHARDS).iterdir()}
    assert names == {sh.dir(after).name for sh in m1.shards}  # old generations deleted
    # every kept document's rows are the first build's, bit for bit
    old, new = _rows_by_document(before), _rows_by_document(after)
    gone = {k for k in old if k[0] in ids}
    assert len(gone) == 2 and set(new) == set(old) - gone
    for key, rows in new.items():
        for name in ARRAYS:
            assert np.array_equal(rows[name], old[key][name]), (key[0], name)
        assert np.allclose(rows["self"], old[key]["self"], rtol=2e-3, atol=0), key[0]
    # the statistics lost exactly the removed documents' tokens
    s0, s1 = _stats(before), _stats(after)
    removed_tokens = sum(len(old[k]["tokens"]) for k in gone)
    assert s1["scalars"][0] == s0["scalars"][0] - removed_tokens == m1.tokens
    assert np.all(s1["count"] <= s0["count"]) and s1["count"].sum() < s0["count"].sum()
    # the index answers, without them; the takedown record no longer masks anything
    att = Attributor.open(after)
    assert att.reader.n_docs == m1.documents and not att.reader.takedown.any()
    res = att.attribute(QuerySpec("A computer", " is"), QueryOptions(n_documents=5))
    assert res.documents and not {d.external_id for d in res.documents} & set(ids)
    att.close()


def test_the_absence_check_before_and_after(removed_and_compacted, tiny_ckpt, tmp_path):
    before, after, ids, _ = removed_and_compacted
    assert [c["status"] for c in absence(before)] == ["filtered", "filtered"]
    checks = absence(after)
    assert [c["status"] for c in checks] == ["absent", "absent"]
    assert all(not c["document_in_store"] and c["sequences_with_its_ngrams"] == 0 for c in checks)
    assert all(x.grams for x in read_removals(after))
    # the check can fail: the first removed text, appended again under another id, is found by its n-grams
    r = IndexReader(before)
    text = next(r.document(d)["text"] for d in range(r.n_docs) if r.external_id(d) == ids[0])
    r.close()
    again = tmp_path / "again"
    shutil.copytree(after, again)
    (tmp_path / "copy.jsonl").write_text(json.dumps({"id": "a-copy", "text": text}) + "\n")
    build_index(tiny_ckpt, [str(tmp_path / "copy.jsonl")], again, layout.read_manifest(again).config,
                progress=False, append=True)
    checks = absence(again)
    assert checks[0]["status"] == "present" and checks[0]["sequences_with_its_ngrams"] > 0
    assert not checks[0]["document_in_store"]  # another id: another document, the same text
    assert checks[1]["status"] == "absent"


@pytest.mark.slow
@pytest.mark.parametrize("kill_when", ["new_generation", "statistics"])
def test_sigkill_during_compaction_then_rerun_finishes_it(removed_and_compacted, tmp_path, kill_when):
    before, after, _, _ = removed_and_compacted
    out = tmp_path / "killed"
    shutil.copytree(before, out)
    stats_mtime = (out / layout.STATS).stat().st_mtime_ns
    cmd = [sys.executable, "-m", "prism_tda.cli", "index", "--out", str(out), "--compact", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if kill_when == "new_generation" and list((out / layout.SHARDS).glob(f"*.g1/{layout.SHARD_INFO}")):
            break
        if kill_when == "statistics" and (out / layout.STATS).stat().st_mtime_ns != stats_mtime:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the compaction finished before it could be killed"
    Attributor.open(out).close()  # a killed compaction leaves a readable index (one generation or the other)
    rerun = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert not (out / ".compact").exists()
    assert layout.read_manifest(out).documents == layout.read_manifest(after).documents
    new, ref = _rows_by_document(out), _rows_by_document(after)
    assert set(new) == set(ref)
    for key in ref:
        for name in ARRAYS:
            assert np.array_equal(new[key][name], ref[key][name]), (key, name)
        assert np.array_equal(new[key]["self_scale"], ref[key]["self_scale"]), key
        assert_same_float16(new[key]["self16"], ref[key]["self16"], what=str(key))
    s, t = _stats(out), _stats(after)
    for k in s:
        assert np.allclose(s[k], t[k], rtol=1e-9, atol=1e-9), k
    assert [c["status"] for c in absence(out)] == ["absent", "absent"]
