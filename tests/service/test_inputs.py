"""Hostile and impossible inputs get a 4xx naming the field, before any work: over-long and non-ASCII
digit strings, bodies that are not UTF-8 or nest too deep, generation that cannot fit the context,
over-long id lists."""

from __future__ import annotations

import pytest

from prism_tda.model.model import PRISM

from .conftest import assert_problem

CONTEXT = 32  # the tiny model's


@pytest.mark.parametrize("ids", ["9" * 5000, "1," + "7" * 4301, "٣", "1,２", "12345678901", "-1", "1,,2", "0x10"])
def test_document_ids_are_checked_before_conversion(client, ids):
    body = assert_problem(client.get("/v1/documents", params={"ids": ids}), 422, "validation-error")
    assert body["detail"].startswith("ids: item ") and len(body["detail"]) < 300


def test_valid_document_ids(client):
    r = client.get("/v1/documents", params={"ids": " 0, 1 ,2147483647"})
    assert r.status_code == 200 and r.json()["missing"] == [2147483647]
    # ten digits past 2^31: as the schema allows, answered as missing (no document has such an id)
    r = client.get("/v1/documents", params={"ids": "2147483648,9999999999"})
    assert r.status_code == 200 and r.json() == {"index": "tiny", "documents": [], "missing": [2147483648, 9999999999]}


@pytest.mark.parametrize("content", [b'{"sql": "SELECT \xff\xfe"}', b"[" * 100_000 + b"]" * 100_000,
                                     b'{"prompt": ', b"\xff"], ids=["bad-utf8", "deep", "truncated", "byte"])
def test_malformed_bodies(client, content):
    for path in ("/v1/sql", "/v1/attribute", "/v1/audits"):
        r = client.post(path, content=content, headers={"content-type": "application/json"})
        assert_problem(r, 400, "malformed-request")


def _no_generation(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("generation ran for a query that cannot fit the context")

    monkeypatch.setattr(PRISM, "generate", fail)


def _prompt_of_at_least(client, n_min: int) -> tuple[str, int]:
    """A prompt of n_min..CONTEXT tokens, and its length (the prompt's own predictions: no generation)."""
    words = []
    while True:
        words.append("computer")
        n = len(client.post("/v1/attribute", json={"prompt": " ".join(words)}).json()["query"]["token_ids"])
        if n >= n_min:
            assert n <= CONTEXT
            return " ".join(words), n


def test_attribute_refuses_a_generation_that_cannot_fit_before_generating(client, monkeypatch):
    prompt, n = _prompt_of_at_least(client, 20)
    _no_generation(monkeypatch)
    body = assert_problem(client.post("/v1/attribute", json={"prompt": prompt, "max_new_tokens": CONTEXT + 2 - n}),
                          422, "prompt-too-long")
    assert "max_new_tokens" in body["detail"] and f"at most {CONTEXT + 1 - n} new tokens" in body["detail"]


def test_audit_items_are_validated_at_submission(client, monkeypatch):
    prompt, n = _prompt_of_at_least(client, 20)
    _no_generation(monkeypatch)
    items = [{"prompt": "A computer", "completion": " is a"}, {"prompt": prompt, "max_new_tokens": CONTEXT + 2 - n}]
    body = assert_problem(client.post("/v1/audits", json={"items": items}), 422, "prompt-too-long")
    assert body["detail"].startswith("items[1].prompt + max_new_tokens")


def test_id_lists_are_capped(client, live):
    cap = live.settings.max_batch_items
    r = client.post("/v1/generate", json={"prompt": "A", "suppress": list(range(cap + 1)), "max_new_tokens": 1})
    assert_problem(r, 422, "too-many-items", mentions="suppress")
    r = client.post("/v1/audits", json={"items": [{"prompt": "A", "completion": " b"}],
                                        "flag_prototypes": [0] * (cap + 1)})
    assert_problem(r, 422, "too-many-items", mentions="flag_prototypes")
