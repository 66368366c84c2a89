"""bench/gpu_check.py on the CPU at its smallest: the dry run's JSON has every field a GPU run reads back,
a failing stage is recorded with its error, and a stage past its limit is killed and recorded."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench.gpu_check import REPO, SIZES, run_stage, run_stage_process


@pytest.mark.slow  # about 10 s on 2 cores
def test_dry_run_records_the_train_and_faiss_stages(tmp_path, monkeypatch):
    from bench.gpu_check import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the dry run hides GPUs; restored after the test
    out = tmp_path / "gpu_dry_run.json"
    sizes = ["train_steps=2", "train_warmup=0", "train_batch_size=2", "faiss_n=512", "faiss_queries=32",
             "faiss_cpu_queries=32", "faiss_pq=PQ16x4np"]
    res = main(["--dry-run", "--in-process", "--stages", "train,faiss", "--work", str(tmp_path / "w"),
                "--out", str(out), *[f"--set={s}" for s in sizes]])
    assert res is not None and json.loads(out.read_text()) == json.loads(json.dumps(res))
    for key in ("mode", "machine", "command", "date", "stages", "summary", "all_ok", "config"):
        assert key in res, key
    assert {"torch", "torch_cuda", "faiss", "cuda_available"} <= set(res["machine"])
    assert {"version", "gpus", "packages"} <= set(res["machine"]["faiss"])
    assert res["all_ok"], {k: v["error"] for k, v in res["stages"].items()}
    assert set(res["stages"]) == {"train", "faiss"}
    for stage in res["stages"].values():
        assert stage["ok"] is True and stage["error"] is None and stage["seconds"] > 0 and stage["limit_s"] > 0
    train = res["stages"]["train"]
    assert train["steps_run"] == 2 and train["data"].startswith("synthetic")
    assert train["throughput_ratio"] > 0 and train["prism_tokens_per_s"] > 0 and train["dense_tokens_per_s"] > 0
    assert train["model"]["n_layer"] == 4  # the tiny preset
    faiss = res["stages"]["faiss"]
    assert faiss["dim"] == 1024 and faiss["built_on"] == "cpu"
    assert set(faiss["indexes"]) == {"flat", "ivf_flat", "ivf_pq"}
    for name, v in faiss["indexes"].items():
        assert v["cpu_queries_per_s"] > 0 and "gpu_queries_per_s" not in v, name
    assert faiss["indexes"]["ivf_flat"]["recall_cpu_vs_exact"] > 0.5


def test_a_failing_stage_is_recorded_with_its_error(tmp_path):
    rec = run_stage("index", {**SIZES["dry_run"], "index_preset": "no-such-preset"}, 30.0, False, tmp_path)
    assert rec["ok"] is False and "no-such-preset" in rec["error"] and rec["seconds"] >= 0
    assert "traceback" in rec


def test_a_stage_past_its_limit_is_killed_and_recorded(tmp_path):
    rec = run_stage_process("faiss", dict(SIZES["dry_run"]), 0.5, False, tmp_path)
    assert rec["ok"] is False and rec["error"].startswith("timed out")
    assert 0.5 <= rec["seconds"] < 10 and rec["limit_s"] == 0.5


def test_the_script_parses_and_shows_its_usage():
    script = Path(REPO) / "bench" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    usage = subprocess.run(["bash", str(script), "--help"], check=True, capture_output=True, text=True).stdout
    assert "--dry-run" in usage and "--install" in usage
