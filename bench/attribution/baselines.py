"""Baseline attribution methods on the same PRISM model: EK-FAC influence (kronfluence), TRAK (traker)
and BM25 (rank-bm25).

Training examples are the indexed sequences (what PRISM scores too); queries are (prompt, completion)
token lists whose completion tokens are the targets. Scores are (n_queries, n_train_sequences),
positive = the training example lowers the query's loss.

Installing (they stay out of the product's dependencies)::

    pip install --no-deps kronfluence==1.0.1 traker==0.3.2
    pip install accelerate einops einconv opt-einsum rank-bm25

(kronfluence declares torchvision, which would replace the CPU torch; it never imports it.)
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

IGNORE = -100


class TokenDataset(Dataset):
    """Fixed-length (input_ids, labels) pairs; labels are IGNORE outside the targets and on padding."""

    def __init__(self, inputs: list[list[int]], labels: list[list[int]], length: int) -> None:
        n = len(inputs)
        self.input_ids = torch.zeros(n, length, dtype=torch.long)
        self.labels = torch.full((n, length), IGNORE, dtype=torch.long)
        self.mask = torch.zeros(n, length, dtype=torch.long)
        for i, (x, y) in enumerate(zip(inputs, labels, strict=True)):
            self.input_ids[i, : len(x)] = torch.tensor(x)
            self.labels[i, : len(y)] = torch.tensor(y)
            self.mask[i, : len(x)] = 1

    @classmethod
    def from_sequences(cls, token_ids: list[list[int]], target_ids: list[list[int]], length: int) -> TokenDataset:
        return cls(token_ids, target_ids, length)

    @classmethod
    def from_queries(cls, queries: list[tuple[list[int], list[int]]], length: int) -> TokenDataset:
        """(prompt ids, completion ids) -> inputs ids[:-1], labels = completion tokens only."""
        inputs, labels = [], []
        for p, c in queries:
            ids = p + c
            inputs.append(ids[:-1])
            labels.append([IGNORE] * (len(p) - 1) + c)
        return cls(inputs, labels, length)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i], "attention_mask": self.mask[i]}


def summed_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")


@torch.no_grad()
def query_losses(model, ds: TokenDataset) -> np.ndarray:
    """Mean cross-entropy over each query's target tokens."""
    model.eval()
    logits = model(ds.input_ids).logits
    ce = F.cross_entropy(logits.float().transpose(1, 2), ds.labels, ignore_index=IGNORE, reduction="none")
    n = (ds.labels != IGNORE).sum(1).clamp(min=1)
    return (ce.sum(1) / n).numpy()


# --------------------------------------------------------------------------- EK-FAC (kronfluence)
#: EK-FAC's damping grid on the tuning split: the same multiples of the mean eigenvalue as PRISM's
#: (kronfluence's heuristic damping with its scale set to each), and kronfluence's default (1e-8, absolute)
EKFAC_DAMPING_SCALES = (0.01, 0.03, 0.1, 0.3, 1.0)


def ekfac_analyzer(model, work: Path):
    """kronfluence's analyzer of ``model`` (next-token cross-entropy summed over the labelled tokens),
    storing its factors and scores under ``work``: factors fitted by one call are read by later ones."""
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.task import Task

    class LMTask(Task):
        def compute_train_loss(self, batch, model, sample: bool = False) -> torch.Tensor:
            logits = model(batch["input_ids"]).logits
            labels = batch["labels"]
            if sample:  # labels drawn from the model's own predictive distribution (true Fisher)
                with torch.no_grad():
                    probs = torch.softmax(logits.detach().float(), -1)
                    drawn = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).reshape(labels.shape)
                    labels = torch.where(labels == IGNORE, labels, drawn)
            return summed_ce(logits, labels)

        def compute_measurement(self, batch, model) -> torch.Tensor:
            return summed_ce(model(batch["input_ids"]).logits, batch["labels"])

        def get_attention_mask(self, batch):
            return batch["attention_mask"]

    logging.getLogger("kronfluence").setLevel(logging.WARNING)
    model.eval()
    model = prepare_model(model, LMTask())
    analyzer = Analyzer("prism", model, LMTask(), cpu=True, output_dir=str(work), disable_tqdm=True)
    return analyzer


def ekfac_scores(model, train: TokenDataset, queries: TokenDataset, work: Path, *, batch_size: int = 16,
                 query_batch_size: int = 64, single_queries: int = 0,
                 damping_scales: tuple[float, ...] = ()) -> dict:
    """Fit EK-FAC factors on the training sequences, then score every (query, sequence) pair.

    kronfluence makes one pass over the training gradients per batch of queries, so its time per
    query depends on how many queries share a pass: ``query_batch_size`` for the scores returned;
    with ``single_queries``, the first that many queries are also scored one per pass (as a served
    index answers them), timed apart (``single_seconds_per_query``)."""
    from kronfluence.arguments import FactorArguments, ScoreArguments

    analyzer = ekfac_analyzer(model, work)
    t0 = time.perf_counter()
    analyzer.fit_all_factors("ekfac", train, per_device_batch_size=batch_size,
                             factor_args=FactorArguments(strategy="ekfac"), overwrite_output_dir=True)
    fit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    analyzer.compute_pairwise_scores("scores", "ekfac", queries, train, per_device_query_batch_size=query_batch_size,
                                     per_device_train_batch_size=batch_size, score_args=ScoreArguments(),
                                     overwrite_output_dir=True)
    score_s = time.perf_counter() - t0
    scores = analyzer.load_pairwise_scores("scores")["all_modules"].float().numpy()
    out = {"scores": scores, "fit_seconds": fit_s, "score_seconds": score_s, "query_batch_size": query_batch_size}
    if single_queries:
        from torch.utils.data import Subset

        ts = []
        for i in range(min(single_queries, len(queries))):
            t0 = time.perf_counter()
            analyzer.compute_pairwise_scores(f"single_{i}", "ekfac", Subset(queries, [i]), train,
                                             per_device_query_batch_size=1, per_device_train_batch_size=batch_size,
                                             score_args=ScoreArguments(), overwrite_output_dir=True)
            ts.append(time.perf_counter() - t0)
            one = analyzer.load_pairwise_scores(f"single_{i}")["all_modules"].float().numpy()
            out.setdefault("single_max_abs_diff", 0.0)
            out["single_max_abs_diff"] = max(out["single_max_abs_diff"], float(np.abs(one[0] - scores[i]).max()))
        out["single_seconds"] = ts
        out["single_seconds_per_query"] = float(np.median(ts))
    if damping_scales:  # the same factors, scored again at damping = scale x each module's mean eigenvalue
        import kronfluence.factor.config as kcfg

        default_scale = kcfg.HEURISTIC_DAMPING_SCALE
        out["scores_by_damping"] = {}
        try:
            for c in damping_scales:
                kcfg.HEURISTIC_DAMPING_SCALE = c
                analyzer.compute_pairwise_scores(f"scores_d{c:g}", "ekfac", queries, train,
                                                 per_device_query_batch_size=query_batch_size,
                                                 per_device_train_batch_size=batch_size,
                                                 score_args=ScoreArguments(damping_factor=None), overwrite_output_dir=True)
                out["scores_by_damping"][c] = analyzer.load_pairwise_scores(f"scores_d{c:g}")["all_modules"].float().numpy()
        finally:
            kcfg.HEURISTIC_DAMPING_SCALE = default_scale
    # kronfluence scores are grad_q^T H^-1 grad_x of the losses; + means x lowers the query's loss
    return out


# --------------------------------------------------------------------------- TRAK (traker)
def trak_scores(model, train: TokenDataset, queries: TokenDataset, work: Path, *, proj_dim: int = 512,
                batch_size: int = 16) -> dict:
    """TRAK with one checkpoint, per-sample gradients of all parameters, a dense JL projection on CPU."""
    from trak import TRAKer
    from trak.gradient_computers import IterativeGradientComputer
    from trak.modelout_functions import AbstractModelOutput
    from trak.projectors import BasicProjector, ProjectionType

    class LMOutput(AbstractModelOutput):
        """Model output = summed log-odds of the target tokens (TRAK's margin, per token)."""

        def __init__(self) -> None:
            super().__init__()

        def get_output(self, model, weights, buffers, input_ids, labels, attention_mask):
            logits = model(input_ids).logits.float()
            logp = torch.log_softmax(logits, -1)
            m = labels != IGNORE
            lp = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            margin = lp - torch.log1p(-lp.exp().clamp(max=1 - 1e-6))
            return (margin * m).sum(1)

        def get_out_to_loss_grad(self, model, weights, buffers, batch):
            input_ids, labels, _ = batch
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids).logits.float(), -1)
                m = labels != IGNORE
                p = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1).exp()
                return (((1 - p) * m).sum(1) / m.sum(1).clamp(min=1)).unsqueeze(-1)

    class GradientComputer(IterativeGradientComputer):
        """Per-sample gradients one sample at a time; parameters a sample does not reach get zeros."""

        def compute_per_sample_grad(self, batch):
            margin = self.modelout_fn.get_output(self.model, None, None, *batch)
            grads = torch.zeros(len(margin), self.grad_dim)
            for i in range(len(margin)):
                g = torch.autograd.grad(margin[i], self.model_params, retain_graph=True, allow_unused=True)
                grads[i] = torch.cat([(torch.zeros_like(p) if x is None else x).flatten()
                                      for p, x in zip(self.model_params, g, strict=True)])
            return grads

    class Projector(BasicProjector):
        """BasicProjector whose single-block matrix survives ``finalize_features`` (which frees it)."""

        def project(self, grads, model_id):
            if not self.proj_matrix_available:
                self.generate_sketch_matrix(self.generator_states[0])
            return super().project(grads, model_id)

    shutil.rmtree(work, ignore_errors=True)  # a fresh store: features of another model must not be reused
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    projector = Projector(n_params, proj_dim, seed=0, proj_type=ProjectionType.rademacher, device="cpu",
                          block_size=proj_dim, dtype=torch.float32)
    traker = TRAKer(model=model, task=LMOutput(), train_set_size=len(train), save_dir=str(work), device="cpu",
                    gradient_computer=GradientComputer, projector=projector, proj_dim=proj_dim,
                    use_half_precision=False, logging_level=logging.WARNING)
    t0 = time.perf_counter()
    traker.load_checkpoint(model.state_dict(), model_id=0)
    for s in range(0, len(train), batch_size):
        b = [train.input_ids[s : s + batch_size], train.labels[s : s + batch_size], train.mask[s : s + batch_size]]
        traker.featurize(batch=b, num_samples=len(b[0]))
    traker.finalize_features()
    fit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    traker.start_scoring_checkpoint(exp_name="q", checkpoint=model.state_dict(), model_id=0,
                                    num_targets=len(queries))
    for s in range(0, len(queries), batch_size):
        b = [queries.input_ids[s : s + batch_size], queries.labels[s : s + batch_size],
             queries.mask[s : s + batch_size]]
        traker.score(batch=b, num_samples=len(b[0]))
    scores = np.asarray(traker.finalize_scores(exp_name="q")).T  # (n_queries, n_train)
    score_s = time.perf_counter() - t0
    return {"scores": scores.astype(np.float32), "fit_seconds": fit_s, "score_seconds": score_s,
            "proj_dim": proj_dim, "n_params": n_params}


def score_index(method: str, index_dir: Path, queries: list[tuple[list[int], list[int]]], work: Path,
                **kw) -> dict:
    """EK-FAC, TRAK or Bergson scores of the queries ((prompt ids, completion ids)) against every
    indexed sequence, with the index's own model; adds ``seq_doc`` (each sequence's document) and
    ``model``."""

    from prism_tda.engine import layout as store
    from prism_tda.model import checkpoint as ckpt

    checkpoint = store.read_manifest(index_dir).checkpoint
    model, _, _ = ckpt.load_checkpoint(checkpoint)
    from bench._common import index_sequences

    seqs = index_sequences(index_dir)
    block = model.cfg.block_size
    train = TokenDataset.from_sequences(seqs["token_ids"], seqs["target_ids"], block)
    if method == "bergson":
        from bench.attribution.bergson_baseline import bergson_scores

        fn, kw = bergson_scores, {"checkpoint": checkpoint, "faiss": True} | kw
    else:
        fn = ekfac_scores if method == "ekfac" else trak_scores
    r = fn(model, train, TokenDataset.from_queries(queries, block), work, **kw)
    return r | {"seq_doc": np.asarray(seqs["doc_id"]), "model": model}


# --------------------------------------------------------------------------- BM25
def bm25_scores(doc_texts: list[str], query_texts: list[str]) -> dict:
    from rank_bm25 import BM25Okapi

    t0 = time.perf_counter()
    bm25 = BM25Okapi([t.lower().split() for t in doc_texts])
    fit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    scores = np.stack([bm25.get_scores(q.lower().split()) for q in query_texts])
    return {"scores": scores, "fit_seconds": fit_s, "score_seconds": time.perf_counter() - t0}
