"""A `datasets` folder as the corpus, with its own field names, trained on and indexed; and `prism index`
without --corpus indexing the corpus the checkpoint's training record names."""

from __future__ import annotations

import gzip
import json
import logging
import shutil

import numpy as np
import pytest

from prism_tda import demo_corpus_path
from prism_tda.cli import main
from prism_tda.corpus import Fields
from prism_tda.engine import Attributor
from prism_tda.errors import PrismError
from prism_tda.indexer.run import build_index
from prism_tda.model import checkpoint as ckpt
from prism_tda.model.record import document_key
from prism_tda.model.train import Trainer
from tests.conftest import index_cfg, tiny_model_cfg, tiny_train_cfg

datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory, tiny_tokenizer):
    """A tiny model trained on a `datasets` folder whose records keep the text in `body` and the id in
    `meta.key` (450 fortunes, two .arrow files)."""
    tmp = tmp_path_factory.mktemp("hf")
    with gzip.open(demo_corpus_path(), "rt") as fh:
        recs = [json.loads(line) for _, line in zip(range(450), fh, strict=False)]
    ds = datasets.Dataset.from_dict({"body": [r["text"] for r in recs],
                                     "meta": [{"key": f"fortune-{r['id']}", "n": i} for i, r in enumerate(recs)]})
    ds.save_to_disk(str(tmp / "ds"), num_shards=2)
    fields = Fields(text="body", id="meta.key")
    t = Trainer(tiny_model_cfg(), tiny_train_cfg(max_steps=12, ckpt_every=12), [tmp / "ds"], tmp / "run",
                tokenizer_path=tiny_tokenizer, progress=False, fields=fields).setup()
    assert t.data.stats["bad_records"] == 0 and t.data.stats["documents"] == 450
    return tmp, t.fit(), recs


def test_a_datasets_folder_is_trained_on_and_indexed_by_default_from_the_record(hf_run, capsys):
    tmp, path, recs = hf_run
    rec = ckpt.load_record(path)
    assert rec.corpus["corpus_fields"] == {"text_field": "body", "id_field": "meta.key"}
    # no --corpus: the record's corpus, with the record's fields
    assert main(["index", "--checkpoint", str(path), "--out", str(tmp / "ix"), "--no-progress",
                 "--set", "index.shard_bytes=40000", "--set", "index.code_bits=8", "--set", "index.posting_cells=16",
                 "--set", "index.embed_dim=16", "--set", "index.sketch_buckets=8"]) == 0
    err = capsys.readouterr().err
    assert f"indexing {tmp / 'ds'}: the corpus the checkpoint was trained on" in err
    summary = json.loads((tmp / "ix" / "manifest.json").read_text())
    assert summary["identity"]["corpus_fields"] == {"text_field": "body", "id_field": "meta.key"}
    r = Attributor.open(tmp / "ix").reader
    assert r.n_docs == 450
    ids = [r.external_id(d) for d in range(r.n_docs)]
    assert ids == [f"fortune-{x['id']}" for x in recs]
    # trained exactly where the record says, keyed by the id field's value and the text field's text
    windows, held = rec.lookup(np.array([document_key(f"fortune-{x['id']}", x["text"]) for x in recs]))
    assert held.sum() == len(rec.keys) and r.trained(np.arange(r.n_docs)).tolist() == (windows > 0).tolist()


def test_another_corpus_is_announced_and_a_missing_one_refused(hf_run, tiny_corpus, caplog):
    tmp, path, _ = hf_run
    with caplog.at_level(logging.WARNING, logger="prism_tda.indexer.run"):
        summary = build_index(path, [str(tiny_corpus)], tmp / "other", index_cfg(), progress=False)
    notes = [r for r in caplog.records if "not the one the checkpoint was trained on" in r.getMessage()]
    assert len(notes) == 1
    assert summary["trained_documents"] == 0  # none of its documents is in the record (other ids)
    moved = tmp / "moved"
    shutil.copytree(ckpt.resolve(path), moved)
    shutil.move(tmp / "ds", tmp / "ds_gone")
    try:
        with pytest.raises(PrismError, match="the corpus it was trained on is not here"):
            build_index(moved, None, tmp / "never", index_cfg(), progress=False)
    finally:
        shutil.move(tmp / "ds_gone", tmp / "ds")
