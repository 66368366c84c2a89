"""The committed openapi.yaml equals the app's, and a fuzz run of the live app against it finds no 5xx."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prism_tda.service.openapi import DEFAULT_PATH, render

from .conftest import service_settings, serving


def test_committed_openapi_matches_the_app():
    assert DEFAULT_PATH.is_file(), "openapi.yaml is missing; run `prism openapi`"
    assert DEFAULT_PATH.read_text() == render(), "openapi.yaml is out of date; run `prism openapi`"


def test_operation_ids_are_readable_and_problems_documented():
    doc = yaml.safe_load(DEFAULT_PATH.read_text())
    ops = [op for path in doc["paths"].values() for op in path.values()]
    ids = [op["operationId"] for op in ops]
    assert len(ids) == len(set(ids)) and all(i.isidentifier() and "_" not in i for i in ids)
    assert {"attribute", "createAudit", "getAudit", "cancelAudit", "runSql", "getPrototype", "getDocument",
            "fetchDocuments", "generate"} <= set(ids)
    for path, item in doc["paths"].items():
        if path.startswith("/v1/"):
            for op in item.values():
                assert "application/problem+json" in op["responses"]["422"]["content"], (path, op["operationId"])


KEY = "fuzz-key"


@pytest.fixture(scope="module")
def fuzzed(index, tmp_path_factory):
    """A server with an API key, as deployed; the fuzzer sends the key. The failed-authentication limiter
    is off here: it answers a wrong key 429 after ten tries on purpose (tests/service/test_tenants.py),
    and the contract check of invalid credentials wants each of its many tries answered 401."""
    settings = service_settings(index, tmp_path_factory.mktemp("state-fuzz"), api_keys=[KEY],
                                auth_failures_per_minute=0)
    with serving(settings) as live:
        yield live


@pytest.mark.slow
def test_fuzz_live_app_agrees_with_the_contract(fuzzed, tmp_path):
    """Every schemathesis check (status codes and content types documented, schema-valid requests
    accepted, invalid ones refused, responses matching their schemas, Allow headers, no 5xx), with a
    valid key; the refusals only the index can make are listed per operation in schemathesis.toml."""
    config = Path(__file__).with_name("schemathesis.toml")
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run", str(DEFAULT_PATH),
           "--url", fuzzed.url,
           "--checks", "all", "--phases", "examples,coverage,fuzzing", "--max-examples", "12",
           "--seed", "7", "--workers", "1", "--request-timeout", "60", "--no-color",
           "-H", f"Authorization: Bearer {KEY}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
