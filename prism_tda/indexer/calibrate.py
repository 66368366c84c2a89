"""Calibration: one forward pass over a sample of the corpus fixes what every shard shares
(``engine/calibration.py``): the index curvature, the token-vector codec, the posting cells, the
activation scale, the FAISS spec and its trained template.

The sample takes documents in turn from up to ``MAX_SAMPLED_UNITS`` work units spread over the
corpus (a unit is read from its start, so sampling reads only a little of each), until it has
``index.calibration_tokens`` tokens or the corpus ends.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch
from tokenizers import Tokenizer

from prism_tda.corpus import CorpusStats, WorkUnit, read_unit
from prism_tda.engine.calibration import IndexCalibration
from prism_tda.engine.codec import TokenCodec
from prism_tda.engine.curvature import CurvatureStats, finalize, fit_basis, mean_eigenvalue
from prism_tda.engine.layout import FAISS_TEMPLATE, Calibration, IndexConfig
from prism_tda.engine.sketch import Sketch, embed_sequences, normalise
from prism_tda.engine.tokens import run_batch
from prism_tda.model import PRISM
from prism_tda.model.tokenizer import eos_id

log = logging.getLogger(__name__)

MAX_SAMPLED_UNITS = 64
FLAT_MAX_SEQUENCES = 4096  # "auto": exact search up to this many sequences, IVF-PQ beyond
TRAIN_PER_LIST = 16  # "auto": calibration sequences per IVF list, at least


def windows(ids: list[int], eos: int, block: int, stride: int) -> list[tuple[int, list[int], list[int]]]:
    """(start, tokens, next-token targets) windows over one document; the last target is EOS."""
    targets = ids[1:] + [eos]
    out = []
    for start in range(0, len(ids), stride):
        out.append((start, ids[start : start + block], targets[start : start + block]))
        if start + block >= len(ids):
            break
    return out


@dataclass
class Sample:
    tokens: list[list[int]]
    targets: list[list[int]]
    n_tokens: int
    n_bytes: int  # text bytes of the sampled documents


def sample_windows(units: list[WorkUnit], tokenizer: Tokenizer, block: int, stride: int, n_tokens: int) -> Sample:
    """Windows of documents taken in turn from spread-out units, then put in corpus order: a sample that
    covers the whole corpus is the same however the corpus is cut into units."""
    step = max(1, len(units) // MAX_SAMPLED_UNITS)
    readers = [(j, read_unit(u, CorpusStats())) for j, u in enumerate(units[::step][:MAX_SAMPLED_UNITS])]
    eos = eos_id(tokenizer)
    taken: list[tuple[tuple[int, int], list[list[int]], list[list[int]]]] = []
    n_taken = [0] * len(readers)
    s = Sample([], [], 0, 0)
    while readers and s.n_tokens < n_tokens:
        alive = []
        for j, r in readers:
            docs = list(islice(r, 8))
            if not docs:
                continue
            alive.append((j, r))
            for doc, enc in zip(docs, tokenizer.encode_batch([d.text for d in docs]), strict=True):
                s.n_bytes += doc.nbytes or len(doc.text.encode())
                w = windows(enc.ids or [eos], eos, block, stride)
                taken.append(((j, n_taken[j]), [t for _, t, _ in w], [y for _, _, y in w]))
                n_taken[j] += 1
                s.n_tokens += sum(len(t) for _, t, _ in w)
            if s.n_tokens >= n_tokens:
                break
        readers = alive
    for _, r in readers:
        with contextlib.suppress(Exception):
            r.close()  # type: ignore[attr-defined]  # a generator
    for _, toks, tgts in sorted(taken, key=lambda x: x[0]):
        s.tokens += toks
        s.targets += tgts
    return s


def faiss_spec(cfg: IndexConfig, n_seqs: int, dim: int, n_train: int) -> tuple[str, int]:
    """(factory string, nprobe) for an index of about ``n_seqs`` sequences whose template is trained on
    ``n_train`` sequences: IVF lists about ``4 sqrt(n_seqs)``, as many as the sample trains (at least
    ``TRAIN_PER_LIST`` points each), a sixteenth of them probed; product-quantised codes of 1 byte per
    32 dimensions."""
    if cfg.faiss_spec != "auto":
        m = re.search(r"IVF(\d+)", cfg.faiss_spec)
        return cfg.faiss_spec, max(1, int(m.group(1)) // 16) if m else 1
    if n_seqs <= FLAT_MAX_SEQUENCES:
        return "IDMap,Flat", 1
    want = min(4 * math.sqrt(n_seqs), n_train / TRAIN_PER_LIST, 1 << 16)
    nlist = 2 ** max(4, int(math.log2(max(want, 1))))
    # "np": no polysemous training (a permutation of the codes for Hamming-distance filtering, which the
    # search never uses: polysemous_ht stays 0), by far the longest part of training the template
    return f"IVF{nlist},PQ{max(8, dim // 32)}np", max(1, nlist // 16)


def calibrate(model: PRISM, tokenizer: Tokenizer, units: list[WorkUnit], cfg: IndexConfig, out: Path, *,
              device: torch.device | str = "cpu", autocast: contextlib.AbstractContextManager | None = None,
              codec_iters: int = 12) -> tuple[IndexCalibration, Calibration]:
    """Fit the calibration on a sample of ``units``; write the FAISS template beside the index.
    ``codec_iters``: k-means iterations of the codebooks (the dry-run estimate, which needs codes of
    the right size but not good ones, takes one)."""
    import faiss

    t0 = time.perf_counter()
    mc = model.cfg
    K, d = mc.n_prototypes, mc.d_model
    stride = cfg.stride or mc.block_size
    s = sample_windows(units, tokenizer, mc.block_size, stride, cfg.calibration_tokens)
    if not s.tokens:
        raise ValueError("the corpus has no document to calibrate on")
    # one forward pass; the per-token quantities are kept (fp16 token vectors) for the fits below
    stats = CurvatureStats(K, d)
    us, acts, protos, tgts, seq_of = [], [], [], [], []
    for b in range(0, len(s.tokens), cfg.batch_size):
        tb = run_batch(model, s.tokens[b : b + cfg.batch_size], s.targets[b : b + cfg.batch_size], device=device,
                       autocast=autocast)
        stats.add(tb, tb.u)  # S = sum u u^T (the corrections are refitted in the basis below)
        us.append(tb.u.half().cpu())
        acts.append(tb.acts.cpu())
        protos.append(tb.proto_idx.cpu())
        tgts.append(tb.targets.cpu())
        seq_of.append(tb.row.cpu() + b)
    Q, _ = fit_basis(stats.S)
    u = torch.cat(us).float()
    ut = u @ Q  # (N, d) Q^T u_t
    a, p, y = torch.cat(acts), torch.cat(protos), torch.cat(tgts)
    lam = torch.zeros(K, d, dtype=torch.float64)
    for j in range(a.shape[1]):
        lam.index_add_(0, p[:, j], (a[:, j : j + 1].double() ** 2) * ut.double() ** 2)
    count = torch.bincount(p[a > 0], minlength=K).double()
    curv = finalize(Q, lam, count, len(u), cfg.damping, cfg.damping_scope)
    # D^{-1/2}, over blocks: the codec's scale, at the index's multiplier of the global mean eigenvalue
    scale = (curv.lam.mean(0) + cfg.damping * mean_eigenvalue(curv.lam, count)).rsqrt()
    W = model.W.detach().float().cpu()
    codec = TokenCodec.train(ut + W[y] @ Q, scale, W, Q, n_sub=cfg.code_subquantizers, bits=cfg.code_bits,
                             seed=cfg.seed, u=ut, iters=codec_iters)
    n_cells = max(1, min(cfg.posting_cells, len(u) // 8))
    x = normalise((ut * scale).numpy())
    km = faiss.Kmeans(d, n_cells, niter=20, seed=cfg.seed, spherical=True, max_points_per_centroid=256)
    km.train(x)
    assert km.centroids is not None
    cells = torch.from_numpy(normalise(km.centroids))
    # activation scale per prototype: log range of the sample's activations (all sample, if unseen)
    log_a = torch.log(a[a > 0].float())
    glo, ghi = float(log_a.min()) if len(log_a) else -10.0, float(log_a.max()) if len(log_a) else 3.0
    act_lo = torch.full((K,), glo)
    act_hi = torch.full((K,), ghi)
    flat_p, flat_a = p[a > 0], torch.log(a[a > 0].float())
    for k in torch.unique(flat_p).tolist():
        v = flat_a[flat_p == k]
        if len(v) >= 16:
            act_lo[k], act_hi[k] = min(float(v.min()), ghi - 1e-3), max(float(v.max()), glo + 1e-3)
    act_lo, act_hi = act_lo - 0.05, act_hi + 0.05  # headroom for values beyond the sample's
    calib = IndexCalibration(curv, codec.centroids, scale, cfg.code_bits, cells, act_lo, act_hi, codec.dir_centroids)
    # FAISS: choose by the corpus's estimated size; train the template on the sample's embeddings
    sketch = Sketch(K, d, cfg.embed_dim, cfg.sketch_buckets, cfg.seed)
    tok, slot = (a > 0).nonzero(as_tuple=True)
    e = embed_sequences(sketch, torch.cat(seq_of)[tok], p[tok, slot], a[tok, slot], tok, ut, curv.inv_sqrt(),
                        len(s.tokens)).numpy()
    corpus_bytes = sum(unit.bytes for unit in units)
    est_tokens = int(corpus_bytes * s.n_tokens / max(s.n_bytes, 1))
    est_seqs = int(est_tokens * len(s.tokens) / max(s.n_tokens, 1))
    spec, nprobe = faiss_spec(cfg, est_seqs, sketch.dim, len(e))
    template = faiss.index_factory(sketch.dim, spec, faiss.METRIC_INNER_PRODUCT)
    if not template.is_trained:
        with contextlib.suppress(RuntimeError):  # a small sample is what it is: no k-means warnings
            ivf = faiss.downcast_index(faiss.extract_index_ivf(template))
            ivf.cp.min_points_per_centroid = 1  # type: ignore[attr-defined]
            if hasattr(ivf, "pq"):
                ivf.pq.cp.min_points_per_centroid = 1
        template.train(normalise(e))
    tmp = out / ".faiss_template.index.tmp"
    faiss.write_index(template, str(tmp))
    tmp.replace(out / FAISS_TEMPLATE)
    info = Calibration(tokens=s.n_tokens, sequences=len(s.tokens), estimated_tokens=est_tokens, faiss_spec=spec,
                       faiss_nprobe=nprobe, seconds=round(time.perf_counter() - t0, 3))
    log.info("calibrated", extra={"tokens": s.n_tokens, "estimated_corpus_tokens": est_tokens, "faiss": spec})
    return calib, info
