"""PRISM in Hugging Face transformers: same logits and tokens as our own model, prototypes and
suppression through the HF model, export, loading back (in-process, with trust_remote_code in a fresh
process, and as our checkpoint), and fine-tuned weights read back by load_checkpoint. Offline."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from tokenizers import Tokenizer  # noqa: E402

from prism_tda.errors import CheckpointError, ConfigError  # noqa: E402
from prism_tda.model import PRISM, ModelConfig  # noqa: E402
from prism_tda.model import checkpoint as ckpt  # noqa: E402
from prism_tda.model.generate import generate  # noqa: E402
from prism_tda.model.record import RECORD, TrainingRecord  # noqa: E402
from tests.conftest import tiny_model_cfg  # noqa: E402

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)


@pytest.fixture(scope="module")
def hf():
    import prism_tda.hf

    return prism_tda.hf


@pytest.fixture(scope="module")
def tiny(tiny_tokenizer):
    """A seeded tiny PRISM (eval mode) and its tokenizer."""
    torch.manual_seed(0)
    return PRISM(tiny_model_cfg()).eval(), Tokenizer.from_file(str(tiny_tokenizer))


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory) -> Path:
    """The tiny model saved as our checkpoint, with a training record."""
    model, tok = tiny
    record = TrainingRecord(np.arange(10, dtype=np.int64) * 7919, np.array([0, 1, 2] * 3 + [5]), step=3,
                            corpus={"corpus_fingerprint": "f" * 64, "corpus_files": ["tiny.jsonl"]})
    return ckpt.save_checkpoint(tmp_path_factory.mktemp("ckpt") / "step_0000003", model, tok,
                                training={"step": 3, "train_config": {"val_fraction": 0.1}}, record=record)


@pytest.fixture(scope="module")
def exported(hf, checkpoint, tmp_path_factory) -> Path:
    return hf.export_hf(checkpoint, tmp_path_factory.mktemp("hf") / "prism-tiny")


def prompt(n: int = 40, seed: int = 1) -> list[int]:
    return torch.randint(1, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def most_active(model: PRISM, ids: list[int], n: int) -> list[int]:
    """The n prototypes most often active over the last block of ids."""
    with torch.no_grad():
        head = model(torch.tensor([ids[-model.cfg.block_size:]]), return_head=True).head
    return torch.bincount(head.proto_idx.reshape(-1), minlength=model.cfg.n_prototypes).topk(n).indices.tolist()


def changing_suppression(model: PRISM, tok: Tokenizer, n_new: int) -> tuple[list[int], list[int]]:
    """A prompt and a set of prototypes whose suppression changes our greedy continuation of it (on an
    untrained model the residual carries most of the logits, so not every set does)."""
    for seed in range(1, 20):
        ids = prompt(20, seed=seed)
        plain = generate(model, tok, ids, n_new).token_ids
        for n in (4, 8, 16):
            sup = most_active(model, ids, n)
            if generate(model, tok, ids, n_new, suppress=sup).token_ids != plain:
                return ids, sup
    raise AssertionError("no suppression changes the tiny model's generation")


# ---------------------------------------------------------------------------------------------- config
def test_prism_config_carries_model_config_fields_and_defaults(hf):
    names = [f.name for f in dataclasses.fields(ModelConfig)]
    assert ModelConfig.from_dict({k: getattr(hf.PrismConfig(), k) for k in names}) == ModelConfig()
    cfg = hf.prism_config(tiny_model_cfg())
    assert hf.model_config(cfg) == tiny_model_cfg()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.max_position_embeddings) == (32, 2, 32)
    with pytest.raises(ConfigError, match="n_active"):
        hf.model_config(hf.PrismConfig(n_prototypes=4, n_active=8))


# ---------------------------------------------------------------------------------------------- forward
def test_logits_and_loss_equal_prism(hf, tiny):
    model, tok = tiny
    m = hf.wrap(model, tok)
    assert m.wte.weight is model.wte.weight  # the same tensors, not a copy
    x = torch.tensor([prompt(32), prompt(32, seed=2)])
    with torch.no_grad():
        ours = model(x).logits
        out = m(x)
        last = m(x, logits_to_keep=1).logits
        targets = torch.cat([x[:, 1:], torch.full((2, 1), -1)], dim=1)
        loss_ours = model(x, targets).loss
        loss_hf = m(x, labels=x).loss
    assert out.logits.shape == (2, 32, 400)
    assert torch.allclose(out.logits, ours, atol=1e-6)
    assert torch.allclose(last[:, 0], ours[:, -1], atol=1e-6)
    assert abs(loss_hf.item() - loss_ours.item()) < 1e-5  # PRISM's training loss (CE + aux), labels shifted
    with pytest.raises(ValueError, match="block_size"):
        m(torch.tensor([prompt(33)]))


def test_attention_mask_may_only_pad_on_the_right(hf, tiny):
    model, tok = tiny
    m = hf.wrap(model, tok)
    x = torch.tensor([prompt(12)])
    mask = torch.ones_like(x)
    mask[:, 9:] = 0
    with torch.no_grad():
        assert torch.allclose(m(x, attention_mask=mask).logits[:, :9], model(x[:, :9]).logits, atol=1e-5)
        with pytest.raises(ValueError, match="attention_mask"):
            m(x, attention_mask=mask.flip(1))
        with pytest.raises(ValueError, match="position_ids"):
            m(x, position_ids=torch.arange(12)[None])


def test_output_prototypes_are_the_heads_code(hf, tiny):
    model, tok = tiny
    m = hf.wrap(model, tok)
    ids = prompt(20)
    with torch.no_grad():
        out = m(torch.tensor([ids]), output_prototypes=True, output_hidden_states=True)
    assert isinstance(out, hf.PrismCausalLMOutput)
    d = model.decompose(torch.tensor(ids))
    assert out.prototype_ids.shape == (1, 20, 4) and out.prototype_acts.shape == (1, 20, 4)
    assert torch.equal(out.prototype_ids[0], d.proto_idx)
    assert torch.allclose(out.prototype_acts[0], d.acts, atol=1e-6)
    assert out.hidden_states[0].shape == (1, 20, 32)


# ---------------------------------------------------------------------------------------------- generation
def test_greedy_generate_equals_prism_generate_beyond_block_size(hf, tiny):
    model, tok = tiny
    m = hf.wrap(model, tok)
    ids = prompt(40)  # longer than block_size 32: both crop the context to its last 32 tokens
    ours = generate(model, tok, ids, 12).token_ids
    x = torch.tensor([ids])
    out = m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False)
    assert out[0, :40].tolist() == ids
    assert out[0, 40:].tolist() == ours
    assert torch.equal(m.generate(x, max_new_tokens=12), out)  # greedy is the generation config's default
    assert torch.equal(m.generate(x, max_new_tokens=12, use_cache=True), out)  # no cache to use: same tokens


def test_sampling_with_temperature_and_top_k(hf, tiny):
    model, tok = tiny
    m = hf.wrap(model, tok)
    x = torch.tensor([prompt(8)])
    torch.manual_seed(3)
    a = m.generate(x, max_new_tokens=10, do_sample=True, temperature=0.8, top_k=5)
    torch.manual_seed(3)
    b = m.generate(x, max_new_tokens=10, do_sample=True, temperature=0.8, top_k=5)
    assert torch.equal(a, b) and a.shape[1] <= 18
    # every sampled token is among the 5 most likely of its step
    for t in range(8, a.shape[1]):
        with torch.no_grad():
            top5 = model(a[:, :t][:, -32:]).logits[0, -1].topk(5).indices.tolist()
        assert a[0, t].item() in top5


def test_suppression_through_the_hf_model_equals_ours(hf, tiny):
    model, tok = tiny
    m = hf.wrap(model, tok)
    ids, sup = changing_suppression(model, tok, 10)
    x = torch.tensor([ids])
    with torch.no_grad():
        plain = m(x).logits
        with m.suppress(sup):
            assert m.suppressed_prototypes == tuple(sorted(sup))
            inside = m(x).logits
            out = m(x, output_prototypes=True)
        expected = model(x, suppress=torch.tensor(sup)).logits
    assert m.suppressed_prototypes == ()
    assert torch.allclose(inside, expected, atol=1e-6)
    assert not torch.allclose(inside, plain, atol=1e-3)
    assert torch.equal(out.prototype_ids, m(x, output_prototypes=True).prototype_ids)  # the code is unsuppressed

    ours = generate(model, tok, ids, 10, suppress=sup).token_ids
    with m.suppress(sup[:2]), m.suppress(sup[2:]):  # nested blocks add up
        got = m.generate(x, max_new_tokens=10)
    assert got[0, 20:].tolist() == ours
    assert got[0, 20:].tolist() != m.generate(x, max_new_tokens=10)[0, 20:].tolist()
    assert m.generate(x, max_new_tokens=10, suppress_prototypes=sup)[0, 20:].tolist() == ours
    with pytest.raises(ValueError, match="not in"):
        with m.suppress([32]):
            pass
    with pytest.raises(ValueError, match="labels"):
        m(x, labels=x, suppress_prototypes=sup)
    # graded: the block's alpha scales, nested blocks multiply, and generation matches ours
    with torch.no_grad():
        with m.suppress(sup, alpha=0.5), m.suppress(sup[:1], alpha=3.0):
            assert m.prototype_alphas == {**dict.fromkeys(sup, 0.5), sup[0]: 1.5}
            graded = m(x).logits
        want = model(x, suppress=torch.tensor(sup), alpha=torch.tensor([1.5] + [0.5] * (len(sup) - 1))).logits
    assert torch.allclose(graded, want, atol=1e-6) and m.prototype_alphas == {}
    with m.suppress(sup, alpha=0.25):
        got = m.generate(x, max_new_tokens=10)
    assert got[0, 20:].tolist() == generate(model, tok, ids, 10, suppress=sup, alpha=0.25).token_ids
    with pytest.raises(ValueError, match="alpha"):
        with m.suppress(sup, alpha=-1.0):
            pass
    with torch.no_grad(), m.steer({sup[0]: 1.5, sup[1]: 0.5}):  # a strength per prototype (a controller)
        per = m(x).logits
    want = model(x, suppress=torch.tensor(sup[:2]), alpha=torch.tensor([1.5, 0.5])).logits
    assert torch.allclose(per, want, atol=1e-6) and m.prototype_alphas == {}
    # gated (conditional steering): the same gate as ours, in forward and in generation
    with torch.no_grad(), m.suppress(sup, gate=0.1, gate_window=4):
        gated = m(x).logits
        got = m.generate(x, max_new_tokens=10)
    assert torch.allclose(gated, model(x, suppress=torch.tensor(sup), gate=0.1, gate_window=4).logits, atol=1e-6)
    assert got[0, 20:].tolist() == generate(model, tok, ids, 10, suppress=sup, gate=0.1, gate_window=4).token_ids
    with torch.no_grad():
        assert torch.allclose(m(x).logits, plain)  # the gate leaves with its block
    with pytest.raises(ValueError, match="gate"):
        with m.suppress(sup, gate=1.5):
            pass


# ---------------------------------------------------------------------------------------------- export
def test_export_writes_a_model_directory(exported, checkpoint):
    names = sorted(p.name for p in exported.iterdir())
    for f in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "configuration_prism.py", "modeling_prism.py", RECORD):
        assert f in names
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "prism" and config["architectures"] == ["PrismForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_prism.PrismForCausalLM"
    assert config["prism_training"]["step"] == 3
    assert config["prism_training_record"]["corpus_fingerprint"] == "f" * 64
    assert (exported / RECORD).read_bytes() == (checkpoint / RECORD).read_bytes()
    gen = json.loads((exported / "generation_config.json").read_text())
    tok = json.loads((exported / "tokenizer_config.json").read_text())
    assert gen["eos_token_id"] == gen["pad_token_id"] == gen["bos_token_id"] == 0
    assert tok["eos_token"] == tok["pad_token"] == tok["bos_token"] == "<|endoftext|>"
    assert tok["tokenizer_class"] == "PreTrainedTokenizerFast"  # loadable by transformers 4.x and 5.x
    assert not [p for p in exported.parent.iterdir() if p.name.startswith(".")]  # no temporary left
    import prism_tda.hf.modeling as modeling

    assert set(modeling.CARRIED_FILES) <= set(names)


def test_export_refuses_a_non_empty_directory(hf, checkpoint, tmp_path, capsys):
    from prism_tda.cli import main

    out = tmp_path / "taken"
    out.mkdir()
    (out / "x").write_text("")
    with pytest.raises(ConfigError, match=str(out)):
        hf.export_hf(checkpoint, out)
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out), "--format", "hf"]) == 2
    assert str(out) in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    (out / "x").unlink()
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out)]) == 0  # an empty one is fine
    assert (out / "model.safetensors").is_file()


def test_from_pretrained_in_process(hf, tiny, exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = tiny
    m = AutoModelForCausalLM.from_pretrained(exported)
    assert isinstance(m, hf.PrismForCausalLM)
    hf_tok = AutoTokenizer.from_pretrained(exported)
    text = "Never trust a computer you can't throw out a window."
    assert hf_tok(text)["input_ids"] == tok.encode(text).ids
    assert hf_tok.decode(tok.encode(text).ids) == text
    x = torch.tensor([prompt(32)])
    with torch.no_grad():
        assert torch.allclose(m(x).logits, model(x).logits, atol=1e-6)
    assert m.generate(x, max_new_tokens=6)[0, 32:].tolist() == generate(model, tok, x[0].tolist(), 6).token_ids


def test_load_checkpoint_reads_an_export(tiny, exported, checkpoint):
    from prism_tda.cli.train import generate_texts

    model, tok = tiny
    m2, tok2, config = ckpt.load_checkpoint(exported)
    x = torch.tensor([prompt(32)])
    with torch.no_grad():
        assert torch.allclose(m2(x).logits, model(x).logits, atol=1e-6)
    assert m2.cfg == model.cfg
    assert tok2.encode("A computer is a fortune.").ids == tok.encode("A computer is a fortune.").ids
    assert config["training"]["train_config"]["val_fraction"] == 0.1
    assert config["files"]["model.safetensors"] == ckpt.sha256_file(exported / "model.safetensors")
    rec, orig = ckpt.load_record(exported), ckpt.load_record(checkpoint)
    assert rec is not None and orig is not None
    assert np.array_equal(rec.keys, orig.keys) and np.array_equal(rec.windows, orig.windows)
    assert rec.corpus["corpus_fingerprint"] == "f" * 64
    prompts = ["A computer", "Love is"]
    assert generate_texts(str(exported), prompts, 8, 0.0, None, 0) == generate_texts(str(checkpoint), prompts, 8,
                                                                                     0.0, None, 0)


def test_load_checkpoint_errors_name_the_file(exported, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(exported, broken)
    (broken / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        ckpt.load_checkpoint(broken)
    (broken / "model.safetensors").rename(broken / "model-00001-of-00001.safetensors")
    (broken / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="sharded"):
        ckpt.load_checkpoint(broken)


def test_fine_tuned_weights_are_read_back(hf, exported, tmp_path):
    """from_pretrained -> change the weights -> save_pretrained -> load_checkpoint sees the change."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(exported)
    x = torch.tensor([prompt(16)])
    m.train()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    m(x, labels=x).loss.backward()
    assert m.head.prototypes.grad is not None  # the auxiliary losses reach the prototypes
    opt.step()
    with torch.no_grad():
        m.wte.weight[5] += 1.0
    m.eval()
    out = tmp_path / "tuned"
    m.save_pretrained(out)
    AutoTokenizer.from_pretrained(exported).save_pretrained(out)
    assert (out / RECORD).is_file() and (out / "modeling_prism.py").is_file()  # carried from the export
    loaded, _, _ = ckpt.load_checkpoint(out)
    assert torch.equal(loaded.wte.weight, m.wte.weight.detach())
    assert torch.equal(loaded.head.prototypes, m.head.prototypes.detach())
    assert ckpt.load_record(out) is not None
    with torch.no_grad():
        assert torch.allclose(loaded(x).logits, m(x).logits, atol=1e-6)


def test_hf_trainer_fine_tunes_and_the_result_loads(hf, exported, tmp_path):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    m = AutoModelForCausalLM.from_pretrained(exported)
    before = m.wte.weight.detach().clone()
    data = [{"input_ids": prompt(16, seed=s), "labels": prompt(16, seed=s)} for s in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=2,
                             learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True,
                             logging_strategy="no", disable_tqdm=True)
    Trainer(model=m, args=args, train_dataset=data).train()
    m.save_pretrained(tmp_path / "tuned")
    shutil.copy(exported / "tokenizer.json", tmp_path / "tuned" / "tokenizer.json")
    loaded, _, _ = ckpt.load_checkpoint(tmp_path / "tuned")
    assert not torch.equal(loaded.wte.weight, before)
    assert torch.equal(loaded.wte.weight, m.wte.weight.detach().cpu())


# ---------------------------------------------------------------------------------------------- processes
def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE, "HF_HOME": str(cwd / "hf-home")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_trust_remote_code_without_prism_tda(tiny, exported, tmp_path):
    """A fresh process that never imports prism_tda loads the export's own code and agrees with ours."""
    model, tok = tiny
    ids = prompt(40)
    sup = most_active(model, ids, 8)
    expected = {
        "logits": model(torch.tensor([ids[-32:]])).logits[0, -1].tolist(),
        "greedy": generate(model, tok, ids, 8).token_ids,
        "suppressed": generate(model, tok, ids, 8, suppress=sup).token_ids,
    }
    code = f"""
        import json, sys, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        m = AutoModelForCausalLM.from_pretrained({str(exported)!r}, trust_remote_code=True)
        tok = AutoTokenizer.from_pretrained({str(exported)!r}, trust_remote_code=True)
        ids = torch.tensor([{ids}])
        with torch.no_grad():
            out = m(ids[:, -32:], output_prototypes=True)
        greedy = m.generate(ids, max_new_tokens=8)[0, 40:].tolist()
        with m.suppress({sup}):
            suppressed = m.generate(ids, max_new_tokens=8)[0, 40:].tolist()
        print(json.dumps({{"logits": out.logits[0, -1].tolist(), "greedy": greedy, "suppressed": suppressed,
                          "protos": list(out.prototype_ids.shape), "module": type(m).__module__,
                          "eos": tok.eos_token_id, "imported": sorted(k for k in sys.modules if "prism_tda" in k
                                                                      and "finder" not in k)}}))
    """
    r = _run(code, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["imported"] == [] and got["module"].endswith("modeling_prism")
    assert np.allclose(got["logits"], expected["logits"], atol=1e-5)
    assert got["greedy"] == expected["greedy"] and got["suppressed"] == expected["suppressed"]
    assert got["protos"] == [1, 32, 4] and got["eos"] == 0


@pytest.mark.slow
def test_import_prism_tda_registers_only_when_transformers_is_loaded(tmp_path):
    r = _run("""
        import sys, prism_tda
        assert "transformers" not in sys.modules and "torch" not in sys.modules, "import prism_tda stays light"
        import transformers
        try:
            transformers.AutoConfig.for_model("prism")
        except ValueError:
            print("not registered")
    """, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "not registered"
    r = _run("""
        import transformers, prism_tda
        from transformers import AutoConfig, AutoModelForCausalLM
        m = AutoModelForCausalLM.from_config(AutoConfig.for_model("prism", n_layer=1, d_model=16, n_head=2,
                                             vocab_size=50, block_size=8, n_prototypes=8, n_active=2))
        print(type(m).__module__)
    """, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "prism_tda.hf.modeling"


def test_standalone_code_defines_every_name(hf):
    from prism_tda.hf.standalone import modeling_source

    src = modeling_source("test")
    assert "prism_tda" not in "".join(line for line in src.splitlines() if line.lstrip().startswith(("import",
                                                                                                    "from")))
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    r = subprocess.run([ruff, "check", "--no-cache", "--isolated", "--select", "F821,F822,F823,E9", "-"],
                       input=src, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


@pytest.mark.slow
def test_an_export_can_be_indexed(exported, tiny_corpus, tmp_path):
    from prism_tda.indexer.run import build_index
    from tests.conftest import index_cfg

    corpus = tmp_path / "few.jsonl"
    corpus.write_text("".join(open(tiny_corpus).readlines()[:80]))
    out = tmp_path / "index"
    build_index(exported, [corpus], out, index_cfg(), progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["identity"]["checkpoint_sha256"] == ckpt.sha256_file(exported / "model.safetensors")
