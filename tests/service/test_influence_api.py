"""The query option ``influence`` over HTTP: each returned document's full-model influence where the
index has its influence curvature, a problem naming the fix where it has none."""

from __future__ import annotations

import io
import shutil
import time

import httpx
import pyarrow.parquet as pq

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
        # an audit asking for it where the index cannot serve it is refused at once, and stores nothing
        audit = {"index": "bare", "items": [{"prompt": "A computer", "completion": " is a"}], "influence": True}
        assert_problem(c.post("/v1/audits", json=audit), 422, "invalid-query", mentions="--influence")
        assert c.get("/v1/audits", params={"index": "bare"}).json()["audits"] == []
        assert c.post("/v1/audits", json={**audit, "index": "fitted"}).status_code == 202


def test_an_audit_with_influence_keeps_each_documents_influence(index, tmp_path):
    """An audit run with the option stores what it paid for: each cited document's full-model influence,
    equal to the one-query answer's, in the items, the Parquet download and ``audit_results``; an audit
    without it stores null there."""
    fitted = tmp_path / "fitted"
    shutil.copytree(index, fitted)
    fit_index(fitted, max_sequences=32)
    settings = service_settings(fitted, tmp_path / "state")
    q = {"prompt": "A computer", "completion": " is a", "n_documents": 4}
    with serving(settings) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        want = c.post("/v1/attribute", json={**q, "influence": True}).json()["documents"]
        ids = {}
        for name, opt in (("with", True), ("without", False)):
            r = c.post("/v1/audits", json={"items": [{"id": "x", "prompt": q["prompt"], "completion": q["completion"]}],
                                           "n_documents": 4, "influence": opt})
            assert r.status_code == 202, r.text
            ids[name] = r.json()["id"]
            deadline = time.monotonic() + 60
            while c.get(f"/v1/audits/{ids[name]}").json()["status"] != "completed":
                assert time.monotonic() < deadline, "the audit did not finish"
                time.sleep(0.1)
        docs = c.get(f"/v1/audits/{ids['with']}/items").json()["items"][0]["documents"]
        assert [(d["doc_id"], d["influence"]) for d in docs] == [(d["doc_id"], d["influence"]) for d in want]
        assert docs and all(isinstance(d["influence"], float) for d in docs)
        raw = c.get(f"/v1/audits/{ids['with']}/results", params={"format": "parquet"})
        assert pq.read_table(io.BytesIO(raw.content))["influence"].to_pylist() == [d["influence"] for d in docs]
        rows = c.post("/v1/sql", json={"sql": "SELECT job_id, influence FROM audit_results ORDER BY job_id, rank"}
                      ).json()["rows"]
        got = {j: [v for jj, v in rows if jj == j] for j in ids.values()}
        assert got[ids["with"]] == [d["influence"] for d in docs]
        assert got[ids["without"]] and all(v is None for v in got[ids["without"]])


def test_a_curvature_the_index_cannot_use_is_a_problem_naming_the_fix(index, tmp_path):
    """A curvature fitted for another checkpoint, or a file cut short, answers 422 with the file and the
    command that fits it again, for one query and for an audit alike (not a server error)."""
    from prism_tda.engine.influence import EKFAC

    fitted = tmp_path / "fitted"
    shutil.copytree(index, fitted)
    fit_index(fitted, max_sequences=32)
    path = fitted / layout.EKFAC
    foreign, cut = tmp_path / "foreign", tmp_path / "cut"
    for d in (foreign, cut):
        shutil.copytree(fitted, d)
    EKFAC.load(path).save(foreign / layout.EKFAC, "0" * 64)
    (cut / layout.EKFAC).write_bytes(path.read_bytes()[:100])
    settings = service_settings(fitted, tmp_path / "state", indexes={"foreign": foreign, "cut": cut})
    with serving(settings) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        for name, says in (("foreign", "another checkpoint"), ("cut", "cannot be read")):
            q = {"index": name, "prompt": "A computer", "completion": " is a", "influence": True}
            assert_problem(c.post("/v1/attribute", json=q), 422, "invalid-query", mentions=says)
            audit = {"index": name, "items": [{"prompt": "A computer", "completion": " is a"}], "influence": True}
            assert_problem(c.post("/v1/audits", json=audit), 422, "invalid-query", mentions="--influence")
