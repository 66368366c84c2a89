"""Upgrading an index built by an earlier version (``indexer/upgrade.py``): shards that store the exact
``I(t, t)`` come out holding what a fresh build stores, from what they hold alone; a second run and a
run after a crash finish without redoing anything; the fast path's cosines are the stored tokens'."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from prism_tda.engine import Attributor, QuerySpec, layout
from prism_tda.engine.reader import IndexReader
from prism_tda.engine.scoring import approx_scores, exact_scores
from prism_tda.engine.takedown import remove_documents
from prism_tda.errors import PrismError
from prism_tda.indexer.compact import compact
from prism_tda.indexer.upgrade import upgrade
from prism_tda.model import checkpoint as ckpt
from tests.conftest import REPO


def _self(index) -> np.ndarray:
    m = layout.read_manifest(index)
    return np.concatenate([np.load(layout.array_file(s.dir(index), "self")).astype(np.float64) * s.self_scale
                           for s in m.shards])


def _as_built_before(index, tiny_ckpt) -> np.ndarray:
    """Rewrite a copy of a fresh index as an earlier version wrote it: every token's exact I(t, t),
    recomputed by the model, and shards that say so; returns those values."""
    model, _, _ = ckpt.load_checkpoint(tiny_ckpt)
    r = IndexReader(index, model.W)
    att = Attributor.open(index)
    G = att.encode(QuerySpec("A computer", " is a")).G
    pre = att.preconditioner()
    ex = exact_scores(model, r, G, pre, np.arange(r.n_seqs))
    assert np.array_equal(ex.tok, np.arange(r.n_tokens))
    live = ex.cos != 0
    exact = np.zeros(r.n_tokens)
    exact[live] = (ex.raw[live] / ex.cos[live]) ** 2 / pre.self_influence(G)
    # tokens sharing no prototype with the query: their stored value (direction-coded ones are exact)
    dirs = r.token_code_dirs(np.arange(r.n_tokens))
    keep = ~live | dirs
    exact[keep] = _self(index)[keep]
    r.close()
    att.close()
    m = layout.read_manifest(index)
    for s in m.shards:
        lo = r.tok_base[m.shards.index(s)]
        layout.write_array(layout.array_file(s.dir(index), "self"),
                           (exact[lo : lo + s.n_tokens] / s.self_scale).astype(np.float16))
        layout.write_shard_info(s.dir(index), dataclasses.replace(s, self_of="exact"))
    layout.write_manifest(index, dataclasses.replace(m, shards=[dataclasses.replace(s, self_of="exact")
                                                               for s in m.shards]))
    return exact


def test_an_index_of_exact_values_upgrades_to_what_a_build_stores(index, tiny_ckpt, tmp_path, caplog):
    built = _self(index)
    assert {s.self_of for s in layout.read_manifest(index).shards} == {"codes"}
    old = tmp_path / "old"
    shutil.copytree(index, old)
    exact = _as_built_before(old, tiny_ckpt)
    dirs = Attributor.open(index).reader.token_code_dirs(np.arange(len(built)))
    assert not np.allclose(exact[~dirs], built[~dirs], rtol=2e-3)  # the earlier values differ
    # an earlier index's fast path divides by the exact value: other cosines than a fresh build's
    G = Attributor.open(index).encode(QuerySpec("Love is", " a")).G
    rows = np.arange(len(built))
    caplog.clear()
    a, b = Attributor.open(index), Attributor.open(old)
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and "--upgrade" in said[0] and str(old) in said[0]  # the earlier index only
    cos_new = approx_scores(a.reader, G, a.preconditioner(), rows).cos
    assert not np.allclose(approx_scores(b.reader, G, b.preconditioner(), rows).cos, cos_new, rtol=2e-3)
    b.close()

    res = upgrade(old, progress=False)
    assert res["shards_upgraded"] == res["shards"] == len(layout.read_manifest(old).shards) >= 3
    np.testing.assert_allclose(_self(old), built, rtol=2e-3)
    assert {s.self_of for s in layout.read_manifest(old).shards} == {"codes"}
    assert all(layout.read_shard_info(s.dir(old)).self_of == "codes" for s in layout.read_manifest(old).shards)
    caplog.clear()
    b = Attributor.open(old)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    np.testing.assert_allclose(approx_scores(b.reader, G, b.preconditioner(), rows).cos, cos_new, rtol=2e-3)
    b.close()
    # nothing left to do
    assert upgrade(old, progress=False)["shards_upgraded"] == 0


def test_an_upgrade_killed_before_the_manifest_is_finished_by_running_it_again(index, tiny_ckpt, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(index, old)
    _as_built_before(old, tiny_ckpt)
    m = layout.read_manifest(old)
    upgrade(old, progress=False)
    first = _self(old)
    # the state a kill after the shards and before the manifest leaves: shards done, manifest not
    layout.write_manifest(old, dataclasses.replace(m, shards=[dataclasses.replace(s, self_of="exact")
                                                             for s in m.shards]))
    # and one shard whose array was replaced but whose shard.json was not written
    s0 = m.shards[0]
    layout.write_shard_info(s0.dir(old), dataclasses.replace(s0, self_of="exact"))
    res = upgrade(old, progress=False)
    assert res["shards_upgraded"] == 1
    np.testing.assert_array_equal(_self(old), first)  # recomputed from the codes: the same array
    assert {s.self_of for s in layout.read_manifest(old).shards} == {"codes"}


def test_the_cli_upgrades_and_refuses_an_incomplete_index(index, tiny_ckpt, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(index, old)
    _as_built_before(old, tiny_ckpt)
    run = [sys.executable, "-m", "prism_tda.cli", "index", "--out", str(old), "--upgrade", "--no-progress"]
    p = subprocess.run(run, capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["shards_upgraded"] == len(layout.read_manifest(old).shards)
    p = subprocess.run([*run[:5], str(tmp_path / "nothing"), *run[6:]], capture_output=True, text=True, cwd=REPO)
    assert p.returncode != 0 and "does not exist" in p.stderr


def test_every_job_refuses_a_checkpoint_the_index_was_not_built_from(index, tmp_path):
    """Opening, upgrading and compacting an index whose manifest names other weights than its
    checkpoint holds: each refuses, naming the index and the checkpoint."""
    other = tmp_path / "other"
    shutil.copytree(index, other)
    m = layout.read_manifest(other)
    layout.write_manifest(other, dataclasses.replace(m, identity={**m.identity, "checkpoint_sha256": "0" * 64}))
    s0 = layout.read_manifest(other).shards[0]
    layout.write_shard_info(s0.dir(other), dataclasses.replace(layout.read_shard_info(s0.dir(other)), self_of="exact"))
    for job in (Attributor.open, upgrade):
        with pytest.raises(PrismError, match="is not the one the index was built from") as e:
            job(other)
        assert str(other) in str(e.value) and str(m.checkpoint) in str(e.value)
    ids = [IndexReader(other).external_id(0)]
    remove_documents(other, ids, by="test", reason="test")
    with pytest.raises(PrismError, match="is not the one the index was built from"):
        compact(other, progress=False)
