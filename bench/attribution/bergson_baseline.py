"""Bergson (EleutherAI, ``bergson==2.5.1``) as a baseline: TrackStar-style gradient similarity.

Each training sequence's per-example gradient of its summed cross-entropy is taken at every
``nn.Linear`` of the model (the qkv/proj/fc/proj matrices of each block; the tied embedding /
unembedding and the prototype head are not ``nn.Linear`` and are not seen), optionally divided
element-wise by the square root of Adam's second moment (the checkpoint's optimizer state),
randomly projected per module to ``projection_dim x projection_dim`` (Rademacher, two-sided),
optionally whitened by the autocorrelation ("R") Hessian of those projected training gradients
(``H^-1/2``, damped), unit-normalised and written to an on-disk store (``gradients.bin``). A query's
gradient (summed CE over its completion tokens) goes through the same steps and is scored
against every stored row by inner product (exact torch matmul, or a FAISS ``Flat`` inner-product
index with ``faiss=True``). Scores are (n_queries, n_train), positive = similar gradients, i.e.
a step on the training example lowers the query's loss.

Installing (kept out of the product's dependencies; bergson declares torchvision/torchaudio and
``pip install bergson`` would replace the CPU torch)::

    pip install --no-deps bergson==2.5.1
    pip install datasets "transformers>=5.0" "jaxtyping>=0.3.3" ml_dtypes natsort petname simple-parsing
    pip install --no-deps "peft>=0.17.0" torchopt bitsandbytes
    pip install graphviz optree

Bergson's collection code is written for Hugging Face causal LMs. What it actually touches is:
``model.base_model`` (the module tree it hooks), ``model.device``, ``model.dtype``,
``model.zero_grad()`` and ``model(x).logits`` with *unshifted* labels (it computes the loss of
``logits[:, :-1]`` against ``labels[:, 1:]``); data must be a ``datasets.Dataset`` with
``input_ids`` (and ``labels``) list columns. ``BergsonLM`` below is the minimal adapter for our
``PRISM`` (whose labels are already shifted: ``labels[t]`` is the target of position ``t``).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from bench.attribution.baselines import IGNORE, TokenDataset, summed_ce


# --------------------------------------------------------------------------- adapter
class _Out:
    __slots__ = ("logits",)

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class BergsonLM(nn.Module):
    """What Bergson needs of a Hugging Face model, around a plain ``forward(ids).logits`` model.

    * ``base_model`` is the module tree whose ``nn.Linear`` layers Bergson hooks; it is this
      wrapper itself (Bergson's collector also asks the hooked root for ``.device``), so module
      names are ``model.blocks.0.attn.qkv`` etc.
    * Bergson shifts labels itself. Inputs reach us with one dummy token appended and labels
      with ``IGNORE`` prepended; the wrapped model runs on the real tokens only (a sequence may
      fill the whole ``block_size``) and a zero logit row is appended for the dummy position,
      which Bergson's ``logits[:, :-1]`` drops again. The loss is then exactly ours.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    @property
    def base_model(self) -> nn.Module:
        return self

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def forward(self, input_ids: torch.Tensor, **_) -> _Out:
        logits = self.model(input_ids[:, :-1]).logits
        pad = logits.new_zeros(logits.shape[0], 1, logits.shape[-1])
        return _Out(torch.cat([logits, pad], dim=1))


def to_hf_dataset(ds: TokenDataset):
    """Our fixed-length rows -> a ``datasets.Dataset`` in Bergson's (unshifted) label convention,
    trimmed to each row's real length (Bergson pads each batch itself)."""
    from datasets import Dataset as HFDataset

    ids, labels, lengths = [], [], []
    for i in range(len(ds)):
        y = ds.labels[i]
        n = int(ds.mask[i].sum())
        tgt = torch.nonzero(y != IGNORE)
        if len(tgt):
            n = max(n, int(tgt.max()) + 1)
        ids.append(ds.input_ids[i, :n].tolist() + [0])  # + dummy token
        labels.append([IGNORE] + y[:n].tolist())  # labels[t+1] = our target of position t
        lengths.append(n + 1)
    return HFDataset.from_dict({"input_ids": ids, "labels": labels, "length": lengths})


# --------------------------------------------------------------------------- optimizer state
def adam_normalizers(wrapper: BergsonLM, checkpoint: str | Path, *, kind: str = "adam") -> dict:
    """Bergson normalizers from a PRISM checkpoint's ``optimizer.safetensors`` (AdamW, bias-corrected).

    Bergson's own loader (``bergson.load_from_optimizer``) only reads a pickled HF-Trainer
    ``optimizer.pt``; ours is safetensors with state ``state.<i>.exp_avg_sq``, ``i`` indexing the
    trainer's two parameter groups (matrices except the prototypes, then the rest; see
    ``model/train.py``). ``kind="adafactor"`` keeps only the row/column means (cheaper: no
    per-example [out, in] gradient is formed before projection)."""
    from bergson.gradients import AdamNormalizer
    from safetensors.torch import load_file

    from prism_tda.model import checkpoint as ckpt

    path = ckpt.resolve(checkpoint)
    state = load_file(str(path / ckpt.OPTIMIZER))
    beta2 = ckpt.read_config(path)["training"]["train_config"]["beta2"]
    named = list(wrapper.model.named_parameters())
    order = [n for n, p in named if p.dim() >= 2 and not n.endswith("prototypes")]
    order += [n for n, p in named if not (p.dim() >= 2 and not n.endswith("prototypes"))]
    shapes = dict(named)
    out = {}
    for i, pname in enumerate(order):
        key = f"state.{i}.exp_avg_sq"
        if key not in state or not pname.endswith(".weight"):
            continue
        mod = "model." + pname.removesuffix(".weight")
        layer = wrapper.get_submodule(mod)
        if not isinstance(layer, nn.Linear):
            continue
        v = state[key].float()
        if tuple(v.shape) != tuple(shapes[pname].shape):
            raise ValueError(f"{path}: {key} has shape {tuple(v.shape)}, {pname} is {tuple(shapes[pname].shape)}")
        step = float(state.get(f"state.{i}.step", torch.tensor(1.0)))
        norm = AdamNormalizer(weight_avg_sq=v / (1.0 - beta2**step))
        out[mod] = norm.to_adafactor() if kind == "adafactor" else norm
    if not out:
        raise ValueError(f"{path}: no Adam second moments for any nn.Linear")
    return out


def _faiss_cpu_shim() -> None:
    """Bergson's FAISS code asks ``isinstance(index, faiss.GpuIndex)`` even for ``device="cpu"``;
    faiss-cpu has no ``GpuIndex`` (AttributeError). A stand-in class makes that test False."""
    import faiss

    if not hasattr(faiss, "GpuIndex"):
        faiss.GpuIndex = type("GpuIndex", (), {})


# --------------------------------------------------------------------------- the baseline
def bergson_scores(model, train: TokenDataset, queries: TokenDataset, work: Path, *, projection_dim: int = 16,
                   optimizer: str | None = "adam", checkpoint: str | Path | None = None, hessian: bool = True,
                   damping: float = 0.1, unit_norm: bool = True, faiss: bool = False, batch_size: int = 16,
                   query_batch_size: int = 64, single_queries: int = 0, seed: int = 0) -> dict:
    """TrackStar-style Bergson scores of every (query, training sequence) pair.

    ``optimizer``: ``"adam"`` / ``"adafactor"`` / ``None``: divide gradients by sqrt of the
    checkpoint's Adam second moments (needs ``checkpoint``). ``hessian``: whiten by the damped
    autocorrelation Hessian of the projected training gradients (one extra pass over ``train``;
    ``damping`` times the mean eigenvalue). The store holds the preconditioned, unit-normalised
    rows, so a query costs one backward pass plus one inner product per stored row.
    ``single_queries``: the first that many queries are also scored one per call, timed apart.
    """
    from bergson import (
        Attributor,
        FaissConfig,
        GradientProcessor,
        IndexConfig,
        PreprocessConfig,
        collect_gradients,
    )
    from bergson.collector.collector import CollectorComputer
    from bergson.collector.gradient_collectors import TraceCollector
    from bergson.config import InversionConfig
    from bergson.hessians.autocorrelation import AutocorrelationCollector
    from bergson.hessians.preconditioner import load_preconditioner

    if hessian and not projection_dim:
        raise ValueError("hessian=True needs projection_dim > 0 (a dense Gram of unprojected gradients)")
    work = Path(work)
    shutil.rmtree(work, ignore_errors=True)  # a fresh store: gradients of another model must not be reused
    work.mkdir(parents=True)
    model.eval()
    wrapper = BergsonLM(model)
    normalizers = {}
    if optimizer:
        if checkpoint is None:
            raise ValueError("optimizer normalisation needs the checkpoint holding optimizer.safetensors")
        normalizers = adam_normalizers(wrapper, checkpoint, kind=optimizer)

    def processor() -> GradientProcessor:
        return GradientProcessor(dict(normalizers), projection_dim=projection_dim or None,
                                 projection_type="rademacher", projection_target="per_module",
                                 projection_seed=seed)

    data = to_hf_dataset(train)
    batches = [list(range(s, min(s + batch_size, len(data)))) for s in range(0, len(data), batch_size)]
    inversion = InversionConfig(inversion="damped_inverse", damping_factor=damping)

    t0 = time.perf_counter()
    hess_dir = None
    if hessian:  # TrackStar's R: second moment of the (normalised, projected) training gradients
        hcfg = IndexConfig(run_path=str(work / "hessian"), projection_dim=projection_dim)
        hcfg.partial_run_path.mkdir(parents=True)
        hess_dir = work / "hessian"
        coll = AutocorrelationCollector(model=wrapper, data=data, path=str(hess_dir), processor=processor())
        CollectorComputer(model=wrapper, data=data, collector=coll, batches=batches, cfg=hcfg) \
            .run_with_collector_hooks(desc="bergson hessian")
    cfg = IndexConfig(run_path=str(work / "index"), projection_dim=projection_dim, loss_reduction="sum")
    cfg.partial_run_path.mkdir(parents=True)
    pre = PreprocessConfig(unit_normalize=unit_norm, hessian_path=str(hess_dir) if hess_dir else None,
                           inversion_cfg=inversion)
    collect_gradients(wrapper, data, processor(), cfg, batches=batches, preprocess_cfg=pre)
    index_dir = work / "index"
    shutil.move(str(cfg.partial_run_path), str(index_dir))
    faiss_cfg = None
    if faiss:
        _faiss_cpu_shim()
        faiss_cfg = FaissConfig(index_factory="Flat")  # exact inner product; "IVF...,SQfp16" etc. for ANN
    # The stored rows are already preconditioned and unit-normalised (Builder), so the Attributor
    # gets no hessian_path (it would apply H^-1/2 to them a second time; and its FAISS build
    # normalises *before* preconditioning); unit_norm=True just normalises the query.
    att = Attributor(index_dir, device="cpu", unit_norm=unit_norm, faiss_cfg=faiss_cfg)
    precond = (load_preconditioner(hess_dir, inversion_cfg=inversion, power=-0.5 if unit_norm else -1.0)
               if hess_dir else None)  # the same H^-1/2 (or H^-1) for the query side
    fit_s = time.perf_counter() - t0

    def score(ds: TokenDataset, idx: list[int]) -> np.ndarray:
        coll = TraceCollector(model=wrapper, processor=att.processor, device="cpu", dtype=torch.float32)
        with coll:
            out = wrapper.model(ds.input_ids[idx])
            summed_ce(out.logits, ds.labels[idx]).backward()  # per-query grads: hooks are per example
        wrapper.zero_grad(set_to_none=True)
        q = {name: torch.cat(coll.mod_grads[name], dim=1) for name in att.ordered_modules}
        if precond is not None:
            q = precond.apply(q)
        vals, rows = att.search(q, k=None)  # all rows, best first
        s = np.zeros((len(idx), att.N), dtype=np.float32)
        np.put_along_axis(s, np.asarray(rows, dtype=np.int64), np.asarray(vals, dtype=np.float32), axis=1)
        return s

    t0 = time.perf_counter()
    scores = np.concatenate([score(queries, list(range(s, min(s + query_batch_size, len(queries)))))
                             for s in range(0, len(queries), query_batch_size)])
    score_s = time.perf_counter() - t0
    info = json.loads((index_dir / "info.json").read_text())
    grad_bytes = (index_dir / "gradients.bin").stat().st_size
    out = {"scores": scores, "fit_seconds": fit_s, "score_seconds": score_s, "query_batch_size": query_batch_size,
           "bytes_per_train_example": grad_bytes // len(train), "store_dim": sum(info["grad_sizes"].values()),
           "store_dtype": info["base_dtype"], "modules": list(info["grad_sizes"]), "projection_dim": projection_dim,
           "optimizer": optimizer, "hessian": hessian, "unit_norm": unit_norm, "faiss": faiss}
    if faiss:
        fdir = next(index_dir.glob("faiss_*"))
        out["faiss_bytes_per_train_example"] = sum(f.stat().st_size for f in fdir.glob("*.faiss")) // len(train)
    if single_queries:
        ts, diff = [], 0.0
        for i in range(min(single_queries, len(queries))):
            t0 = time.perf_counter()
            one = score(queries, [i])
            ts.append(time.perf_counter() - t0)
            diff = max(diff, float(np.abs(one[0] - scores[i]).max()))
        out.update(single_seconds=ts, single_seconds_per_query=float(np.median(ts)), single_max_abs_diff=diff)
    return out


# --------------------------------------------------------------------------- tiny smoke test
def _smoke() -> None:
    """20 training sequences of the bench_lds index, 2 of its queries; rows 3 and 11 are queries 0
    and 1 verbatim (same inputs and target positions), row 15 is query 1's full text with every
    token a target."""
    from bench._common import index_sequences
    from prism_tda.model import checkpoint as ckpt

    torch.set_num_threads(1)
    root = Path(__file__).resolve().parents[2] / "runs/bench_lds"
    model, _, _ = ckpt.load_checkpoint(root / "model")
    block = model.cfg.block_size
    qs = json.loads((root / "queries.json").read_text())[:2]
    queries = TokenDataset.from_queries([(q["prompt_ids"], q["completion_ids"]) for q in qs], block)
    seqs = index_sequences(root / "index")
    ins, tgts = seqs["token_ids"][:20], seqs["target_ids"][:20]
    for row, q in ((3, 0), (11, 1)):
        n = int(queries.mask[q].sum())
        ins[row], tgts[row] = queries.input_ids[q, :n].tolist(), queries.labels[q, :n].tolist()
    full = qs[1]["prompt_ids"] + qs[1]["completion_ids"]
    ins[15], tgts[15] = full[:-1], full[1:]
    train = TokenDataset.from_sequences(ins, tgts, block)
    for kw in ({}, {"faiss": True, "single_queries": 2}, {"optimizer": None, "hessian": False}):
        r = bergson_scores(model, train, queries, Path("/tmp/bergson_smoke"), checkpoint=root / "model",
                           batch_size=8, **kw)
        s = r.pop("scores")
        print(kw, s.shape, "argmax:", s.argmax(1).tolist(), "top:", np.round(s.max(1), 4).tolist(),
              "q1 rank of row 15:", int((s[1] > s[1, 15]).sum()),
              {k: v for k, v in r.items() if k != "modules"})


if __name__ == "__main__":
    _smoke()
