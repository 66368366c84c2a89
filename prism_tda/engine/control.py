"""Sparse prototype controllers: a learned strength per prototype, fitted on a labelled task.

A controller is a vector ``alpha`` over the prototype bank (1: untouched). At inference every active
prototype's activation is multiplied by its alpha before mixing (``PRISM.forward(suppress=ids,
alpha=...)``): ``l_t = W z_t + sum_{i in K_t} (alpha_i - 1) a_{t,i} W p_i``. The active sets, the
backbone and the residual are the model's own, so a controller re-weights what the model already
does on a token, never adds a direction it does not use there, keeps every activation non-negative
(``alpha >= 0``) and keeps the logit decomposition exact; each weight names a prototype whose
training contexts explain it.

**The task.** Multiple choice from text the model has seen (``choice_items``): a document's opening
and four candidate endings of the same number of tokens, its own and three of other documents. An
ending's score is the log-probability the model gives its tokens after the opening; the answer is the
best-scoring ending.

**The fit** (``fit``): ``alpha = 1 + c`` with ``c`` L1-penalised (sparse) and ``c >= -1``, by proximal
gradient descent on the softmax over the four endings' mean log-probabilities per token of each
training item (cross-entropy on the true one); ``l1`` is relative to the largest gradient at ``c = 0``. The
backbone does not change with ``c``, so every ending token's final hidden state and active prototypes
are computed once (``ChoiceCache``) and the fit touches only the head's mixing and the unembedding.

**The baseline** (``fit_random``): a controller of the same size on random directions of the final
hidden state (``z + R diag(w) R^T z``, ``R`` orthonormal, ``w >= -1``), fitted the same way: what the
same number of free weights does without the prototypes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from prism_tda.errors import QueryError
from prism_tda.model import PRISM

from .tokens import run_batch

N_CHOICES = 4


@dataclass
class ChoiceItem:
    """One question: an opening and its candidate endings (token ids); ``answer`` indexes the true one."""

    context: list[int]
    endings: list[list[int]]
    answer: int
    source: int = -1  # the document the opening came from


def choice_items(texts: list[list[int]], *, ending_tokens: int, min_context: int, max_context: int,
                 seed: int = 0, n_choices: int = N_CHOICES) -> list[ChoiceItem]:
    """Items from tokenised documents long enough for an opening of ``min_context`` tokens and an ending
    of ``ending_tokens``: the opening is the document's tokens before its last ``ending_tokens`` (its last
    ``max_context`` of them), the distractors the endings of other such documents, drawn at random
    (seeded), with the true ending at a random place."""
    rng = np.random.default_rng(seed)
    usable = [i for i, t in enumerate(texts) if len(t) >= min_context + ending_tokens]
    if len(usable) < n_choices:
        raise QueryError(f"only {len(usable)} documents have {min_context + ending_tokens} tokens; "
                         f"a question needs {n_choices}")
    endings = {i: texts[i][-ending_tokens:] for i in usable}
    items = []
    for i in usable:
        others = [int(j) for j in rng.choice([j for j in usable if j != i], size=n_choices - 1, replace=False)]
        answer = int(rng.integers(n_choices))
        cands = [endings[j] for j in others]
        cands.insert(answer, endings[i])
        if len({tuple(c) for c in cands}) < n_choices:  # two documents end alike: not a question
            continue
        items.append(ChoiceItem(texts[i][:-ending_tokens][-max_context:], cands, answer, i))
    return items


@dataclass
class ChoiceCache:
    """Per ending token of every (item, choice): the final hidden state before it, its id, and the
    active prototypes there, computed once."""

    z: torch.Tensor  # (N, d)
    y: torch.Tensor  # (N,)
    proto_idx: torch.Tensor  # (N, k)
    acts: torch.Tensor  # (N, k)
    slot: torch.Tensor  # (N,) item * n_choices + choice
    n_items: int
    n_choices: int
    answers: torch.Tensor  # (n_items,)
    lengths: torch.Tensor  # (n_items, n_choices) tokens of each ending

    @classmethod
    @torch.no_grad()
    def of(cls, model: PRISM, items: list[ChoiceItem], batch_size: int = 32) -> ChoiceCache:
        if not items:
            raise QueryError("no multiple-choice items")
        T = model.cfg.block_size
        seqs, wanted, slots = [], [], []
        n_choices = len(items[0].endings)
        for q, it in enumerate(items):
            for c, end in enumerate(it.endings):
                ids = (it.context + end)[-(T + 1):]
                n_ctx = len(ids) - len(end)
                if n_ctx < 1:
                    raise QueryError(f"item {q}: the ending does not fit the model's context with its opening")
                seqs.append(ids)
                wanted.append(np.arange(n_ctx - 1, len(ids) - 1))  # positions predicting the ending's tokens
                slots.append(q * n_choices + c)
        zs, ys, ps, acts, sl = [], [], [], [], []
        for b in range(0, len(seqs), batch_size):
            chunk = range(b, min(b + batch_size, len(seqs)))
            tb = run_batch(model, [seqs[i][:-1] for i in chunk], [seqs[i][1:] for i in chunk],
                           positions=[wanted[i] for i in chunk])
            zs.append(tb.z.float())
            ys.append(tb.targets)
            ps.append(tb.proto_idx)
            acts.append(tb.acts.float())
            sl.append(torch.as_tensor([slots[i] for i in chunk])[tb.row])
        slot = torch.cat(sl)
        lengths = torch.bincount(slot, minlength=len(items) * n_choices).float().view(len(items), n_choices)
        return cls(torch.cat(zs), torch.cat(ys), torch.cat(ps), torch.cat(acts), slot, len(items), n_choices,
                   torch.tensor([it.answer for it in items]), lengths.clamp_min(1.0))

    def scores(self, model: PRISM, shift: Callable[[slice], torch.Tensor] | None = None,
               chunk: int = 8192) -> torch.Tensor:
        """(n_items, n_choices) each ending's log-probability; ``shift(rows)``: added to those rows' hidden
        states (a controller's change), differentiable."""
        W = model.W.float().detach()
        out = torch.zeros(self.n_items * self.n_choices, dtype=torch.float32)
        for b in range(0, len(self.y), chunk):
            rows = slice(b, b + chunk)
            z = self.z[rows] if shift is None else self.z[rows] + shift(rows)
            lp = -F.cross_entropy(z @ W.T, self.y[rows], reduction="none")
            out = out.index_add(0, self.slot[rows], lp)
        return out.view(self.n_items, self.n_choices)

    def accuracy(self, scores: torch.Tensor) -> np.ndarray:
        """(n_items,) 1 where the true ending scores best."""
        return (scores.argmax(1) == self.answers).numpy().astype(np.float64)


@dataclass
class Controller:
    """A strength per prototype (``alpha``, 1: untouched) and what it was fitted on."""

    alpha: torch.Tensor  # (K,)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prototypes(self) -> list[int]:
        """The prototypes it changes, by how much it changes them (largest first)."""
        c = (self.alpha - 1.0).abs()
        ids = torch.nonzero(c > 0).flatten()
        return ids[c[ids].argsort(descending=True)].tolist()

    def weights(self) -> dict[int, float]:
        return {i: float(self.alpha[i]) for i in self.prototypes}

    def shift(self, model: PRISM, cache: ChoiceCache) -> Callable[[slice], torch.Tensor]:
        return _prototype_shift(model, cache, self.alpha - 1.0)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"kind": "prism-controller", "n_prototypes": len(self.alpha),
                                   "alpha": {str(i): a for i, a in self.weights().items()}, "meta": self.meta},
                                  indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path, n_prototypes: int | None = None) -> Controller:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
            if raw.get("kind") != "prism-controller":
                raise ValueError("not a controller file (kind is not 'prism-controller')")
            K = int(raw["n_prototypes"])
            alpha = torch.ones(K)
            for i, a in raw["alpha"].items():
                alpha[int(i)] = float(a)
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            raise QueryError(f"{path}: {e}") from None
        if n_prototypes is not None and K != n_prototypes:
            raise QueryError(f"{path}: a controller for {K} prototypes, the model has {n_prototypes}")
        if not bool(torch.isfinite(alpha).all()) or bool((alpha < 0).any()):
            raise QueryError(f"{path}: alpha must be finite and >= 0")
        return cls(alpha, raw.get("meta", {}))


def _prototype_shift(model: PRISM, cache: ChoiceCache, c: torch.Tensor) -> Callable[[slice], torch.Tensor]:
    assert model.head is not None
    P = model.head.prototypes.float().detach()

    def shift(rows: slice) -> torch.Tensor:
        idx, a = cache.proto_idx[rows], cache.acts[rows]
        return torch.einsum("nk,nkd->nd", a * c[idx], P[idx])

    return shift


def _fit(score: Callable[[torch.Tensor], torch.Tensor], cache: ChoiceCache, n: int, l1: float, steps: int,
         lr: float, progress: bool, desc: str) -> torch.Tensor:
    """(n,) weights minimising ``L(w) + lam |w|_1`` with ``w >= -1``, by proximal gradient descent (ISTA):
    ``L`` is the cross-entropy of the true endings, each ending scored by its mean log-probability per
    token. Scale-free settings: the step is ``lr / g`` and ``lam = l1 g``, with ``g`` the largest
    gradient at ``w = 0``; so the first step moves the strongest weight by ``lr``, and a weight whose
    gradient stays below ``l1`` times that never leaves 0."""
    w = torch.zeros(n, requires_grad=True)

    def loss_at(w: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(score(w) / cache.lengths, cache.answers)

    g0 = torch.autograd.grad(loss_at(w), w)[0].abs().max()
    if not float(g0) > 0:
        return w.detach()
    eta, lam = lr / float(g0), l1 * float(g0)
    it = range(steps)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=desc, unit="step")
    for _ in it:
        grad = torch.autograd.grad(loss_at(w), w)[0]
        with torch.no_grad():  # a gradient step, the L1 term's soft threshold, then w >= -1
            v = w - eta * grad
            w.copy_((torch.sign(v) * (v.abs() - eta * lam).clamp_min(0.0)).clamp_min(-1.0))
    return w.detach()


def fit(model: PRISM, cache: ChoiceCache, *, l1: float = 0.2, steps: int = 150, lr: float = 0.05,
        progress: bool = False) -> Controller:
    """A sparse controller fitted on ``cache``'s items (module docstring)."""
    if model.head is None:
        raise QueryError("a controller needs a PRISM model; this is the dense baseline")
    K = model.head.n_prototypes
    c = _fit(lambda w: cache.scores(model, _prototype_shift(model, cache, w)), cache, K, l1, steps, lr, progress,
             "fit controller")
    return Controller(1.0 + c, {"l1": l1, "steps": steps, "lr": lr, "items": cache.n_items})


def fit_random(model: PRISM, cache: ChoiceCache, n_dirs: int, *, l1: float = 0.2, steps: int = 150,
               lr: float = 0.05, seed: int = 0, progress: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The baseline: ``n_dirs`` random orthonormal directions R of the final hidden state and weights w,
    the hidden state becoming ``z + R diag(w) R^T z``; returns (R, w)."""
    d = cache.z.shape[1]
    n_dirs = min(n_dirs, d)  # at most the hidden state's dimension
    g = torch.Generator().manual_seed(seed)
    R, _ = torch.linalg.qr(torch.randn(d, max(n_dirs, 1), generator=g))
    R = R[:, :n_dirs]

    def score(w: torch.Tensor) -> torch.Tensor:
        return cache.scores(model, lambda rows: ((cache.z[rows] @ R) * w) @ R.T)

    return R, _fit(score, cache, n_dirs, l1, steps, lr, progress, "fit random directions")


def random_scores(model: PRISM, cache: ChoiceCache, R: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return cache.scores(model, lambda rows: ((cache.z[rows] @ R) * w) @ R.T)


@dataclass
class Task:
    """The multiple-choice task of an index: items from its trained documents, split by document into a
    fitting part and a held-out part (seeded)."""

    train: list[ChoiceItem]
    heldout: list[ChoiceItem]
    documents: int  # trained documents the items were drawn from
    config: dict[str, Any]


def index_task(index_dir: str | Path, tokenizer: Tokenizer, *, ending_tokens: int = 8, min_context: int = 8,
               max_context: int = 48, max_items: int = 1200, heldout: float = 0.3, seed: int = 0) -> Task:
    """Items from the index's trained documents (text the model has seen), at most ``max_items`` (a seeded
    sample), ``heldout`` of them held out; the distractors of an item are drawn from documents of its own
    part, so no ending crosses the split."""
    from .reads import document_table

    table = document_table(Path(index_dir), ["text", "trained"]).to_pydict()
    texts = [t for t, tr in zip(table["text"], table["trained"], strict=True) if tr]
    rng = np.random.default_rng(seed)
    need = min_context + ending_tokens
    enc = [tokenizer.encode(t).ids for t in texts]
    usable = rng.permutation([i for i, t in enumerate(enc) if len(t) >= need])[:max_items]
    n_held = int(round(heldout * len(usable)))
    parts = (usable[n_held:], usable[:n_held])
    made = [choice_items([enc[i] for i in part], ending_tokens=ending_tokens, min_context=min_context,
                         max_context=max_context, seed=seed + k) for k, part in enumerate(parts)]
    for part, items in zip(parts, made, strict=True):  # item.source: back to the index's trained documents
        for it in items:
            it.source = int(part[it.source])
    cfg = {"ending_tokens": ending_tokens, "min_context": min_context, "max_context": max_context,
           "max_items": max_items, "heldout": heldout, "seed": seed}
    return Task(made[0], made[1], len(texts), cfg)


def bootstrap(values: np.ndarray, reps: int = 2000, seed: int = 0) -> list[float]:
    """95% percentile interval of the mean over items."""
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), (reps, len(values)))].mean(1)
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]
