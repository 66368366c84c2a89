"""Training: losses decrease, checkpoints round-trip, resume is exact, bad checkpoints fail clearly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from prism_tda.errors import CheckpointError, ConfigError
from prism_tda.model import checkpoint as ckpt
from prism_tda.model.tokenizer import train_tokenizer
from prism_tda.model.train import Trainer
from tests.conftest import REPO, tiny_model_cfg, tiny_train_cfg


def _trainer(tmp, corpus, tok, name="run", model_kw=None, **train_kw) -> Trainer:
    return Trainer(tiny_model_cfg(**(model_kw or {})), tiny_train_cfg(**train_kw), [corpus], tmp / name,
                   tokenizer_path=tok, progress=False).setup()


@pytest.mark.slow
def test_all_four_losses_decrease(tmp_path, tiny_corpus, tiny_tokenizer):
    """From random prototypes, every loss term falls. The first steps of language-model training
    collapse the token states toward a few directions, away from random prototypes, so L_R1 is
    measured from step 10 on (after that transient) for every term alike."""
    t = _trainer(tmp_path, tiny_corpus, tiny_tokenizer, max_steps=200, proto_init="random", reseed_every=0)
    hist = []
    for step in range(200):
        hist.append(t.train_step(step))
        t.step = step + 1
    for name in ("ce", "rec", "r1", "r2"):
        first = sum(h[name] for h in hist[10:20]) / 10
        last = sum(h[name] for h in hist[-10:]) / 10
        assert last < 0.95 * first, f"L_{name} did not decrease: {first:.4f} -> {last:.4f}"


@pytest.mark.slow
def test_reseeding_keeps_prototype_usage_spread(tmp_path, tiny_corpus, tiny_tokenizer):
    """Early token states collapse onto a few prototypes; re-seeding idle ones spreads usage again."""
    evals = {}
    for every in (0, 5):
        t = _trainer(tmp_path, tiny_corpus, tiny_tokenizer, f"reseed{every}", max_steps=200, reseed_every=every)
        t.fit()
        evals[every] = t.evaluate()
    on, off = evals[5], evals[0]
    # a few prototypes re-seeded near the end can be idle again when evaluated (1 or 2 of 32, by CPU)
    assert on["dead_prototypes"] <= 32 // 8 and 5 * on["dead_prototypes"] < off["dead_prototypes"], (on, off)
    assert on["effective_prototypes"] >= 32 / 4, on
    assert on["effective_prototypes"] > 1.5 * off["effective_prototypes"], (on, off)
    assert on["R2"] > 0.9 and on["R1bar"] > 0.9, on


def test_checkpoint_round_trip_is_bit_for_bit(tmp_path, tiny_corpus, tiny_tokenizer):
    t = _trainer(tmp_path, tiny_corpus, tiny_tokenizer, max_steps=3)
    path = t.fit()
    model, tok, config = ckpt.load_checkpoint(path)
    for k, v in t.model.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    assert config["model"] == t.model.cfg.to_dict()
    assert tok.to_str() == t.tokenizer.to_str()
    # a second save of the loaded model gives the same tensors byte for byte
    again = ckpt.save_checkpoint(tmp_path / "again", model, tok)
    assert (again / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    # the run directory resolves to its newest checkpoint
    assert ckpt.resolve(tmp_path / "run") == path


def test_resume_continues_exactly(tmp_path, tiny_corpus, tiny_tokenizer):
    kw = dict(max_steps=20, ckpt_every=10, reseed_every=3)
    full = _trainer(tmp_path, tiny_corpus, tiny_tokenizer, "full", **kw)
    full.fit()
    part = _trainer(tmp_path, tiny_corpus, tiny_tokenizer, "part", **kw)
    part.fit(max_steps=10)
    assert part.step == 10
    resumed = _trainer(tmp_path, tiny_corpus, tiny_tokenizer, "part", **kw)
    assert resumed.step == 10
    resumed.fit()
    for k, v in full.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k
    a = load_file(str(tmp_path / "full" / "step_0000020" / "optimizer.safetensors"))
    b = load_file(str(tmp_path / "part" / "step_0000020" / "optimizer.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_a_different_model_config(tmp_path, tiny_corpus, tiny_tokenizer):
    _trainer(tmp_path, tiny_corpus, tiny_tokenizer, max_steps=2).fit()
    with pytest.raises(ConfigError, match="different model config"):
        _trainer(tmp_path, tiny_corpus, tiny_tokenizer, model_kw={"d_model": 64}, max_steps=2)


@pytest.fixture()
def saved(tmp_path, tiny_corpus, tiny_tokenizer):
    t = _trainer(tmp_path, tiny_corpus, tiny_tokenizer, max_steps=2)
    path = t.fit()
    dst = tmp_path / "ck"
    shutil.copytree(path, dst)
    return dst


def test_corrupt_weights_are_reported_with_the_file(saved):
    f = saved / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*sha256"):
        ckpt.load_checkpoint(saved)
    f.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read"):
        ckpt.load_checkpoint(saved, verify=False)


def test_bad_config_names_the_file_and_field(saved):
    f = saved / "config.json"
    good = json.loads(f.read_text())
    f.write_text("{ truncated")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        ckpt.load_checkpoint(saved)
    bad = dict(good, model={**good["model"], "n_head": 3})
    f.write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match=r"config\.json: field 'model'.*model\.d_model \(32\) must be divisible"):
        ckpt.load_checkpoint(saved)
    bad = dict(good, model={**good["model"], "n_layer": 3})
    f.write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensors missing"):
        ckpt.load_checkpoint(saved)
    bad = dict(good, model={**good["model"], "d_model": 64})
    f.write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match=r"tensor '.*' has shape"):
        ckpt.load_checkpoint(saved)
    del good["files"]
    f.write_text(json.dumps(good))
    with pytest.raises(CheckpointError, match="field 'files'"):
        ckpt.load_checkpoint(saved)


def test_tokenizer_model_vocab_mismatch(saved, tiny_corpus):
    texts = [json.loads(line)["text"] for line in open(tiny_corpus)]
    big = train_tokenizer(texts, vocab_size=700)
    big.save(str(saved / "tokenizer.json"))
    with pytest.raises(CheckpointError, match=r"tokenizer\.json.*sha256"):
        ckpt.load_checkpoint(saved)
    with pytest.raises(CheckpointError, match=r"tokenizer has \d+ tokens but .*model\.vocab_size"):
        ckpt.load_checkpoint(saved, verify=False)
    (saved / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not a valid"):
        ckpt.load_checkpoint(saved, verify=False)


@pytest.mark.slow
def test_ddp_two_gloo_processes_match_single_process_gradients(tmp_path, tiny_corpus, tiny_tokenizer):
    out = tmp_path / "grads.safetensors"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "helpers" / "ddp_grads.py"), str(tiny_corpus), str(tiny_tokenizer),
           str(tmp_path / "ddp"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = load_file(str(out))

    single = _trainer(tmp_path, tiny_corpus, tiny_tokenizer, "single", grad_accum=2)
    single.optimizer.zero_grad()
    single.forward_backward(0)
    for name, p in single.model.named_parameters():
        assert torch.allclose(p.grad, ddp[name], atol=1e-6, rtol=1e-4), name
    assert set(ddp) == {n for n, _ in single.model.named_parameters()}


def test_bf16_autocast_keeps_the_head_in_fp32(tmp_path, tiny_corpus, tiny_tokenizer):
    t = _trainer(tmp_path, tiny_corpus, tiny_tokenizer, max_steps=3, dtype="bf16")
    stats = [t.train_step(s) for s in range(3)]
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in stats)
    x = torch.randint(0, 400, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = t.model(x, return_head=True)
    assert out.logits.dtype == torch.bfloat16 and out.head.acts.dtype == torch.float32


def test_auto_precision_uses_bf16_on_a_cpu_only_where_it_is_native(monkeypatch):
    from prism_tda.model import device

    cpu = torch.device("cpu")
    for native in (False, True):
        monkeypatch.setattr(device, "cpu_has_native_bf16", lambda native=native: native)
        ctx = device.autocast_for(cpu, "auto", cpu_bf16_when_native=True)
        assert isinstance(ctx, torch.autocast) == native
        assert not isinstance(device.autocast_for(cpu, "auto"), torch.autocast)  # the indexer's rows stay fp32
        assert isinstance(device.autocast_for(cpu, "bf16"), torch.autocast)
        assert not isinstance(device.autocast_for(cpu, "fp32", cpu_bf16_when_native=True), torch.autocast)
