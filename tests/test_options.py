"""Every field of the engine's QueryOptions reaches the engine, by its own name, from HTTP (attribute
and audits) and from the command line: a field added to the engine without reaching it fails here."""

from __future__ import annotations

import dataclasses
import re
import time

import httpx
import pytest

from prism_tda.engine import Attributor, QueryOptions, QuerySpec
from prism_tda.service.schemas import AttributeRequest, AuditRequest
from tests.service.conftest import service_settings, serving

# a value other than the default for every option
CHOSEN = dict(n_documents=7, mode="exact", n_candidates=77, opponents=True, damping=0.7, aggregation="cosine_sum",
              exact_rerank=9, adaptive_rerank=False, exact_tokens=None, nprobe=3, include_untrained=True,
              influence=True, keep_opposed=True, allow_partial=True, tie_break="score")


def test_the_chosen_values_cover_every_option():
    defaults = QueryOptions()
    assert set(CHOSEN) == {f.name for f in dataclasses.fields(QueryOptions)}
    assert all(CHOSEN[k] != getattr(defaults, k) for k in CHOSEN)
    assert {f.name for f in dataclasses.fields(QueryOptions)} <= set(AttributeRequest.model_fields)
    assert {f.name for f in dataclasses.fields(QuerySpec)} <= set(AttributeRequest.model_fields)
    assert {f.name for f in dataclasses.fields(QueryOptions)} <= set(AuditRequest.model_fields)


@pytest.fixture
def recorded(monkeypatch):
    """Attributor.attribute records what it is asked and answers a cheap real query."""
    seen: list[tuple[QuerySpec, QueryOptions]] = []
    real = Attributor.attribute

    def spy(self, spec, options=None, *, stop=None, progress=False):
        seen.append((spec, options))
        return real(self, QuerySpec(spec.prompt, " a"), QueryOptions(n_documents=1), stop=stop, progress=progress)

    monkeypatch.setattr(Attributor, "attribute", spy)
    return seen


def test_options_reach_the_engine_over_http(index, tmp_path, recorded, monkeypatch):
    # the spy answers without influence: the audit's check that the index can serve it (tested in
    # tests/service/test_influence_api.py) would refuse this curvature-less index at submission
    monkeypatch.setattr(Attributor, "check_influence", lambda self: None)
    settings = service_settings(index, tmp_path / "state", max_exact_rerank=1024, max_rerank_tokens=10**6)
    with serving(settings) as live:
        spec = {"prompt": "A computer", "completion": " is a", "target_index": 1}
        r = httpx.post(live.url + "/v1/attribute", json={**spec, **CHOSEN}, timeout=60)
        assert r.status_code == 200, r.text
        assert recorded[-1] == (QuerySpec("A computer", " is a", None, 1), QueryOptions(**CHOSEN))
        # the earlier name of n_documents
        httpx.post(live.url + "/v1/attribute", json={"prompt": "A computer", "top_k": 4}, timeout=60)
        assert recorded[-1][1].n_documents == 4
        # audits: the options are stored with the audit and given to every item
        r = httpx.post(live.url + "/v1/audits", json={"items": [spec], **CHOSEN}, timeout=60)
        assert r.status_code == 202, r.text
        job = r.json()
        deadline = time.monotonic() + 60
        while httpx.get(f"{live.url}/v1/audits/{job['id']}").json()["status"] != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert recorded[-1] == (QuerySpec("A computer", " is a", None, 1), QueryOptions(**CHOSEN))


def test_options_reach_the_engine_from_the_command_line(index, recorded, capsys):
    from prism_tda.cli import main

    argv = ["attribute", "--index", str(index), "--prompt", "A computer", "--completion", " is a",
            "--target-index", "1", "--n-documents", "7", "--mode", "exact", "--n-candidates", "77", "--opponents",
            "--damping", "0.7", "--aggregation", "cosine_sum", "--exact-rerank", "9", "--no-adaptive-rerank", "--exact-tokens", "none",
            "--nprobe", "3", "--include-untrained", "--influence", "--keep-opposed", "--allow-partial",
            "--tie-break", "score"]
    assert main(argv) == 0
    assert recorded[-1] == (QuerySpec("A computer", " is a", None, 1), QueryOptions(**CHOSEN))
    # exact mode says what it will cost before it starts
    assert re.search(r"exact mode: recomputes all [\d,]+ training tokens, about [\d,]+ s at [\d,]+ tokens/s",
                     capsys.readouterr().err)
