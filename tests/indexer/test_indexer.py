"""The indexer: schemas, exact active sets, additive statistics, crash-resume, Ray, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from prism_tda.engine import layout as store
from prism_tda.engine.curvature import Curvature
from prism_tda.engine.reader import open_faiss
from prism_tda.engine.sketch import Sketch, normalise
from prism_tda.indexer.embed import shard_embeddings
from prism_tda.indexer.forward import ShardStats
from prism_tda.indexer.run import Indexer, IndexMismatchError, build_index
from prism_tda.model import checkpoint as ckpt
from prism_tda.model.train import Trainer
from tests.conftest import REPO, tiny_model_cfg, tiny_train_cfg
from tests.conftest import index_cfg as _cfg

TABLES = ("documents", "sequences", "activations", "token_grads")


def _read(index_dir: Path, table: str):
    files = sorted((index_dir / table).glob("part-*.parquet"))
    return pq.read_table(files) if len(files) > 1 else pq.read_table(files[0])


def test_tables_have_the_declared_schemas_and_order(index, tiny_ckpt):
    model, tok, _ = ckpt.load_checkpoint(tiny_ckpt)
    sch = store.schemas(model.cfg.vocab_size, model.cfg.n_prototypes, model.cfg.d_model)
    m = store.read_manifest(index)
    assert m.complete and len(m.shards) == 4 and all(s.forward for s in m.shards)
    for name in TABLES:
        for f in sorted((index / name).glob("part-*.parquet")):
            assert pq.read_schema(f).remove_metadata() == sch[name], (name, f)
            assert pq.ParquetFile(f).metadata.row_group(0).column(0).compression == "ZSTD"
    for name in ("prototypes", "vocab"):
        assert pq.read_schema(index / f"{name}.parquet").remove_metadata() == sch[name]
    # narrowest types: vocab 400 and K 32 fit int16
    assert str(sch["activations"].field("proto_id").type) == "int16"
    assert str(sch["activations"].field("act").type) == "halffloat"
    acts = _read(index, "activations")
    key = acts["seq_id"].to_numpy().astype(np.int64) * 4096 + acts["pos"].to_numpy()
    assert (np.diff(key) >= 0).all()
    grads = _read(index, "token_grads")
    gkey = grads["seq_id"].to_numpy().astype(np.int64) * 4096 + grads["pos"].to_numpy()
    assert (np.diff(gkey) > 0).all()
    seqs = _read(index, "sequences")
    assert seqs["seq_id"].to_pylist() == list(range(seqs.num_rows))
    assert len(gkey) == sum(seqs["n_tokens"].to_pylist()) == m.summary["tokens"]
    docs = _read(index, "documents")
    assert docs.num_rows == 600 and docs["doc_id"].to_pylist() == list(range(600))
    assert len(pq.read_table(index / "vocab.parquet")) == tok.get_vocab_size()


def test_activation_rows_are_exactly_the_models_active_sets(index, tiny_ckpt):
    model, _, _ = ckpt.load_checkpoint(tiny_ckpt)
    k = model.cfg.n_active
    seqs = _read(index, "sequences").to_pydict()
    acts = _read(index, "activations").to_pydict()
    rows: dict[tuple[int, int], dict[int, float]] = {}
    for s, p, pid, a in zip(acts["seq_id"], acts["pos"], acts["proto_id"], acts["act"]):
        rows.setdefault((s, p), {})[pid] = a
    assert max(len(v) for v in rows.values()) <= k
    checked = 0
    for i in range(0, len(seqs["seq_id"]), 17):  # a sample of sequences, each run alone
        ids = torch.tensor(seqs["token_ids"][i])
        with torch.no_grad():
            z = model.hidden(ids[None])[0]
            h = model.head(z)
        for pos in range(len(ids)):
            want = {int(j): float(a) for j, a in zip(h.proto_idx[pos], h.acts[pos]) if a > 0}
            got = rows.get((seqs["seq_id"][i], pos), {})
            assert set(got) == set(want), (i, pos)
            for j, a in want.items():
                assert abs(got[j] - a) <= 2**-8 * abs(a) + 1e-6  # stored at bfloat16 precision
            checked += 1
    assert checked > 100


def test_shard_statistics_sum_to_the_whole(index, tiny_ckpt, tiny_corpus, tmp_path):
    whole = tmp_path / "one"
    build_index(tiny_ckpt, [tiny_corpus], whole, _cfg(shard_documents=600), progress=False)
    parts = [ShardStats.from_tensors(load_file(str(f))) for f in sorted((index / "stats").glob("*.safetensors"))]
    merged = parts[0]
    for p in parts[1:]:
        merged.merge(p)
    one = ShardStats.from_tensors(load_file(str(whole / "stats" / "part-00000.safetensors")))
    for name in ("S", "lam", "count", "mass", "scalars", "max_cos"):
        a, b = getattr(merged, name), getattr(one, name)
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-9), name
    c1, c4 = Curvature.load(whole / "curvature.safetensors"), Curvature.load(index / "curvature.safetensors")
    assert torch.allclose(c1.lam, c4.lam, rtol=1e-5) and torch.allclose(c1.damping, c4.damping, rtol=1e-5)
    for name in ("activations", "token_grads", "sequences"):
        assert _read(whole, name).equals(_read(index, name)), name


def _tables_equal(a: Path, b: Path) -> None:
    for name in TABLES:
        assert _read(a, name).equals(_read(b, name)), name
    for name in ("prototypes.parquet", "vocab.parquet"):
        assert pq.read_table(a / name).equals(pq.read_table(b / name)), name
    ca, cb = Curvature.load(a / "curvature.safetensors"), Curvature.load(b / "curvature.safetensors")
    assert torch.allclose(ca.lam, cb.lam, rtol=1e-6) and torch.allclose(ca.Q, cb.Q)
    ea = np.concatenate([np.load(f) for f in sorted((a / "embeddings").glob("*.npy"))])
    eb = np.concatenate([np.load(f) for f in sorted((b / "embeddings").glob("*.npy"))])
    np.testing.assert_allclose(ea, eb, rtol=1e-5, atol=1e-6)
    assert open_faiss(a).ntotal == open_faiss(b).ntotal == len(ea)


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_gives_the_same_index(index, tiny_ckpt, tiny_corpus, tmp_path):
    out = tmp_path / "killed"
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"index": _cfg().to_dict()}))
    cmd = [sys.executable, "-m", "prism_tda.cli", "index", "--checkpoint", str(tiny_ckpt), "--corpus",
           str(tiny_corpus), "--out", str(out), "--config", str(cfg), "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    deadline = time.time() + 120
    done_at_kill = None
    while time.time() < deadline and proc.poll() is None:
        m = store.read_manifest(out) if (out / store.MANIFEST).is_file() else None
        if m and any(s.forward for s in m.shards):
            proc.send_signal(signal.SIGKILL)
            done_at_kill = sum(1 for s in m.shards if s.forward)
            break
        time.sleep(0.01)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert done_at_kill is not None and done_at_kill < 4
    m = store.read_manifest(out)
    assert not m.complete
    rerun = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)),
                           timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert not list(out.rglob(".*.tmp-*"))
    _tables_equal(index, out)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_two_workers_give_the_same_index(index, tiny_ckpt, tiny_corpus, tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "ray"
    summary = build_index(tiny_ckpt, [tiny_corpus], out, _cfg(), workers=2, progress=False)
    assert summary["documents"] == 600
    _tables_equal(index, out)


def test_rerun_refuses_another_model_or_config(index, tiny_ckpt, tiny_corpus, tiny_tokenizer, tmp_path):
    with pytest.raises(IndexMismatchError, match=r"index\.embed_dim"):
        build_index(tiny_ckpt, [tiny_corpus], index, _cfg(embed_dim=32), progress=False)
    t = Trainer(tiny_model_cfg(), tiny_train_cfg(max_steps=2, seed=7), [tiny_corpus], tmp_path / "other",
                tokenizer_path=tiny_tokenizer, progress=False).setup()
    other = t.fit()
    with pytest.raises(IndexMismatchError, match="checkpoint_sha256"):
        build_index(other, [tiny_corpus], index, _cfg(), progress=False)
    # the same inputs: nothing to do, same summary
    assert build_index(tiny_ckpt, [tiny_corpus], index, _cfg(), progress=False) == store.read_manifest(index).summary


def test_bad_inputs_are_counted_and_reported(tiny_ckpt, tmp_path, tiny_corpus):
    d = tmp_path / "corpus"
    d.mkdir()
    lines = [json.dumps({"id": "ok", "text": "A fine document."}), json.dumps({"id": "none"}),
             json.dumps({"id": "int", "text": 3}), "{broken", json.dumps({"id": "long", "text": "word " * 3000})]
    (d / "a.jsonl").write_bytes(("\n".join(lines) + "\n").encode() + b'{"id": "bytes", "text": "\xff"}\n')
    (d / "empty.jsonl").write_text("")
    import pyarrow as pa

    pq.write_table(pa.table({"body": ["no text column"]}), d / "nocol.parquet")
    (d / "bin.txt").write_bytes(b"\xff\xfe")
    out = tmp_path / "ix"
    s = build_index(tiny_ckpt, [d], out, _cfg(), progress=False)
    assert s["bad_by_reason"] == {"missing_text": 1, "text_not_string": 1, "invalid_json": 1,
                                  "undecodable_bytes": 2, "empty_file": 1, "missing_text_column": 1}
    assert s["bad_records"] == 7 and s["documents"] == 2
    docs = _read(out, "documents").to_pydict()
    long_tokens = docs["n_tokens"][docs["external_id"].index("long")]
    seqs = _read(out, "sequences").to_pydict()
    n_long = sum(1 for x in seqs["doc_id"] if x == docs["external_id"].index("long"))
    assert n_long == -(-long_tokens // 32) and long_tokens > 1000
    examples = store.read_manifest(out).plan.corpus["bad_examples"]
    assert {"file": str(d / "a.jsonl"), "row": 3, "reason": "invalid_json"}.items() <= examples[2].items()


def test_dry_run_estimate_is_close(index, tiny_ckpt, tiny_corpus):
    ix = Indexer(tiny_ckpt, [tiny_corpus], index / "unused", _cfg(), progress=False)
    from prism_tda.indexer.estimate import estimate

    est = estimate(ix)
    s = store.read_manifest(index).summary
    assert est["tokens"] == s["tokens"] and est["sequences"] == s["faiss_vectors"]
    assert not (index / "unused").exists()
    for table in ("activations", "token_grads", "embeddings"):
        assert 0.5 < s["bytes"][table] / est["disk_bytes"][table] < 2.0, table
    assert "estimate_vs_actual" in s


def test_sketch_inner_products_estimate_preconditioned_influence(index):
    """<e(x), e(y)> over stored embeddings tracks the exact sum_i v_i(x).v_i(y) from the tables."""
    curv = Curvature.load(index / "curvature.safetensors")
    acts = _read(index, "activations").to_pydict()
    grads = _read(index, "token_grads")
    u = np.asarray(grads["u"].combine_chunks().flatten().to_numpy(zero_copy_only=False), np.float32)
    u = u.reshape(grads.num_rows, -1)
    key = {(s, p): i for i, (s, p) in enumerate(zip(grads["seq_id"].to_pylist(), grads["pos"].to_pylist()))}
    n = 60
    G = [dict() for _ in range(n)]
    scale = curv.inv_sqrt().numpy()
    for s, p, pid, a in zip(acts["seq_id"], acts["pos"], acts["proto_id"], acts["act"]):
        if s < n:
            G[s][pid] = G[s].get(pid, 0) + a * u[key[(s, p)]] * scale[pid]
    exact = np.array([[sum(float(G[i][j] @ G[k][j]) for j in G[i] if j in G[k]) for k in range(n)] for i in range(n)])
    iu = np.triu_indices(n, 1)
    # with an identity projection and one bucket per prototype the sketch is exact: checks the math
    ident = Sketch(32, u.shape[1], u.shape[1], 32, seed=1)
    ident.R, ident.bucket, ident.sign = torch.eye(u.shape[1]), torch.arange(32), torch.ones(32)
    n0 = store.read_manifest(index).shards[0].n_seqs
    ew = shard_embeddings(index, 0, 0, n0, curv, ident)[:n]
    np.testing.assert_allclose(ew @ ew.T, exact, rtol=1e-3, atol=1e-3 * np.abs(exact).max())
    # the index's own narrow sketch (r=16, 8 buckets) is a noisier estimate of the same quantity
    e = np.concatenate([np.load(f) for f in sorted((index / "embeddings").glob("*.npy"))])[:n]
    assert np.corrcoef(exact[iu], (e @ e.T)[iu])[0, 1] > 0.4
    # and FAISS finds each sequence's own embedding first
    _, nearest = open_faiss(index).search(normalise(e[:10]), 1)
    assert (nearest[:, 0] == np.arange(10)).all()
    assert Sketch(32, 32, 16, 8, 0).dim == 128


def test_every_table_reads_in_duckdb(index):
    """The store is queried with DuckDB: every Parquet file must be readable by it."""
    duckdb = pytest.importorskip("duckdb")
    con = duckdb.connect()
    for name in ("documents", "sequences", "activations", "token_grads"):
        n = con.execute(f"SELECT count(*) FROM read_parquet('{index / name}/*.parquet')").fetchone()[0]
        assert n == _read(index, name).num_rows, name
    got = con.execute(f"SELECT sum(act::DOUBLE) FROM read_parquet('{index}/activations/*.parquet')").fetchone()[0]
    assert got == pytest.approx(float(np.sum(_read(index, "activations")["act"].to_numpy().astype(np.float64))))
    for name in ("prototypes", "vocab"):
        assert con.execute(f"SELECT count(*) FROM '{index / name}.parquet'").fetchone()[0] > 0
