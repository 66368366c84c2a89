"""The committed openapi.yaml equals the app's, and a fuzz run of the live app against it finds no 5xx."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from prism_tda.service.openapi import DEFAULT_PATH, render


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


@pytest.mark.slow
def test_fuzz_live_app_finds_no_server_error(live, tmp_path):
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", str(DEFAULT_PATH), "--url", live.url,
           "--checks", "not_a_server_error", "--phases", "examples,fuzzing", "--max-examples", "12",
           "--seed", "7", "--workers", "1", "--request-timeout", "30", "--no-color"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
