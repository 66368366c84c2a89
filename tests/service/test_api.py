"""Every endpoint's success path and its documented problems, against the live app on the tiny index."""

from __future__ import annotations

import pytest

from .conftest import assert_problem

LONG = "the cat sat on the mat " * 40  # far beyond the tiny model's 32-token context


def test_health_ready_metrics(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready" and ready["default_index"] == "tiny"
    assert {i["name"] for i in ready["indexes"]} == {"tiny", "other"} and ready["audit_worker"] == "leader"
    client.get("/v1/documents/0")
    text = client.get("/metrics").text
    assert 'prism_http_requests_total{method="GET",operation="get_document",status="200"}' in text


def test_attribute(client):
    r = client.post("/v1/attribute", json={"prompt": "A computer", "completion": " is a", "top_k": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["index"] == "tiny" and body["mode"] == "fast" and len(body["documents"]) == 3
    assert [d["rank"] for d in body["documents"]] == [1, 2, 3]
    scores = [d["score"] for d in body["documents"]]
    assert scores == sorted(scores, reverse=True)
    assert all(d["external_id"] and isinstance(d["snippet"], str) for d in body["documents"])
    assert body["query"]["target_text"] == " is a" and len(body["per_token"]) == len(body["query"]["target_ids"])
    tok = body["per_token"][0]
    assert abs(sum(p["contribution"] for p in tok["prototypes"]) + tok["residual"] - tok["logit"]) < 1e-3
    assert r.headers["x-request-id"]
    # the same query on the other index, exact mode, a generated target, one target token
    r = client.post("/v1/attribute", json={"index": "other", "prompt": "A computer", "max_new_tokens": 3,
                                           "mode": "exact", "target_index": 0, "top_k": 2})
    assert r.status_code == 200 and r.json()["index"] == "other" and len(r.json()["per_token"]) == 1


def test_attribute_bad_inputs(client):
    url = "/v1/attribute"
    assert_problem(client.post(url, json={"prompt": ""}), 422, "validation-error", mentions="prompt")
    assert_problem(client.post(url, json={"prompt": LONG}), 422, "prompt-too-long", mentions="context is 32")
    assert_problem(client.post(url, json={"prompt": "A", "completion": LONG}), 422, "prompt-too-long")
    assert_problem(client.post(url, json={"prompt": 3}), 422, "validation-error", mentions="prompt")
    assert_problem(client.post(url, json={"prompt": "A", "n_documents": "many"}), 422, "validation-error",
                   mentions="n_documents")
    assert_problem(client.post(url, json={"prompt": "A", "n_documents": 500}), 422, "validation-error",
                   mentions="n_documents: 500 is over the server's limit of 100")
    assert_problem(client.post(url, json={"prompt": "A", "mode": "slow"}), 422, "validation-error", mentions="mode")
    assert_problem(client.post(url, json={"prompt": "A", "completion": "b", "max_new_tokens": 2}), 422,
                   "validation-error", mentions="either completion or max_new_tokens")
    assert_problem(client.post(url, json={"prompt": "A", "typo": 1}), 422, "validation-error", mentions="typo")
    assert_problem(client.post(url, json={"prompt": "A", "index": "nope"}), 404, "unknown-index", mentions="nope")
    assert_problem(client.post(url, json={"prompt": "A computer", "completion": " is", "target_index": 9}), 422,
                   "invalid-query", mentions="target_index")
    bad = client.post(url, content=b'{"prompt": "A', headers={"content-type": "application/json"})
    assert_problem(bad, 400, "malformed-request", mentions="JSON")
    assert_problem(client.post(url, json=["prompt"]), 422, "validation-error")
    assert_problem(client.get(url), 405, "method-not-allowed")
    assert_problem(client.get("/v1/nothing-here"), 404, "not-found")


def test_documents(client):
    doc = client.get("/v1/documents/3").json()
    assert doc["doc_id"] == 3 and doc["text"] and doc["external_id"] and doc["n_tokens"] > 0
    batch = client.get("/v1/documents", params={"ids": "3, 5,3,99999"}).json()
    assert [d["doc_id"] for d in batch["documents"]] == [3, 5] and batch["missing"] == [99999]
    post = client.post("/v1/documents/batch", json={"ids": [5, 3], "index": "other"}).json()
    assert [d["doc_id"] for d in post["documents"]] == [5, 3] and post["index"] == "other"
    assert_problem(client.get("/v1/documents/99999"), 404, "document-not-found", mentions="99999")
    assert_problem(client.get("/v1/documents/-1"), 422, "validation-error", mentions="doc_id")
    assert_problem(client.get("/v1/documents/abc"), 422, "validation-error", mentions="doc_id")
    assert_problem(client.get("/v1/documents", params={"ids": "1,x"}), 422, "validation-error", mentions="ids")
    assert_problem(client.post("/v1/documents/batch", json={"ids": list(range(51))}), 422, "too-many-items",
                   mentions="limit is 50")
    assert_problem(client.post("/v1/documents/batch", json={"ids": ["a"]}), 422, "validation-error")
    assert_problem(client.get("/v1/documents/3", params={"index": "nope"}), 404, "unknown-index")


def test_prototypes(client):
    listing = client.get("/v1/prototypes", params={"limit": 5}).json()
    assert listing["total"] == 32 and len(listing["prototypes"]) == 5
    masses = [p["mass"] for p in listing["prototypes"]]
    assert masses == sorted(masses, reverse=True)
    top = listing["prototypes"][0]["proto_id"]
    p = client.get(f"/v1/prototypes/{top}", params={"contexts": 3}).json()
    assert p["proto_id"] == top and p["n_tokens"] > 0 and 0 < p["share"] <= 1
    assert len(p["signature"]) == 10 and len(p["top_contexts"]) == 3
    acts = [c["act"] for c in p["top_contexts"]]
    assert acts == sorted(acts, reverse=True) and all(c["token"] for c in p["top_contexts"])
    assert_problem(client.get("/v1/prototypes/32"), 404, "prototype-not-found", mentions="32")
    assert_problem(client.get("/v1/prototypes/7", params={"contexts": 1000}), 422, "validation-error",
                   mentions="contexts")


def test_prototype_sets_and_generation_with_suppression(client):
    base = client.post("/v1/generate", json={"prompt": "A computer", "max_new_tokens": 8}).json()
    assert base["token_ids"] and base["suppressed"] == [] and base["n_prompt_tokens"] > 0
    again = client.post("/v1/generate", json={"prompt": "A computer", "max_new_tokens": 8}).json()
    assert again["completion"] == base["completion"]  # greedy is deterministic
    r = client.put("/v1/prototype-sets/everything", json={"prototypes": list(range(32)), "description": "all"})
    assert r.status_code == 200 and r.json()["prototypes"] == list(range(32))
    assert client.get("/v1/prototype-sets/everything").json()["description"] == "all"
    assert "everything" in [s["name"] for s in client.get("/v1/prototype-sets").json()["sets"]]
    sup = client.post("/v1/generate", json={"prompt": "A computer", "max_new_tokens": 8,
                                            "suppress": "everything"}).json()
    assert sup["suppress_set"] == "everything" and sup["suppressed"] == list(range(32))
    assert sup["token_ids"] != base["token_ids"]  # without its prototypes the model writes something else
    by_ids = client.post("/v1/generate", json={"prompt": "A computer", "max_new_tokens": 8,
                                               "suppress": list(range(32))}).json()
    assert by_ids["token_ids"] == sup["token_ids"]
    sampled = client.post("/v1/generate", json={"prompt": "A", "max_new_tokens": 5, "temperature": 1.0,
                                                "top_k": 20, "seed": 3}).json()
    assert sampled["token_ids"]
    url = "/v1/generate"
    assert_problem(client.post(url, json={"prompt": "A", "suppress": [32]}), 422, "invalid-prototype",
                   mentions="[32]")
    assert_problem(client.post(url, json={"prompt": "A", "suppress": "missing-set"}), 404,
                   "prototype-set-not-found", mentions="missing-set")
    assert_problem(client.post(url, json={"prompt": "A", "max_new_tokens": 17}), 422, "validation-error",
                   mentions="max_new_tokens")
    assert_problem(client.post(url, json={"prompt": LONG}), 422, "prompt-too-long")
    assert_problem(client.post(url, json={"prompt": ""}), 422, "validation-error")
    assert_problem(client.post(url, json={"prompt": "A", "temperature": "hot"}), 422, "validation-error",
                   mentions="temperature")
    # graded strength: alpha 1 is the model as it is, 0 is suppression, per-set alphas through `steer`
    body = {"prompt": "A computer", "max_new_tokens": 8}
    same = client.post(url, json={**body, "suppress": "everything", "alpha": 1.0}).json()
    assert same["token_ids"] == base["token_ids"] and same["alpha"] == 1.0
    zero = client.post(url, json={**body, "steer": [{"prototypes": "everything", "alpha": 0}]}).json()
    assert zero["token_ids"] == sup["token_ids"] and zero["suppressed"] == []
    assert zero["steered"] == [{"prototypes": list(range(32)), "set": "everything", "alpha": 0.0}]
    both = client.post(url, json={**body, "suppress": [1, 2], "alpha": 0.5,
                                  "steer": [{"prototypes": [3], "alpha": 2.5}, {"prototypes": [2], "alpha": 0.5}]}).json()
    assert [t["alpha"] for t in both["steered"]] == [0.5, 2.5, 0.5] and both["suppressed"] == [1, 2]
    ctrl = client.post(url, json={**body, "prototype_alphas": {"3": 2.5, "1": 0.5}, "suppress": [1, 2], "alpha": 0.5,
                                  "steer": [{"prototypes": [3], "alpha": 2.5}]}).json()
    assert ctrl["token_ids"] == both["token_ids"]  # the same strengths, given per prototype
    assert_problem(client.post(url, json={**body, "prototype_alphas": {"40": 1.0}}), 422, "invalid-prototype",
                   mentions="prototype_alphas")
    assert_problem(client.post(url, json={**body, "prototype_alphas": {"x": 1.0}}), 422, "validation-error",
                   mentions="prototype_alphas")
    assert_problem(client.post(url, json={**body, "suppress": [1, 2], "steer": [{"prototypes": [2], "alpha": 3}]}),
                   422, "invalid-query", mentions="steer[0]")
    assert_problem(client.post(url, json={**body, "steer": [{"prototypes": [40], "alpha": 0}]}), 422,
                   "invalid-prototype", mentions="steer[0].prototypes")
    assert_problem(client.post(url, json={**body, "suppress": [1], "alpha": 4.5}), 422, "validation-error",
                   mentions="alpha")
    assert_problem(client.post(url, json={**body, "steer": [{"prototypes": "nope", "alpha": 1}]}), 404,
                   "prototype-set-not-found", mentions="nope")
    # conditional steering: the whole bank holds every position's mass, so any gate opens everywhere; two
    # prototypes of the k active never hold all of it, so a gate of 1 never opens
    gated = client.post(url, json={**body, "suppress": "everything", "gate": 0.5}).json()
    assert gated["token_ids"] == sup["token_ids"] and (gated["gate"], gated["gate_window"]) == (0.5, 16)
    shut = client.post(url, json={**body, "suppress": [1, 2], "gate": 1.0, "gate_window": 4}).json()
    assert shut["token_ids"] == base["token_ids"] and shut["gate_window"] == 4
    assert base["gate"] is None and sup["gate"] is None
    assert_problem(client.post(url, json={**body, "gate": 0.2}), 422, "invalid-query", mentions="gate")
    assert_problem(client.post(url, json={**body, "suppress": [1], "gate": 1.5}), 422, "validation-error",
                   mentions="gate")
    assert_problem(client.post(url, json={**body, "suppress": [1], "gate": 0.1, "gate_window": 0}), 422,
                   "validation-error", mentions="gate_window")
    assert_problem(client.put("/v1/prototype-sets/bad", json={"prototypes": [99]}), 422, "invalid-prototype")
    assert_problem(client.put("/v1/prototype-sets/bad name", json={"prototypes": [1]}), 422, "validation-error")
    assert client.delete("/v1/prototype-sets/everything").status_code == 204
    assert_problem(client.get("/v1/prototype-sets/everything"), 404, "prototype-set-not-found")
    assert_problem(client.delete("/v1/prototype-sets/everything"), 404, "prototype-set-not-found")


def test_sql_success(client):
    r = client.post("/v1/sql", json={"sql": "SELECT proto_id, count(*) AS n FROM activations GROUP BY proto_id "
                                            "ORDER BY n DESC, proto_id LIMIT 3"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["name"] for c in body["columns"]] == ["proto_id", "n"] and body["row_count"] == 3
    assert body["rows"][0][1] >= body["rows"][1][1]
    nan = client.post("/v1/sql", json={"sql": "SELECT 'nan'::DOUBLE AS x, 1.5 AS y, DATE '2020-01-02' AS d"})
    assert nan.json()["rows"] == [[None, 1.5, "2020-01-02"]]


@pytest.mark.parametrize("body,status,kind", [
    ({"sql": ""}, 422, "validation-error"),
    ({"sql": 42}, 422, "validation-error"),
    ({"sql": "SELEC 1"}, 400, "sql-syntax"),
    ({"sql": "SELECT * FROM no_such_table"}, 400, "sql-error"),
    ({"sql": "SELECT 1", "index": "nope"}, 404, "unknown-index"),
])
def test_sql_bad_inputs(client, body, status, kind):
    assert_problem(client.post("/v1/sql", json=body), status, kind)
