"""Which prototypes carry a topic: discovery from examples, and a few words to name each prototype.

**Discovery.** A topic is given by example texts (run through the model) or by training documents
of the index (read from the shards' stored activations); the contrast by other texts, other
documents, or by default the rest of the corpus (the prototypes table's totals minus the topic's
part when the topic's documents are in the index). A prototype's specificity is the log-ratio of
its activation mass per token on the topic and on the contrast, each smoothed by half a token's
mean activation (``smoothing``), so that a prototype never seen in the contrast does not win on a
handful of tokens; prototypes active on fewer than ``min_support`` topic tokens or in fewer than
``min_docs`` topic documents are left out. Each ranked prototype comes with its evidence: topic
and contrast support, the share of the topic's activation mass it carries, and its strongest
topic contexts.

**Labels.** What a prototype's top contexts share, in two parts. First the tokens it fires on: each
activating token form (whitespace shown as ``↵`` and ``⇥``, a leading space dropped) that fires in at
least ``min_share`` of the contexts, in quotes, most common first. Then context words that most of
them share: class-based TF-IDF (each prototype a class) over the words of each context (the
6 tokens either side of the activating one, widened to whole words), each counted once per
context, kept when at least ``min_share`` of the contexts hold them. After an arrow, the tokens that follow the activating
one in at least ``min_share`` of the contexts (at most two), when it has tokens. A prototype whose contexts
share neither is named as before this rule, by the top c-TF-IDF words of its contexts (the
activating word counted double) and of its logit signature. ``label_parts`` reads a label back.
"""

from __future__ import annotations

import math
import re
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tokenizers import Tokenizer

from prism_tda.errors import QueryError, check_stop
from prism_tda.model import PRISM

from .arrays import unique
from .reads import Reads, token_context
from .tokens import run_batch


@dataclass
class PrototypeMass:
    """Activation mass per prototype over some tokens, and where it was strongest."""

    mass: np.ndarray  # (K,) sum of activations
    support: np.ndarray  # (K,) tokens on which the prototype is active
    docs: np.ndarray  # (K,) documents (or texts) in which it is active
    n_tokens: int
    n_docs: int
    # per prototype, its strongest tokens: (activation, where) with ``where`` a global token row or
    # (text, position) for pasted texts
    top: dict[int, list[tuple[float, object]]] = field(default_factory=dict)

    @classmethod
    def empty(cls, K: int) -> PrototypeMass:
        return cls(np.zeros(K), np.zeros(K, np.int64), np.zeros(K, np.int64), 0, 0)

    def __add__(self, other: PrototypeMass) -> PrototypeMass:
        top = {p: sorted(self.top.get(p, []) + other.top.get(p, []), key=lambda x: -x[0])[:TOP]
               for p in set(self.top) | set(other.top)}
        return PrototypeMass(self.mass + other.mass, self.support + other.support, self.docs + other.docs,
                             self.n_tokens + other.n_tokens, self.n_docs + other.n_docs, top)

    def __sub__(self, other: PrototypeMass) -> PrototypeMass:
        return PrototypeMass(np.maximum(self.mass - other.mass, 0), np.maximum(self.support - other.support, 0),
                             np.maximum(self.docs - other.docs, 0), max(self.n_tokens - other.n_tokens, 0),
                             max(self.n_docs - other.n_docs, 0))


TOP = 5  # strongest contexts kept per prototype
STRENGTHS = (0.0, 0.25, 0.5, 0.75)  # the strengths a selected set's effect and cost are reported at


MEASURES = ("activation", "logit")


def token_weights(protos: np.ndarray, acts: np.ndarray, targets: np.ndarray, measure: str,
                  signature: torch.Tensor | None) -> np.ndarray:
    """What each active slot counts (n, k): its activation, or (``logit``) the positive part of its
    share of the logit of the token that follows, ``a_{t,i} (W p_i)_{y_t}`` (the per-token view)."""
    if measure == "activation":
        return acts
    if measure != "logit" or signature is None:
        raise QueryError(f"measure: must be one of {list(MEASURES)}, got {measure!r}")
    s = signature[torch.from_numpy(np.asarray(protos, np.int64)), torch.from_numpy(np.asarray(targets, np.int64))[:, None]]
    return np.where(acts > 0, np.maximum(acts * s.numpy(), 0.0), 0.0).astype(np.float32)


def mass_of_tokens(protos: np.ndarray, acts: np.ndarray, doc: np.ndarray, K: int, where: list | np.ndarray,
                   *, keep_top: bool = True) -> PrototypeMass:
    """The mass of tokens with active prototypes ``protos`` (n, k), activations (or other non-negative
    weights) ``acts`` (n, k), the document of each (n,), and each token's place ``where`` (n,)."""
    live = acts > 0
    p, a = protos[live], acts[live].astype(np.float64)
    mass = np.bincount(p, weights=a, minlength=K)
    support = np.bincount(p, minlength=K)
    rows = np.nonzero(live)[0]
    pairs = np.unique(np.stack([p, np.asarray(doc)[rows]], 1), axis=0) if len(p) else np.zeros((0, 2), np.int64)
    docs = np.bincount(pairs[:, 0], minlength=K) if len(pairs) else np.zeros(K, np.int64)
    top: dict[int, list[tuple[float, object]]] = {}
    if keep_top and len(p):
        order = np.lexsort((-a, p))  # by prototype, strongest first
        ps = p[order]
        first = np.r_[True, ps[1:] != ps[:-1]]
        starts = np.nonzero(first)[0]
        ends = np.r_[starts[1:], len(ps)]
        for s, e in zip(starts, ends, strict=True):
            sel = order[s : min(e, s + TOP)]
            top[int(ps[s])] = [(float(a[i]), where[int(rows[i])]) for i in sel]
    return PrototypeMass(mass, support.astype(np.int64), docs.astype(np.int64), int(len(protos)),
                         int(len(unique(doc))) if len(doc) else 0, top)


@torch.no_grad()
def text_mass(model: PRISM, tokenizer: Tokenizer, texts: list[str], *, batch_size: int = 16,
              measure: str = "activation") -> PrototypeMass:
    """The mass of example texts, each cut into windows of the model's context; ``where`` of a token
    is (text index, token position in the text)."""
    K, T = model.cfg.n_prototypes, model.cfg.block_size
    windows: list[tuple[int, int, list[int]]] = []  # (text, first position, tokens)
    for i, t in enumerate(texts):
        ids = tokenizer.encode(t).ids
        if len(ids) < 2:
            raise QueryError(f"texts[{i}]: fewer than 2 tokens; give longer examples")
        for s in range(0, len(ids) - 1, T):
            windows.append((i, s, ids[s : s + T + 1]))
    out = PrototypeMass.empty(K)
    sig = signature_matrix(model) if measure == "logit" else None
    pairs = []  # (prototype, text) of every active slot: a text's windows may fall in several batches
    for b in range(0, len(windows), batch_size):
        chunk = windows[b : b + batch_size]
        tb = run_batch(model, [w[2][:-1] for w in chunk], [w[2][1:] for w in chunk])
        row, pos = tb.row.numpy(), tb.pos.numpy()
        of_text = np.array([chunk[r][0] for r in row], dtype=np.int64)
        where = [(int(of_text[j]), int(chunk[row[j]][1] + pos[j])) for j in range(len(row))]
        protos = tb.proto_idx.numpy()
        acts = token_weights(protos, tb.acts.float().numpy(), tb.targets.numpy(), measure, sig)
        out = out + mass_of_tokens(protos, acts, of_text, K, where)
        live = acts > 0
        pairs.append(np.stack([protos[live], np.broadcast_to(of_text[:, None], protos.shape)[live]], 1))
    both = np.unique(np.concatenate(pairs), axis=0)
    out.docs = np.bincount(both[:, 0], minlength=K).astype(np.int64)
    out.n_docs = len(texts)
    return out


def signature_matrix(model: PRISM) -> torch.Tensor:
    """(K, V) every prototype's token-logit signature ``W p_i``."""
    assert model.head is not None, "a PRISM model has prototypes; the dense baseline has none"
    return (model.head.prototypes.float() @ model.W.float().T).detach()


@dataclass
class Discovered:
    """One prototype that carries the topic, and the evidence."""

    proto_id: int
    score: float  # log-ratio of activation mass per token, topic / contrast (smoothed)
    topic_share: float  # share of the topic's activation mass this prototype carries
    topic_rate: float  # activation mass per topic token
    contrast_rate: float  # activation mass per contrast token
    topic_support: int  # topic tokens on which it is active
    topic_docs: int  # topic documents (texts) in which it is active
    contrast_support: int
    contexts: list[tuple[float, object]]  # its strongest topic tokens: (activation, where)


def rank_prototypes(topic: PrototypeMass, contrast: PrototypeMass, *, min_support: int = 5, min_docs: int = 2,
                    smoothing: float = 0.5, n: int | None = None) -> list[Discovered]:
    """Prototypes by how specifically they carry the topic (see the module docstring), best first."""
    if topic.n_tokens == 0:
        raise QueryError("topic: no tokens; give example texts or documents")
    if contrast.n_tokens == 0:
        raise QueryError("contrast: no tokens; give contrast texts or documents, or leave it to the corpus")
    mean_act = float(contrast.mass.sum() / max(contrast.support.sum(), 1)) or 1.0
    eps_t, eps_c = smoothing * mean_act / topic.n_tokens, smoothing * mean_act / contrast.n_tokens
    rate_t, rate_c = topic.mass / topic.n_tokens, contrast.mass / contrast.n_tokens
    score = np.log((rate_t + eps_t) / (rate_c + eps_c))
    ok = (topic.support >= min_support) & (topic.docs >= min_docs)
    ids = np.nonzero(ok)[0]
    ids = ids[np.lexsort((ids, -score[ids]))][: n or len(ids)]
    total = float(topic.mass.sum()) or 1.0
    return [Discovered(int(i), float(score[i]), float(topic.mass[i] / total), float(rate_t[i]), float(rate_c[i]),
                       int(topic.support[i]), int(topic.docs[i]), int(contrast.support[i]), topic.top.get(int(i), []))
            for i in ids]


# ---------------------------------------------------------------------------- labels
WORD = re.compile(r"[A-Za-z][A-Za-z'\-]{2,}")
STOP = frozenset("""the and for that with this from have was are not but you your all any can had her his its one our
out they their them then there these this were what when where which who will would could should about into over
than too very just also more most some such only other been being does did doing has him she how why whom yet
""".split())


def words(text: str) -> list[str]:
    return [w for w in (m.group(0).lower().strip("'-") for m in WORD.finditer(text)) if len(w) > 2 and w not in STOP]


def word_window(tokenizer: Tokenizer, ids: list[int], a: int, b: int, most: int = 4) -> tuple[int, int]:
    """The token window ``[a, b)`` of ``ids`` widened (by at most ``most`` tokens a side) to whole words: a
    window cut inside a word would name a prototype by a fragment ("estigator" of "investigator")."""

    def inside(i: int) -> bool:  # token i continues the word of token i - 1
        piece, prev = tokenizer.decode([ids[i]]), tokenizer.decode([ids[i - 1]])
        return bool(piece[:1].isalpha() and prev[-1:].isalpha())

    lo, hi = a, b
    while lo > 0 and a - lo < most and inside(lo):
        lo -= 1
    while hi < len(ids) and hi - b < most and inside(hi):
        hi += 1
    return lo, hi


def token_form(piece: str) -> str:
    """A token as a label shows it: a leading space dropped, newlines and tabs made visible."""
    piece = piece[1:] if piece.startswith(" ") and piece.strip() else piece
    return piece.replace("\n", "↵").replace("\t", "⇥")


QUOTED = re.compile(r'"([^"]+)"')


def label_parts(label: str) -> tuple[set[str], set[str]]:
    """(token forms, words) of a label ``prototype_labels`` made: the quoted tokens it fires on, and the
    words of the rest, up to the arrow that introduces the tokens that follow."""
    label = label.split(" → ", 1)[0]
    return set(QUOTED.findall(label)), set(words(QUOTED.sub(" ", label)))


def prototype_labels(reader: Reads, model: PRISM, tokenizer: Tokenizer, *, n_contexts: int = 10, n_signature: int = 10,
                     n_words: int = 3, min_share: float = 0.3) -> dict[int, str]:
    """A few tokens and words naming each prototype (see the module docstring); ``reader``: an index
    reader (``engine/reader.py``)."""
    K = model.cfg.n_prototypes
    _, sig = model.signatures(None, n_signature)
    weighted: dict[int, Counter] = {}  # the fallback's classes: words weighted by where they sit
    shared: dict[int, Counter] = {}  # words counted once per context
    fired: dict[int, Counter] = {}
    followed: dict[int, Counter] = {}  # the token after the activating one
    n_ctx: dict[int, int] = {}
    for p in range(K):
        c: Counter = Counter()
        once: Counter = Counter()
        forms: Counter = Counter()
        after: Counter = Counter()
        contexts = reader.top_contexts(p, n_contexts)
        for row, _ in contexts:
            _, _, pos, ids = token_context(reader, row)
            forms[token_form(tokenizer.decode([ids[pos]]))] += 1
            if pos + 1 < len(ids):
                after[token_form(tokenizer.decode([ids[pos + 1]]))] += 1
            a, b = word_window(tokenizer, ids, max(0, pos - 6), min(len(ids), pos + 6))
            start, end = len(tokenizer.decode(ids[a:pos])), len(tokenizer.decode(ids[a : pos + 1]))
            seen: set[str] = set()
            for m in WORD.finditer(tokenizer.decode(ids[a:b])):
                for w in words(m.group(0)):
                    # the whole word the token is part of counts double; its neighbours once
                    c[w] += 2 if m.start() < end and m.end() > start else 1
                    seen.add(w)
            once.update(seen)
        c.update(words(" ".join(tokenizer.decode([int(t)]) for t in sig[p].tolist())))
        weighted[p], shared[p], fired[p], n_ctx[p] = c, once, forms, len(contexts)
        followed[p] = after
    fallback = c_tf_idf_labels(weighted, n_words)
    ranked = c_tf_idf_labels(shared, len(max(shared.values(), key=len, default=())))
    out = {}

    def most(c: Counter, need: int, n: int) -> list[str]:
        return [t for t, k in sorted(c.items(), key=lambda x: (-x[1], x[0])) if k >= need and t.strip()
                and '"' not in t and "→" not in t][:n]

    for p in range(K):
        need = max(2, math.ceil(min_share * n_ctx[p]))
        tokens = most(fired[p], need, n_words)
        named = {t.lower() for t in tokens}
        common = [w for w in ranked.get(p, []) if shared[p][w] >= need and w not in named][: max(0, n_words - len(tokens))]
        nxt = most(followed[p], need, 2) if tokens else []
        if tokens or common:
            out[p] = " ".join([*(f'"{t}"' for t in tokens), *common, *(["→", *(f'"{t}"' for t in nxt)] if nxt else [])])
        elif fallback.get(p):
            out[p] = " ".join(fallback[p])
    return out


def c_tf_idf_labels(classes: dict[int, Counter], n_words: int = 3) -> dict[int, list[str]]:
    """Top words of each class by class-based TF-IDF: ``tf(w, c) * log(1 + A / f(w))`` with ``A`` the mean
    number of words per class and ``f(w)`` the word's count over every class."""
    f: Counter = Counter()
    for c in classes.values():
        f.update(c)
    A = (sum(sum(c.values()) for c in classes.values()) / max(len(classes), 1)) or 1.0
    out = {}
    for k, c in classes.items():
        n = sum(c.values()) or 1
        scored = sorted(((v / n) * math.log(1 + A / f[w]), w) for w, v in c.items())
        out[k] = [w for _, w in sorted(scored, key=lambda x: (-x[0], x[1]))[:n_words]]
    return out


# ---------------------------------------------------------------------------- selection by measured effect
@dataclass
class EffectTexts:
    """Final hidden states of texts in three groups, computed once: scaling prototypes changes only the
    head's mixing, never the backbone, so every candidate set is scored from these without rerunning it.
    Groups: 0 the topic, 1 other text the model should keep writing (its loss is the baseline the
    topic's is measured against), 2 the contrast whose perplexity bounds the cost."""

    z: torch.Tensor  # (N, d)
    y: torch.Tensor  # (N,) next-token targets
    group: torch.Tensor  # (N,) 0, 1 or 2
    proto_idx: torch.Tensor  # (N, k) the active prototypes
    acts: torch.Tensor  # (N, k) their activations
    text: torch.Tensor | None = None  # (N,) the text of its group each row came from (its index there)

    @classmethod
    @torch.no_grad()
    def of(cls, model: PRISM, groups: tuple[list[list[int]], list[list[int]], list[list[int]]],
           batch_size: int = 16, stop: threading.Event | None = None,
           on_progress: Callable[[int, int], None] | None = None) -> EffectTexts:
        """Token ids per group, each text cut into windows of the model's context. ``stop``: checked before
        each batch (``Cancelled``); ``on_progress(windows done, windows)`` after each."""
        T = model.cfg.block_size
        zs, ys, gs, ps, acts, ts = [], [], [], [], [], []
        per_group = [[(w, j) for j, ids in enumerate(texts) for w in (ids[s : s + T + 1]
                      for s in range(0, max(len(ids) - 1, 1), T)) if len(w) > 1] for texts in groups]
        n_windows, done = sum(map(len, per_group)), 0
        for g, windows in enumerate(per_group):
            for b in range(0, len(windows), batch_size):
                check_stop(stop, "selection by effect")
                chunk = [w for w, _ in windows[b : b + batch_size]]
                tb = run_batch(model, [w[:-1] for w in chunk], [w[1:] for w in chunk])
                zs.append(tb.z.float())
                ys.append(tb.targets)
                gs.append(torch.full((len(tb.targets),), g, dtype=torch.long))
                # run_batch's rows are each window's positions in order, window after window
                ts.append(torch.repeat_interleave(torch.tensor([j for _, j in windows[b : b + batch_size]]),
                                                  torch.tensor([len(w) - 1 for w in chunk])))
                assert len(ts[-1]) == len(tb.targets), "a window's positions are not all rows of its batch"
                ps.append(tb.proto_idx)
                acts.append(tb.acts.float())
                done += len(chunk)
                if on_progress is not None:
                    on_progress(done, n_windows)
        if not any(len(t) for t in groups[0]):
            raise QueryError("selection by effect needs topic text of at least 2 tokens")
        return cls(torch.cat(zs), torch.cat(ys), torch.cat(gs), torch.cat(ps), torch.cat(acts), torch.cat(ts))

    @torch.no_grad()
    def nll(self, model: PRISM, ids: list[int], alpha: float = 0.0, chunk: int = 4096, reroute: bool = False
            ) -> torch.Tensor:
        """(3,) mean next-token loss per group with prototypes ``ids`` scaled by ``alpha`` (or removed with
        re-routing, ``reroute``; nan: empty group)."""
        W = model.W.float()
        total = torch.zeros(3, dtype=torch.float64)
        for b in range(0, len(self.y), chunk):
            z = self.z[b : b + chunk]
            if ids:
                z = model.steered_hidden(z[None], torch.tensor(ids), alpha, reroute=reroute)[0].float()
            loss = torch.nn.functional.cross_entropy(z @ W.T, self.y[b : b + chunk], reduction="none")
            total.index_add_(0, self.group[b : b + chunk], loss.double())
        n = torch.bincount(self.group, minlength=3).double()
        return total / n.where(n > 0, torch.tensor(float("nan"), dtype=torch.float64))

    @torch.no_grad()
    def rises(self, model: PRISM, ids: list[int], alphas: Sequence[float], chunk: int = 4096) -> torch.Tensor:
        """(len(alphas), N) float64: each row's next-token loss increase with prototypes ``ids`` scaled by each
        alpha. Scaling changes a row only where one of them is active, so only those rows are unembedded (their
        unscaled loss once for every alpha); the rest are 0."""
        out = torch.zeros(len(alphas), len(self.y), dtype=torch.float64)
        if not ids:
            return out
        sel = torch.tensor(ids, dtype=torch.long)
        rows = torch.isin(self.proto_idx, sel).any(1).nonzero().flatten()
        W = model.W.float()
        ce = torch.nn.functional.cross_entropy
        for b in range(0, len(rows), chunk):
            r = rows[b : b + chunk]
            z, y = self.z[r].float(), self.y[r]
            own = ce(z @ W.T, y, reduction="none")
            for i, a in enumerate(alphas):
                zs = model.steered_hidden(z[None], sel, a)[0].float()
                out[i, r] = (ce(zs @ W.T, y, reduction="none") - own).double()
        return out

    @torch.no_grad()
    def strengths(self, model: PRISM, ids: list[int], alphas: tuple[float, ...] = STRENGTHS
                  ) -> list[dict[str, float]]:
        """What scaling prototypes ``ids`` by each of ``alphas`` does, measured as :func:`select_by_effect`
        measures a set: per alpha the topic's loss increase, the reference's (the other text's, or the
        contrast's when there is none), their difference ``effect``, the contrast's loss increase and its
        perplexity ratio. A lower strength often keeps most of the effect for a fraction of the cost
        (``docs/benchmarks.md``, "Steering under a judge precise enough")."""
        if not ids:
            return []
        n = torch.bincount(self.group, minlength=3).double()
        other = 1 if n[1] > 0 else 2
        per_group = torch.zeros(len(alphas), 3, dtype=torch.float64).index_add_(1, self.group,
                                                                                self.rises(model, ids, alphas))
        out = []
        for a, d in zip(alphas, (per_group / n.clamp_min(1)).tolist(), strict=True):
            out.append({"alpha": a, "effect": d[0] - d[other], "topic_loss_increase": d[0],
                        "contrast_loss_increase": d[2], "contrast_ppl_ratio": math.exp(d[2])})
        return out

    @torch.no_grad()
    def cost_by_text(self, model: PRISM, ids: list[int], group: int = 2, alpha: float = 0.0, top: int = 3
                     ) -> list[dict[str, float | int]]:
        """Where scaling prototypes ``ids`` by ``alpha`` costs in ``group`` (the contrast by default): the ``top``
        texts whose summed next-token loss rises most, each with ``text`` (its index in the group), ``tokens``,
        ``extra_nats`` and ``share`` of the group's whole rise. A set's perplexity cost often sits on a few texts
        (``docs/benchmarks.md``, conditional suppression); this names them."""
        if self.text is None:
            raise ValueError("cost_by_text: these texts were built without their text index")
        rows = (self.group == group).nonzero().flatten()
        if not len(rows) or not ids:
            return []
        rise = self.rises(model, ids, [alpha])[0, rows]
        text = self.text[rows]
        n_texts = int(text.max()) + 1
        per = torch.zeros(n_texts, dtype=torch.float64).index_add_(0, text, rise)
        tokens = torch.bincount(text, minlength=n_texts)
        total = float(rise.sum())
        order = torch.argsort(per, descending=True)[:top]
        return [{"text": int(j), "tokens": int(tokens[j]), "extra_nats": round(float(per[j]), 4),
                 "share": round(float(per[j]) / total, 4) if total > 0 else 0.0}
                for j in order.tolist() if float(per[j]) > 0]


@dataclass
class EffectStep:
    """One prototype added by :func:`select_by_effect`, with the set's measured effect once it is in."""

    proto_id: int
    effect: float  # the topic's loss increase minus the other text's (nats per token)
    topic_loss_increase: float
    other_loss_increase: float
    contrast_ppl_ratio: float


def select_by_effect(model: PRISM, texts: EffectTexts, candidates: list[int], *, budget: int,
                     max_ppl_ratio: float = 1.02, alpha: float = 0.0, reroute: bool = False, progress: bool = False,
                     stop: threading.Event | None = None,
                     on_progress: Callable[[int, int], None] | None = None) -> list[EffectStep]:
    """Greedy forward selection of at most ``budget`` prototypes from ``candidates`` by their measured
    effect at strength ``alpha``: each step adds the candidate that most raises the topic's next-token loss
    relative to the other text's (group 1; the contrast's when group 1 is empty), among those that keep
    the contrast's perplexity within ``max_ppl_ratio`` of the unscaled model's; it stops at the budget or
    when no candidate raises the effect further (so a set is never chosen whose effect is not positive).
    ``reroute`` (``alpha`` 0): the set is removed with re-routing (:meth:`PRISM.steered_hidden`): a
    candidate's tokens are encoded again without the set and it, the next-nearest prototypes taking their place.
    ``stop``: checked before each candidate (``Cancelled``). ``on_progress(done, total)``: called after each
    candidate evaluated, ``total`` being the most evaluations the selection can take (it jumps to ``total``
    when the selection stops early)."""
    # Scaling a set adds sum_{i in S & K_t} (alpha - 1) a_{t,i} p_i to z_t: additive over the set's members,
    # and a member changes only the tokens where it is active. So each step keeps every token's current
    # hidden state and loss, and a candidate costs one unembedding of its own tokens, not of all of them.
    assert model.head is not None
    if reroute and alpha != 0.0:
        raise QueryError("reroute: removes the set; alpha must be 0")
    W, P = model.W.float(), model.head.prototypes.float()

    def losses(z: torch.Tensor, y: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        return torch.cat([torch.nn.functional.cross_entropy(z[b : b + chunk] @ W.T, y[b : b + chunk], reduction="none")
                          for b in range(0, len(y), chunk)]).double() if len(y) else torch.zeros(0, dtype=torch.float64)

    def group_sums(rows_group: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(3, dtype=torch.float64).index_add_(0, rows_group, values)

    with torch.no_grad():
        z_cur = texts.z.float().clone()
        loss_cur = losses(z_cur, texts.y)
        n = torch.bincount(texts.group, minlength=3).double()
        n = n.where(n > 0, torch.tensor(float("nan"), dtype=torch.float64))
        sums = group_sums(texts.group, loss_cur)
        base = sums / n
        other = 1 if not bool(torch.isnan(base[1])) else 2
        chosen: list[int] = []
        steps: list[EffectStep] = []
        pool = list(dict.fromkeys(int(c) for c in candidates))
        if reroute:  # each token's active set in the current state, and the unsteered residual it keeps
            cur_idx = texts.proto_idx.clone()
            residual = texts.z.float() - model.head(texts.z.float()).zhat
        else:  # the active sets never change: each candidate's tokens and its activation there, once
            where = {}
            for c in pool:
                hit = texts.proto_idx == c
                rows = hit.any(1).nonzero().flatten()
                where[c] = (rows, (texts.acts * hit).sum(1)[rows])

        def changed(c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
            """The rows that removing ``c`` (on top of the chosen set) changes, their new hidden states and,
            re-routed, their new active sets (encoded again from ``z`` without the set and ``c``)."""
            if not reroute:
                rows, a = where[c]
                return rows, z_cur[rows] + (alpha - 1.0) * a[:, None] * P[c], None
            assert model.head is not None
            rows = (cur_idx == c).any(1).nonzero().flatten()
            h = model.head(texts.z[rows].float(), exclude=torch.tensor(chosen + [c], dtype=torch.long))
            return rows, residual[rows] + h.zhat, h.proto_idx

        total = sum(len(pool) - k for k in range(min(budget, len(pool))))  # evaluations if no early stop
        done = 0
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="select by effect", unit="set")
        for _ in range(budget):
            best: tuple[EffectStep, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                        torch.Tensor | None] | None = None
            for c in pool:
                if c in chosen:
                    continue
                check_stop(stop, "selection by effect")
                rows, z_new, idx_new = changed(c)
                loss_new = losses(z_new, texts.y[rows])
                g = texts.group[rows]
                new_sums = sums - group_sums(g, loss_cur[rows]) + group_sums(g, loss_new)
                d = (new_sums / n - base).tolist()
                ratio = math.exp(d[2]) if not math.isnan(d[2]) else 1.0
                step = EffectStep(c, d[0] - d[other], d[0], d[other], ratio)
                if bar is not None:
                    bar.update()
                done += 1
                if on_progress is not None:
                    on_progress(done, total)
                if ratio <= max_ppl_ratio and (best is None or step.effect > best[0].effect):
                    best = (step, rows, z_new, loss_new, new_sums, idx_new)
            if best is None or best[0].effect <= (steps[-1].effect if steps else 0.0):
                break
            step, rows, z_new, loss_new, sums, idx_new = best
            z_cur[rows], loss_cur[rows] = z_new, loss_new
            if idx_new is not None:
                cur_idx[rows] = idx_new
            chosen.append(step.proto_id)
            steps.append(step)
        if bar is not None:
            bar.close()
        if on_progress is not None and done < total:
            on_progress(total, total)
    return steps
