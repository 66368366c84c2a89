"""The training record: which documents a run trained on, counted from the windows it drew, saved with
every checkpoint, continued on resume, and what the indexer reads `trained` from."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prism_tda.engine import Attributor
from prism_tda.indexer.run import build_index
from prism_tda.model import checkpoint as ckpt
from prism_tda.model.record import TrainingRecord, document_key, window_starts
from tests.conftest import index_cfg, tiny_model_cfg, tiny_train_cfg


def _trainer(tmp, corpus, tok, name, **kw):
    from prism_tda.model.train import Trainer

    return Trainer(tiny_model_cfg(), tiny_train_cfg(**kw), [corpus], tmp / name, tokenizer_path=tok,
                   progress=False).setup()


def test_the_record_counts_the_windows_each_document_was_in(tmp_path, tiny_corpus, tiny_tokenizer):
    t = _trainer(tmp_path, tiny_corpus, tiny_tokenizer, "run", max_steps=12, ckpt_every=6)
    path = t.fit()
    rec = ckpt.load_record(path)
    assert rec.step == 12 and np.array_equal(rec.keys, t.data.doc_keys)
    # recounted independently: each window's tokens, each token's document
    block, stream = t.model_cfg.block_size, t.data.train
    owner = np.searchsorted(t.data.doc_start, np.arange(len(stream)), side="right") - 1
    expect = np.zeros(len(rec.keys), np.int64)
    for step in range(12):
        for s in window_starts(len(stream), step=step, seed=t.cfg.seed, block=block, total=t.cfg.batch_size):
            expect[np.unique(owner[s: s + block + 1])] += 1
    assert np.array_equal(rec.windows, expect)
    assert 0 < rec.n_trained < len(rec.keys)  # 12 small steps cover some documents, not all
    # listed and hashed in config.json, summarised there
    config = ckpt.read_config(path)
    assert "training_record.safetensors" in config["files"]
    assert config["training_record"]["trained_documents"] == rec.n_trained
    assert config["training_record"]["corpus_fingerprint"]
    ckpt.load_checkpoint(path)  # the hash verifies


def test_a_resumed_run_continues_the_record(tmp_path, tiny_corpus, tiny_tokenizer):
    whole = _trainer(tmp_path, tiny_corpus, tiny_tokenizer, "whole", max_steps=10, ckpt_every=5)
    whole.fit()
    part = _trainer(tmp_path, tiny_corpus, tiny_tokenizer, "part", max_steps=10, ckpt_every=5)
    part.fit(max_steps=5)
    resumed = _trainer(tmp_path, tiny_corpus, tiny_tokenizer, "part", max_steps=10, ckpt_every=5)
    assert resumed.step == 5 and resumed.record.step == 5
    resumed.fit()
    a, b = ckpt.load_record(tmp_path / "whole"), ckpt.load_record(tmp_path / "part")
    assert a.step == b.step == 10 and np.array_equal(a.windows, b.windows)
    # a checkpoint from before records: the resumed run recounts its steps
    (tmp_path / "part" / ckpt.resolve(tmp_path / "part").name / "training_record.safetensors").unlink()
    config = ckpt.resolve(tmp_path / "part") / "config.json"
    c = json.loads(config.read_text())
    c["files"].pop("training_record.safetensors")
    config.write_text(json.dumps(c))
    again = _trainer(tmp_path, tiny_corpus, tiny_tokenizer, "part", max_steps=10, ckpt_every=5)
    assert np.array_equal(again.record.windows, a.windows)


def test_the_indexer_reads_trained_from_the_record(tmp_path, tiny_corpus, tiny_tokenizer):
    t = _trainer(tmp_path, tiny_corpus, tiny_tokenizer, "run", max_steps=20, ckpt_every=10)
    path = t.fit()
    rec = ckpt.load_record(path)
    # the training corpus, plus documents it never held: new ids, and a training id with other text
    lines = [json.loads(x) for x in open(tiny_corpus)]
    outside = [{"id": f"never-{i}", "text": f"A sentence the model never trained on, number {i}."} for i in range(5)]
    changed = {**lines[0], "text": lines[0]["text"] + " (edited)"}
    corpus = tmp_path / "indexed.jsonl"
    corpus.write_text("".join(json.dumps(x) + "\n" for x in [*lines, *outside, changed]))
    summary = build_index(path, [str(corpus)], tmp_path / "ix", index_cfg(), progress=False)
    assert summary["trained_from"] == "record" and summary["outside_record"] >= 6
    att = Attributor.open(tmp_path / "ix")
    r = att.reader
    trained = r.trained(np.arange(r.n_docs))
    by_id = {}
    for d in range(r.n_docs):
        rec_d = r.document(d)
        by_id.setdefault(rec_d["external_id"], []).append((rec_d["text"], bool(trained[d])))
    for x in outside:
        assert by_id[x["id"]] == [(x["text"], False)]
    assert (changed["text"], False) in by_id[changed["id"]]
    seen, _ = rec.lookup(np.array([document_key(x["id"], x["text"]) for x in lines]))
    for x, n in zip(lines, seen, strict=True):
        assert (x["text"], bool(n > 0)) in by_id[x["id"]]
    assert summary["trained_documents"] == int(trained.sum()) == int((seen > 0).sum())
    # appended documents are untrained unless the record lists them
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(json.dumps({"id": f"late-{i}", "text": f"Added later, {i}."}) + "\n" for i in range(3))
                     + json.dumps(lines[int(np.argmax(seen))]) + "\n")
    build_index(path, [str(extra)], tmp_path / "ix", index_cfg(), progress=False, append=True)
    r2 = Attributor.open(tmp_path / "ix").reader
    tail = np.arange(r.n_docs, r2.n_docs)
    assert r2.trained(tail).tolist() == [False, False, False, True]


def test_a_checkpoint_without_a_record_falls_back_to_the_validation_split(tiny_ckpt, tiny_corpus, tmp_path):
    import shutil

    from prism_tda.corpus import is_validation

    old = tmp_path / "old"
    shutil.copytree(ckpt.resolve(tiny_ckpt), old)
    (old / "training_record.safetensors").unlink()
    c = json.loads((old / "config.json").read_text())
    c["files"].pop("training_record.safetensors")
    c.pop("training_record")
    (old / "config.json").write_text(json.dumps(c))
    assert ckpt.load_record(old) is None
    summary = build_index(old, [str(tiny_corpus)], tmp_path / "ix", index_cfg(), progress=False)
    assert summary["trained_from"].startswith("validation split")
    r = Attributor.open(tmp_path / "ix").reader
    frac = c["training"]["train_config"]["val_fraction"]
    expect = [not is_validation(r.external_id(d), frac) for d in range(r.n_docs)]
    assert r.trained(np.arange(r.n_docs)).tolist() == expect


@pytest.mark.parametrize("n", [0, 3])
def test_lookup_of_an_empty_or_small_record(n):
    keys = np.arange(n, dtype=np.int64) * 7
    rec = TrainingRecord(keys, np.arange(n, dtype=np.int64))
    seen, held = rec.lookup(np.array([0, 7, 5], np.int64))
    assert held.tolist() == ([True, True, False] if n else [False] * 3)
    assert seen.tolist() == ([0, 1, 0] if n else [0, 0, 0])
