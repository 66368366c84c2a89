"""Steering, measured: find a topic's prototypes from its training documents, suppress them, and see
how often generations still talk about the topic, at what cost to other text.

On the demo corpus (the fortunes; each document's id starts with its category) and the demo model:

1. **Topic**: one category. ``--topic auto`` (the default) picks, before any generation, the
   category whose discovered top 10 prototypes carry the largest share of its activation mass (the
   most specifically represented topic) among categories with at least 3% of the documents; the
   choice uses discovery's evidence only, never a suppression result.
2. **Discovery** (``engine/steering.py``) from half of that category's *training* documents
   (a seeded split), read from the index's stored activations, against the other categories'
   training documents; prototypes ranked by the smoothed log-ratio of activation mass per token
   (fixed defaults: ``min_support`` 5, ``min_docs`` 2, ``smoothing`` 0.5; nothing tuned on the
   results below).
3. **Topic classifier** trained on documents discovery did not see: the other half of the topic's
   training documents and its validation documents (positives); the other categories' validation
   documents and as many of their training documents (negatives). Logistic regression on word
   counts (TF-IDF; each word as written and lower-cased), classes weighted to balance, decision
   threshold fixed at 0.5; accuracy, precision and recall by 5-fold cross-validation.
4. **Generations**: ``--prompts`` neutral openings x ``--samples`` seeded samples each (temperature 1,
   top 40, ``--new-tokens`` tokens), the same seeds with and without suppression; a generation is
   on the topic when the classifier says so.
5. **Cost**: perplexity of the validation documents of the *other* categories with and without
   suppression (the active sets stay those of the unsuppressed model, as in ``/v1/generate``); the
   ratio's 95% interval is a bootstrap over those documents.

For set sizes 1, 2, 5, 10, 20, 50 (the discovered top n) and a random set of each size (a control,
from the prototypes not discovered in the top 50), the topic rate, its relative drop and the
perplexity ratio; the headline is the largest set within 2% of the bank. Intervals: 95% bootstrap
over prompts.

6. **Selection by effect** (``engine/steering.py``, ``select_by_effect``): from discovery's top 50,
   greedily, within 2% of the bank, the set that most raises the model's loss on the topic's tuning
   generations relative to its other tuning generations, keeping the perplexity of tuning contrast
   documents within 2%. The tuning set shares nothing with the evaluation: its own prompts
   (``TUNE_PROMPTS``), its own sampling seeds, the classifier's labels of those generations, and
   other categories' validation documents after the ones perplexity is evaluated on. The chosen set
   is evaluated as every set is (the evaluation prompts, seeds and documents), with a random set of
   its size as the control.
7. **Graded strength**: the headline set and the selected set at alpha 0.25 ... 3 (activations scaled,
   ``PRISM.forward(alpha=...)``; alpha > 1 boosts), and at alpha 0 with the residual's component in
   the set's span removed too (``project=True``).
8. **What the measurement allows**: the classifier's rate on generation-length windows (``--new-tokens``
   tokens at a seeded offset) of documents it was not fitted on: other categories' training documents
   (its false-positive floor: text with nothing of the topic is still called on-topic this often) and
   the topic's discovery half (its recall at that length); the relative drop that a rate at the floor
   would give; and every prototype of the bank suppressed at once (the logits from the residual alone).
9. **A strict judge**: the same classifier at the threshold where 1% (``STRICT_FP``) of generation-length
   windows of other categories' documents score above it (4,000 windows of documents neither fitted on
   nor among step 8's; the setting was fixed before its first run), so that a drop of 0.75 is
   measurable at all; step 8's windows check its false-positive rate on other text. The base rate,
   the headline set, the selected set, their random controls and the whole bank, re-judged from the
   same generations; then, because on-topic generations are rare under it, a fresh draw of
   ``--strict-samples`` samples per prompt (other seeds) for the base, the selected set and its control.

10. **Prompts that invite the topic** (the paper's setting: a behaviour is measured where the context
   asks for it, so the base rate is high and a large drop is measurable at all): the openings of the
   topic's documents that discovery did not read (a seeded draw; each document's first
   ``ELICIT_TOKENS`` tokens, at most half of it, at least 2; distinct openings only), ``--elicit-prompts``
   of them, ``--samples`` seeded samples each (their own sampling seed). Only the continuation is judged,
   never the prompt, by both judges. The base, the selected set at alpha 0 (the primary row, fixed before
   the first run), its random control (the same prototypes as step 6's), the headline set, and the
   selected set at alpha 0.25 and 0.5; the largest drop each judge can show is ``1 - false-positive rate
   / base rate``. Nothing earlier is changed by it (its random streams are its own).
11. **Removal with re-routing** (``--reroute``, on by default): the listed prototypes leave every token's
   active set, which is chosen again without them (the next-nearest prototypes take their place, the
   residual is kept, so the logits still decompose exactly). Step 6's rule selects a set under it from
   the same tuning texts; it is evaluated by every protocol above (neutral prompts under both judges,
   the strict judge's larger draw with the same seeds, the invited prompts), beside a random set of its
   size removed the same way and step 6's set re-routed. The primary row (this set, neutral prompts,
   the default judge, and its perplexity ratio) was fixed before the first run. Nothing earlier is
   changed by it (its random streams are its own).
12. **A window judge** (``--window-judge``, on by default): the topic's style as well as its words. Logistic
   regression on TF-IDF of words, lower-cased word pairs and every 4-character sequence (``style_features``:
   punctuation and capitals count, and words the vocabulary has not seen), fitted on ``WINDOWS_PER_DOC``
   generation-length windows of each of step 3's documents (no other document), its threshold where
   ``STRICT_FP`` of the strict judge's calibration windows score above it (step 9's rule); step 8's windows
   check its false-positive rate and recall. Every judged generation above (neutral prompts, the larger draw,
   the invited prompts) re-judged by it; then step 6's rule run again on the same tuning generations as this
   judge labels them, and that set evaluated by it, with a random control of its size. **Primary row, fixed
   before the first run: that set, neutral prompts, the larger draw, this judge; and its perplexity ratio.**
   Nothing earlier is changed by it (its random streams are its own).
13. **One set for both parts of the topic** (``--both-judges-samples``, 30 by default): step 6's rule on a larger
   tuning draw (the tuning prompts, that many samples each, their own seed), a generation counted on the topic
   when either judge says so (the strict word judge or the window judge, each at its 1% false-positive
   threshold); the set evaluated by both judges on the larger draw and the invited prompts. **Primary row,
   fixed before the first run: this set, neutral prompts, the larger draw, the drop under each judge, and its
   perplexity ratio.**
14. **Conditional suppression** (``--gate``, on by default): each selected set (step 6's, step 12's, step 13's)
   scaled only where the context carries it: its share of the activation mass, averaged over the last
   ``GATE_WINDOW`` positions, at least a threshold (``PRISM.forward(gate=...)``; elsewhere the model is unchanged,
   and the logits decompose exactly either way). Per set, the threshold of ``GATE_GRID`` with the largest effect
   on the tuning generations that selected it (the topic's loss increase minus the others', positive) among those
   whose tuning contrast perplexity stays within ``GATE_TUNE_PPL``. Each gated set is evaluated by every judge on the
   neutral prompts, the larger draw and the invited prompts; step 6's set with its random control gated the same
   way. **Primary row, fixed before the first run: step 6's set gated, neutral prompts, the larger draw, the drop
   under the strict and the window judge, and its perplexity ratio.** A fourth set, ``both_judges_effect_only``:
   step 13's rule (generations either judge calls on the topic) with no perplexity bound, since the gate bounds
   the cost, gated and evaluated the same way with its own random control; its row is the same as the primary's.

    python -m bench.steering --index runs/demo_idle/index

Writes ``bench/results/steering.json`` and ``docs/img/steering.png`` (with matplotlib installed).
"""

from __future__ import annotations

import argparse
import math
import re
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench._common import finish, index_documents
from prism_tda.engine import Attributor
from prism_tda.engine.steering import rank_prototypes
from prism_tda.model.tokenizer import eos_id

PROMPTS = ["The", "I", "You", "A man", "My", "When", "There is", "It is", "Never", "Life is", "If you", "Why",
           "What", "One day", "We", "People", "All", "Nothing", "Some", "In the", "How to", "This is", "Every",
           "No one", "The best", "Today", "She", "He", "They", "Don't", "Always", "The world", "Love", "Time",
           "Man is", "Anyone who", "Our", "A good", "Most", "Once", "Here", "Remember", "Beware", "Things",
           "The only", "Whatever", "Those who", "Many", "Few", "Truth"]
SIZES = [1, 2, 5, 10, 20, 50]
STRICT_FP = 0.01  # the strict judge's false-positive rate (step 9), fixed before its first run
ELICIT_TOKENS = 8  # step 10: a topic document's opening, in tokens (at most half of the document)
# openings for the selection's tuning generations only (none is an evaluation prompt)
TUNE_PROMPTS = ["So", "Before", "After all", "A woman", "Your", "Sometimes", "There was", "Yesterday", "Perhaps",
                "Nobody", "The first", "Every man", "Be", "Do not", "It takes", "God", "Money", "Work", "Friends",
                "The secret", "Old", "Youth", "Better", "Good", "Great", "Small", "Love is", "A fool", "Wise men",
                "History"]
ALPHAS = [0.25, 0.5, 0.75, 1.5, 2.0, 3.0]
WINDOWS_PER_DOC = 4  # step 12: generation-length windows the window judge is fitted on, per document
# step 14: the gate's window, and the thresholds the tuning split chooses from, fixed before its first run
GATE_WINDOW = 16
GATE_GRID = [0.05, 0.1, 0.15, 0.2, 0.3]
GATE_TUNE_PPL = 1.01  # the tuning contrast's bound: half the target's 2%, as held-out cost ran above tuning's


# ---------------------------------------------------------------------------- classifier
WORD = re.compile(r"[A-Za-z][A-Za-z'\-]{2,}")


def features(text: str) -> list[str]:
    """Each word as written and lower-cased: a topic is style (capitals) as well as vocabulary. (Chosen
    on the classifier's own cross-validated accuracy: 0.846 against 0.832 lower-cased only, zippy.)"""
    found = [m.group(0) for m in WORD.finditer(text)]
    return found + ["_" + w.lower() for w in found]


def style_features(text: str) -> list[str]:
    """The window judge's features (step 12): :func:`features`, lower-cased word pairs, and every
    4-character sequence of the text with its runs of white space made one space, so that punctuation
    and capitals ("YOW!", "!! I", "ING ") count as well as words the vocabulary has seen."""
    found = [m.group(0) for m in WORD.finditer(text)]
    low = [w.lower() for w in found]
    s = " " + re.sub(r"\s+", " ", text) + " "
    return (found + ["_" + w for w in low] + [f"{a}__{b}" for a, b in zip(low, low[1:])]
            + ["#" + s[i : i + 4] for i in range(len(s) - 3)])


class TopicClassifier:
    """Logistic regression on TF-IDF counts of ``featurize``'s features (torch, L2, balanced classes);
    ``sparse``: the design matrix held sparse (the window judge's ~60k features)."""

    def __init__(self, vocab_min: int = 2, l2: float = 1e-3, epochs: int = 300, seed: int = 0,
                 featurize=features, sparse: bool = False) -> None:
        self.vocab_min, self.l2, self.epochs, self.seed = vocab_min, l2, epochs, seed
        self.featurize, self.sparse = featurize, sparse

    def _x(self, texts: list[str]) -> torch.Tensor:
        if self.sparse:
            idf = self.idf.tolist()
            rows, cols, vals = [], [], []
            for i, t in enumerate(texts):
                for w, c in Counter(self.featurize(t)).items():
                    j = self.vocab.get(w)
                    if j is not None:
                        rows.append(i)
                        cols.append(j)
                        vals.append((1 + math.log(c)) * idf[j])
            v = torch.tensor(vals, dtype=torch.float32)
            r = torch.tensor(rows, dtype=torch.long)
            norm = torch.zeros(len(texts)).index_add_(0, r, v * v).sqrt().clamp_min(1e-9)
            return torch.sparse_coo_tensor(torch.stack([r, torch.tensor(cols, dtype=torch.long)]), v / norm[r],
                                           (len(texts), len(self.vocab))).coalesce()
        X = torch.zeros(len(texts), len(self.vocab))
        for i, t in enumerate(texts):
            for w, c in Counter(self.featurize(t)).items():
                j = self.vocab.get(w)
                if j is not None:
                    X[i, j] = 1 + math.log(c)
        X = X * self.idf
        return X / X.norm(dim=1, keepdim=True).clamp_min(1e-9)

    def _logits(self, X: torch.Tensor) -> torch.Tensor:
        return (torch.sparse.mm(X, self.w[:, None])[:, 0] if self.sparse else X @ self.w) + self.b

    def fit(self, texts: list[str], y: np.ndarray) -> TopicClassifier:
        df: Counter = Counter()
        for t in texts:
            df.update(set(self.featurize(t)))
        self.vocab = {w: i for i, w in enumerate(sorted(w for w, c in df.items() if c >= self.vocab_min))}
        n = len(texts)
        self.idf = torch.tensor([math.log((1 + n) / (1 + df[w])) + 1 for w in sorted(self.vocab, key=self.vocab.get)])
        X, t = self._x(texts), torch.tensor(y, dtype=torch.float32)
        pos = float(t.mean())
        weight = torch.where(t > 0, 0.5 / max(pos, 1e-9), 0.5 / max(1 - pos, 1e-9))
        g = torch.Generator().manual_seed(self.seed)
        self.w = (0.01 * torch.randn(X.shape[1], generator=g)).requires_grad_()
        self.b = torch.zeros(1, requires_grad=True)
        opt = torch.optim.LBFGS([self.w, self.b], max_iter=self.epochs, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = (weight * F.binary_cross_entropy_with_logits(self._logits(X), t, reduction="none")).mean()
            loss = loss + self.l2 * self.w.pow(2).sum()
            loss.backward()
            return loss

        opt.step(closure)
        return self

    @torch.no_grad()
    def proba(self, texts: list[str]) -> np.ndarray:
        """The probability that each text is on the topic."""
        if not texts:
            return np.zeros(0, dtype=np.float32)
        if not self.sparse:
            return torch.sigmoid(self._x(texts) @ self.w + self.b).numpy()
        return torch.cat([torch.sigmoid(self._logits(self._x(texts[a : a + 2048])))
                          for a in range(0, len(texts), 2048)]).numpy()

    def predict(self, texts: list[str]) -> np.ndarray:
        return self.proba(texts) > 0.5


def classifier_documents(rng: np.random.Generator, topic: np.ndarray, trained: np.ndarray,
                         half: np.ndarray) -> np.ndarray:
    """Step 3's documents (indices): the topic's documents outside discovery's half (positives), the other
    categories' validation documents and as many of their training documents, drawn with ``rng``."""
    pos = np.nonzero(topic & ~(trained & half))[0]
    neg_val = np.nonzero(~topic & ~trained)[0]
    neg_tr = rng.choice(np.nonzero(~topic & trained)[0], size=len(neg_val), replace=False)
    return np.concatenate([pos, neg_val, neg_tr])


def cross_validate(texts: list[str], y: np.ndarray, folds: int = 5, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    fold = rng.permutation(len(texts)) % folds
    pred = np.zeros(len(texts), dtype=bool)
    for f in range(folds):
        tr, te = fold != f, fold == f
        clf = TopicClassifier().fit([texts[i] for i in np.nonzero(tr)[0]], y[tr])
        pred[te] = clf.predict([texts[i] for i in np.nonzero(te)[0]])
    tp = int((pred & (y == 1)).sum())
    return {"accuracy": round(float((pred == (y == 1)).mean()), 4),
            "precision": round(tp / max(int(pred.sum()), 1), 4), "recall": round(tp / max(int((y == 1).sum()), 1), 4),
            "n": len(texts), "n_topic": int((y == 1).sum()), "folds": folds}


# ---------------------------------------------------------------------------- model runs
@torch.no_grad()
def sample(model, prompt_ids: list[list[int]], samples: int, new_tokens: int, suppress: list[int] | None,
           seed: int, eos: int, alpha: float = 0.0, project: bool = False, reroute: bool = False,
           gate: float | None = None) -> list[list[int]]:
    """``samples`` continuations of each prompt (temperature 1, top 40), seeded per prompt, so a run with
    and one without suppression draw from the same random stream."""
    sup = torch.tensor(sorted(suppress), dtype=torch.long) if suppress else None
    out = []
    for p, ids in enumerate(prompt_ids):
        x = torch.tensor([ids] * samples)
        g = torch.Generator().manual_seed(seed * 100_003 + p)
        y = model.generate(x, new_tokens, temperature=1.0, sample_top_k=40, generator=g, suppress=sup, alpha=alpha,
                           project=project, reroute=reroute, gate=gate, gate_window=GATE_WINDOW)
        for row in y[:, len(ids):].tolist():
            out.append(row[: row.index(eos)] if eos in row else row)
    return out


@torch.no_grad()
def perplexity(model, docs: list[list[int]], suppress: list[int] | None, batch: int = 16, alpha: float = 0.0,
               project: bool = False, reroute: bool = False, gate: float | None = None) -> tuple[float, np.ndarray]:
    """Perplexity over the documents' windows, and per document its scored tokens and summed loss
    ((n_docs, 2): what :func:`boot_ppl_ratio` resamples)."""
    sup = torch.tensor(sorted(suppress), dtype=torch.long) if suppress else None
    T = model.cfg.block_size
    windows = [(d[s : s + T + 1], j) for j, d in enumerate(docs) for s in range(0, max(len(d) - 1, 1), T)
               if len(d[s : s + T + 1]) > 1]
    windows.sort(key=lambda w: len(w[0]))
    nll, n = 0.0, 0
    per_doc = np.zeros((len(docs), 2))
    for b in range(0, len(windows), batch):
        chunk = windows[b : b + batch]
        L = max(len(w) for w, _ in chunk) - 1
        x = torch.zeros(len(chunk), L, dtype=torch.long)
        y = torch.full((len(chunk), L), -1, dtype=torch.long)
        for i, (w, _) in enumerate(chunk):
            x[i, : len(w) - 1] = torch.tensor(w[:-1])
            y[i, : len(w) - 1] = torch.tensor(w[1:])
        logits = (model(x, suppress=sup, alpha=alpha, project=project, reroute=reroute, gate=gate,
                        gate_window=GATE_WINDOW).logits if sup is not None else model(x).logits)
        flat = logits.float().reshape(-1, logits.size(-1))
        nll += float(F.cross_entropy(flat, y.reshape(-1), ignore_index=-1, reduction="sum"))
        n += int((y >= 0).sum())
        tok_loss = F.cross_entropy(flat, y.reshape(-1), ignore_index=-1, reduction="none").view(len(chunk), L)
        for i, (_, j) in enumerate(chunk):
            per_doc[j] += (float((y[i] >= 0).sum()), float(tok_loss[i].double().sum()))
    return math.exp(nll / n), per_doc


def boot_ppl_ratio(base: np.ndarray, supp: np.ndarray, reps: int = 1000, seed: int = 0) -> list[float]:
    """95% bootstrap interval over documents of a perplexity ratio (``base``, ``supp``: the per-document
    tokens and summed losses of :func:`perplexity`, the same documents in the same order)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(base), (reps, len(base)))
    ratios = np.exp((supp[idx, 1].sum(1) - base[idx, 1].sum(1)) / np.maximum(base[idx, 0].sum(1), 1))
    return [round(float(np.percentile(ratios, 2.5)), 4), round(float(np.percentile(ratios, 97.5)), 4)]


def boot_rate(on: np.ndarray, n_prompts: int, samples: int, reps: int = 1000, seed: int = 0) -> list[float]:
    """95% bootstrap interval of a rate over prompts (``on``: (n_prompts * samples,) in prompt order)."""
    per = on.reshape(n_prompts, samples).mean(1)
    rng = np.random.default_rng(seed)
    draws = per[rng.integers(0, n_prompts, (reps, n_prompts))].mean(1)
    return [round(float(np.percentile(draws, 2.5)), 4), round(float(np.percentile(draws, 97.5)), 4)]


def boot_drop(base: np.ndarray, supp: np.ndarray, n_prompts: int, samples: int, reps: int = 1000,
              seed: int = 0) -> list[float]:
    b, s = base.reshape(n_prompts, samples).mean(1), supp.reshape(n_prompts, samples).mean(1)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n_prompts, (reps, n_prompts))
    drops = 1 - s[idx].mean(1) / np.maximum(b[idx].mean(1), 1e-9)
    return [round(float(np.percentile(drops, 2.5)), 4), round(float(np.percentile(drops, 97.5)), 4)]


def rate_row(on: np.ndarray, base_on: np.ndarray, n_prompts: int, samples: int) -> dict:
    """A judged set of generations against the base's (both (n_prompts * samples,) in prompt order): its
    topic rate and relative drop, each with its 95% bootstrap interval over prompts."""
    rate_b, rate_s = float(base_on.mean()), float(on.mean())
    return {"topic_rate": round(rate_s, 4), "topic_rate_ci": boot_rate(on, n_prompts, samples),
            "topic_rate_drop": round(1 - rate_s / max(rate_b, 1e-9), 4),
            "topic_rate_drop_ci": boot_drop(base_on, on, n_prompts, samples)}


def elicit_openings(docs: list[list[int]], n: int, rng: np.random.Generator) -> list[list[int]]:
    """Up to ``n`` distinct openings of the documents (token ids), in a seeded order: each one's first
    ``ELICIT_TOKENS`` tokens, at most half of it, at least 2 (documents shorter than 4 tokens are skipped)."""
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for i in rng.permutation(len(docs)):
        d = docs[i]
        if len(d) < 4:
            continue
        o = tuple(d[: max(2, min(ELICIT_TOKENS, len(d) // 2))])
        if o not in seen:
            seen.add(o)
            out.append(list(o))
        if len(out) == n:
            break
    return out


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(1, 3, figsize=(15, 3.8))
    for key, label, style in (("discovered", "discovered set", "o-"), ("random", "random set (control)", "s--")):
        rows = res["curve"][key]
        x = [r["size"] for r in rows]
        ax[0].plot(x, [r["topic_rate_drop"] for r in rows], style, label=label)
        ax[1].plot(x, [r["other_ppl_ratio"] for r in rows], style, label=label)
    ax[0].axhline(0.75, color="grey", lw=0.8, ls=":")
    ax[1].axhline(1.02, color="grey", lw=0.8, ls=":")
    if res.get("select_effect", {}).get("heldout"):
        sel = res["select_effect"]
        ax[0].plot([len(sel["prototypes"])], [sel["heldout"]["topic_rate_drop"]], "D", label="selected by effect")
        ax[1].plot([len(sel["prototypes"])], [sel["heldout"]["other_ppl_ratio"]], "D", label="selected by effect")
    for a in ax[:2]:
        a.set_xscale("log")
        a.set_xlabel("prototypes suppressed")
        a.legend()
    ax[0].set_ylabel(f"relative drop of topic rate ({res['topic']})")
    ax[1].set_ylabel("perplexity ratio, other categories")
    for name, rows in res.get("alpha_curve", {}).items():
        pts = sorted([(0.0, res["topic_rate_suppressed"] if name == "headline" else
                       res["select_effect"]["heldout"]["topic_rate"]), (1.0, res["topic_rate_base"])]
                     + [(r["alpha"], r["topic_rate"]) for r in rows])
        names = {"headline": f"discovered top {res['headline_size']}", "selected": "selected by effect"}
        ax[2].plot([x for x, _ in pts], [y for _, y in pts], "o-", label=names.get(name, name))
    ax[2].set_xlabel("strength alpha (0 removes, 1 unchanged, > 1 boosts)")
    ax[2].set_ylabel("topic rate of generations")
    ax[2].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", default="runs/demo_idle/index")
    ap.add_argument("--topic", default="auto", help="a category, or auto (see the docstring)")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    ap.add_argument("--ppl-docs", type=int, default=400, help="validation documents of other categories for perplexity")
    ap.add_argument("--tune-docs", type=int, default=200,
                    help="further validation documents of other categories: the selection's perplexity bound")
    ap.add_argument("--alphas", type=float, nargs="+", default=ALPHAS)
    ap.add_argument("--measure", default="activation", choices=["activation", "logit"],
                    help="what a token counts for a prototype in discovery (engine/steering.py)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strict-samples", type=int, default=100,
                    help="samples per prompt of the strict judge's larger, fresh draw (base, selected set, its "
                         "control); 0: none")
    ap.add_argument("--elicit-prompts", type=int, default=50,
                    help="step 10: openings of topic documents discovery did not read, as prompts; 0: none")
    ap.add_argument("--reroute", action=argparse.BooleanOptionalAction, default=True,
                    help="step 11: removal with re-routing, its own selection and evaluation")
    ap.add_argument("--window-judge", action=argparse.BooleanOptionalAction, default=True,
                    help="step 12: a judge of the topic's style as well as its words, and a selection by its labels")
    ap.add_argument("--both-judges-samples", type=int, default=30,
                    help="step 13: tuning samples per tuning prompt for the selection both judges label; 0: none")
    ap.add_argument("--gate", action=argparse.BooleanOptionalAction, default=True,
                    help="step 14: conditional suppression, each set scaled only where the context carries it")
    ap.add_argument("--out", default="bench/results/steering.json")
    ap.add_argument("--plot", default="docs/img/steering.png")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    att = Attributor.open(args.index)
    model, tok = att.model, att.tokenizer
    K = model.cfg.n_prototypes
    docs = index_documents(args.index, ["doc_id", "external_id", "text", "trained"])
    cat = np.array([e.split("/")[0] for e in docs["external_id"]])
    trained = np.array(docs["trained"], dtype=bool)
    ids = np.arange(len(cat))
    rng = np.random.default_rng(args.seed)
    half = rng.random(len(cat)) < 0.5  # discovery's half of each category's training documents
    choice = {}
    if args.topic == "auto":
        for c in np.unique(cat):
            if (cat == c).mean() < 0.03:
                continue
            m = att.shards.prototype_mass(ids[(cat == c) & trained & half])
            rest = att.shards.prototype_mass(ids[(cat != c) & trained])
            choice[str(c)] = round(sum(d.topic_share for d in rank_prototypes(m, rest, n=10)), 4)
        args.topic = max(choice, key=choice.get)
    topic = cat == args.topic
    if not topic.any():
        raise SystemExit(f"--topic {args.topic}: no document id starts with '{args.topic}/'")
    # 2. discovery from half of the topic's training documents, against the other training documents
    t_disc = time.perf_counter()
    from prism_tda.engine.steering import signature_matrix

    sig = signature_matrix(model) if args.measure == "logit" else None
    m_topic = att.shards.prototype_mass(ids[topic & trained & half], args.measure, sig)
    m_rest = att.shards.prototype_mass(ids[~topic & trained], args.measure, sig)
    found = rank_prototypes(m_topic, m_rest, n=max(args.sizes))
    disc_s = time.perf_counter() - t_disc
    ranked = [d.proto_id for d in found]
    # 3. the classifier, on documents discovery did not see
    clf_docs = classifier_documents(rng, topic, trained, half)
    texts = [docs["text"][i] for i in clf_docs]
    y = topic[clf_docs].astype(int)
    held = np.nonzero(~trained)[0]
    cv = cross_validate(texts, y, seed=args.seed)
    clf = TopicClassifier().fit(texts, y)
    # 4. generations; 5. perplexity on other categories' held-out documents
    eos = eos_id(tok)
    prompt_ids = [tok.encode(p).ids for p in PROMPTS[: args.prompts]]
    other = [i for i in held if not topic[i]][: args.ppl_docs]
    other_ids = [tok.encode(docs["text"][i]).ids for i in other]
    n_p, n_s = len(prompt_ids), args.samples

    def measure(suppress: list[int] | None, alpha: float = 0.0, project: bool = False, reroute: bool = False,
                gate: float | None = None) -> dict:
        gens = sample(model, prompt_ids, n_s, args.new_tokens, suppress, args.seed, eos, alpha, project, reroute, gate)
        texts_ = [tok.decode(g) for g in gens]
        p = clf.proba(texts_)
        ppl, ppl_docs = perplexity(model, other_ids, suppress, alpha=alpha, project=project, reroute=reroute, gate=gate)
        return {"on": (p > 0.5).astype(float), "p": p, "ppl": ppl, "ppl_docs": ppl_docs,
                "examples": texts_[:3], "texts": texts_}

    def row(m: dict) -> dict:
        return {**rate_row(m["on"], base["on"], n_p, n_s),
                "other_ppl": round(m["ppl"], 4), "other_ppl_ratio": round(m["ppl"] / base["ppl"], 4),
                "other_ppl_ratio_ci": boot_ppl_ratio(base["ppl_docs"], m["ppl_docs"])}

    base = measure(None)
    rng = np.random.default_rng(args.seed + 1)
    pool = np.setdiff1d(np.arange(K), ranked)
    curve: dict[str, list] = {"discovered": [], "random": []}
    measured: dict[tuple[str, int], dict] = {}  # the curve's measures, for the strict judge (step 9)
    examples = {}
    for size in args.sizes:
        for kind, chosen in (("discovered", ranked[:size]), ("random", sorted(rng.choice(pool, size, replace=False).tolist()))):
            m = measure(chosen)
            measured[kind, size] = m
            curve[kind].append({"size": size, "prototypes": [int(c) for c in chosen],
                                "share_of_bank": round(size / K, 4), **row(m)})
            if kind == "discovered":
                examples[size] = m["examples"]
            print(kind, curve[kind][-1]["size"], curve[kind][-1]["topic_rate"], curve[kind][-1]["other_ppl_ratio"],
                  flush=True)
    head = max((r for r in curve["discovered"] if r["share_of_bank"] <= 0.02), key=lambda r: r["size"])
    ctrl = next(r for r in curve["random"] if r["size"] == head["size"])
    rate_b = float(base["on"].mean())

    # 6. selection by measured effect, on a tuning set disjoint from the evaluation
    from prism_tda.engine.steering import EffectTexts, select_by_effect

    t_sel = time.perf_counter()
    budget = int(0.02 * K)
    tune_ids = [tok.encode(p).ids for p in TUNE_PROMPTS]
    tune_gens = sample(model, tune_ids, n_s, args.new_tokens, None, args.seed + 7919, eos)
    tune_texts = [tok.decode(g) for g in tune_gens]
    tune_on = clf.predict(tune_texts)
    tune_docs = [tok.encode(docs["text"][i]).ids
                 for i in [i for i in held if not topic[i]][args.ppl_docs : args.ppl_docs + args.tune_docs]]

    def effect_texts(gens: list[list[int]], on: np.ndarray) -> EffectTexts:
        """The selection's texts: the generations ``on`` the topic, the others, and the contrast documents."""
        return EffectTexts.of(model, ([g for g, o in zip(gens, on, strict=True) if o and len(g) > 1],
                                      [g for g, o in zip(gens, on, strict=True) if not o and len(g) > 1], tune_docs))

    eff_texts = effect_texts(tune_gens, tune_on)
    steps = select_by_effect(model, eff_texts, ranked[:50], budget=budget, max_ppl_ratio=1.02, progress=True)
    selected = [st.proto_id for st in steps]
    sel_s = time.perf_counter() - t_sel
    sel_m = measure(selected) if selected else None
    sel_ctrl_ids = sorted(rng.choice(pool, len(selected), replace=False).tolist()) if selected else []
    sel_ctrl_m = measure(sel_ctrl_ids) if selected else None
    sel_eval = row(sel_m) if sel_m else None
    sel_ctrl = row(sel_ctrl_m) if sel_ctrl_m else None
    print("selected", selected, sel_eval and sel_eval["topic_rate_drop"], sel_eval and sel_eval["other_ppl_ratio"],
          flush=True)

    # 7. graded strength, and suppression with the residual's component in the set's span removed
    sets = {"headline": head["prototypes"], **({"selected": selected} if selected else {})}
    alpha_curve = {name: [{"alpha": a, **row(measure(ids_, alpha=a))} for a in args.alphas] for name, ids_ in sets.items()}
    projection = {name: {"alpha": 0.0, **row(measure(ids_, project=True))} for name, ids_ in sets.items()}
    # 8. the classifier's floor at generation length, on documents it was not fitted on; the whole bank off
    fit_docs = set(clf_docs.tolist())
    wrng = np.random.default_rng(args.seed + 2)

    wrng_used: list[int] = []  # the documents the floor's windows came from

    def windows(which: np.ndarray, n: int) -> list[str]:
        out = []
        for i in wrng.permutation([j for j in which if j not in fit_docs])[:n]:
            wrng_used.append(int(i))
            t = tok.encode(docs["text"][i]).ids
            at = int(wrng.integers(0, max(1, len(t) - args.new_tokens + 1)))
            out.append(tok.decode(t[at : at + args.new_tokens]))
        return out

    neg_w = windows(np.nonzero(~topic & trained)[0], 2000)
    pos_w = windows(np.nonzero(topic & trained & half)[0], 2000)
    on_neg = clf.predict(neg_w).astype(float)
    fp = float(on_neg.mean()) if neg_w else float("nan")
    boot = [np.random.default_rng(r).choice(on_neg, len(on_neg)).mean() for r in range(1000)] if neg_w else [fp]
    floor = {"other_windows": len(neg_w), "false_positive_rate": round(fp, 4),
             "false_positive_rate_ci": [round(float(x), 4) for x in np.percentile(boot, [2.5, 97.5])],
             "topic_windows": len(pos_w), "recall": round(float(clf.predict(pos_w).mean()), 4) if pos_w else None,
             "largest_drop_at_floor": round(1 - fp / max(rate_b, 1e-9), 4)}
    whole_m = measure(list(range(K)))
    whole = row(whole_m)
    # 9. a strict judge: the same classifier at the threshold where its false-positive rate on windows of
    # other categories' documents (neither fitted on nor among the floor's) is STRICT_FP; the floor's
    # windows then check that rate on text the threshold was not set on
    floor_docs = set(int(i) for i in wrng_used)
    crng = np.random.default_rng(args.seed + 3)
    cal_docs = [j for j in crng.permutation(np.nonzero(~topic & trained)[0]) if j not in fit_docs and j not in floor_docs]
    cal_w = []
    for i in cal_docs[:4000]:
        t = tok.encode(docs["text"][i]).ids
        at = int(crng.integers(0, max(1, len(t) - args.new_tokens + 1)))
        cal_w.append(tok.decode(t[at : at + args.new_tokens]))
    cal_p = clf.proba(cal_w)
    thr = float(np.quantile(cal_p, 1 - STRICT_FP)) if len(cal_p) else 1.0
    strict_base = (base["p"] > thr).astype(float)

    def strict_row(m: dict) -> dict:
        return rate_row((m["p"] > thr).astype(float), strict_base, n_p, n_s)

    fp_strict = float((clf.proba(neg_w) > thr).mean()) if neg_w else float("nan")
    strict = {
        "rule": (f"the classifier's threshold set where {STRICT_FP:.0%} of generation-length windows of other "
                 "categories' training documents (not fitted on, not the floor's) score above it; fixed before "
                 "any generation was judged by it"),
        "false_positive_target": STRICT_FP, "threshold": round(thr, 4), "calibration_windows": len(cal_w),
        "false_positive_rate_floor_windows": round(fp_strict, 4),
        "recall_topic_windows": round(float((clf.proba(pos_w) > thr).mean()), 4) if pos_w else None,
        "topic_rate_base": round(float(strict_base.mean()), 4), "topic_rate_base_ci": boot_rate(strict_base, n_p, n_s),
        "largest_drop_at_floor": round(1 - fp_strict / max(float(strict_base.mean()), 1e-9), 4),
        "headline": {"size": head["size"], **strict_row(measured["discovered", head["size"]])},
        "headline_control_random": strict_row(measured["random", head["size"]]),
        "selected": strict_row(sel_m) if sel_m else None,
        "selected_control_random": strict_row(sel_ctrl_m) if sel_ctrl_m else None,
        "whole_bank_suppressed": strict_row(whole_m),
    }
    big_texts: dict[str, list[str]] = {}  # the larger draw's generations, for step 12
    if args.strict_samples and selected:
        # the strict judge's rates are small: fresh, larger draws of the base, the selected set and its control
        big = {}
        for name, sup in (("base", None), ("selected", selected), ("selected_control_random", sel_ctrl_ids)):
            gens = sample(model, prompt_ids, args.strict_samples, args.new_tokens, sup, args.seed + 104_729, eos)
            big_texts[name] = [tok.decode(g) for g in gens]
            big[name] = (clf.proba(big_texts[name]) > thr).astype(float)
            print("strict draw", name, float(big[name].mean()), flush=True)
        n_big = args.strict_samples

        def big_row(on: np.ndarray) -> dict:
            return rate_row(on, big["base"], n_p, n_big)

        strict["larger_draw"] = {
            "samples_per_prompt": n_big, "generations": n_p * n_big, "sampling_seed": args.seed + 104_729,
            "topic_rate_base": round(float(big["base"].mean()), 4), "topic_rate_base_ci": boot_rate(big["base"], n_p, n_big),
            "largest_drop_at_floor": round(1 - fp_strict / max(float(big["base"].mean()), 1e-9), 4),
            "selected": big_row(big["selected"]), "selected_control_random": big_row(big["selected_control_random"]),
            "selected_control_prototypes": [int(c) for c in sel_ctrl_ids]}
    # 10. prompts that invite the topic: openings of its documents discovery did not read
    elicit = None
    e_texts: dict[str, list[str]] = {}  # the invited prompts' generations, for step 12
    if args.elicit_prompts and selected:
        openings = elicit_openings([tok.encode(docs["text"][i]).ids for i in np.nonzero(topic & ~(trained & half))[0]],
                                   args.elicit_prompts, np.random.default_rng(args.seed + 5))
        n_e, e_seed = len(openings), args.seed + 31

        def judged(sup: list[int] | None, alpha: float = 0.0, reroute: bool = False, name: str = "") -> np.ndarray:
            gens = sample(model, openings, n_s, args.new_tokens, sup, e_seed, eos, alpha, reroute=reroute)
            e_texts[name] = [tok.decode(g) for g in gens]
            return clf.proba(e_texts[name])

        e_p = {"base": judged(None, name="base"), "selected": judged(selected, name="selected"),
               "selected_control_random": judged(sel_ctrl_ids, name="selected_control_random"),
               "headline": judged(head["prototypes"], name="headline"),
               "selected_alpha_0.25": judged(selected, 0.25, name="selected_alpha_0.25"),
               "selected_alpha_0.5": judged(selected, 0.5, name="selected_alpha_0.5")}
        elicit = {"rule": (f"prompts: the first {ELICIT_TOKENS} tokens (at most half, at least 2) of the topic's "
                           "documents discovery did not read, distinct, a seeded draw; only continuations judged; "
                           "primary row: the selected set at alpha 0, fixed before the first run"),
                  "prompts": n_e, "samples_per_prompt": n_s, "generations": n_e * n_s, "sampling_seed": e_seed,
                  "examples": [tok.decode(o) for o in openings[:5]]}
        for judge, t_j, fp_j in (("default_judge", 0.5, fp), ("strict_judge", thr, fp_strict)):
            on = {k: (v > t_j).astype(float) for k, v in e_p.items()}
            elicit[judge] = {
                "topic_rate_base": round(float(on["base"].mean()), 4), "topic_rate_base_ci": boot_rate(on["base"], n_e, n_s),
                "largest_drop_at_floor": round(1 - fp_j / max(float(on["base"].mean()), 1e-9), 4),
                **{k: rate_row(v, on["base"], n_e, n_s) for k, v in on.items() if k != "base"}}
        print("elicited", {j: elicit[j] for j in ("default_judge", "strict_judge")}, flush=True)
    # 11. removal with re-routing: the set chosen again by the same rule with each token's active set re-chosen
    # without it, evaluated by every protocol above (the primary row fixed before the first run: this set,
    # neutral prompts, the default judge, and its perplexity ratio)
    reroute = None
    if args.reroute:
        t_rr = time.perf_counter()
        rr_steps = select_by_effect(model, eff_texts, ranked[:50], budget=budget, max_ppl_ratio=1.02, reroute=True,
                                    progress=True)
        rr_sel = [st.proto_id for st in rr_steps]
        rr_s = time.perf_counter() - t_rr
        rr_ctrl_ids = sorted(np.random.default_rng(args.seed + 11).choice(pool, len(rr_sel), replace=False).tolist())
        arms = {"selected_rerouted": rr_sel, "selected_rerouted_control_random": rr_ctrl_ids}
        if selected:
            arms["step6_selected_rerouted"] = selected
        rr_m = {name: measure(ids_, reroute=True) for name, ids_ in arms.items() if ids_}
        reroute = {
            "rule": ("removal with re-routing (PRISM.forward(reroute=True)): each token's active set chosen again "
                     "without the set, the residual kept; the set selected by step 6's rule under it (discovery's "
                     "top 50, tuning generations, contrast perplexity within 2%, at most 2% of the bank); primary "
                     "row: this set, neutral prompts, default judge, fixed before the first run"),
            "steps": [{"proto_id": st.proto_id, "effect": round(st.effect, 5),
                       "topic_loss_increase": round(st.topic_loss_increase, 5),
                       "other_loss_increase": round(st.other_loss_increase, 5),
                       "contrast_ppl_ratio": round(st.contrast_ppl_ratio, 5)} for st in rr_steps],
            "prototypes": rr_sel, "share_of_bank": round(len(rr_sel) / K, 4), "seconds": round(rr_s, 1),
            "control_prototypes": rr_ctrl_ids,
            "default_judge": {k: row(m) for k, m in rr_m.items()},
            "strict_judge": {k: strict_row(m) for k, m in rr_m.items()},
        }
        if args.strict_samples and rr_sel and "larger_draw" in strict:
            big_rr = {}
            for name in ("selected_rerouted", "selected_rerouted_control_random"):
                gens = sample(model, prompt_ids, args.strict_samples, args.new_tokens, arms[name], args.seed + 104_729,
                              eos, reroute=True)
                big_rr[name] = (clf.proba([tok.decode(g) for g in gens]) > thr).astype(float)
                print("strict draw", name, float(big_rr[name].mean()), flush=True)
            reroute["strict_larger_draw"] = {k: rate_row(v, big["base"], n_p, args.strict_samples)
                                             for k, v in big_rr.items()}
        if elicit is not None and rr_sel:
            e_rr = {"selected_rerouted": judged(rr_sel, reroute=True, name="selected_rerouted"),
                    "selected_rerouted_control_random": judged(rr_ctrl_ids, reroute=True,
                                                               name="selected_rerouted_control_random")}
            reroute["elicited_prompts"] = {
                judge: {k: rate_row((v > t_j).astype(float), (e_p["base"] > t_j).astype(float), n_e, n_s)
                        for k, v in e_rr.items()}
                for judge, t_j in (("default_judge", 0.5), ("strict_judge", thr))}
        print("reroute", rr_sel, {k: (v["topic_rate_drop"], v["other_ppl_ratio"])
                                  for k, v in reroute["default_judge"].items()}, flush=True)
    # 12. a window judge (the topic's style as well as its words): fitted on generation-length windows of the
    # classifier's own documents, its threshold where STRICT_FP of the strict judge's calibration windows score
    # above it; the generations above re-judged by it; then step 6's rule run again on the same tuning
    # generations as this judge labels them, evaluated by it (primary row, fixed before the first run: that
    # set, neutral prompts, the larger draw, this judge; and its perplexity ratio)
    window: dict | None = None
    if args.window_judge:
        t_w = time.perf_counter()
        jrng = np.random.default_rng(args.seed + 12)
        w_texts, w_y = [], []
        for i in clf_docs:
            tw = tok.encode(docs["text"][i]).ids
            for _ in range(WINDOWS_PER_DOC):
                at = int(jrng.integers(0, max(1, len(tw) - args.new_tokens + 1)))
                w_texts.append(tok.decode(tw[at : at + args.new_tokens]))
                w_y.append(int(topic[i]))
        wjudge = TopicClassifier(featurize=style_features, sparse=True).fit(w_texts, np.array(w_y))
        thr_w = float(np.quantile(wjudge.proba(cal_w), 1 - STRICT_FP)) if cal_w else 1.0

        def w_on(texts_: list[str]) -> np.ndarray:
            return (wjudge.proba(texts_) > thr_w).astype(float)

        fp_w = float(w_on(neg_w).mean()) if neg_w else float("nan")
        w_base = w_on(base["texts"])

        def w_row(m: dict) -> dict:
            return rate_row(w_on(m["texts"]), w_base, n_p, n_s)

        window = {
            "rule": (f"logistic regression on TF-IDF of words, word pairs and 4-character sequences "
                     f"(style_features), fitted on {WINDOWS_PER_DOC} generation-length windows of each of the "
                     f"classifier's documents; threshold where {STRICT_FP:.0%} of the strict judge's calibration "
                     "windows score above it; primary row: the set step 6's rule selects with this judge's labels "
                     "of the tuning generations, neutral prompts, the larger draw, and its perplexity ratio, fixed "
                     "before the first run"),
            "features": len(wjudge.vocab), "windows": len(w_texts), "threshold": round(thr_w, 4),
            "false_positive_rate_floor_windows": round(fp_w, 4),
            "recall_topic_windows": round(float(w_on(pos_w).mean()), 4) if pos_w else None,
            "recall_topic_windows_strict_judge": strict["recall_topic_windows"],
            "topic_rate_base": round(float(w_base.mean()), 4), "topic_rate_base_ci": boot_rate(w_base, n_p, n_s),
            "largest_drop_at_floor": round(1 - fp_w / max(float(w_base.mean()), 1e-9), 4),
            "headline": {"size": head["size"], **w_row(measured["discovered", head["size"]])},
            "headline_control_random": w_row(measured["random", head["size"]]),
            "selected": w_row(sel_m) if sel_m else None,
            "selected_control_random": w_row(sel_ctrl_m) if sel_ctrl_m else None,
        }
        if big_texts:
            wb = {k: w_on(v) for k, v in big_texts.items()}
            window["larger_draw"] = {
                "topic_rate_base": round(float(wb["base"].mean()), 4),
                "topic_rate_base_ci": boot_rate(wb["base"], n_p, args.strict_samples),
                "largest_drop_at_floor": round(1 - fp_w / max(float(wb["base"].mean()), 1e-9), 4),
                **{k: rate_row(v, wb["base"], n_p, args.strict_samples) for k, v in wb.items() if k != "base"}}
        if e_texts:
            we = {k: w_on(v) for k, v in e_texts.items()}
            window["elicited_prompts"] = {
                "topic_rate_base": round(float(we["base"].mean()), 4),
                "largest_drop_at_floor": round(1 - fp_w / max(float(we["base"].mean()), 1e-9), 4),
                **{k: rate_row(v, we["base"], len(e_texts["base"]) // n_s, n_s) for k, v in we.items() if k != "base"}}
        # step 6's rule with this judge's labels of the same tuning generations
        tune_on_w = w_on(tune_texts) > 0
        eff_w = effect_texts(tune_gens, tune_on_w)
        steps_w = select_by_effect(model, eff_w, ranked[:50], budget=budget, max_ppl_ratio=1.02, progress=True)
        sel_w = [st.proto_id for st in steps_w]
        window["select_effect"] = {
            "tuning_generations_on_topic": int(tune_on_w.sum()),
            "steps": [{"proto_id": st.proto_id, "effect": round(st.effect, 5),
                       "contrast_ppl_ratio": round(st.contrast_ppl_ratio, 5)} for st in steps_w],
            "prototypes": sel_w, "share_of_bank": round(len(sel_w) / K, 4),
            "shared_with_step6": sorted(set(sel_w) & set(selected))}
        if sel_w:
            ctrl_w = sorted(np.random.default_rng(args.seed + 13).choice(pool, len(sel_w), replace=False).tolist())
            for name, ids_ in (("selected", sel_w), ("control_random", ctrl_w)):
                mw = measure(ids_)
                window["select_effect"][name] = {
                    **w_row(mw), "other_ppl_ratio": round(mw["ppl"] / base["ppl"], 4),
                    "other_ppl_ratio_ci": boot_ppl_ratio(base["ppl_docs"], mw["ppl_docs"]),
                    "default_judge_topic_rate_drop": row(mw)["topic_rate_drop"]}
                if big_texts:
                    gens = sample(model, prompt_ids, args.strict_samples, args.new_tokens, ids_, args.seed + 104_729, eos)
                    window["select_effect"][name]["larger_draw"] = rate_row(
                        w_on([tok.decode(g) for g in gens]), wb["base"], n_p, args.strict_samples)
            window["select_effect"]["control_prototypes"] = ctrl_w
        window["seconds"] = round(time.perf_counter() - t_w, 1)
        # 13. one set for both parts of the topic: step 6's rule on a larger tuning draw (its own seed), a
        # generation on the topic when either judge says so (the strict word judge or this one, each at its 1%
        # false-positive threshold);
        # evaluated by both judges (primary row, fixed before the first run: this set, neutral prompts, the
        # larger draw, the drop under each judge, and its perplexity ratio)
        if args.both_judges_samples and big_texts:
            t_b = time.perf_counter()
            gens_b = sample(model, tune_ids, args.both_judges_samples, args.new_tokens, None, args.seed + 7927, eos)
            texts_b = [tok.decode(g) for g in gens_b]
            on_word, on_style = clf.proba(texts_b) > thr, w_on(texts_b) > 0
            on_b = on_word | on_style
            eff_b = effect_texts(gens_b, on_b)
            steps_b = select_by_effect(model, eff_b, ranked[:50], budget=budget, max_ppl_ratio=1.02, progress=True)
            sel_b = [st.proto_id for st in steps_b]
            both: dict = {
                "rule": ("step 6's rule on --both-judges-samples tuning generations per tuning prompt (seed + 7927), on "
                         "the topic when the strict word judge or the window judge (each at its 1% false-positive threshold) says "
                         "so; primary row: "
                         "this set, neutral prompts, the larger draw, the drop under each judge, and its perplexity "
                         "ratio, fixed before the first run"),
                "tuning_generations": len(texts_b), "on_topic_word_judge": int(on_word.sum()),
                "on_topic_window_judge": int(on_style.sum()), "on_topic_either": int(on_b.sum()),
                "steps": [{"proto_id": st.proto_id, "effect": round(st.effect, 5),
                           "contrast_ppl_ratio": round(st.contrast_ppl_ratio, 5)} for st in steps_b],
                "prototypes": sel_b, "share_of_bank": round(len(sel_b) / K, 4),
                "shared_with_step6": sorted(set(sel_b) & set(selected)), "shared_with_window_selection": sorted(set(sel_b) & set(sel_w))}
            if sel_b:
                mb = measure(sel_b)
                gens = sample(model, prompt_ids, args.strict_samples, args.new_tokens, sel_b, args.seed + 104_729, eos)
                tb = [tok.decode(g) for g in gens]
                both["other_ppl_ratio"] = round(mb["ppl"] / base["ppl"], 4)
                both["other_ppl_ratio_ci"] = boot_ppl_ratio(base["ppl_docs"], mb["ppl_docs"])
                both["default_judge"] = row(mb)
                both["larger_draw"] = {"strict_judge": rate_row((clf.proba(tb) > thr).astype(float), big["base"], n_p,
                                                                args.strict_samples),
                                       "window_judge": rate_row(w_on(tb), wb["base"], n_p, args.strict_samples)}
                if e_texts:
                    gens = sample(model, openings, n_s, args.new_tokens, sel_b, e_seed, eos)
                    te = [tok.decode(g) for g in gens]
                    both["elicited_prompts"] = {
                        "strict_judge": rate_row((clf.proba(te) > thr).astype(float), (e_p["base"] > thr).astype(float),
                                                 n_e, n_s),
                        "window_judge": rate_row(w_on(te), we["base"], n_e, n_s)}
            both["seconds"] = round(time.perf_counter() - t_b, 1)
            window["both_judges"] = both
            print("both judges", both, flush=True)
        print("window judge", {k: v for k, v in window.items() if k not in ("rule", "select_effect")},
              window["select_effect"], flush=True)
    # 14. conditional suppression: each set scaled only where the context carries it (its share of the activation
    # mass over the last GATE_WINDOW positions at least a threshold, chosen per set on the tuning split that
    # selected it); primary row, fixed before the first run: step 6's set gated, neutral prompts, the larger
    # draw, the drop under the strict and the window judge, and its perplexity ratio
    gated: dict | None = None
    if args.gate and window is not None and big_texts and selected:
        t_g = time.perf_counter()
        tune_base_ppl = perplexity(model, tune_docs, None)[0]

        def tune_gate(ids_: list[int], gens: list[list[int]], on: np.ndarray) -> dict:
            """The threshold of GATE_GRID with the largest tuning effect (the topic generations' loss increase
            minus the others'; positive) whose tuning contrast perplexity stays within GATE_TUNE_PPL (None: no
            threshold does); the table it chose from."""
            on_g = [g for g, o in zip(gens, on, strict=True) if o and len(g) > 1]
            off_g = [g for g, o in zip(gens, on, strict=True) if not o and len(g) > 1]
            b_on, b_off = math.log(perplexity(model, on_g, None)[0]), math.log(perplexity(model, off_g, None)[0])
            table = []
            for g in GATE_GRID:
                eff = (math.log(perplexity(model, on_g, ids_, gate=g)[0]) - b_on
                       - (math.log(perplexity(model, off_g, ids_, gate=g)[0]) - b_off))
                table.append({"gate": g, "effect": round(eff, 5),
                              "contrast_ppl_ratio": round(perplexity(model, tune_docs, ids_, gate=g)[0] / tune_base_ppl, 5)})
            ok = [r for r in table if r["contrast_ppl_ratio"] <= GATE_TUNE_PPL and r["effect"] > 0]
            return {"gate": max(ok, key=lambda r: r["effect"])["gate"] if ok else None, "tuning": table}

        @torch.no_grad()
        def open_share(ids_: list[int], g: float) -> float:
            """The share of the evaluation's other documents' tokens where the gate is open."""
            n_open, n = 0, 0
            T = model.cfg.block_size
            for d in other_ids:
                for st in range(0, max(len(d) - 1, 1), T):
                    w = d[st : st + T]
                    if len(w) < 2:
                        continue
                    z = model.hidden(torch.tensor([w]))
                    n_open += int(model.suppression_gate(z, torch.tensor(ids_), g, GATE_WINDOW).sum())
                    n += len(w)
            return round(n_open / max(n, 1), 4)

        sets_g = {"step6_selected": (selected, tune_gens, tune_on), "window_selected": (sel_w, tune_gens, tune_on_w)}
        controls = {"step6_selected": sel_ctrl_ids}
        if window.get("both_judges", {}).get("prototypes"):
            sets_g["both_judges_selected"] = (window["both_judges"]["prototypes"], gens_b, on_b)
            # the gate bounds the cost, so the selection need not: step 13's rule by effect alone
            steps_u = select_by_effect(model, eff_b, ranked[:50], budget=budget, max_ppl_ratio=float("inf"),
                                       progress=True)
            sel_u = [st.proto_id for st in steps_u]
            if sel_u:
                sets_g["both_judges_effect_only"] = (sel_u, gens_b, on_b)
                controls["both_judges_effect_only"] = sorted(
                    np.random.default_rng(args.seed + 14).choice(pool, len(sel_u), replace=False).tolist())
        gated = {"rule": (f"each set scaled (alpha 0) only where its share of the activation mass, averaged over the last "
                          f"{GATE_WINDOW} positions, is at least a threshold; the threshold of {GATE_GRID} with the "
                          f"largest effect on the tuning generations that selected the set whose tuning contrast "
                          f"perplexity stays within {GATE_TUNE_PPL}; window, grid and bound fixed before the first run; "
                          "primary row: step 6's set gated, neutral prompts, the larger draw, the drop under the strict "
                          "and the window judge, and its perplexity ratio; second, both_judges_effect_only: step 13's "
                          "rule with no perplexity bound (the gate bounds the cost), gated, the same row"),
                 "window": GATE_WINDOW}
        for name, (ids_, gens, on) in sets_g.items():
            tg = tune_gate(ids_, gens, on)
            entry: dict = {"prototypes": [int(i) for i in ids_], **tg}
            g = tg["gate"]
            if g is not None:
                arms = {"set": ids_}
                if name in controls:
                    arms["control_random"] = controls[name]
                for arm, a_ids in arms.items():
                    mg = measure(a_ids, gate=g)
                    gens_big = sample(model, prompt_ids, args.strict_samples, args.new_tokens, a_ids, args.seed + 104_729,
                                      eos, gate=g)
                    tb = [tok.decode(x) for x in gens_big]
                    r = {"other_ppl_ratio": round(mg["ppl"] / base["ppl"], 4),
                         "other_ppl_ratio_ci": boot_ppl_ratio(base["ppl_docs"], mg["ppl_docs"]),
                         "gate_open_share_other_docs": open_share(a_ids, g),
                         "default_judge": row(mg), "strict_judge": strict_row(mg), "window_judge": w_row(mg),
                         "larger_draw": {"strict_judge": rate_row((clf.proba(tb) > thr).astype(float), big["base"], n_p,
                                                                  args.strict_samples),
                                         "window_judge": rate_row(w_on(tb), wb["base"], n_p, args.strict_samples)},
                         "examples": mg["examples"]}
                    if e_texts:
                        gens_e = sample(model, openings, n_s, args.new_tokens, a_ids, e_seed, eos, gate=g)
                        te = [tok.decode(x) for x in gens_e]
                        r["elicited_prompts"] = {
                            "strict_judge": rate_row((clf.proba(te) > thr).astype(float), (e_p["base"] > thr).astype(float),
                                                     n_e, n_s),
                            "window_judge": rate_row(w_on(te), we["base"], n_e, n_s)}
                    entry[arm] = r
                    print("gated", name, arm, g, r["other_ppl_ratio"], r["larger_draw"], flush=True)
                if name in controls:
                    entry["control_prototypes"] = controls[name]
            gated[name] = entry
        gated["seconds"] = round(time.perf_counter() - t_g, 1)
    print("strict judge", {k: v for k, v in strict.items() if k != "rule"}, flush=True)
    print("floor", floor, "whole bank", whole["topic_rate"], whole["other_ppl_ratio"], flush=True)
    for name in sets:
        print(name, [(r["alpha"], r["topic_rate"], r["other_ppl_ratio"]) for r in alpha_curve[name]],
              projection[name]["topic_rate_drop"], projection[name]["other_ppl_ratio"], flush=True)
    res = {
        "topic": args.topic, "measure": args.measure, "index": str(Path(args.index).resolve()), "prototypes_in_bank": K,
        "why_topic": ("picked by --topic auto: the category (>= 3% of documents) whose discovered top 10 carry the "
                      "largest share of its activation mass, from discovery's evidence only") if choice else "given",
        "topic_choice_top10_share": choice,
        "discovery": {"topic_training_docs": int((topic & trained & half).sum()), "contrast_training_docs": int((~topic & trained).sum()),
                      "topic_tokens": m_topic.n_tokens, "contrast_tokens": m_rest.n_tokens, "seconds": round(disc_s, 2),
                      "top": [{"proto_id": d.proto_id, "score": round(d.score, 3), "topic_share": round(d.topic_share, 4),
                               "topic_support": d.topic_support, "topic_docs": d.topic_docs,
                               "contrast_support": d.contrast_support} for d in found[:20]]},
        "classifier": {"trained_on": "documents discovery did not see: the topic's other half and validation "
                                     "documents; other categories' validation documents and as many training ones",
                       **cv},
        "generations": {"prompts": n_p, "samples_per_prompt": n_s, "total": n_p * n_s, "new_tokens": args.new_tokens,
                        "temperature": 1.0, "sample_top_k": 40},
        "other_ppl_docs": len(other_ids),
        "topic_rate_base": round(rate_b, 4), "topic_rate_base_ci": boot_rate(base["on"], n_p, n_s),
        "headline_size": head["size"], "prototypes_suppressed_share": head["share_of_bank"],
        "topic_rate_suppressed": head["topic_rate"], "topic_rate_drop": head["topic_rate_drop"],
        "topic_rate_drop_ci": head["topic_rate_drop_ci"], "other_ppl_base": round(base["ppl"], 4),
        "other_ppl_ratio": head["other_ppl_ratio"], "other_ppl_ratio_ci": head["other_ppl_ratio_ci"],
        "control_random": {k: ctrl[k] for k in ("size", "topic_rate", "topic_rate_drop", "topic_rate_drop_ci",
                                                 "other_ppl_ratio", "other_ppl_ratio_ci")},
        "targets": {"topic_rate_drop": ">= 0.75", "prototypes_suppressed_share": "<= 0.02", "other_ppl_ratio": "<= 1.02"},
        "select_effect": {
            "rule": ("greedy from discovery's top 50 by the tuning generations' loss increase on the topic minus "
                     "on the rest, contrast perplexity within 2%, at most 2% of the bank"),
            "budget": budget, "tuning": {"prompts": len(tune_ids), "samples_per_prompt": n_s,
                                         "generations_on_topic": int(tune_on.sum()), "generations": len(tune_gens),
                                         "contrast_docs": len(tune_docs)},
            "steps": [{"proto_id": st.proto_id, "effect": round(st.effect, 5),
                       "topic_loss_increase": round(st.topic_loss_increase, 5),
                       "other_loss_increase": round(st.other_loss_increase, 5),
                       "contrast_ppl_ratio": round(st.contrast_ppl_ratio, 5)} for st in steps],
            "prototypes": selected, "share_of_bank": round(len(selected) / K, 4), "seconds": round(sel_s, 1),
            "heldout": sel_eval, "control_random": sel_ctrl},
        "alpha_curve": alpha_curve, "projection": projection,
        "classifier_floor": floor, "whole_bank_suppressed": whole, "strict_judge": strict, "elicited_prompts": elicit,
        "reroute": reroute, "window_judge": window, "gated": gated,
        "curve": curve, "examples": {"base": base["examples"], **{f"suppressed_{k}": v for k, v in examples.items()}},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    plot(res, Path(args.plot))
    return finish(res, "steering.py", argv, args.out)


if __name__ == "__main__":
    main()
