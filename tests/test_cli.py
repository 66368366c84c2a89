"""The `prism` command line, used the way a person would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from prism_tda.cli import build_configs, main


@pytest.mark.parametrize("cmd", [[], ["train"], ["generate"], ["demo"]])
def test_help(cmd):
    proc = subprocess.run([sys.executable, "-m", "prism_tda.cli", *cmd, "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "usage: prism" in proc.stdout


def test_config_overrides_and_errors(tmp_path):
    m, t = build_configs("tiny", None, ["model.d_model=64", "train.max_steps=7"], head="dense")
    assert (m.d_model, t.max_steps, m.head) == (64, 7, "dense")
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"model": {"n_layer": 3}}))
    m, _ = build_configs("tiny", str(cfg), [])
    assert m.n_layer == 3
    from prism_tda.errors import ConfigError

    for bad in (["model.nope=1"], ["d_model=3"], ["model.d_model=30"]):
        with pytest.raises(ConfigError):
            build_configs("tiny", None, bad)


def test_train_then_generate(tmp_path, tiny_corpus, tiny_tokenizer, capsys):
    sets = ["model.vocab_size=400", "model.block_size=32", "model.n_layer=1", "model.n_head=2", "model.d_model=32",
            "model.n_prototypes=16", "model.n_active=4", "train.max_steps=4", "train.batch_size=4",
            "train.eval_tokens=512", "train.eval_every=2"]
    args = ["train", "--corpus", str(tiny_corpus), "--out", str(tmp_path / "run"), "--tokenizer",
            str(tiny_tokenizer), "--no-progress"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checkpoint"].endswith("step_0000004") and out["val_loss"] > 0
    assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "The", "--max-new-tokens", "5",
                 "--json"]) == 0
    gen = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert gen["prompt"] == "The" and isinstance(gen["completion"], str)
    # steering: alpha 1 is the model as it is; --compare prints both; ids and terms are checked
    run = ["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "The", "--max-new-tokens", "5", "--json"]
    assert main([*run, "--suppress", "1", "2", "--alpha", "1", "--steer", "3,4=1", "--compare"]) == 0
    both = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert both["completion"] == both["default_completion"] == gen["completion"]
    assert main([*run, "--suppress", *map(str, range(16)), "--compare"]) == 0
    both = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert both["default_completion"] == gen["completion"]
    # gated: every prototype holds all of each position's mass, so any gate opens everywhere
    assert main([*run, "--suppress", *map(str, range(16)), "--gate", "0.5", "--gate-window", "4"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["completion"] == both["completion"]
    assert main([*run, "--gate", "0.5"]) == 2 and "--gate" in capsys.readouterr().err
    assert main([*run, "--suppress", "1", "--gate", "2"]) == 2 and "--gate" in capsys.readouterr().err
    assert main([*run, "--suppress", "16"]) == 2 and "[0, 16)" in capsys.readouterr().err
    assert main([*run, "--suppress", "1", "--steer", "1=0.5"]) == 2 and "prototype 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*run, "--steer", "1,2"])
    # a bad checkpoint path is a clean error, exit code 2
    assert main(["generate", "--checkpoint", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "no such checkpoint" in capsys.readouterr().err


def test_index_dry_run_and_attribute(index, tiny_ckpt, tiny_corpus, tmp_path, capsys):
    out = tmp_path / "ix"
    assert main(["index", "--checkpoint", str(tiny_ckpt), "--corpus", str(tiny_corpus), "--out", str(out),
                 "--dry-run", "--json", "--no-progress"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert 0.7 < est["documents"] / 600 < 1.4 and est["tokens"] > 0 and not out.exists()
    assert main(["index", "--checkpoint", str(tiny_ckpt), "--out", str(out), "--set", "index.nope=1"]) == 2
    assert "unknown field" in capsys.readouterr().err
    assert main(["attribute", "--index", str(index), "--prompt", "A computer", "--completion", " is a",
                 "--top-k", "3", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res["documents"]) == 3 and all(d["snippet"] and d["external_id"] for d in res["documents"])
    for d in res["documents"]:  # the highlights point into the snippet that is printed
        assert d["highlights"] and all(d["snippet"][h["start"]:h["end"]] == h["text"] for h in d["highlights"])


@pytest.mark.slow
def test_demo_end_to_end_with_a_tiny_model(tmp_path, capsys):
    """The main job with --train on the whole bundled corpus (model shrunk so it runs in seconds), then reused."""
    sets = ["model.d_model=32", "model.n_layer=1", "model.n_head=2", "model.n_prototypes=32", "model.vocab_size=512",
            "train.max_steps=4", "train.eval_every=4", "train.ckpt_every=4", "train.eval_tokens=1024",
            "index.code_bits=8", "index.calibration_tokens=32768", "index.posting_cells=16"]
    args = ["demo", "--train", "--out", str(tmp_path / "demo"), "--no-progress", "--no-serve"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[: out.index("\n}\n") + 2])
    assert summary["index_summary"]["documents"] == 14225 and summary["index_summary"]["bad_records"] == 0
    assert "Which training documents drove" in out and "  1. " in out
    assert main(args) == 0  # second run reuses the model and the index
    assert json.loads(capsys.readouterr().out.split("\n}\n")[0] + "\n}")["train_seconds"] < 5


@pytest.mark.slow
def test_demo_uses_the_bundled_model_without_training(tiny_ckpt, tiny_corpus, tmp_path, monkeypatch, capsys):
    """Without --train the demo copies the bundled model into its run directory and trains nothing (here
    the bundled model is the tiny checkpoint and the corpus its 600 documents); a second run reuses both;
    model settings without --train are refused, naming the option."""
    import prism_tda.cli.serve as serve_mod
    from prism_tda.model import checkpoint as ckpt
    from prism_tda.model.train import Trainer

    monkeypatch.setattr(serve_mod, "demo_model_path", lambda: str(tiny_ckpt))
    monkeypatch.setattr(serve_mod, "demo_corpus_path", lambda: str(tiny_corpus))
    import prism_tda.engine.influence as influence_mod
    from prism_tda.engine import layout

    monkeypatch.setattr(Trainer, "fit", lambda self, *a, **k: pytest.fail("the demo trained"))
    steps: list[str] = []  # the first answer comes before the influence curvature is fitted
    answer, fit = serve_mod.print_attribution, influence_mod.fit_index
    monkeypatch.setattr(serve_mod, "print_attribution", lambda *a, **k: steps.append("answer") or answer(*a, **k))
    monkeypatch.setattr(influence_mod, "fit_index", lambda *a, **k: steps.append("fit") or fit(*a, **k))
    out = tmp_path / "demo"
    args = ["demo", "--out", str(out), "--no-progress", "--no-serve", "--set", "index.code_bits=8",
            "--set", "index.posting_cells=16"]
    for expected in (["answer", "fit"], ["answer"]):
        steps.clear()
        assert main(args) == 0
        text = capsys.readouterr().out
        summary = json.loads(text[: text.index("\n}\n") + 2])
        assert summary["bundled_model"] is True and summary["index_summary"]["documents"] == 600
        assert "Which training documents drove" in text
        assert steps == expected and (out / "index" / layout.EKFAC).exists()
    got = ckpt.resolve(out)
    assert got.parent == out and ckpt.read_config(got)["files"] == ckpt.read_config(tiny_ckpt)["files"]
    assert main(["demo", "--out", str(tmp_path / "d2"), "--no-serve", "--set", "model.d_model=64"]) == 2
    assert "--train" in capsys.readouterr().err


def test_serve_names_a_missing_index_in_one_line(tmp_path, capsys):
    missing = tmp_path / "idx"
    assert main(["serve", "--index", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert str(missing) in err and "does not exist" in err and "prism index" in err
    half = tmp_path / "half"
    half.mkdir()
    assert main(["serve", "--index", f"h={half}"]) == 2
    assert "not a complete index" in capsys.readouterr().err


def test_demo_serve_and_sql_share_one_state_directory(index, tmp_path, monkeypatch, capsys):
    from prism_tda.cli import default_state_dir, index_args
    from prism_tda.service import Settings
    from prism_tda.service.state import StateDB

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PRISM_STATE_DIR", raising=False)
    assert Settings().state_dir.resolve() == default_state_dir().resolve()
    # an audit stored by a server started from this directory with the defaults ...
    (name, _), = index_args([str(index)]).items()
    state = StateDB(Settings().state_dir)
    job, _ = state.create_job(name, {}, [{"prompt": "A", "completion": " b"}], principal="local",
                              idempotency_key=None, req_hash="h")
    state.next_item([name])
    state.finish_item(job["id"], 0, result={"target_text": " b", "documents": [{"doc_id": 3, "score": 0.5}]})
    # ... is what `prism sql` sees from the same directory, with no option
    assert main(["sql", "--index", str(index), "--json", "SELECT job_id, doc_id FROM audit_results"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == [[job["id"], 3]]


def test_demo_rebuilds_an_index_of_another_config(index, tmp_path):
    """`prism demo` reuses its index when the config is the one asked for, and rebuilds it (an index
    is derived data) when a field that changes the stored rows differs, e.g. an older damping default."""
    import shutil

    from prism_tda.cli.serve import _drop_outdated_index
    from tests.conftest import index_cfg

    copy = tmp_path / "index"
    shutil.copytree(index, copy)
    _drop_outdated_index(copy, index_cfg())
    assert (copy / "manifest.json").is_file()
    _drop_outdated_index(copy, index_cfg(damping_scope="global", damping=1.0))
    assert not copy.exists()


def test_control_fit_eval_and_generate_with_it(index, tmp_path, capsys):
    out = tmp_path / "ctrl.json"
    args = ["--index", str(index), "--items", "120", "--ending-tokens", "4", "--json"]
    assert main(["control", "fit", *args, "--out", str(out), "--steps", "30", "--l1", "0.2", "--no-progress"]) == 0
    rep = json.loads(capsys.readouterr().out)
    held = rep["heldout"]
    assert held["items"] > 10 and held["chance"] == 0.25 and 0 <= held["accuracy_base"] <= 1
    assert rep["prototypes"] == len(json.loads(out.read_text())["alpha"]) > 0
    assert all(w["alpha"] >= 0 and w["alpha"] != 1 for w in rep["weights"])
    assert main(["control", "eval", *args, "--controller", str(out)]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["accuracy_controller"] == held["accuracy_controller"] and ev["items"] == held["items"]
    ckpt = json.loads((index / "manifest.json").read_text())["checkpoint"]
    assert main(["generate", "--checkpoint", ckpt, "--prompt", "The", "--max-new-tokens", "4", "--json",
                 "--controller", str(out), "--compare"]) == 0
    gen = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "default_completion" in gen
    out.write_text("{}")
    assert main(["control", "eval", *args, "--controller", str(out)]) == 2
    assert "ctrl.json" in capsys.readouterr().err


def test_importing_the_package_first_sets_the_openmp_spin_count_and_keeps_a_users():
    """``import prism_tda`` before torch: torch's OpenMP workers spin 30,000 iterations, not libgomp's
    300,000 (they would hold a core from the compiled scoring); a value in the environment stays."""
    code = "import os, prism_tda, torch; print(os.environ['GOMP_SPINCOUNT'])"
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "30000"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "GOMP_SPINCOUNT": "5"}, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "5"
