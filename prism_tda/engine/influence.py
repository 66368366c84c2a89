"""Full-model influence of the documents an answer returns (DESIGN §2, "Values behind a ranking").

The ranking (prototype space, one forward pass per candidate) decides *which* documents drove an
output; how much each one moved it is better predicted through the whole network. For the returned
documents only, this computes the eigenvalue-corrected K-FAC (EK-FAC) influence of every
``nn.Linear`` of the backbone:

    I(q, x) = sum_l <P_l, G_l(x)>,   P_l = Q_S (Q_S^T G_l(q) Q_A / (Lambda_l + lambda_l)) Q_A^T

where ``G_l(q)`` is the gradient of the query's loss (its target tokens) with respect to layer ``l``'s
weight, ``G_l(x) = sum_t g_t a_t^T`` that of a training sequence's summed loss, ``Q_A`` and ``Q_S``
the eigenvectors of the layer's input and output-gradient covariances, ``Lambda_l`` the corrected
eigenvalues ``E_x[(Q_S^T G_l(x) Q_A)^2]`` and ``lambda_l = damping x mean(Lambda_l)``. A positive
value means training on ``x`` lowered the query's loss. The training side never forms ``G_l(x)``:
``<P, sum_t g_t a_t^T> = sum_t g_t . (P a_t)``, one backward pass per batch of sequences.

The factors are fitted once per index (``fit``: two passes with backward over a sample of the
trained sequences, labels drawn from the model's own predictions, the true Fisher) and kept beside it
in ``ekfac.safetensors``, stamped with the checkpoint they belong to.

    ek = fit(model, reader, max_sequences=8192)
    ek.save(index_dir / layout.EKFAC, checkpoint_sha)
    values = document_influence(model, ek, reader, query, docs)
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from prism_tda.errors import PrismError
from prism_tda.model import PRISM

from .arrays import index_in
from .tokens import length_batches, pad_batch

#: damping default: x each layer's mean corrected eigenvalue (chosen on the LDS tuning split,
#: docs/benchmarks.md "Full-model influence of the returned documents")
DEFAULT_DAMPING = 1e-6


def tracked(model: PRISM) -> dict[str, nn.Linear]:
    """The layers whose weights the influence goes through: every ``nn.Linear`` of the model."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


class _Capture:
    """Each tracked layer's inputs (B, T, d_in) and, after ``backward``, its output gradients (B, T, d_out),
    of the forward passes of the thread that made it. The gradients are taken with
    ``torch.autograd.grad``: nothing accumulates in the parameters' ``.grad``, so queries in other
    threads can share the model."""

    def __init__(self, layers: dict[str, nn.Linear]) -> None:
        self.a: dict[str, torch.Tensor] = {}
        self.out: dict[str, torch.Tensor] = {}
        self.g: dict[str, torch.Tensor] = {}
        # hooks belong to the shared modules: record only this thread's forward passes (a server runs
        # other queries' forwards through the same model meanwhile)
        self._thread = threading.get_ident()
        self._hooks = [m.register_forward_hook(self._hook(name)) for name, m in layers.items()]

    def _hook(self, name: str):
        def fwd(_m: nn.Module, inp: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            if threading.get_ident() == self._thread:
                self.a[name], self.out[name] = inp[0].detach(), out
        return fwd

    def backward(self, loss: torch.Tensor) -> None:
        names = list(self.out)
        grads = torch.autograd.grad(loss, [self.out[n] for n in names], allow_unused=True)
        self.g = {n: torch.zeros_like(self.out[n]) if g is None else g.detach()
                  for n, g in zip(names, grads, strict=True)}
        self.out = {}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


@contextlib.contextmanager
def captured(model: PRISM) -> Iterator[_Capture]:
    cap = _Capture(tracked(model))
    try:
        yield cap
    finally:
        cap.close()


def _loss(model: PRISM, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
          generator: torch.Generator | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy over the ``mask``ed positions; with ``generator``, against labels
    drawn from the model's own predictive distribution (the true Fisher's)."""
    logits = model(x).logits.float()  # (B, T, V)
    if generator is not None:
        with torch.no_grad():
            probs = torch.softmax(logits.detach(), -1).reshape(-1, logits.shape[-1])
            y = torch.multinomial(probs, 1, generator=generator).reshape(y.shape)
    # the unmasked positions ignored rather than indexed out: a boolean index of the (B, T, V) logits
    # copies them, and its backward scatters into a zeroed (B, T, V) tensor, a fifth of the option's
    # time (docs/benchmarks.md, "The `influence` option without a boolean index into the logits")
    return F.cross_entropy(logits.flatten(0, 1), torch.where(mask, y, -100).flatten(), ignore_index=-100,
                           reduction="sum")


@dataclass
class EKFAC:
    """Per tracked layer: eigenvectors of the input (``qa``, d_in x d_in) and output-gradient (``qs``,
    d_out x d_out) covariances and the corrected eigenvalues (``lam``, d_out x d_in)."""

    qa: dict[str, torch.Tensor]
    qs: dict[str, torch.Tensor]
    lam: dict[str, torch.Tensor]
    n_sequences: int
    checkpoint_sha256: str = ""

    def precondition(self, grads: dict[str, torch.Tensor], damping: float = DEFAULT_DAMPING) -> dict[str, torch.Tensor]:
        """``(F + lambda)^-1 G`` per layer, F the EK-FAC Fisher, ``lambda`` = ``damping`` x the layer's mean
        corrected eigenvalue."""
        out = {}
        for name, G in grads.items():
            qa, qs, lam = self.qa[name], self.qs[name], self.lam[name]
            R = qs.T @ G.to(qa.dtype) @ qa  # in the factors' precision (float32 as fitted)
            out[name] = (qs @ (R / (lam + damping * lam.mean())) @ qa.T).float()
        return out

    def save(self, path: Path, checkpoint_sha256: str) -> None:
        from safetensors.torch import save_file

        t = {f"{k}.{name}": v.contiguous() for k, d in (("qa", self.qa), ("qs", self.qs), ("lam", self.lam))
             for name, v in d.items()}
        tmp = path.with_suffix(".tmp")
        save_file(t, str(tmp), metadata={"n_sequences": str(self.n_sequences), "checkpoint_sha256": checkpoint_sha256,
                                         "layers": json.dumps(sorted(self.qa))})
        tmp.replace(path)  # whole or absent

    @staticmethod
    def stamp(path: Path) -> str:
        """The checkpoint a stored curvature was fitted for (its header only)."""
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get("checkpoint_sha256", "")

    @classmethod
    def load(cls, path: Path) -> EKFAC:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            parts: dict[str, dict[str, torch.Tensor]] = {"qa": {}, "qs": {}, "lam": {}}
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                kind, name = key.split(".", 1)
                parts[kind][name] = f.get_tensor(key)
        return cls(parts["qa"], parts["qs"], parts["lam"], int(meta.get("n_sequences", 0)),
                   meta.get("checkpoint_sha256", ""))


def _batches(reader, seqs: np.ndarray, batch_tokens: int):
    """(x, y, mask, at) of the sequences ``seqs`` in batches of similar lengths; ``at`` their indices."""
    spans = [reader.seq_span(int(s)) for s in seqs]
    lens = np.array([hi - lo for lo, hi, _ in spans], dtype=np.int64)
    for at in length_batches(lens, batch_tokens):
        at = np.sort(at)
        toks, tgts = zip(*(reader.sequence_tokens(int(s)) for s in seqs[at]), strict=True)
        x, y, mask = pad_batch(list(toks), list(tgts))
        yield x, y, mask, at


def fit(model: PRISM, reader, *, max_sequences: int = 8192, batch_size: int = 16, seed: int = 0,
        sample: bool = True, progress: bool = False) -> EKFAC:
    """EK-FAC factors of ``model`` on up to ``max_sequences`` of the index's trained sequences (a seeded
    sample when there are more): one pass for the covariances, one for the corrected eigenvalues, both
    with labels drawn from the model (the true Fisher; ``sample=False``: the sequences' own next tokens,
    the empirical Fisher)."""
    from tqdm import tqdm

    model.eval()
    all_seqs = np.arange(reader.n_seqs)
    trained = reader.trained(reader.doc_of_seqs(all_seqs))
    seqs = all_seqs[trained] if trained.any() else all_seqs
    rng = np.random.default_rng(seed)
    if len(seqs) > max_sequences:
        seqs = np.sort(rng.choice(seqs, max_sequences, replace=False))
    if not len(seqs):
        raise PrismError(f"{reader.dir}: no sequences to fit the influence curvature on")
    gen = torch.Generator().manual_seed(seed) if sample else None
    layers = tracked(model)
    A = {n: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for n, m in layers.items()}
    S = {n: torch.zeros(m.out_features, m.out_features, dtype=torch.float64) for n, m in layers.items()}
    block = model.cfg.block_size
    bar = tqdm(total=2 * len(seqs), desc="influence curvature", unit="seq", disable=not progress)
    with captured(model) as cap, torch.enable_grad():
        for x, y, mask, at in _batches(reader, seqs, batch_size * block):
            cap.backward(_loss(model, x, y, mask, gen))
            w = mask.double()[..., None]
            for n in layers:
                a, g = cap.a[n].double() * w, cap.g[n].double() * w
                A[n] += a.flatten(0, 1).T @ a.flatten(0, 1)
                S[n] += g.flatten(0, 1).T @ g.flatten(0, 1)
            bar.update(len(at))
        qa = {n: torch.linalg.eigh(A[n])[1] for n in layers}
        qs = {n: torch.linalg.eigh(S[n])[1] for n in layers}
        lam = {n: torch.zeros(m.out_features, m.in_features, dtype=torch.float64) for n, m in layers.items()}
        for x, y, mask, at in _batches(reader, seqs, batch_size * block):
            cap.backward(_loss(model, x, y, mask, gen))
            w = mask.double()[..., None]
            for n in layers:
                G = torch.einsum("btj,bti->bji", cap.g[n].double() * w, cap.a[n].double())  # per sequence
                lam[n] += ((qs[n].T @ G @ qa[n]) ** 2).sum(0)
            bar.update(len(at))
    bar.close()
    # kept and stored in float32 (eigenvectors to ~1e-7; half the bytes of float64)
    return EKFAC({n: v.float() for n, v in qa.items()}, {n: v.float() for n, v in qs.items()},
                 {n: (v / len(seqs)).float() for n, v in lam.items()}, len(seqs))


def query_gradient(model: PRISM, token_ids: list[int], target_positions: list[int],
                   target_ids: list[int]) -> dict[str, torch.Tensor]:
    """Per tracked layer, the gradient of the query's summed loss on its target tokens (d_out, d_in)."""
    end = max(target_positions) + 1
    x = torch.tensor([token_ids[:end]])
    y = torch.zeros_like(x)
    mask = torch.zeros_like(x, dtype=torch.bool)
    y[0, target_positions] = torch.tensor(target_ids)
    mask[0, target_positions] = True
    with captured(model) as cap, torch.enable_grad():
        cap.backward(_loss(model, x, y, mask))
        grads = {n: cap.g[n][0].double().T @ cap.a[n][0].double() for n in cap.a}
    return {n: g.float() for n, g in grads.items()}


def sequence_influence(model: PRISM, P: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]], reader,
                       seqs: np.ndarray, batch_size: int = 32) -> np.ndarray:
    """``I(q, x)`` for each sequence of ``seqs``, given the query's preconditioned gradient ``P`` (n,);
    given a list of them (several dampings or queries), one row each from the same passes (len(P), n)."""
    Ps = P if isinstance(P, list) else [P]
    out = np.zeros((len(Ps), len(seqs)))
    block = model.cfg.block_size
    with captured(model) as cap, torch.enable_grad():
        for x, y, mask, at in _batches(reader, np.asarray(seqs, np.int64), batch_size * block):
            cap.backward(_loss(model, x, y, mask))
            for i, Pi in enumerate(Ps):
                tot = torch.zeros(len(at), dtype=torch.float64)
                for n, p in Pi.items():
                    tot += ((cap.a[n] @ p.T) * cap.g[n]).double().sum((1, 2))  # sum_t g_t . (P a_t)
                out[i, at] = tot.numpy()
    return out if isinstance(P, list) else out[0]


def document_sequences(reader, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(every sequence of the documents ``docs``, each one's document); a reader of shards held elsewhere
    fetches their windows at once."""
    seqs = reader.sequences_of_documents(np.asarray(docs, np.int64))
    reader.prefetch(seqs)
    return seqs, reader.doc_of_seqs(seqs)


def document_influence(model: PRISM, ek: EKFAC, reader, token_ids: list[int], target_positions: list[int],
                       target_ids: list[int], docs: np.ndarray, damping: float | list[float] = DEFAULT_DAMPING
                       ) -> np.ndarray:
    """Each document's influence on the query: the sum over its sequences (every window the model
    trained on); (n_docs,), or (len(damping), n_docs) for a list of dampings."""
    docs = np.asarray(docs, np.int64)
    many = isinstance(damping, list)
    damps = damping if isinstance(damping, list) else [damping]
    if not len(docs):
        return np.zeros((len(damps), 0)) if many else np.zeros(0)
    G = query_gradient(model, token_ids, target_positions, target_ids)
    seqs, of = document_sequences(reader, docs)
    per_seq = sequence_influence(model, [ek.precondition(G, d) for d in damps], reader, seqs)
    per_doc = np.zeros((len(damps), len(docs)))
    np.add.at(per_doc.T, index_in(docs, of), per_seq.T)
    return per_doc if many else per_doc[0]


def fit_index(index_dir: str | Path, *, max_sequences: int = 8192, seed: int = 0, progress: bool = False) -> dict:
    """Fit the influence curvature of a complete index with its own checkpoint and write it beside the
    index (``layout.EKFAC``, replaced whole); returns what was fitted."""
    import time

    from prism_tda.model import checkpoint as ckpt

    from . import layout
    from .reader import IndexReader
    from .reads import read_complete_manifest

    index_dir = Path(index_dir)
    manifest = read_complete_manifest(index_dir)
    model, _, _ = ckpt.load_checkpoint(manifest.checkpoint)
    reader = IndexReader(index_dir)
    t0 = time.perf_counter()
    try:
        ek = fit(model, reader, max_sequences=max_sequences, seed=seed, progress=progress)
    finally:
        reader.close()
    ek.save(index_dir / layout.EKFAC, manifest.identity["checkpoint_sha256"])
    return {"index": str(index_dir), "file": layout.EKFAC, "sequences": ek.n_sequences,
            "layers": sorted(ek.qa), "seconds": round(time.perf_counter() - t0, 1)}


def fitted_for(index_dir: str | Path) -> bool:
    """Whether the index holds an influence curvature fitted for its own checkpoint."""
    from . import layout

    path = Path(index_dir) / layout.EKFAC
    if not path.exists():
        return False
    manifest = layout.read_manifest(Path(index_dir))
    return manifest is not None and EKFAC.stamp(path) == manifest.identity["checkpoint_sha256"]
