"""Prototype discovery: the ranking math, masses against the stored arrays read apart, texts against
documents, and c-TF-IDF labels."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from prism_tda.engine import Attributor, layout
from prism_tda.engine.steering import PrototypeMass, c_tf_idf_labels, mass_of_tokens, rank_prototypes
from prism_tda.errors import QueryError


@pytest.fixture(scope="module")
def att(index):
    return Attributor.open(index)


def _mass(mass, support, docs, n_tokens, n_docs):
    return PrototypeMass(np.asarray(mass, float), np.asarray(support), np.asarray(docs), n_tokens, n_docs)


def test_ranking_prefers_specific_prototypes_and_needs_support():
    K = 4
    # prototype 0: 10x more mass per token on the topic; 1: as common on both; 2: topic-only on 2 tokens;
    # 3: absent from the topic
    topic = _mass([50, 10, 2, 0], [50, 10, 2, 0], [20, 5, 1, 0], 100, 20)
    contrast = _mass([50, 100, 0, 300], [50, 100, 0, 300], [40, 80, 0, 90], 1000, 200)
    got = rank_prototypes(topic, contrast, min_support=5, min_docs=2)
    assert [d.proto_id for d in got] == [0, 1]  # 2 lacks support, 3 never shows on the topic
    assert got[0].score == pytest.approx(np.log((0.5 + 0.5 / 100) / (0.05 + 0.5 / 1000)), rel=1e-9)
    assert got[0].topic_share == pytest.approx(50 / 62) and got[0].topic_support == 50
    assert len(rank_prototypes(topic, contrast, min_support=1, min_docs=1)) == 3
    with pytest.raises(QueryError):
        rank_prototypes(PrototypeMass.empty(K), contrast)


def test_mass_of_tokens_counts_mass_support_documents_and_contexts():
    protos = np.array([[0, 1], [0, 2], [1, 2], [0, 1]])
    acts = np.array([[0.5, 0.2], [0.3, 0.0], [0.4, 0.1], [0.9, 0.6]], dtype=np.float32)
    doc = np.array([0, 0, 1, 2])
    m = mass_of_tokens(protos, acts, doc, 3, np.arange(4) + 100)
    np.testing.assert_allclose(m.mass, [1.7, 1.2, 0.1], rtol=1e-6)
    assert m.support.tolist() == [3, 3, 1] and m.docs.tolist() == [2, 3, 1]  # an inactive slot counts nothing
    assert [w for _, w in m.top[0]] == [103, 100, 101] and m.top[0][0][0] == pytest.approx(0.9)


def test_document_mass_equals_the_stored_arrays_read_apart(att, index):
    """The mass the shards report for some documents equals a sum over the shard files themselves."""
    docs = np.arange(0, att.reader.n_docs, 3)
    got = att.shards.prototype_mass(docs)
    K = att.model.cfg.n_prototypes
    mass, support, n_tok = np.zeros(K), np.zeros(K, np.int64), 0
    m = layout.read_manifest(index)
    doc0 = 0
    want = set(docs.tolist())
    for sh in m.shards:
        d = layout.shard_dir(index, sh.unit)
        protos, acts_q = np.load(d / "protos.npy"), np.load(d / "acts.npy")
        tok0, seq_doc = np.load(d / "seq_tok0.npy"), np.load(d / "seq_doc.npy")
        for s in range(sh.n_seqs):
            if doc0 + int(seq_doc[s]) not in want:
                continue
            for t in range(tok0[s], tok0[s + 1]):
                n_tok += 1
                for p, q in zip(protos[t], acts_q[t], strict=True):
                    a = att.reader.act_table[int(p), int(q)]
                    if a > 0:
                        mass[int(p)] += a
                        support[int(p)] += 1
        doc0 += sh.n_docs
    assert got.n_tokens == n_tok and got.n_docs == len(docs)
    np.testing.assert_allclose(got.mass, mass, rtol=1e-5, atol=1e-6)
    assert np.array_equal(got.support, support)


def test_texts_of_documents_find_what_the_documents_find(att):
    """A topic given as the documents' own texts (recomputed by the model) ranks like the documents
    (read from the stored, quantised activations)."""
    docs = [d for d in range(att.reader.n_docs) if att.reader.document(d)["external_id"].startswith("art/")][:60]
    texts = [att.reader.document(d)["text"] for d in docs]
    by_docs, m_docs, _, what = att.discover(topic_docs=np.array(docs), n=10)
    by_text, m_text, _, _ = att.discover(topic_texts=texts, n=10)
    assert what == "the rest of the corpus"
    assert m_docs.n_tokens > 0 and m_text.n_tokens > 0  # the indexer's windows and the texts' are cut differently
    top_d, top_t = [d.proto_id for d in by_docs], [d.proto_id for d in by_text]
    assert len(set(top_d[:5]) & set(top_t[:10])) >= 4
    with pytest.raises(QueryError, match="topic"):
        att.discover()
    with pytest.raises(QueryError, match="out of range"):
        att.discover(topic_docs=np.array([att.reader.n_docs + 5]))


def test_c_tf_idf_labels_name_each_class_by_its_own_words():
    classes = {0: Counter({"cat": 5, "the": 9, "purr": 3}), 1: Counter({"dog": 6, "the": 9, "bark": 2}),
               2: Counter({"the": 9, "cat": 1, "dog": 1})}
    labels = c_tf_idf_labels(classes, n_words=2)
    assert labels[0] == ["cat", "purr"] and labels[1] == ["dog", "bark"]
    assert labels[2][0] == "the"  # nothing of its own: the common word is all it has


def test_logit_measure_is_the_per_token_view(att):
    """The logit measure of a text equals the sum, over its tokens, of each prototype's positive share
    of the next token's logit as the model's own decomposition gives it."""
    import torch

    text = att.reader.document(3)["text"]
    got = att.discover(topic_texts=[text], min_support=1, min_docs=1, n=1000, measure="logit")[1]
    ids_all, T = att.tokenizer.encode(text).ids, att.model.cfg.block_size
    want = np.zeros(att.model.cfg.n_prototypes)
    for s in range(0, len(ids_all) - 1, T):  # the model's context at a time
        ids = ids_all[s : s + T + 1]
        with torch.no_grad():
            dec = att.model.decompose(torch.tensor(ids[:-1]), tokens=torch.tensor(ids[1:]))
        for t in range(len(ids) - 1):
            for p, c in zip(dec.proto_idx[t].tolist(), dec.contrib[t].tolist(), strict=True):
                want[p] += max(c, 0.0)
    np.testing.assert_allclose(got.mass, want, rtol=1e-3, atol=1e-4)
    with pytest.raises(QueryError, match="measure"):
        att.discover(topic_texts=[text], measure="nonsense")


def test_label_windows_widen_to_whole_words(tiny_ckpt):
    """A context window cut inside a word is widened to the whole word (labels name no fragments)."""
    from prism_tda.engine.steering import word_window
    from prism_tda.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_ckpt / "tokenizer.json")
    text = "The unbelievably overcomplicated investigator was uncharacteristically quiet"
    ids = tok.encode(text).ids
    pieces = [tok.decode([i]) for i in ids]
    cuts = [i for i in range(1, len(ids) - 1) if pieces[i][:1].isalpha() and pieces[i - 1][-1:].isalpha()]
    assert cuts, pieces  # the tiny tokenizer splits these words
    for c in cuts:
        a, b = word_window(tok, ids, c, c + 1, most=len(ids))
        got = tok.decode(ids[a:b]).strip()
        assert got in text.split(), (pieces, c, got)  # exactly one whole word
        a, b = word_window(tok, ids, c, c + 1, most=1)  # the widening is bounded
        assert c - a <= 1 and b - (c + 1) <= 1


def test_selection_by_effect_is_greedy_on_the_measured_losses(tiny_ckpt):
    import math

    import torch
    import torch.nn.functional as F

    from prism_tda.engine.steering import EffectTexts, select_by_effect
    from prism_tda.model.checkpoint import load_checkpoint

    model, tok, _ = load_checkpoint(tiny_ckpt)
    enc = lambda ts: [tok.encode(t).ids for t in ts]  # noqa: E731
    texts = EffectTexts.of(model, (enc(["The picture of a computer screen.", "A computer program runs."]),
                                   enc(["It was a long time ago.", "She said nothing at all."]),
                                   enc(["Never trust a man who laughs.", "Life is what happens to you."])))
    # the cached losses are the model's own, with and without scaling
    ids = enc(["The picture of a computer screen."])[0]
    x = torch.tensor([ids[:-1]])
    with torch.no_grad():
        own = F.cross_entropy(model(x).logits[0], torch.tensor(ids[1:]))
        scaled = F.cross_entropy(model(x, suppress=torch.tensor([1, 2]), alpha=0.5).logits[0], torch.tensor(ids[1:]))
    one = EffectTexts.of(model, (enc(["The picture of a computer screen."]), [], []))
    assert float(one.nll(model, [])[0]) == pytest.approx(float(own), rel=1e-5)
    assert float(one.nll(model, [1, 2], 0.5)[0]) == pytest.approx(float(scaled), rel=1e-5)
    assert math.isnan(float(one.nll(model, [])[1]))
    # the first step is the best single candidate by effect among those within the perplexity bound
    cands = list(range(12))
    base = texts.nll(model, [])
    single = {c: (texts.nll(model, [c]) - base).tolist() for c in cands}
    allowed = {c: d[0] - d[1] for c, d in single.items() if math.exp(d[2]) <= 1.05}
    steps = select_by_effect(model, texts, cands, budget=3, max_ppl_ratio=1.05)
    assert steps and steps[0].proto_id == max(allowed, key=allowed.get)
    assert steps[0].effect == pytest.approx(allowed[steps[0].proto_id])
    assert all(s.contrast_ppl_ratio <= 1.05 for s in steps) and len(steps) <= 3
    assert all(b.effect > a.effect for a, b in zip(steps, steps[1:]))  # each step raises the effect
    # the incremental bookkeeping gives the whole set's effect as a fresh pass measures it
    d = (texts.nll(model, [st.proto_id for st in steps]) - base).tolist()
    assert steps[-1].effect == pytest.approx(d[0] - d[1], abs=1e-5)
    assert steps[-1].contrast_ppl_ratio == pytest.approx(math.exp(d[2]), abs=1e-6)
    with pytest.raises(QueryError):
        EffectTexts.of(model, ([], [], enc(["Never trust a man."])))
    # where the set's cost falls: each contrast text's summed loss rise, as a fresh pass of that text alone
    # measures it; the shares are of the whole contrast's rise, which the set's perplexity ratio gives
    chosen = [st.proto_id for st in steps]
    cost = texts.cost_by_text(model, chosen, top=5)
    contrast = enc(["Never trust a man who laughs.", "Life is what happens to you."])
    for c in cost:
        alone = EffectTexts.of(model, ([contrast[c["text"]]], [], []))
        rise = float(alone.nll(model, chosen)[0] - alone.nll(model, [])[0]) * c["tokens"]
        assert c["extra_nats"] == pytest.approx(rise, abs=1e-3) and c["tokens"] == len(contrast[c["text"]]) - 1
    total = float(d[2]) * int((texts.group == 2).sum())  # the mean rise per contrast token, times the tokens
    assert total > 0 and cost  # the set costs something on this contrast, so the texts are named
    if total > 0:
        assert sum(c["share"] for c in cost) == pytest.approx(sum(c["extra_nats"] for c in cost) / total, abs=1e-3)
    assert [c["extra_nats"] for c in cost] == sorted((c["extra_nats"] for c in cost), reverse=True)
    assert texts.cost_by_text(model, []) == []
    # the chosen set at each reported strength: at alpha 0 the last step's figures; at every alpha the losses a
    # fresh pass of the model with the set scaled gives (one text per group, its windows scored alone)
    strengths = texts.strengths(model, chosen)
    assert [r["alpha"] for r in strengths] == [0.0, 0.25, 0.5, 0.75]
    assert strengths[0]["effect"] == pytest.approx(steps[-1].effect, abs=1e-5)
    assert strengths[0]["contrast_ppl_ratio"] == pytest.approx(steps[-1].contrast_ppl_ratio, abs=1e-6)
    topic_one, contrast_one = enc(["A computer program runs."])[0], contrast[1]
    for r in strengths:
        rise = []
        for ids_ in (topic_one, contrast_one):
            x, y = torch.tensor([ids_[:-1]]), torch.tensor(ids_[1:])
            with torch.no_grad():
                rise.append(float(F.cross_entropy(model(x, suppress=torch.tensor(chosen), alpha=r["alpha"]).logits[0], y)
                                  - F.cross_entropy(model(x).logits[0], y)))
        alone = EffectTexts.of(model, ([topic_one], [], [contrast_one]))
        mine = {a["alpha"]: a for a in alone.strengths(model, chosen)}[r["alpha"]]
        assert mine["topic_loss_increase"] == pytest.approx(rise[0], abs=1e-5)
        assert mine["contrast_loss_increase"] == pytest.approx(rise[1], abs=1e-5)
        assert mine["effect"] == pytest.approx(rise[0] - rise[1], abs=1e-5)  # no other text: against the contrast
        assert mine["contrast_ppl_ratio"] == pytest.approx(math.exp(rise[1]), abs=1e-6)
    assert texts.strengths(model, []) == []
    # re-routed: the same greedy rule, its bookkeeping (each token encoded again without the set) equal to a
    # fresh pass of the model's re-routed removal
    rr = select_by_effect(model, texts, cands, budget=3, max_ppl_ratio=1.05, reroute=True)
    single_rr = {c: (texts.nll(model, [c], reroute=True) - base).tolist() for c in cands}
    allowed_rr = {c: d[0] - d[1] for c, d in single_rr.items() if math.exp(d[2]) <= 1.05}
    assert rr and rr[0].proto_id == max(allowed_rr, key=allowed_rr.get)
    # every step's set as a fresh pass measures it, over the whole bank, where a prototype removal makes
    # active on other tokens is chosen later (so the active sets the bookkeeping tracks must follow)
    K = model.cfg.n_prototypes
    deep = select_by_effect(model, texts, list(range(K)), budget=8, max_ppl_ratio=1.5, reroute=True)
    ids = [st.proto_id for st in deep]
    rerouted_in = False
    for i, st in enumerate(deep):
        d = (texts.nll(model, ids[: i + 1], reroute=True) - base).tolist()
        assert st.effect == pytest.approx(d[0] - d[1], abs=1e-5)
        assert st.contrast_ppl_ratio == pytest.approx(math.exp(d[2]), abs=1e-6)
        if i:
            now = model.head(texts.z.float(), exclude=torch.tensor(ids[:i])).proto_idx
            rerouted_in |= bool(((now == st.proto_id).any(1) & ~(texts.proto_idx == st.proto_id).any(1)).any())
    assert len(deep) >= 3 and rerouted_in
    assert len(rr) >= 2 and single_rr != single  # several steps; re-routing is not the plain removal
    with pytest.raises(QueryError, match="alpha must be 0"):
        select_by_effect(model, texts, cands, budget=2, alpha=0.5, reroute=True)


def test_labels_name_what_the_top_contexts_share(tiny_ckpt, index):
    """A label's quoted tokens are tokens its prototype fires on in at least 30% of its top 10 contexts, its
    words are in that many of their windows, and the tokens after the arrow follow that often; a prototype
    whose contexts share nothing keeps the earlier rule's c-TF-IDF words (no quotes)."""
    from prism_tda.engine.reader import IndexReader
    from prism_tda.engine.reads import token_context
    from prism_tda.engine.steering import WORD, label_parts, prototype_labels, token_form, word_window, words
    from prism_tda.model import checkpoint as ckpt

    model, tok, _ = ckpt.load_checkpoint(tiny_ckpt)
    reader = IndexReader(index)
    labels = prototype_labels(reader, model, tok)
    earlier = prototype_labels(reader, model, tok, min_share=2.0)
    assert not any('"' in v for v in earlier.values())
    n_tokens = 0
    for p, label in labels.items():
        ctx = reader.top_contexts(p, 10)
        need = max(2, -(-3 * len(ctx) // 10))
        fired, after, windows = [], [], []
        for row, _ in ctx:
            _, _, pos, ids = token_context(reader, row)
            fired.append(token_form(tok.decode([ids[pos]])))
            after.append(token_form(tok.decode([ids[pos + 1]])) if pos + 1 < len(ids) else None)
            a, b = word_window(tok, ids, max(0, pos - 6), min(len(ids), pos + 6))
            windows.append({w for m in WORD.finditer(tok.decode(ids[a:b])) for w in words(m.group(0))})
        tokens, label_words = label_parts(label)
        if not tokens and all(sum(w in win for win in windows) < need for w in label_words):
            assert label == earlier[p]  # nothing shared: the earlier rule's words
            continue
        n_tokens += bool(tokens)
        assert all(fired.count(t) >= need for t in tokens), (p, label, fired)
        assert all(sum(w in win for win in windows) >= need for w in label_words), (p, label)
        if " → " in label:
            assert all(after.count(t) >= need for t in label_parts(label.split(" → ", 1)[1])[0]), (p, label, after)
    assert n_tokens > 0
