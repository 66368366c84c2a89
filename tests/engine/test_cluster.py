"""Shards held by Ray actors of a local cluster answer exactly what one process answers; an actor
killed mid-loop costs at most a clear error, never a wrong answer."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from prism_tda.engine import Attributor, QueryOptions, QuerySpec
from prism_tda.engine.shards import place_shards

ray = pytest.importorskip("ray")

from prism_tda.engine.cluster import ClusterSpec  # noqa: E402
from prism_tda.errors import ShardUnavailable  # noqa: E402

pytestmark = pytest.mark.slow  # Ray: the slow tier

QUERIES = [QuerySpec("A computer", " is a machine"), QuerySpec("The cat sat on the", " mat"),
           QuerySpec("Water is made of"), QuerySpec("The history of", " the city", target_index=1)]
OPTIONS = [QueryOptions(n_documents=8), QueryOptions(n_documents=8, aggregation="cosine_sum"),
           QueryOptions(n_documents=8, aggregation="cosine_match"), QueryOptions(n_documents=8, aggregation="raw_max"),
           QueryOptions(n_documents=6, opponents=True), QueryOptions(n_documents=8, include_untrained=True,
                                                                     exact_rerank=4, n_candidates=16)]



@pytest.fixture(scope="module")
def single(index):
    return Attributor.open(index)


def same_answer(a, b) -> None:
    assert [d.doc_id for d in a.documents] == [d.doc_id for d in b.documents]
    np.testing.assert_allclose([d.score for d in a.documents], [d.score for d in b.documents], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose([d.value for d in a.documents], [d.value for d in b.documents], rtol=1e-5, atol=1e-9)
    assert [d.token_row for d in a.documents] == [d.token_row for d in b.documents]
    assert [d.snippet for d in a.documents] == [d.snippet for d in b.documents]
    assert [d.trained for d in a.documents] == [d.trained for d in b.documents]
    assert a.tokens_scored == b.tokens_scored and not b.partial


def test_placement_balances_tokens():
    groups = place_shards([100, 10, 90, 20, 50], 2)
    assert sorted(s for g in groups for s in g) == [0, 1, 2, 3, 4]
    loads = [sum([100, 10, 90, 20, 50][s] for s in g) for g in groups]
    assert max(loads) - min(loads) <= 20
    assert place_shards([5, 5], 4) == [[0], [1]]  # no empty holders


@pytest.mark.parametrize("actors", [2, 3])
def test_cluster_returns_the_single_process_answer(local_ray, single, index, actors):
    n_shards = len(single.manifest.shards)
    assert n_shards >= 3, "the test index must have several shards"
    att = Attributor.open(index, cluster=ClusterSpec(actors=actors, num_cpus=0.5, call_timeout_s=60))
    try:
        assert len(att.shards.groups) == actors
        for spec in QUERIES:
            for opt in OPTIONS:
                same_answer(single.attribute(spec, opt), att.attribute(spec, opt))
        ex = QueryOptions(n_documents=5, mode="exact")
        same_answer(single.attribute(QUERIES[0], ex), att.attribute(QUERIES[0], ex))
        # what the service reads besides attribution, through the actors
        for d in (0, single.reader.n_docs // 2, single.reader.n_docs - 1):
            assert att.reader.document(d) == single.reader.document(d)
        for p in (0, 7):
            assert att.reader.top_contexts(p, 5) == single.reader.top_contexts(p, 5)
        docs = np.arange(single.reader.n_docs)
        assert np.array_equal(att.reader.trained(docs), single.reader.trained(docs))
    finally:
        att.close()


def test_a_dead_shard_is_named_or_left_out_when_asked(local_ray, single, index):
    att = Attributor.open(index, cluster=ClusterSpec(actors=2, num_cpus=0.5, call_timeout_s=20))
    try:
        gone = att.shards.groups[1]
        ray.kill(att.shards.actors[1], no_restart=True)  # for good: no restart to wait for
        with pytest.raises(ShardUnavailable) as e:
            att.attribute(QUERIES[0], QueryOptions(n_documents=8))
        assert e.value.shards == gone and str(gone) in str(e.value)
        res = att.attribute(QUERIES[0], QueryOptions(n_documents=8, allow_partial=True))
        assert res.partial and res.missing_shards == gone
        shard_of = np.searchsorted(single.reader.doc_base, [d.doc_id for d in res.documents], side="right") - 1
        assert len(res.documents) and not set(shard_of.tolist()) & set(gone)
        # the documents the other shards hold keep their single-process scores
        full = single.attribute(QUERIES[0], QueryOptions(n_documents=50, exact_rerank=64, include_untrained=True))
        exact = {d.doc_id: d.score for d in full.documents}
        for d in res.documents:
            if d.doc_id in exact:
                assert d.score == pytest.approx(exact[d.doc_id], rel=1e-6)
        # a sum over whole documents, from the shards that answer
        summed = att.attribute(QUERIES[0], QueryOptions(n_documents=8, aggregation="raw_sum", allow_partial=True))
        shard_of = np.searchsorted(single.reader.doc_base, [d.doc_id for d in summed.documents], side="right") - 1
        assert summed.partial and len(summed.documents) and not set(shard_of.tolist()) & set(gone)
    finally:
        att.close()


def test_sigkill_of_a_shard_actor_mid_loop(local_ray, single, index):
    """Kill one actor's process with SIGKILL while queries run: every answer is the single-process
    one or a ShardUnavailable naming shards, Ray restarts the actor, and later answers are whole."""
    att = Attributor.open(index, cluster=ClusterSpec(actors=2, num_cpus=0.5, call_timeout_s=60))
    try:
        opt = QueryOptions(n_documents=8)
        want = {i: single.attribute(q, opt) for i, q in enumerate(QUERIES)}
        victim = att.shards.pids()[0]
        outcomes = []
        t_kill = None
        for i in range(16):
            if i == 3:
                os.kill(victim, signal.SIGKILL)
                t_kill = time.time()
            spec = QUERIES[i % len(QUERIES)]
            try:
                got = att.attribute(spec, opt)
            except ShardUnavailable as e:
                assert e.shards and set(e.shards) <= set(att.shards.groups[0])
                outcomes.append("503")
                continue
            same_answer(want[i % len(QUERIES)], got)
            outcomes.append("ok")
        assert t_kill is not None and outcomes[:3] == ["ok"] * 3
        assert outcomes[-1] == "ok", outcomes
        assert att.shards.pids()[0] != victim  # restarted: a new process holds the shards
        for i, q in enumerate(QUERIES):
            same_answer(want[i], att.attribute(q, opt))
    finally:
        att.close()


def test_influence_from_a_cluster_is_the_single_process_one(local_ray, index, tmp_path):
    """`influence` served from a cluster reads the returned documents' windows from the actors holding
    them and gives each document the value one process gives, with the same documents left out."""
    import shutil

    from prism_tda.engine.influence import fit_index

    ix = tmp_path / "ix"
    shutil.copytree(index, ix)
    fit_index(ix, max_sequences=16)
    one = Attributor.open(ix)
    att = Attributor.open(ix, cluster=ClusterSpec(actors=2, num_cpus=0.5, call_timeout_s=60))
    try:
        multi_window = 0
        for spec in QUERIES[:2]:
            for opt in (QueryOptions(n_documents=8, influence=True),
                        QueryOptions(n_documents=8, influence=True, keep_opposed=True)):
                a, b = one.attribute(spec, opt), att.attribute(spec, opt)
                assert [d.doc_id for d in a.documents] == [d.doc_id for d in b.documents]
                assert a.opposed_by_influence == b.opposed_by_influence
                np.testing.assert_allclose([d.influence for d in b.documents], [d.influence for d in a.documents],
                                           rtol=1e-5, atol=1e-9)
                assert all(d.influence is not None for d in b.documents)
                docs = np.array([d.doc_id for d in a.documents], np.int64)
                seqs = att.reader.sequences_of_documents(docs)
                assert np.array_equal(seqs, one.reader.sequences_of_documents(docs))
                multi_window += int(len(seqs) > len(docs))
        assert multi_window  # some returned document has several windows, all read from its holder
        # the documents span several shards, so both holders are asked
        held = {int(g) for g in att.shards.holders_of(np.array([d.doc_id for d in a.documents]), one.reader.doc_base)}
        assert len(held) == 2
    finally:
        att.close()
        one.close()
