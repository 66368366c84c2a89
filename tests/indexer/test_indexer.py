"""The indexer: shard files and types, stored rows against the model, additive statistics, shard
layout independence, crash-resume, Ray, append, refusals, bad input, dry-run."""

from __future__ import annotations

import gzip
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

from prism_tda.engine import layout
from prism_tda.engine.calibration import IndexCalibration
from prism_tda.engine.curvature import CurvatureStats, damping_unit, self_influence
from prism_tda.engine.reader import IndexReader
from prism_tda.engine.tokens import run_batch
from prism_tda.indexer.run import Indexer, IndexMismatchError, build_index
from prism_tda.model import checkpoint as ckpt
from prism_tda.model.train import Trainer
from tests.conftest import REPO, assert_same_float16, tiny_model_cfg, tiny_train_cfg
from tests.conftest import index_cfg as _cfg

PER_TOKEN = ("tokens", "protos", "acts", "codes", "self")
PER_SEQ = ("seq_tok0", "seq_doc", "seq_start", "seq_last_target")


def _reader(index: Path, ck: Path) -> IndexReader:
    model, _, _ = ckpt.load_checkpoint(ck)
    return IndexReader(index, model.W)


def test_shards_have_the_declared_files_and_types(index, tiny_ckpt):
    model, tok, _ = ckpt.load_checkpoint(tiny_ckpt)
    sch = layout.schemas(model.cfg.vocab_size, model.cfg.n_prototypes)
    m = layout.read_manifest(index)
    assert m.complete and len(m.shards) == len(m.units) >= 3
    assert [s.unit for s in m.shards] == sorted(s.unit for s in m.shards)
    k = model.cfg.n_active
    for s in m.shards:
        d = layout.shard_dir(index, s.unit)
        assert layout.read_shard_info(d) == s
        assert pq.read_schema(d / "documents.parquet").remove_metadata() == sch["documents"]
        assert pq.read_schema(d / "sequences.parquet").remove_metadata() == sch["sequences"]
        assert pq.ParquetFile(d / "documents.parquet").metadata.row_group(0).column(0).compression == "ZSTD"
        a = {n: np.load(d / f"{n}.npy", mmap_mode="r") for n in (*PER_TOKEN, *PER_SEQ)}
        assert a["tokens"].dtype == np.uint16 and a["protos"].dtype == np.uint16  # vocabulary 400, K 32
        assert a["acts"].dtype == np.uint8 and a["codes"].dtype == np.uint8 and a["self"].dtype == np.float16
        assert a["protos"].shape == a["acts"].shape == (s.n_tokens, k) and len(a["tokens"]) == s.n_tokens
        assert a["seq_tok0"][-1] == s.n_tokens and len(a["seq_doc"]) == s.n_seqs
        assert (np.diff(a["seq_tok0"]) > 0).all() and (np.diff(a["seq_doc"]) >= 0).all()
    for name in ("prototypes", "vocab"):
        assert pq.read_schema(index / f"{name}.parquet").remove_metadata() == sch[name]
    assert len(pq.read_table(index / "vocab.parquet")) == tok.get_vocab_size()
    r = _reader(index, tiny_ckpt)
    assert r.n_docs == 600 and [r.document(i)["doc_id"] for i in (0, 299, 599)] == [0, 299, 599]
    assert r.n_tokens == m.summary["tokens"] == sum(s.n_tokens for s in m.shards)


def test_stored_rows_are_the_models_own(index, tiny_ckpt):
    """Per token: the active prototypes exactly; activations within the 8-bit log scale's step; I(t, t)
    to float16 precision, of the token as stored (its decoded vector with its stored activations; the
    exact value for a direction-coded token, whose codes hold no length); the stored target is the
    next token; the decoded vector points like u."""
    model, _, _ = ckpt.load_checkpoint(tiny_ckpt)
    r = IndexReader(index, model.W)
    calib = IndexCalibration.load(index / layout.CALIBRATION)
    step = float(((calib.act_hi - calib.act_lo) / 254).max())  # log-scale quantisation step
    inv = calib.curvature.inv()
    cosines, checked, n_dir, stored_vs_exact = [], 0, 0, []
    # a sample of sequences, each run alone, and those holding the first direction-coded tokens (how many
    # tokens a trained model predicts confidently enough for them depends on its training's last bits)
    holding_dirs = r.seq_of_tokens(np.flatnonzero(r.token_code_dirs(np.arange(r.n_tokens)))[:200])
    for seq in sorted(set(range(0, r.n_seqs, 23)) | set(holding_dirs.tolist())):
        toks, tgts = r.sequence_tokens(seq)
        tb = run_batch(model, [toks], [tgts])
        lo, hi, _ = r.seq_span(seq)
        rows = np.arange(lo, hi)
        data = r.token_data(rows)
        assert data.targets.tolist() == tgts
        ut = tb.u @ calib.curvature.Q
        exact = np.zeros(len(rows))
        for t in range(len(rows)):
            want = {int(j): float(a) for j, a in zip(tb.proto_idx[t], tb.acts[t], strict=True) if a > 0}
            got = {int(j): float(a) for j, a in zip(data.protos[t], data.acts[t], strict=True) if a > 0}
            assert set(got) == set(want), (seq, t)
            for j, a in want.items():
                assert abs(np.log(got[j]) - np.log(a)) <= step / 2 + 1e-6
            exact[t] = float((tb.acts[t] ** 2 * (ut[t] ** 2 * inv[tb.proto_idx[t]]).sum(1)).sum())
            checked += 1
        dec = r.token_vectors(rows, data)
        cosines += torch.nn.functional.cosine_similarity(dec, ut, dim=1).tolist()
        # what the shard stores: the exact I(t, t) of direction-coded tokens, that of the stored token else
        is_dir = r.token_code_dirs(rows)
        of_stored = self_influence(dec, data.protos, data.acts, inv)
        np.testing.assert_allclose(data.self_influence[is_dir], exact[is_dir], rtol=2e-3)
        np.testing.assert_allclose(data.self_influence[~is_dir], of_stored[~is_dir], rtol=2e-3)
        n_dir += int(is_dir.sum())
        pos = ~is_dir & (exact > 0)  # (a token no prototype fired for has I(t, t) = 0 both ways)
        stored_vs_exact += (data.self_influence[pos] / exact[pos]).tolist()
    assert checked > 500 and n_dir < checked and n_dir >= min(len(holding_dirs), 1)
    # the stored token's I(t, t) is near the exact one (by the codes' error: tiny at this model's width)
    assert 0.8 < np.median(stored_vs_exact) < 1.2
    assert np.mean(cosines) > 0.9  # 8-bit product codes of the expected embedding, target row exact


def test_damping_is_per_prototype_from_the_corpus_usage(index, tiny_ckpt):
    """The default index damps each prototype's block by 0.03 x its own mean eigenvalue shrunk toward
    the mean (the calibration sample is the whole tiny corpus, so its usage is the stored one); a
    query's other damping scales the same unit; a manifest written before the scope existed is read
    as the global damping it was built with."""
    r = _reader(index, tiny_ckpt)
    calib = IndexCalibration.load(index / layout.CALIBRATION)
    assert r.cfg.damping_scope == "prototype" and r.cfg.damping == 0.03
    unit = damping_unit(calib.curvature.lam, _stats(index).count, "prototype")
    assert torch.allclose(calib.curvature.damping, 0.03 * unit, rtol=1e-5)
    assert torch.allclose(r.inv(0.3), 1.0 / (calib.curvature.lam + 0.3 * unit), rtol=1e-5)
    assert len(torch.unique(unit)) > 10  # one value per used prototype, not one for all
    data = json.loads((index / layout.MANIFEST).read_text())
    del data["config"]["damping_scope"]
    old = layout.IndexManifest.from_dict(data)
    assert old.config.damping_scope == "global" and old.config.damping == 0.03
    del data["config"]["posting_by"]  # older indexes filed tokens by I(t, t) share alone
    assert layout.IndexManifest.from_dict(data).config.posting_by == "share"


def test_posting_lists_hold_each_tokens_strongest_prototypes(index, tiny_ckpt):
    r = _reader(index, tiny_ckpt)
    sh = r.shards[0]
    C = r.n_cells
    for g in range(0, r.n_prototypes * C, 7):
        a, b = int(sh.post_offsets[g]), int(sh.post_offsets[g + 1])
        toks = sh.post_tokens[a:b].astype(np.int64)
        assert ((sh.protos[toks] == g // C).any(1)).all()  # every entry's token has that prototype active
    assert len(sh.post_tokens) <= 2 * sh.info.n_tokens and sh.post_offsets[-1] == len(sh.post_tokens)
    # the index-level list lengths (what a query picks lists by) sum every shard's
    sizes = np.load(index / layout.POST_SIZES)
    want = sum(np.diff(np.asarray(s.post_offsets, dtype=np.int64)) for s in r.shards)
    assert np.array_equal(sizes, want) and np.array_equal(r.list_sizes, want)


def _filed(sh, C: int) -> dict[int, set[int]]:
    """Each token row of a shard: the prototypes it is filed under."""
    out: dict[int, set[int]] = {}
    off = np.asarray(sh.post_offsets, dtype=np.int64)
    for g in np.flatnonzero(np.diff(off)):
        for t in sh.post_tokens[off[g]:off[g + 1]].tolist():
            out.setdefault(int(t), set()).add(int(g) // C)
    return out


def test_tokens_are_filed_under_their_most_active_prototype_too(index, tiny_ckpt, tiny_corpus, tmp_path):
    """By default a token's entries are the prototype carrying most of its I(t, t) and the most active
    of its others, so its most active prototype always holds it (filed by I(t, t) share alone, a token
    whose share sits on rarely used, strongly whitened prototypes is missing from the lists of the
    prototypes that carry its score)."""
    def not_under_most_active(ix: Path) -> float:
        r = _reader(ix, tiny_ckpt)
        sh, C = r.shards[0], r.n_cells
        filed = _filed(sh, C)
        data = r.token_data(np.arange(sh.info.n_tokens, dtype=np.int64))  # (shard 0: global rows = local)
        miss = 0
        for t in range(sh.info.n_tokens):
            a = data.acts[t]  # stored on an 8-bit log scale: near-equal activations may swap
            top = set(data.protos[t][a >= 0.97 * a.max()].tolist())
            miss += not (filed.get(t, set()) & top)
        return miss / sh.info.n_tokens

    assert layout.IndexConfig().posting_by == "both"
    assert not_under_most_active(index) == 0.0
    share = tmp_path / "share"
    build_index(tiny_ckpt, [tiny_corpus], share, _cfg(posting_by="share"), progress=False)
    # filed by share alone, some tokens' second entry is another prototype (on this tiny model the most
    # active one is still among them; on the memorised-facts corpus it is not: docs/benchmarks.md)
    r, rs = _reader(index, tiny_ckpt), _reader(share, tiny_ckpt)
    a, b = _filed(r.shards[0], r.n_cells), _filed(rs.shards[0], rs.n_cells)
    assert sum(a.get(t) != b.get(t) for t in set(a) | set(b)) > 0.01 * len(a)


def _arrays(index: Path) -> dict[str, np.ndarray]:
    m = layout.read_manifest(index)
    out: dict[str, np.ndarray] = {}
    for name in ("tokens", "protos", "acts", "codes"):
        out[name] = np.concatenate([np.load(layout.shard_dir(index, s.unit) / f"{name}.npy") for s in m.shards])
    out["self"] = np.concatenate([np.load(layout.shard_dir(index, s.unit) / "self.npy").astype(np.float64)
                                  * s.self_scale for s in m.shards])
    return out


def _stats(index: Path) -> CurvatureStats:
    return CurvatureStats.from_tensors(load_file(str(index / "stats.safetensors")))


def _same_index(a: Path, b: Path, *, same_layout: bool) -> None:
    xa, xb = _arrays(a), _arrays(b)
    for name in ("tokens", "protos", "acts"):
        assert np.array_equal(xa[name], xb[name]), name
    # batches of other shapes round differently in the last bits, which can move a code across a
    # boundary between two centroids: a handful of tokens' codes may differ
    same = (xa["codes"] == xb["codes"]).all(1).mean()
    assert same == 1.0 if same_layout else same > 0.995, same
    np.testing.assert_allclose(xa["self"], xb["self"], rtol=2e-3)
    sa, sb = _stats(a), _stats(b)
    for name in ("S", "lam", "count", "mass", "scalars", "max_cos"):
        assert torch.allclose(getattr(sa, name), getattr(sb, name), rtol=1e-6, atol=1e-9), name
    assert pq.read_table(a / "vocab.parquet").equals(pq.read_table(b / "vocab.parquet"))
    pa_, pb = pq.read_table(a / "prototypes.parquet").to_pydict(), pq.read_table(b / "prototypes.parquet").to_pydict()
    for col in pa_:  # sums over tokens in another order: equal to float tolerance
        if isinstance(pa_[col][0], float):
            np.testing.assert_allclose(pa_[col], pb[col], rtol=1e-6, err_msg=col)
        else:
            assert pa_[col] == pb[col], col
    if same_layout:  # the same shards, file for file
        for s in layout.read_manifest(a).shards:
            for f in sorted(layout.shard_dir(a, s.unit).iterdir()):
                if f.name == "self.npy":
                    assert_same_float16(np.load(f), np.load(layout.shard_dir(b, s.unit) / f.name), what=str(f))
                elif f.suffix in (".npy", ".parquet"):
                    assert f.read_bytes() == (layout.shard_dir(b, s.unit) / f.name).read_bytes(), f


def test_the_cut_into_shards_does_not_change_the_index(index, tiny_ckpt, tiny_corpus, tmp_path):
    """One shard or several: the same rows, codes and summed statistics (the calibration sample covers
    the whole corpus either way)."""
    whole = tmp_path / "one"
    build_index(tiny_ckpt, [tiny_corpus], whole, _cfg(shard_bytes=1 << 30), progress=False)
    assert len(layout.read_manifest(whole).shards) == 1
    _same_index(whole, index, same_layout=False)


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_gives_the_same_index(index, tiny_ckpt, tiny_corpus, tmp_path):
    out = tmp_path / "killed"
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"index": _cfg().to_dict()}))
    cmd = [sys.executable, "-m", "prism_tda.cli", "index", "--checkpoint", str(tiny_ckpt), "--corpus",
           str(tiny_corpus), "--out", str(out), "--config", str(cfg), "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    deadline = time.time() + 300
    done_at_kill = None
    while time.time() < deadline and proc.poll() is None:
        done = list((out / layout.SHARDS).glob(f"*/{layout.SHARD_INFO}"))
        if done:
            proc.send_signal(signal.SIGKILL)
            done_at_kill = len(done)
            break
        time.sleep(0.01)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert done_at_kill is not None and done_at_kill < len(layout.read_manifest(index).shards)
    assert not layout.read_manifest(out).complete
    rerun = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)),
                           timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert not list(out.rglob(".*.tmp-*"))
    _same_index(index, out, same_layout=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_two_workers_give_the_same_index(index, tiny_ckpt, tiny_corpus, tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "ray"
    summary = build_index(tiny_ckpt, [tiny_corpus], out, _cfg(), workers=2, progress=False)
    assert summary["documents"] == 600
    _same_index(index, out, same_layout=True)


def test_append_adds_shards_and_leaves_the_others(tiny_ckpt, tiny_corpus, tmp_path):
    lines = open(tiny_corpus).read().splitlines(keepends=True)
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(lines[:400]))
    second.write_text("".join(lines[400:]))
    out = tmp_path / "ix"
    build_index(tiny_ckpt, [first], out, _cfg(), progress=False)
    before = {f: f.stat().st_mtime_ns for f in (out / layout.SHARDS).rglob("*")}
    n_before = layout.read_manifest(out).documents
    calib = (out / layout.CALIBRATION).read_bytes()
    s = build_index(tiny_ckpt, [second], out, _cfg(), progress=False, append=True)
    assert s["documents"] == 600 and n_before == 400
    assert all(f.stat().st_mtime_ns == t for f, t in before.items())  # old shards untouched
    assert (out / layout.CALIBRATION).read_bytes() == calib  # scored under the same calibration
    r = _reader(out, tiny_ckpt)
    ext = [json.loads(line)["id"] for line in lines]
    assert [r.external_id(i) for i in (0, 399, 400, 599)] == [ext[0], ext[399], ext[400], ext[599]]
    # the index's statistics fold every shard once, old and new; the shards' copies are gone
    st = load_file(str(out / "stats.safetensors"))
    m = layout.read_manifest(out)
    assert sorted(st["units"].tolist()) == [s.unit for s in m.shards] and len(m.shards) > 1
    assert int(st["scalars"][0]) == m.tokens
    assert not list((out / layout.SHARDS).glob("*/stats.safetensors"))
    # appending the same corpus again adds nothing
    assert build_index(tiny_ckpt, [second], out, _cfg(), progress=False, append=True)["documents"] == 600
    with pytest.raises(IndexMismatchError, match=r"index\.embed_dim"):
        build_index(tiny_ckpt, [second], out, _cfg(embed_dim=32), progress=False, append=True)
    # an index from before tokens were filed under their most active prototype too (no posting_by in its
    # manifest): appended to with the rule it was built with, refused with the other
    data = json.loads((out / layout.MANIFEST).read_text())
    del data["identity"]["index.posting_by"], data["config"]["posting_by"]
    (out / layout.MANIFEST).write_text(json.dumps(data))
    with pytest.raises(IndexMismatchError, match=r"index\.posting_by"):
        build_index(tiny_ckpt, [second], out, _cfg(), progress=False, append=True)
    assert build_index(tiny_ckpt, [second], out, _cfg(posting_by="share"), progress=False,
                       append=True)["documents"] == 600


def test_rerun_refuses_another_model_or_config(index, tiny_ckpt, tiny_corpus, tiny_tokenizer, tmp_path):
    with pytest.raises(IndexMismatchError, match=r"index\.embed_dim"):
        build_index(tiny_ckpt, [tiny_corpus], index, _cfg(embed_dim=32), progress=False)
    t = Trainer(tiny_model_cfg(), tiny_train_cfg(max_steps=2, seed=7), [tiny_corpus], tmp_path / "other",
                tokenizer_path=tiny_tokenizer, progress=False).setup()
    other = t.fit()
    with pytest.raises(IndexMismatchError, match="checkpoint_sha256"):
        build_index(other, [tiny_corpus], index, _cfg(), progress=False)
    # the same inputs: nothing to do, same summary
    assert build_index(tiny_ckpt, [tiny_corpus], index, _cfg(), progress=False) == layout.read_manifest(index).summary


def test_bad_inputs_are_counted_and_reported(tiny_ckpt, tmp_path):
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
    r = _reader(out, tiny_ckpt)
    long_doc = [i for i in range(r.n_docs) if r.external_id(i) == "long"][0]
    n_tokens = r.document(long_doc)["n_tokens"]
    n_long = int((r.doc_of_seqs(np.arange(r.n_seqs)) == long_doc).sum())
    assert n_long == -(-n_tokens // 32) and n_tokens > 1000
    examples = [e for sh in layout.read_manifest(out).shards for e in sh.corpus["bad_examples"]]
    assert any({"file": str(d / "a.jsonl"), "row": 3, "reason": "invalid_json"}.items() <= e.items() for e in examples)


def test_a_split_jsonl_file_reads_every_record_once(tiny_ckpt, tiny_corpus, tmp_path):
    from prism_tda.corpus import CorpusStats, plan_units, read_unit

    units = plan_units([tiny_corpus], 5_000)
    assert len(units) > 10 and all(u.kind == "jsonl" for u in units)
    ids = [d.doc_id for u in units for d in read_unit(u, CorpusStats())]
    want = [str(json.loads(line)["id"]) for line in open(tiny_corpus)]
    assert ids == want
    # a compressed file is one unit, sized by its uncompressed bytes (what the estimates scale by)
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(tiny_corpus.read_bytes()))
    (unit,) = plan_units([gz], 5_000)
    assert unit.bytes == tiny_corpus.stat().st_size > gz.stat().st_size


def test_dry_run_estimate_is_close(index, tiny_ckpt, tiny_corpus):
    ix = Indexer(tiny_ckpt, [tiny_corpus], index / "unused", _cfg(), progress=False)
    from prism_tda.indexer.estimate import estimate

    est = estimate(ix)
    s = layout.read_manifest(index).summary
    assert not (index / "unused").exists()
    assert 0.7 < s["tokens"] / est["tokens"] < 1.4
    for name in ("tokens", "protos", "acts", "codes", "post_tokens"):
        assert 0.6 < s["bytes"][name] / est["disk_bytes"][name] < 1.6, name
    assert est["serving_memory_bytes"] > 0 and "estimate_vs_actual" in s


def test_the_large_index_spec_trains_without_polysemous_codes_and_is_sized():
    """Beyond 4,096 sequences: IVF-PQ without polysemous training (a code permutation the search never
    uses, and most of the template's training time); the estimate reads its code size."""
    import faiss

    from prism_tda.indexer.calibrate import faiss_spec
    from prism_tda.indexer.estimate import pq_code_bytes

    spec, nprobe = faiss_spec(_cfg(), 100_000, 1024, 20_000)
    ivf = faiss.downcast_index(faiss.index_factory(1024, spec, faiss.METRIC_INNER_PRODUCT))
    assert spec.startswith("IVF") and not ivf.do_polysemous_training and ivf.polysemous_ht == 0
    assert pq_code_bytes(spec) == 32 and nprobe >= 1
    assert pq_code_bytes("IVF8,PQ32x4np") == 16 and pq_code_bytes("IDMap,Flat") is None
