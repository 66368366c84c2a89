"""Steering over the API: discovery from texts, documents or a SQL filter, saved as a set, seen by SQL,
searchable labels; and `prism discover`."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from .conftest import assert_problem


def test_discover_from_sql_texts_and_ids(client):
    sql = "SELECT doc_id FROM documents WHERE external_id LIKE 'art/%' ORDER BY doc_id LIMIT 200"
    r = client.post("/v1/prototypes/discover", json={"topic": {"sql": sql}, "top_n": 8})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["topic"]["source"] == "documents" and body["contrast"]["source"] == "the rest of the corpus"
    assert 0 < body["topic"]["documents"] <= 200 and body["contrast"]["tokens"] > body["topic"]["tokens"]
    protos = body["prototypes"]
    assert 0 < len(protos) <= 8 and [p["score"] for p in protos] == sorted((p["score"] for p in protos), reverse=True)
    for p in protos:
        assert p["topic_support"] >= 5 and p["topic_docs"] >= 2 and abs(p["ratio"] - 2.718281828 ** p["score"]) < 1e-6 * p["ratio"]
        assert p["contexts"] and all(c["doc_id"] is not None and c["text_index"] is None for c in p["contexts"])
    # the same documents by id: the same ranking
    ids = [row[0] for row in client.post("/v1/sql", json={"sql": sql}).json()["rows"]]
    again = client.post("/v1/prototypes/discover", json={"topic": {"doc_ids": ids}, "top_n": 8}).json()
    assert [p["proto_id"] for p in again["prototypes"]] == [p["proto_id"] for p in protos]
    assert again["selection"] is None
    # selection by measured effect: from the ranked ones, within its budget, each step raising the effect
    sel = client.post("/v1/prototypes/discover", json={"topic": {"doc_ids": ids}, "top_n": 8, "select": "effect",
                                                       "max_selected": 3, "max_ppl_ratio": 1.5}).json()["selection"]
    assert sel["rule"] == "effect" and sel["budget"] == 3 and sel["candidates"] == len(protos)
    assert 0 < len(sel["prototypes"]) <= 3 and set(sel["prototypes"]) <= {p["proto_id"] for p in protos}
    assert sel["prototypes"] == [st["proto_id"] for st in sel["steps"]] and sel["topic_tokens"] > 0
    effects = [st["effect"] for st in sel["steps"]]
    assert effects == sorted(effects) and all(st["contrast_ppl_ratio"] <= 1.5 for st in sel["steps"])
    assert "sampled from the rest of the corpus" in sel["contrast"]
    # the contrast documents the set's cost falls on, named by id, with their share of it
    assert sel["cost_by_text"] and sel["cost_by_text"][0]["share"] == max(c["share"] for c in sel["cost_by_text"])
    for c in sel["cost_by_text"]:
        assert c["doc_id"] is not None and c["text_index"] is None and 0 < c["share"] <= 1 and c["extra_nats"] > 0
        assert client.get("/v1/documents", params={"ids": str(c["doc_id"])}).json()["documents"][0]["text"].strip()
    # the chosen set at lower strengths, measured the same way: at 0 the last step's figures
    st = sel["strengths"]
    assert [r["alpha"] for r in st] == [0.0, 0.25, 0.5, 0.75]
    assert abs(st[0]["effect"] - sel["steps"][-1]["effect"]) < 1e-5
    assert abs(st[0]["contrast_ppl_ratio"] - sel["steps"][-1]["contrast_ppl_ratio"]) < 1e-6
    # pasted texts, against pasted contrast texts
    texts = [d["text"] for d in client.get("/v1/documents", params={"ids": ",".join(map(str, ids[:20]))}).json()["documents"]]
    r = client.post("/v1/prototypes/discover", json={"topic": {"texts": texts}, "min_docs": 1,
                                                         "contrast": {"texts": ["The cat sat on the mat.",
                                                                                "Water is made of hydrogen."]}})
    assert r.status_code == 200 and r.json()["contrast"]["source"] == "texts", r.text
    assert all(c["text_index"] is not None for p in r.json()["prototypes"] for c in p["contexts"])
    # save the top 3 as a set: usable in generation, visible to SQL
    top = [p["proto_id"] for p in protos[:3]]
    assert client.put("/v1/prototype-sets/art", json={"prototypes": top}).status_code == 200
    rows = client.post("/v1/sql", json={"sql": "SELECT name, proto_id FROM prototype_sets WHERE name = 'art' "
                                               "ORDER BY proto_id"}).json()["rows"]
    assert rows == [["art", p] for p in sorted(top)]
    g = client.post("/v1/generate", json={"prompt": "A picture", "max_new_tokens": 4, "suppress": "art"})
    assert g.status_code == 200 and sorted(g.json()["suppressed"]) == sorted(top)


def test_discover_refuses_what_cannot_work(client):
    url = "/v1/prototypes/discover"
    assert_problem(client.post(url, json={"topic": {"texts": ["a b c"]}, "select": "best"}), 422, "validation-error",
                   mentions="select")
    assert_problem(client.post(url, json={"topic": {}}), 422, "validation-error", mentions="exactly one")
    assert_problem(client.post(url, json={"topic": {"texts": ["a b c"], "doc_ids": [1]}}), 422, "validation-error")
    assert_problem(client.post(url, json={"topic": {"sql": "SELECT external_id FROM documents LIMIT 3"}}), 422,
                   "invalid-query", mentions="doc_id")
    assert_problem(client.post(url, json={"topic": {"sql": "SELECT * FROM read_csv('/etc/passwd')"}}), 403,
                   "sql-forbidden")
    assert_problem(client.post(url, json={"topic": {"doc_ids": [10**9]}}), 422, "invalid-query", mentions="out of range")
    assert_problem(client.post(url, json={"topic": {"texts": ["x"]}}), 422, "invalid-query", mentions="texts[0]")


def test_labels_name_prototypes_and_are_searchable(client):
    listing = client.get("/v1/prototypes", params={"limit": 20}).json()
    labelled = [p for p in listing["prototypes"] if p["label"]]
    assert len(labelled) >= 15  # a few words each, without an LLM
    word = labelled[0]["label"].split()[0]
    found = client.get("/v1/prototypes", params={"q": word, "limit": 1000}).json()
    assert found["total"] >= 1 and labelled[0]["proto_id"] in [p["proto_id"] for p in found["prototypes"]]
    assert all(word in (p["label"] or "") + " ".join(p["top_tokens"]).lower() for p in found["prototypes"])
    one = client.get(f"/v1/prototypes/{labelled[0]['proto_id']}").json()
    assert one["label"] == labelled[0]["label"]


@pytest.mark.slow
def test_prism_discover_cli(index):
    out = subprocess.run([sys.executable, "-m", "prism_tda.cli", "discover", "--index", str(index), "--doc-prefix",
                          "art/", "--top", "5", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["topic"]["source"] == "documents" and 0 < len(res["prototypes"]) <= 5
    assert res["selection"] is None
    # selection by effect, as text: each step and the set to save
    out = subprocess.run([sys.executable, "-m", "prism_tda.cli", "discover", "--index", str(index), "--doc-prefix",
                          "art/", "--top", "5", "--select", "effect", "--max-selected", "2", "--max-ppl-ratio", "1.5"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    steps = [line for line in out.stdout.splitlines() if line.startswith("  + ")]
    assert "selected by effect" in out.stdout and 1 <= len(steps) <= 2
    assert re.search(r"cost \d+% on document \d+ \(\d+ tokens\)", out.stdout), out.stdout
    assert re.search(r"at strength x0\.50: effect -?[\d.]+ nats/token.*contrast perplexity x[\d.]+", out.stdout), out.stdout
    saved = out.stdout.split('"prototypes": [')[1].split("]")[0]
    assert saved == ",".join(line.split()[1] for line in steps)
    bad = subprocess.run([sys.executable, "-m", "prism_tda.cli", "discover", "--index", str(index)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "give the topic" in bad.stderr
