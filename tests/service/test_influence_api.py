"""The query option ``influence`` over HTTP: each returned document's full-model influence where the
index has its influence curvature, a problem naming the fix where it has none."""

from __future__ import annotations

import shutil

import httpx

from prism_tda.engine import layout
from prism_tda.engine.influence import fit_index

from .conftest import assert_problem, service_settings, serving


def test_attribute_with_influence(index, tmp_path):
    fitted = tmp_path / "fitted"
    shutil.copytree(index, fitted)
    fit_index(fitted, max_sequences=32)
    assert (fitted / layout.EKFAC).exists() and not (index / layout.EKFAC).exists()
    settings = service_settings(fitted, tmp_path / "state", indexes={"fitted": fitted, "bare": index})
    with serving(settings) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        q = {"prompt": "A computer", "completion": " is a", "n_documents": 8}
        r = c.post("/v1/attribute", json={**q, "index": "fitted", "influence": True})
        assert r.status_code == 200, r.text
        docs = r.json()["documents"]
        assert docs and all(isinstance(d["influence"], float) and d["influence"] > 0 for d in docs)
        assert r.json()["timings_ms"]["influence"] > 0
        plain_json = c.post("/v1/attribute", json={**q, "index": "fitted"}).json()
        plain = plain_json["documents"]
        assert all(d["influence"] is None for d in plain)
        # the score's order, less the documents the whole model says push the other way (the plain answer
        # leaves out those whose value does: both come from the same ranked candidates)
        kept, shown = {d["doc_id"] for d in docs}, {d["doc_id"] for d in plain}
        assert [d["doc_id"] for d in docs if d["doc_id"] in shown] == [d["doc_id"] for d in plain if d["doc_id"] in kept]
        assert [d["score"] for d in docs] == sorted((d["score"] for d in docs), reverse=True)
        assert r.json()["opposed_by_value"] == 0 and plain_json["opposed_by_influence"] == 0
        assert len(docs) + r.json()["opposed_by_influence"] == len(plain) + plain_json["opposed_by_value"]
        assert_problem(c.post("/v1/attribute", json={**q, "index": "bare", "influence": True}), 422,
                       "invalid-query", mentions="--influence")
