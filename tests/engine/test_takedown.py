"""The takedown record and the removed-document mask every read applies: what a removal covers (every
document of an id), concurrent removals (none lost), re-reading when the file changes, and the labels
drawn again without the removed contexts (a compaction's generations: tests/indexer/test_compact.py)."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest

from prism_tda.engine import Attributor
from prism_tda.engine.catalog import Catalog
from prism_tda.engine.takedown import read_ids, read_removals, remove_documents
from prism_tda.errors import PrismError


@pytest.fixture
def ix(index, tmp_path):
    out = tmp_path / "ix"
    shutil.copytree(index, out)
    return out


def test_every_document_of_an_id_is_removed_once_and_concurrent_removals_all_land(ix):
    att = Attributor.open(ix)
    r = att.reader
    ids = [r.external_id(d) for d in range(0, 40, 4)]
    assert not r.takedown.any()
    threads = [threading.Thread(target=remove_documents, args=(ix, [x]), kwargs={"by": f"t{i}"})
               for i, x in enumerate(ids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    removals = read_removals(ix)
    assert sorted(x.external_id for x in removals) == sorted(ids)  # no write lost another's
    mask = r.removed(np.arange(r.n_docs))  # the open reader sees the new file at once
    assert sorted(r.external_id(int(d)) for d in np.nonzero(mask)[0]) == sorted(ids)
    again = remove_documents(ix, [ids[0], "nope"], by="x")
    assert again.removed == [] and again.already == [ids[0]] and again.not_found == ["nope"]
    with pytest.raises(PrismError, match="no document id"):
        remove_documents(ix, [], by="x")
    att.close()


def test_labels_are_drawn_again_once_documents_are_removed(ix):
    att = Attributor.open(ix)
    cat = Catalog(att.reader, att.model, att.tokenizer)
    first = cat.labels()
    assert cat.labels() is first  # kept while nothing changes
    proto = next(p for p in range(att.reader.n_prototypes) if att.reader.top_contexts(p, 10))
    rows = att.reader.top_contexts(proto, 10)
    docs = {int(att.reader.doc_of_seqs(att.reader.seq_of_tokens(np.array([row])))[0]) for row, _ in rows}
    remove_documents(ix, [att.reader.external_id(d) for d in docs], by="test")
    assert cat.labels() is not first  # drawn again, from contexts without the removed documents
    left = {int(att.reader.doc_of_seqs(att.reader.seq_of_tokens(np.array([row])))[0])
            for row, _ in att.reader.top_contexts(proto, 10)}
    assert not left & docs
    att.close()


def test_ids_from_a_file_or_a_list(tmp_path):
    f = tmp_path / "ids.txt"
    f.write_text("a/1\n\n  b/2 \n")
    assert read_ids(str(f)) == ["a/1", "b/2"]
    assert read_ids("a/1, b/2,,") == ["a/1", "b/2"]
