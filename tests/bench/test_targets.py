"""bench/targets.py: docs/targets.md is what the results files say, and each row's status follows its
target and interval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import targets
from bench.targets import Target, render, status

REPO = Path(__file__).resolve().parents[2]


def test_the_status_page_matches_the_results_files(monkeypatch):
    monkeypatch.chdir(REPO)  # fails when a results file moved and the page was not rewritten
    assert targets.main(["--check"]) == 0


def test_status_reads_the_point_then_the_interval():
    assert status(0.5, "<=", 0.1) == "**missed**"
    assert status(0.93, ">=", 0.9, [0.85, 0.99]) == "met on the point, not on the interval"
    assert status(0.93, ">=", 0.9, [0.91, 0.99]) == "met"
    assert status(1.027, "<=", 1.02, [1.018, 1.04]) == "**missed**"
    assert status(1.01, "<=", 1.02, [1.0, 1.03]) == "met on the point, not on the interval"
    assert status(0.996, "==", 1.0) == "**missed**"
    assert status(7.2, None, None, [5.2, 9.1]) == "reported"


def test_a_row_compares_against_another_key_and_a_missing_key_names_the_file(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"ours": 0.28, "theirs": 0.36, "x": {"ci": [0.2, 0.3]},
                                                 "date": "2026-01-02T00:00:00"}))
    page = render(tmp_path, [Target(24, "ours vs theirs", "a.json", "ours", ">=", versus="theirs", ci="x.ci")])
    row = next(line for line in page.splitlines() if line.startswith("| ours vs theirs"))
    assert "0.28 (0.2 to 0.3)" in row and ">= 0.36 (`theirs`)" in row and "**missed**" in row and "2026-01-02" in row
    with pytest.raises(KeyError, match=r"a\.json: no key 'x\.nope'"):
        render(tmp_path, [Target(24, "bad", "a.json", "x.nope", ">=", 1.0)])
    with pytest.raises(FileNotFoundError, match=r"b\.json"):
        render(tmp_path, [Target(24, "gone", "b.json", "k", ">=", 1.0)])
