"""The API over shards held by Ray actors: the same answers as the one-process server, SQL, documents
and audits over every shard, per-holder metrics, a 503 problem naming a dead shard, and
`prism serve --ray-address`."""

from __future__ import annotations

import httpx
import pytest

from prism_tda.service import create_app

from .conftest import assert_problem, service_settings, serving
from .test_audits import wait_done

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # Ray: the slow tier

QUERIES = [{"prompt": "A computer", "completion": " is a machine", "top_k": 6},
           {"prompt": "The cat sat on the", "completion": " mat", "top_k": 6, "aggregation": "cosine_sum"},
           {"prompt": "Water is made of", "top_k": 5, "aggregation": "cosine_match", "include_untrained": True},
           {"prompt": "A computer", "completion": " is a", "top_k": 4, "mode": "exact"}]



def _answer(body: dict) -> list[tuple]:
    return [(d["doc_id"], d["token_row"], d["snippet"]) for d in body["documents"]]


def _scores(body: dict) -> list[float]:
    return [d["score"] for d in body["documents"]]


def test_prism_serve_ray_address(index, server_factory):
    """`prism serve --ray-address local` (a Ray started by the server; no other runs yet) answers."""
    srv = server_factory([f"tiny={index}"], "--ray-address", "local", "--ray-actors", "2")
    srv.wait_ready(timeout=180)
    r = httpx.post(srv.url + "/v1/attribute", json=QUERIES[0], timeout=120)
    assert r.status_code == 200, r.text
    ready = httpx.get(srv.url + "/readyz").json()
    assert ready["indexes"][0]["shard_holders"] == 2
    assert "prism_shard_call_seconds" in httpx.get(srv.url + "/metrics").text


def test_api_over_ray_actors(local_ray, index, tmp_path, client):
    settings = service_settings(index, tmp_path / "state", indexes={"tiny": index}, ray_address="auto",
                                ray_actors=2, ray_call_timeout_s=20)
    app = create_app(settings)
    with serving(settings, app) as live, httpx.Client(base_url=live.url, timeout=120) as c:
        ready = c.get("/readyz").json()
        assert ready["indexes"][0]["shard_holders"] == 2 and ready["indexes"][0]["shards"] >= 3
        for q in QUERIES:  # `client` is the one-process server over the same index
            one, many = client.post("/v1/attribute", json=q), c.post("/v1/attribute", json=q)
            assert one.status_code == many.status_code == 200, many.text
            assert _answer(many.json()) == _answer(one.json()) and many.json()["partial"] is False
            # an actor's process may sum in another order: the last float32 bit of a score may differ
            assert _scores(many.json()) == pytest.approx(_scores(one.json()), rel=1e-6)
        # documents, prototypes, SQL over one logical table of every shard
        for path in ("/v1/documents/0", "/v1/documents/5", "/v1/prototypes/3?n_contexts=4"):
            assert c.get(path).json() == client.get(path).json(), path
        sql = {"sql": "SELECT count(*) AS n, count(DISTINCT doc_id) AS d FROM sequences"}
        assert c.post("/v1/sql", json=sql).json()["rows"] == client.post("/v1/sql", json=sql).json()["rows"]
        # an audit runs through the actors too
        r = c.post("/v1/audits", json={"items": [{"prompt": "A computer", "completion": " is a machine"},
                                                 {"prompt": "The cat sat on the", "completion": " mat"}],
                                       "top_k": 3})
        assert r.status_code == 202, r.text
        job = r.json()["id"]
        assert wait_done(c, job)["n_done"] == 2
        rows = c.post("/v1/sql", json={"sql": f"SELECT item_no, rank, doc_id FROM audit_results WHERE job_id = '{job}' "
                                              "ORDER BY item_no, rank"}).json()["rows"]
        want = _answer(client.post("/v1/attribute", json={**QUERIES[0], "top_k": 3}).json())
        assert [r[2] if isinstance(r, list) else r["doc_id"] for r in rows[:3]] == [d[0] for d in want]
        # every holder reports its calls
        text = c.get("/metrics").text
        for holder in ("0", "1"):
            assert f'prism_shard_call_seconds_count{{holder="{holder}",index="tiny",method="shortlist"}}' in text
            assert f'prism_shard_queue_seconds_count{{holder="{holder}",index="tiny",method="first_stages"}}' in text
        assert 'prism_shard_rows_scored_total{holder="0",index="tiny"}' in text
        # a holder gone for good: 503 naming its shards, or the others' answer when asked for
        shards = app.state.services.registry.get("tiny").attributor.shards
        gone = shards.groups[1]
        ray.kill(shards.actors[1], no_restart=True)
        body = assert_problem(c.post("/v1/attribute", json=QUERIES[0]), 503, "shard-unavailable", mentions=str(gone))
        assert body["detail"]
        r = c.post("/v1/attribute", json={**QUERIES[0], "allow_partial": True})
        assert r.status_code == 200 and r.json()["partial"] is True and r.json()["missing_shards"] == gone
