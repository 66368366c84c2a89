"""Takedown end to end on a running server: a document cited by answers, audits, SQL, document reads
and prototype contexts is taken down by an admin key (a tenant's key is refused), and from the next
request on it appears in none of them; the audit that cited it keeps the citation, marked removed and
without its text; the CLI's removal reaches the running server too."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from prism_tda.engine import Attributor, QueryOptions, QuerySpec
from prism_tda.engine.takedown import read_removals
from prism_tda.errors import PrismError

from .conftest import ADMIN, A, B, assert_problem, auth, service_settings, serving


def _wait(url: str, job_id: str, key: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/v1/audits/{job_id}", headers=auth(key)).json()["status"] == "completed":
            return
        time.sleep(0.1)
    raise AssertionError(f"audit {job_id} did not finish")


def _sql(url: str, key: str, sql: str, *params) -> list:
    for i, v in enumerate(params, 1):  # literals: ids, and strings quoted
        sql = sql.replace(f"${i}", str(v) if isinstance(v, int) else "'" + str(v).replace("'", "''") + "'")
    r = httpx.post(url + "/v1/sql", json={"sql": sql}, headers=auth(key), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["rows"]


@pytest.fixture(scope="module")
def victim(index, tmp_path_factory):
    """A copy of the test index (takedowns write into it), a document of it, a query of its own text that
    ranks it in the top 5, and a prototype whose top contexts hold it."""
    ix = tmp_path_factory.mktemp("takedown") / "ix"
    shutil.copytree(index, ix)
    att = Attributor.open(ix)
    r = att.reader
    best = None
    for doc in range(r.n_docs):
        text = r.document(doc)["text"]
        if 30 < len(text) < 200 and r.document(doc)["trained"]:
            cut = len(text) // 2
            try:
                res = att.attribute(QuerySpec(text[:cut], text[cut:]), QueryOptions(n_documents=5))
            except PrismError:  # longer than the tiny model's context
                continue
            if doc in [d.doc_id for d in res.documents]:
                protos = [p for p in range(r.n_prototypes)
                          if doc in {int(r.doc_of_seqs(r.seq_of_tokens(np.array([row])))[0])
                                     for row, _ in r.top_contexts(p, 10)}]
                if protos:
                    best = (doc, r.external_id(doc), text[:cut], text[cut:], protos[0])
                    break
    att.close()
    assert best is not None, "no document of the test index is found by its own text"
    return ix, best


@pytest.mark.slow
def test_takedown_reaches_every_read_immediately_and_audits_keep_a_marked_citation(victim):
    ix, (doc, ext, prompt, completion, proto) = victim
    settings = service_settings(ix, ix.parent / "state", api_keys=[A, B], admin_api_keys=[ADMIN])
    with serving(settings) as live:
        url = live.url
        query = {"prompt": prompt, "completion": completion, "n_documents": 10}
        before = httpx.post(url + "/v1/attribute", json=query, headers=auth(A), timeout=60).json()
        assert doc in {d["doc_id"] for d in before["documents"]}
        job = httpx.post(url + "/v1/audits", json={"items": [{"id": "x", "prompt": prompt, "completion": completion}],
                                                    "top_k": 5}, headers=auth(A)).json()
        _wait(url, job["id"], A)
        assert _sql(url, A, "SELECT count(*) FROM documents WHERE doc_id = $1", doc) == [[1]]
        assert _sql(url, A, "SELECT count(*) FROM tokens WHERE doc_id = $1", doc)[0][0] > 0
        ctx = httpx.get(f"{url}/v1/prototypes/{proto}", headers=auth(A)).json()["top_contexts"]
        assert doc in {c["doc_id"] for c in ctx}

        # the attack: a tenant's key cannot take documents down (nor read the report)
        body = {"external_ids": [ext, "no-such-id"], "reason": "privacy request #12"}
        assert_problem(httpx.post(url + "/v1/admin/indexes/tiny/takedown", json=body, headers=auth(A)),
                       401, "unauthorized")
        assert read_removals(ix) == []
        r = httpx.post(url + "/v1/admin/indexes/tiny/takedown", json=body, headers=auth(ADMIN))
        assert r.status_code == 200, r.text
        out = r.json()
        assert [x["doc_id"] for x in out["removed"]] == [doc] and out["not_found"] == ["no-such-id"]
        assert out["removed"][0]["by"].startswith("key:") and out["removed"][0]["reason"] == "privacy request #12"

        # from the next request on, everywhere
        for mode in ("fast", "exact"):
            after = httpx.post(url + "/v1/attribute", json={**query, "mode": mode}, headers=auth(A), timeout=120)
            assert after.status_code == 200, after.text
            assert doc not in {d["doc_id"] for d in after.json()["documents"]}, mode
        assert_problem(httpx.get(f"{url}/v1/documents/{doc}", headers=auth(A)), 410, "document-removed")
        assert httpx.get(f"{url}/v1/documents?ids={doc}", headers=auth(A)).json()["missing"] == [doc]
        for table in ("documents", "sequences", "tokens", "activations"):
            assert _sql(url, A, f"SELECT count(*) FROM {table} WHERE doc_id = $1", doc) == [[0]], table
        assert _sql(url, A, "SELECT count(*) FROM documents WHERE external_id = $1", ext) == [[0]]
        ctx = httpx.get(f"{url}/v1/prototypes/{proto}", headers=auth(A)).json()["top_contexts"]
        assert doc not in {c["doc_id"] for c in ctx}
        items = httpx.get(f"{url}/v1/audits/{job['id']}/items", headers=auth(A)).json()["items"]
        cited = [d for d in items[0]["documents"] if d["doc_id"] == doc]
        assert cited and cited[0]["removed"] is True and "text" not in cited[0] and "snippet" not in cited[0]
        assert _sql(url, A, "SELECT bool_or(removed) FROM audit_results WHERE doc_id = $1", doc) == [[True]]
        again = httpx.post(url + "/v1/audits", json={"items": [{"prompt": prompt, "completion": completion}],
                                                      "top_k": 5}, headers=auth(A)).json()
        _wait(url, again["id"], A)
        docs = httpx.get(f"{url}/v1/audits/{again['id']}/items", headers=auth(A)).json()["items"][0]["documents"]
        assert doc not in {d["doc_id"] for d in docs}
        report = httpx.get(url + "/v1/admin/indexes/tiny/takedown", headers=auth(ADMIN)).json()
        assert report["removed_documents"] == 1 and report["removals"][0]["external_id"] == ext

        # the command line, beside the running server: its removal shows at the server's next request
        second = next(d for d in before["documents"] if d["doc_id"] != doc)
        run = subprocess.run([sys.executable, "-m", "prism_tda.cli", "index", "--out", str(ix), "--remove",
                              second["external_id"], "--reason", "copyright"], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        after = httpx.post(url + "/v1/attribute", json=query, headers=auth(A), timeout=60).json()
        assert second["doc_id"] not in {d["doc_id"] for d in after["documents"]}
        assert _sql(url, B, "SELECT count(*) FROM documents WHERE doc_id = $1", second["doc_id"]) == [[0]]
        assert [x.by for x in read_removals(ix)][-1] == "cli"
