"""The benchmarks import the package as it is installed and call its public functions: each bench module
imports, and the helpers the benchmarks share run on the tiny index."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import bench
import bench.attribution

pytestmark = pytest.mark.slow  # the bench scripts' smoke runs: the slow tier

MODULES = sorted({f"bench.{m.name}" for m in pkgutil.iter_modules(bench.__path__)}
                 | {f"bench.attribution.{m.name}" for m in pkgutil.iter_modules(bench.attribution.__path__)})


@pytest.mark.parametrize("name", MODULES)
def test_bench_module_imports(name):
    importlib.import_module(name)


def test_shared_helpers_run_on_the_tiny_index(index, tmp_path):
    from bench._common import index_documents, index_sequences
    from bench.scale import disk_bytes, synthetic_index
    from prism_tda.engine import Attributor

    seqs = index_sequences(index)
    docs = index_documents(index, ["doc_id", "external_id"])
    att = Attributor.open(index)
    assert len(seqs["token_ids"]) == att.reader.n_seqs and len(docs["doc_id"]) == att.reader.n_docs
    assert seqs["token_ids"][0][1:] == seqs["target_ids"][0][:-1]
    syn = synthetic_index(index, 2, tmp_path / "syn")
    assert Attributor.open(syn).reader.n_tokens == 2 * att.reader.n_tokens
    sizes = disk_bytes(syn)
    assert sizes["tokens"] > 0 and sizes["manifest"] > 0


def test_index_throughput_runs_on_the_tiny_checkpoint(tiny_ckpt, tmp_path):
    """bench/index_throughput.py end to end at two small scales: its ratios come from this run's timings."""
    from bench.index_throughput import main

    res = main(["--checkpoint", str(tiny_ckpt), "--docs", "40", "--scales", "1,2", "--work", str(tmp_path / "w"),
                "--out", str(tmp_path / "index.json")])
    assert [r["documents"] for r in res["scaling"]] == [40, 80]
    for key in ("throughput_ratio", "whole_job_ratio", "shard_stage_ratio_largest", "forward_tokens_per_s"):
        assert res[key] > 0, key
    assert res["whole_job_ratio"] < res["shard_stage_ratio_largest"]  # the whole job includes the shard stage


def test_index_throughput_takes_index_settings_and_one_scale_not_1x(tiny_ckpt, tmp_path):
    """``--set index.NAME=VALUE`` builds with that setting (and says so); a run whose only scale is not 1x
    still times the bare forward; a setting the index does not have is refused."""
    from bench.index_throughput import main
    from prism_tda.errors import ConfigError

    res = main(["--checkpoint", str(tiny_ckpt), "--docs", "20", "--scales", "2", "--set", "index.code_bits=8",
                "--work", str(tmp_path / "w"), "--out", str(tmp_path / "index.json")])
    assert res["config"]["index"]["code_bits"] == 8 and res["scaling"][0]["documents"] == 40
    assert res["forward_tokens_per_s"] > 0 and res["throughput_ratio"] > 0
    with pytest.raises(ConfigError, match="nope"):
        main(["--checkpoint", str(tiny_ckpt), "--set", "index.nope=1", "--work", str(tmp_path / "x"),
              "--out", str(tmp_path / "x.json")])


def test_rerank_forward_ab_runs_both_arms_on_the_tiny_index(index, tmp_path):
    """bench/rerank_forward_ab.py: both forwards answer each query with the same documents, and the
    engine's switch is put back as it was."""
    import prism_tda.engine.tokens as tokens
    from bench.rerank_forward_ab import ARMS, main

    res = main(["--index", str(index), "--prompts", "2", "--prompt-tokens", "12", "--repeats", "2", "--out", str(tmp_path / "ab.json")])
    assert set(res["arms"]) == set(ARMS) and res["same_documents_and_order"] == "2/2"
    assert res["max_score_diff"] < 1e-4 and tokens.LAST_BLOCK_AT_POSITIONS
    assert all(v["p50"] > 0 for a in ARMS for v in res["arms"][a].values())


def test_kernel_ab_loads_a_revisions_kernel_and_compares_bit_for_bit(index, tmp_path):
    """bench/kernel_ab.py: the baseline kernel comes from git (HEAD's here, so the two are the same code),
    both arms answer alike, the kernel calls are compared bit for bit, and the engine's kernel is put
    back."""
    import prism_tda.engine.reader as reader_mod
    from bench.kernel_ab import main
    from prism_tda.engine.kernels import code_terms

    res = main(["--index", str(index), "--baseline-rev", "HEAD", "--prompts", "2", "--prompt-tokens", "12",
                "--repeats", "1", "--kernel-queries", "1", "--kernel-repeats", "1", "--out", str(tmp_path / "k.json")])
    assert res["same_documents_and_order"] == "2/2" and res["max_score_diff"] == 0.0
    k = res["kernel_alone"]
    assert k["calls"] >= 1 and k["rows"] > 0 and k["same_outputs_bitwise"] is True
    assert reader_mod.code_terms is code_terms
    with pytest.raises(SystemExit, match="no prism_tda/engine/kernels.py"):
        main(["--index", str(index), "--baseline-rev", "no-such-revision", "--out", str(tmp_path / "x.json")])


def test_index_floor_times_each_stage_on_the_tiny_index(index, tmp_path):
    """bench/index_floor.py: every stage timed, and the ceilings follow from the timings."""
    from bench.index_floor import main

    res = main(["--index", str(index), "--batch", "4", "--repeats", "1", "--out", str(tmp_path / "floor.json")])
    us = res["us_per_token"]
    assert all(v > 0 for v in us.values()) and {"bare_forward", "indexer_forward", "encode"} <= set(us)
    assert res["ceiling_ratio"]["indexer_forward_and_encode"] == round(
        us["bare_forward"] / (us["indexer_forward"] + us["encode"]), 3)


def test_index_complete_tells_a_finished_index_from_a_missing_or_half_built_one(index, tmp_path):
    import json

    from bench._common import index_complete
    from prism_tda.engine import layout

    assert index_complete(index)
    assert not index_complete(tmp_path / "nothing")
    half = tmp_path / "half"
    half.mkdir()
    m = json.loads((index / layout.MANIFEST).read_text())
    m["complete"] = False
    (half / layout.MANIFEST).write_text(json.dumps(m))
    assert not index_complete(half)


def test_shortlist_values_are_kept_only_for_the_ranking_best_k():
    import numpy as np

    from bench.attribution.lds_report import on_best
    from bench.attribution.shortlist_influence import overlap_at

    ranking = np.array([[0.9, 0.1, 0.5, 0.7], [0.0, 0.3, 0.2, 0.1]])
    values = np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    assert on_best(values, ranking, 2).tolist() == [[1.0, 0.0, 0.0, 4.0], [0.0, 6.0, 7.0, 0.0]]
    assert overlap_at(ranking, values, 2, np.array([0, 1])) == 0.5  # {0, 3} vs {3, 2}; {1, 2} vs {3, 2}


def test_posting_ab_measures_both_indexes_against_one_exact_pass(index, tiny_ckpt, tiny_corpus, tmp_path):
    """bench/attribution/posting_ab.py: each index's candidate recall of the same exact top 10; with
    every sequence a candidate, both find all of it."""
    import json

    from bench.attribution.posting_ab import main
    from prism_tda.indexer.run import build_index
    from tests.conftest import index_cfg

    work = tmp_path / "w"
    work.mkdir()
    (work / "queries.json").write_text(json.dumps([
        {"kind": "heldout", "prompt": "A computer", "completion": " is a"},
        {"kind": "heldout", "prompt": "Love is", "completion": " a"}]))
    build_index(tiny_ckpt, [tiny_corpus], work / "share", index_cfg(posting_by="share"), progress=False)
    (work / "both").symlink_to(index)
    res = main(["--case", f"t={work}:share:both", "--candidates", "100000", "--out", str(tmp_path / "ab.json")])
    r = res["cases"]["t"]["indexes"]
    assert set(r) == {"share", "both"} and res["cases"]["t"]["queries"] == 2
    assert all(v["candidate_recall_of_exact_top10"] == 1.0 for v in r.values())
    assert (work / "exact_cosine_max.npy").exists()
    few = main(["--case", f"t={work}:share:both", "--candidates", "1", "--out", str(tmp_path / "ab1.json")])
    assert all(0 < v["candidate_recall_of_exact_top10"] <= 1 for v in few["cases"]["t"]["indexes"].values())


def test_planted_answers_splits_recall_by_shared_answers(tmp_path):
    """bench/attribution/planted_answers.py: a paraphrase whose top 10 is another fact's copies with
    the same answer counts as a miss among facts with a shared answer, and the miss says so."""
    import json

    import numpy as np

    from bench.attribution.planted_answers import main

    work = tmp_path / "w"
    work.mkdir()
    facts = {"planted/000": ("Vel", "The official emblem of Vel is the copper lantern.", " copper lantern"),
             "planted/001": ("Zan", "The official emblem of Zan is the copper lantern.", " copper lantern"),
             "planted/002": ("Dor", "In Dor, every child is given a jade tortoise at birth.", " jade tortoise")}
    docs = [{"id": f"{f}#{c}", "text": t} for f, (_, t, _) in facts.items() for c in range(10)]
    docs += [{"id": f"other/{i}", "text": "filler"} for i in range(5)]
    (work / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (work / "train.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    prompts = {"planted/000": ("The official emblem of Vel is the", "Vel has as its official emblem the"),
               "planted/001": ("The official emblem of Zan is the", "Zan has as its official emblem the"),
               "planted/002": ("In Dor, every child is given a", "At birth, each child of Dor receives a")}
    queries = [{"kind": kind, "fact": f, "prompt": prompts[f][k], "completion": a,
                "planted": [f"{f}#{c}" for c in range(10)]}
               for k, kind in enumerate(("verbatim", "paraphrase")) for f, (_, _, a) in facts.items()]
    (work / "queries.json").write_text(json.dumps(queries))
    ids = [d["id"] for d in docs]
    S = np.zeros((len(queries), len(ids)))
    for i, q in enumerate(queries):
        own = [j for j, d in enumerate(ids) if d.startswith(q["fact"] + "#")]
        S[i, own] = 1.0
        if q["kind"] == "paraphrase" and q["fact"] == "planted/000":  # Zan's copies outrank Vel's own
            S[i, [j for j, d in enumerate(ids) if d.startswith("planted/001#")]] = 2.0
    np.save(work / "scores_prism_fast.npy", S)
    res = main(["--work", str(work), "--out", str(tmp_path / "pa.json")])
    s = res["splits"][0]
    assert s["facts_with_a_shared_answer"] == 2 and s["facts_with_a_shared_sentence"] == 2
    r = s["methods"]["prism_fast"]
    assert r["verbatim"]["all"]["recall_at_10"] == 1.0
    assert r["paraphrase"]["answer_unique"]["recall_at_10"] == 1.0
    assert r["paraphrase"]["answer_shared"]["recall_at_10"] == 0.5
    (miss,) = r["paraphrase_misses"]
    assert miss["fact"] == "planted/000" and miss["rank"] == 11  # after the 10 copies of Zan
    assert miss["top10_same_answer_other_fact"] == 10 and miss["top10_same_sentence_other_name"] == 10
    assert r["paraphrase_misses_whose_top10_is_other_facts_with_its_answer"] == 1


def test_scale_rerank_as_real_replaces_the_synthetic_rerank():
    """bench/scale.py: a synthetic size's p50 is re-estimated with the largest real size's re-rank."""
    from bench.scale import rerank_as_real

    def size(tokens, synthetic, p50, rerank):
        return {"tokens": tokens, "synthetic": synthetic,
                "serve": {"p50_ms": p50, "server_timings_ms_median": {"rerank": rerank}}}

    res = {"sizes": [size(0, False, 9, 0), size(1_000, False, 100, 60), size(16_000, True, 60, 10)]}
    out = rerank_as_real(res)
    assert out["p50_ms_largest_rerank_as_real"] == 110  # 60 - 10 + 60
    assert out["latency_growth_16x_rerank_as_real"] == 1.1  # against the real 1,000-token size
    assert rerank_as_real({"sizes": res["sizes"][:2]}) == {}  # no synthetic size: nothing to estimate


def test_planted_facts_with_answers_of_their_own():
    """bench/attribution/planted.py: answers="unique" gives every fact an answer no other fact shares a
    word of; the default draws from the 12 phrases (shared) and is unchanged by the option."""
    from bench.attribution.planted import ANSWERS, make_facts

    drawn = make_facts(30, 2)
    assert {f.answer.strip() for f in drawn} <= set(ANSWERS)
    assert len({f.answer for f in drawn}) < 30  # 30 facts from 12 phrases share answers
    unique = make_facts(30, 2, answers="unique")
    words = [w for f in unique for w in f.answer.split()]
    assert len(words) == len(set(words)) == 60
    assert all(f.text.endswith(f.answer.strip() + ".") or f.answer.strip() + " " in f.text for f in unique)
    assert [f.text for f in make_facts(30, 2)] == [f.text for f in drawn]
    with pytest.raises(ValueError, match="at most"):
        make_facts(100, 2, answers="unique")
    with pytest.raises(ValueError, match="drawn"):
        make_facts(3, 2, answers="shared")


def test_planted_answers_exact_scores_match_the_engine(index, tmp_path):
    """bench/attribution/planted_answers.py --exact: each planted query's row is the engine's exact
    document scores under that aggregation (columns: the index's documents), held-out rows 0."""
    import json

    import numpy as np

    from bench.attribution.planted_answers import exact_planted
    from prism_tda.engine import Attributor, QuerySpec

    work = tmp_path / "w"
    work.mkdir()
    (work / "index").symlink_to(index)
    queries = [{"kind": "verbatim", "fact": "f0", "prompt": "A computer", "completion": " is a", "planted": []},
               {"kind": "heldout", "prompt": "Love is", "completion": " a"}]
    (work / "queries.json").write_text(json.dumps(queries))
    exact_planted(work, ["cosine_max", "cosine_match"])
    att = Attributor.open(index)
    want = att.document_scores(att.encode(QuerySpec("A computer", " is a")), "exact", match=True)
    for agg in ("cosine_max", "cosine_match"):
        S = np.load(work / f"scores_prism_exact_{agg}.npy")
        assert S.shape == (2, att.reader.n_docs) and not S[1].any()
        np.testing.assert_allclose(S[0], want[agg], rtol=1e-6, atol=1e-9)
        assert S[0].max() > 0


def test_rerank_depth_chooses_by_its_rule_and_reuses_the_exact_pass(index, tiny_corpus, tmp_path, monkeypatch):
    """bench/attribution/rerank_depth.py on the tiny index: every depth and margin measured on the
    tuning queries, the report on the others, the exact pass saved once and read back. Its 48-token
    prompts do not fit the tiny model's context, so the queries are short ones."""
    import bench.attribution.rerank_depth as rd
    from bench.attribution.rerank_depth import choose, main

    short = [("A computer", " is a"), ("Love is", " a"), ("The only way to", " be"), ("Never trust a", " man")]
    monkeypatch.setattr(rd, "draw", lambda *a: [{"prompt": p, "completion": c, "id": str(i)}
                                                for i, (p, c) in enumerate(short)])

    assert choose({32: {"overlap_at_10": 0.8}, 64: {"overlap_at_10": 0.9}, 128: {"overlap_at_10": 0.95}}) == 64
    assert choose({32: {"overlap_at_10": 0.8}, 64: {"overlap_at_10": 0.85}, 128: {"overlap_at_10": 0.85}}) == 64
    args = ["--index", str(index), "--heldout", str(tiny_corpus), "--exclude-seed", "-1", "--tune", "2",
            "--report", "2", "--depths", "4,16", "--baseline", "4", "--margins", "2,1",
            "--arrays", str(tmp_path / "x.npz"), "--out", str(tmp_path / "r.json")]
    res = main(args)
    assert set(res["tune"]) == {4, 16} and res["chosen"] in (4, 16) and set(res["report"]) >= {4, res["chosen"]}
    assert all(0 <= v["overlap_at_10"] <= 1 and 0 <= v["tie_aware_at_10"] <= 1 for v in res["tune"].values())
    assert set(res["margins"]["tune"]) == {1.0, 2.0} and res["margins"]["chosen"] in (1.0, 2.0)
    assert len(res["queries"]["tune"]) == len(res["queries"]["report"]) == 2
    again = main(args)
    assert again["exact_pass_seconds"] == res["exact_pass_seconds"]


def three_query_draw(monkeypatch, index, tiny_corpus, tmp_path) -> list[str]:
    """A draw script's arguments on the tiny index, its draw replaced by three short queries
    (``rerank_depth.draw``, which every draw script reads through)."""
    import bench.attribution.rerank_depth as rd

    short = [("A computer", " is a"), ("Love is", " a"), ("The only way to", " be")]
    monkeypatch.setattr(rd, "draw", lambda *a: [{"prompt": p, "completion": c, "id": str(i)}
                                                for i, (p, c) in enumerate(short)])
    return ["--index", str(index), "--heldout", str(tiny_corpus), "--queries", "3", "--exclude", "",
            "--arrays", str(tmp_path / "x.npz"), "--out", str(tmp_path / "r.json")]


@pytest.mark.parametrize("bench, module, switch", [("rows_elsewhere", "prism_tda.engine.shards", "ROWS_ELSEWHERE"),
                                                    ("prefix_copies", "prism_tda.engine.scoring", "PREFIX_COPIES")])
def test_switch_benches_measure_both_arms_on_the_same_queries(bench, module, switch, index, tiny_corpus, tmp_path,
                                                              monkeypatch):
    """bench/attribution/rows_elsewhere.py and prefix_copies.py on the tiny index: both arms on every
    query, the switch put back afterwards, the exact pass read back from its arrays."""
    import importlib

    b, mod = importlib.import_module(f"bench.attribution.{bench}"), importlib.import_module(module)
    args = three_query_draw(monkeypatch, index, tiny_corpus, tmp_path)
    res = b.main(args)
    assert getattr(mod, switch) is True and res["switch"] == f"{module}.{switch}"
    for arm in ("with", "without"):
        assert len(res["arms"][arm]["per_query_overlap"]) == 3
        assert 0 <= res["arms"][arm]["overlap_at_10"][0] <= 1
    assert res["overlap_at_10_fast_vs_exact"] == res["arms"]["with"]["overlap_at_10"][0]
    assert b.main(args)["exact_pass_seconds"] == res["exact_pass_seconds"]


def test_sum_aggregations_measures_both_rules_against_one_exact_pass(index, tiny_corpus, tmp_path, monkeypatch):
    """bench/attribution/sum_aggregations.py on the tiny index: both rules under both sums on every query,
    the switch put back, the exact sums read back from their arrays; the whole-document rule's scores
    within the codes' error of the exact sums."""
    import bench.attribution.sum_aggregations as sa
    from prism_tda.engine import attributor, scoring

    args = three_query_draw(monkeypatch, index, tiny_corpus, tmp_path)
    res = sa.main(args)
    assert scoring.WHOLE_DOCUMENT_SUMS is True and attributor.SUM_DOCUMENTS == res["sum_documents"] > 0
    for agg in ("raw_sum", "cosine_sum"):
        for arm in ("whole", "earlier", "served"):
            assert len(res[agg][arm]["per_query_overlap"]) == 3
        assert res[agg]["whole"]["score_relative_error_median"][0] < 0.02
    assert sa.main(args)["exact_pass_seconds"] == res["exact_pass_seconds"]


def test_match_windows_measures_both_rules_against_one_exact_pass(index, tiny_corpus, tmp_path, monkeypatch):
    """bench/attribution/match_windows.py on the tiny index: both rules on every query, the switch and the
    re-rank's scoring put back, the exact cosine_match read back from its arrays; the windows the re-rank
    recomputed counted."""
    import bench.attribution.match_windows as mw
    from prism_tda.engine import attributor, scoring, shards

    args = three_query_draw(monkeypatch, index, tiny_corpus, tmp_path)
    res = mw.main(args)
    assert shards.WHOLE_DOCUMENT_MATCH is True and attributor.exact_scores is scoring.exact_scores
    assert attributor.MATCH_TARGET_TOKENS == res["match_target_tokens"] > 0
    for arm in ("earlier", "whole", "served"):
        assert len(res[arm]["per_query_overlap"]) == 3
        assert res[arm]["windows_rescored_mean"] > 0
    assert res["served"]["overlap_at_10"][0] >= res["earlier"]["overlap_at_10"][0] - 0.1
    assert mw.main(args)["exact_pass_seconds"] == res["exact_pass_seconds"]


def test_opponents_bench_compares_the_served_opponents_with_exact_mode(index, tiny_corpus, tmp_path, monkeypatch):
    """bench/attribution/opponents.py on the tiny index: the exact pass with the sign reversed read back
    from its arrays, every query measured under both aggregations, the most opposed found."""
    import bench.attribution.opponents as op

    args = three_query_draw(monkeypatch, index, tiny_corpus, tmp_path)
    res = op.main(args)
    for agg in ("cosine_max", "raw_sum"):
        assert len(res[agg]["per_query_overlap"]) == 3
    assert res["overlap_at_10_fast_vs_exact"] >= 0.5
    assert op.main(args)["exact_pass_seconds"] == res["exact_pass_seconds"]


def test_fast_ab_measures_two_option_sets_on_one_slice(index, tiny_corpus, tmp_path, monkeypatch):
    """bench/attribution/fast_ab.py on the tiny index: both arms on every query of the slice, their
    options as given, the exact pass of the whole draw read back from its arrays."""
    import dataclasses

    import bench.attribution.fast_ab as ab
    import bench.attribution.rerank_depth as rd
    from prism_tda.engine import FirstStages

    short = [("A computer", " is a"), ("Love is", " a"), ("The only way to", " be"), ("Never trust a", " man")]
    monkeypatch.setattr(rd, "draw", lambda heldout, tok, n, *a: [{"prompt": p, "completion": c, "id": str(i)}
                                                                  for i, (p, c) in enumerate(short[:n])])
    args = ["--index", str(index), "--heldout", str(tiny_corpus), "--exclude", "", "--first", "1", "--count", "3",
            "--b", '{"exact_tokens": 2, "exact_rerank": 4}', "--stages-b", '{"row_budget": 1024}',
            "--arrays", str(tmp_path / "x.npz"),
            "--out", str(tmp_path / "r.json")]
    res = ab.main(args)
    assert res["queries"] == ["1", "2", "3"]
    assert res["arms"]["b"]["options"] == {"exact_tokens": 2, "exact_rerank": 4} and res["arms"]["a"]["options"] == {}
    assert res["arms"]["b"]["stages"]["row_budget"] == 1024 and res["arms"]["a"]["stages"] == dataclasses.asdict(FirstStages())
    for arm in ("a", "b"):
        assert len(res["arms"][arm]["per_query_overlap"]) == 3
    assert ab.main(args)["exact_pass_seconds"] == res["exact_pass_seconds"]


def test_pool_splits_weights_by_inverse_variance_and_refuses_mixed_rules(tmp_path):
    """bench/attribution/pool_splits.py: two splits, one twice as precise, pooled by hand; splits of
    different rules are not pooled."""
    import json

    import pytest

    from bench.attribution.pool_splits import Z95, main, pool

    got = pool([0.0, 0.3], [-2 * Z95 * 0.1, 0.3 - Z95 * 0.1], [2 * Z95 * 0.1, 0.3 + Z95 * 0.1])
    # se 0.2 and 0.1: weights 25 and 100, estimate 0.24, se sqrt(1/125)
    assert got["estimate"] == pytest.approx(0.24, abs=1e-4) and got["weights"] == [0.2, 0.8]
    assert got["se"] == pytest.approx((1 / 125) ** 0.5, abs=1e-4)
    with pytest.raises(ValueError, match="width"):
        pool([0.1], [0.1], [0.1])
    src = []
    for i, returned in enumerate((128, 128)):
        f = tmp_path / f"s{i}.json"
        f.write_text(json.dumps({"returned": returned, "influence_damping_served": 1e-6, "served_damping": 0.01}))
        src.append(str(f))
    res = tmp_path / "attribution.json"
    blocks = {"fresh_split_influence": {"source": src[0], "lds_diff_prism_fast_ekfac_ci": [0.1, 0.0, 0.2]},
              "fresh_split_influence_b": {"source": src[1], "lds_diff_prism_fast_ekfac_ci": [0.3, 0.2, 0.4]}}
    res.write_text(json.dumps(blocks))
    out = main(["--results", str(res), "--keys", "lds_diff_prism_fast_ekfac_ci"])
    assert out["lds_diff_prism_fast_ekfac_ci"]["estimate"] == pytest.approx(0.2)
    assert json.loads(res.read_text())["fresh_splits_influence_pooled"] == out
    (tmp_path / "s1.json").write_text(json.dumps({"returned": 64, "influence_damping_served": 1e-6,
                                                  "served_damping": 0.01}))
    with pytest.raises(SystemExit, match="different rules"):
        main(["--results", str(res), "--keys", "lds_diff_prism_fast_ekfac_ci"])


def test_steering_rate_row_is_the_rate_and_drop_with_their_bootstrap_intervals():
    """bench/steering.py's rate_row: every judged row of the report (default judge, strict judge, the
    larger draw) is this one function of the judged generations."""
    import numpy as np

    from bench.steering import boot_drop, boot_rate, rate_row

    rng = np.random.default_rng(3)
    base_on = (rng.random(40 * 5) < 0.3).astype(float)
    on = (rng.random(40 * 5) < 0.1).astype(float)
    r = rate_row(on, base_on, 40, 5)
    assert r["topic_rate"] == round(on.mean(), 4)
    assert r["topic_rate_drop"] == round(1 - on.mean() / base_on.mean(), 4)
    assert r["topic_rate_ci"] == boot_rate(on, 40, 5) and r["topic_rate_drop_ci"] == boot_drop(base_on, on, 40, 5)
    assert r["topic_rate_ci"][0] <= r["topic_rate"] <= r["topic_rate_ci"][1]
    assert r["topic_rate_drop_ci"][0] <= r["topic_rate_drop"] <= r["topic_rate_drop_ci"][1]
    assert rate_row(on, np.zeros_like(on), 40, 5)["topic_rate_drop"] < -1e6  # a base of 0: no division by zero


def test_steering_perplexity_ratio_interval_resamples_documents():
    """bench/steering.py's boot_ppl_ratio: the interval of exp(mean loss change per token) over resampled
    documents brackets the ratio of the whole set, and shrinks to it when every document agrees."""
    import numpy as np

    from bench.steering import boot_ppl_ratio

    rng = np.random.default_rng(0)
    tokens = rng.integers(20, 200, 300).astype(float)
    base = np.stack([tokens, tokens * 4.0], 1)
    supp = np.stack([tokens, tokens * 4.0 + tokens * rng.normal(0.02, 0.02, 300)], 1)
    whole = float(np.exp((supp[:, 1].sum() - base[:, 1].sum()) / tokens.sum()))
    lo, hi = boot_ppl_ratio(base, supp)
    assert lo < whole < hi and hi - lo < 0.01
    same = np.stack([tokens, tokens * 4.0 + tokens * 0.02], 1)  # every document's loss up by 0.02 per token
    assert boot_ppl_ratio(base, same) == [round(float(np.exp(0.02)), 4)] * 2


def test_steering_elicit_openings_are_distinct_seeded_document_openings():
    """bench/steering.py's step 10 prompts: each a document's first ELICIT_TOKENS tokens (at most half of it,
    at least 2), distinct, in a seeded order; documents under 4 tokens are never used."""
    import numpy as np

    from bench.steering import ELICIT_TOKENS, elicit_openings

    docs = [list(range(100 + i, 130 + i)) for i in range(5)] + [[1, 2, 3, 4, 5, 6]] + [[7, 8, 9]]
    docs.append(list(docs[0]))  # the same text twice: one opening
    out = elicit_openings(docs, 10, np.random.default_rng(0))
    assert len(out) == 6 and len({tuple(o) for o in out}) == 6
    assert [1, 2, 3] in out and [7, 8] not in out and [7, 8, 9] not in out  # at most half of a 6-token document
    assert all(o == d[: len(o)] for o in out for d in docs if d[:2] == o[:2])
    assert max(len(o) for o in out) == ELICIT_TOKENS
    assert out == elicit_openings(docs, 10, np.random.default_rng(0))
    assert elicit_openings(docs, 2, np.random.default_rng(0)) == out[:2]


def test_baselines_are_added_on_the_same_draws_and_only_to_the_same_split(tmp_path):
    """``influence_lds.py --baselines-only`` adds a baseline's row to an earlier run's file, equal to what
    the full run computes for it on the same split and draws, and refuses a file of another split."""
    import json

    import numpy as np

    from bench.attribution.influence_lds import main
    from bench.attribution.lds_report import against, folder_split

    rng = np.random.default_rng(0)
    n_docs, n_sub, kinds = 24, 6, ["verbatim"] * 2 + ["paraphrase"] * 2 + ["heldout"] * 6
    queries = [{"kind": k} for k in kinds]
    (tmp_path / "queries.json").write_text(json.dumps(queries))
    (tmp_path / "lds").mkdir()
    for j in range(n_sub):
        (tmp_path / "lds" / f"subset_{j:03d}.json").write_text(json.dumps({"loss": rng.normal(size=len(kinds)).tolist()}))
    E, T = rng.normal(size=(len(kinds), n_docs)), rng.normal(size=(len(kinds), n_docs))
    np.save(tmp_path / "scores_ekfac.npy", E)
    np.save(tmp_path / "scores_trak.npy", T)
    split = folder_split(tmp_path, queries, n_docs, n_sub, n_sub, 3, "all")
    row = against(split, E, 200, 3 + 11)
    out = tmp_path / "influence.json"
    out.write_text(json.dumps({"ekfac_all": row(E), "queries": len(split.queries), "subsets": n_sub}))
    argv = ["--work", str(tmp_path), "--subsets", str(n_sub), "--split", "all", "--seed", "3", "--boot", "200",
            "--out", str(out), "--baselines-only"]
    res = main(argv)
    assert res["trak"] == row(T) and "bergson" not in res
    assert json.loads(out.read_text())["trak"] == row(T)
    with pytest.raises(SystemExit, match="not reproduced"):  # another seed: other subsets, other draws
        main([*argv[:6], "--seed", "4", *argv[8:]])


def test_scale_overlap_queries_after_a_skip_are_the_ones_no_earlier_run_asked(tiny_corpus, tiny_tokenizer):
    """bench/scale.py --overlap-skip: the first ``skip`` queries of the seeded draw are exactly an earlier
    run's (``n = skip``), and the ones after them are new."""
    from bench.scale import overlap_queries

    first = overlap_queries(tiny_corpus, tiny_tokenizer, 6)
    fresh = overlap_queries(tiny_corpus, tiny_tokenizer, 10, skip=6)
    both = overlap_queries(tiny_corpus, tiny_tokenizer, 16)
    assert len(first) == 6 and len(fresh) == 10 and all(q["kind"] == "held_out" for q in first + fresh)
    assert both == first + fresh
    assert not {q["id"] for q in first} & {q["id"] for q in fresh}


def test_scale_corpus_manifest_counts_each_source_and_hashes_each_file(tmp_path):
    import hashlib

    from bench.scale_corpus import corpus_manifest

    docs = [{"source": "man", "text": "abc"}, {"source": "man", "text": "de"}, {"text": "fortune"},
            {"source": "planted", "text": "x"}]
    (tmp_path / "part-000.jsonl").write_text("one\n")
    (tmp_path / "part-001.jsonl").write_text("two\n")
    m = corpus_manifest(docs, tmp_path)
    assert m["sources"] == {"fortunes": {"documents": 1, "characters": 7}, "man": {"documents": 2, "characters": 5},
                            "planted": {"documents": 1, "characters": 1}}
    assert m["sha256"] == {"part-000.jsonl": hashlib.sha256(b"one\n").hexdigest(),
                           "part-001.jsonl": hashlib.sha256(b"two\n").hexdigest()}


def test_influence_loss_ab_runs_both_losses_on_a_copy_of_the_tiny_index(index, tmp_path):
    """bench/influence_loss_ab.py: both forms of the loss give the same values and curvature, and the
    engine's loss is put back."""
    import shutil

    import prism_tda.engine.influence as inf
    from bench.influence_loss_ab import ARMS, main

    ix = tmp_path / "ix"
    shutil.copytree(index, ix)
    inf.fit_index(ix, max_sequences=16)
    engine_loss = inf._loss
    res = main(["--index", str(ix), "--prompts", "2", "--prompt-tokens", "12", "--repeats", "2", "--documents", "3",
                "--fit-sequences", "8", "--out", str(tmp_path / "ab.json")])
    block = res["by_documents"]["3"]
    assert block["calls"] == 4 and set(block["ms_p50"]) == set(ARMS)
    assert block["max_rel_value_diff"] < 1e-6 and res["fit"]["max_rel_eigenvalue_diff"] < 1e-6
    assert inf._loss is engine_loss


def test_near_ties_counts_the_served_answer_as_exact_mode_returns_it(index):
    """``served_ranking`` (the benchmarks' served default, from exact per-document scores) returns the
    documents exact mode returns, for queries whose cut falls inside a near-tie and for one whose cut
    does not; and it counts a near-tie only where the summed cosines leave one."""
    import numpy as np

    from bench._common import served_ranking
    from bench.attribution.near_ties import near_ties
    from prism_tda.engine import Attributor, QueryOptions, QuerySpec

    att = Attributor.open(index)
    every = np.ones(att.reader.n_docs, dtype=bool)
    tied = 0
    for spec in (QuerySpec("A computer", " is a"), QuerySpec("Love is", " a"), QuerySpec("The")):
        s = att.document_scores(att.encode(spec), mode="exact")
        res = att.attribute(spec, QueryOptions(n_documents=10, mode="exact", include_untrained=True,
                                               keep_opposed=True))
        ranking, count = served_ranking(s["cosine_max"], s["cosine_sum"], every)
        assert {d.doc_id for d in res.documents} == set(ranking[:10].tolist())
        assert count == (10 + res.unsettled_beyond_last if res.unsettled_beyond_last else 10)
        tied += near_ties(s["cosine_max"], every) > 10
    assert tied >= 1  # the queries include a cut inside a near-tie


def test_steering_window_judge_sees_a_style_the_words_do_not_show():
    """bench/steering.py's step 12 judge: its features count 4-character sequences over the text with white
    space made one space; held sparse it scores as held dense; and on texts whose topic is a style (capitals
    and '!!') written in words no training text used, it separates topic from other text where the word
    features alone cannot."""
    import numpy as np

    from bench.steering import TopicClassifier, features, style_features

    f = style_features("Yow!!\n\tAre we")
    assert "#Yow!" in f and "#!! A" in f and "_yow" in f and "yow__are" in f and not any("\n" in x for x in f)
    rng = np.random.default_rng(0)
    letters = np.array(list("bcdfghklmnprstvz"))

    def word(n: int) -> str:
        return "".join(rng.choice(letters, n)) + "a"

    def text(topic: bool) -> str:
        ws = [word(int(rng.integers(3, 7))) for _ in range(8)]
        if topic:  # the style: capitals and '!!', never the same word twice
            return " ".join(w.upper() + ("!!" if i % 2 else "") for i, w in enumerate(ws))
        return " ".join(ws) + "."

    y = np.array([1, 0] * 60)
    train = [text(bool(v)) for v in y]
    test_y = np.array([1, 0] * 40)
    test = [text(bool(v)) for v in test_y]
    dense = TopicClassifier(featurize=style_features).fit(train, y)
    sparse = TopicClassifier(featurize=style_features, sparse=True).fit(train, y)
    assert np.allclose(dense.proba(test), sparse.proba(test), atol=1e-4)
    assert ((sparse.proba(test) > 0.5) == (test_y == 1)).mean() == 1.0
    words_only = TopicClassifier(featurize=features).fit(train, y)  # test words almost all unseen: little signal
    assert ((words_only.proba(test) > 0.5) == (test_y == 1)).mean() < 0.75


def test_steering_precise_chooses_the_largest_tuning_drop_within_the_perplexity_bound():
    """bench/steering_precise.py's rule: among configurations within the tuning contrast bound, the largest
    positive drop under the precise judge (the lower perplexity on a tie); none when none qualifies. Its fresh
    report prompts share none with steering.py's lists."""
    from bench.steering import PROMPTS, TUNE_PROMPTS
    from bench.steering_precise import FRESH_PROMPTS, choose

    rows = [{"config": "a", "contrast_ppl_ratio": 1.02},  # over the bound: never generated
            {"config": "b", "contrast_ppl_ratio": 1.004, "precise_drop": 0.7},
            {"config": "c", "contrast_ppl_ratio": 1.009, "precise_drop": 0.8},
            {"config": "d", "contrast_ppl_ratio": 1.002, "precise_drop": 0.8}]
    assert choose(rows, 1.01) == "d"
    assert choose(rows[:3], 1.01) == "c"
    assert choose(rows, 1.0) is None
    assert choose([{"config": "e", "contrast_ppl_ratio": 1.0, "precise_drop": -0.1}], 1.01) is None
    assert len(set(FRESH_PROMPTS)) == len(FRESH_PROMPTS) == 50
    assert not set(FRESH_PROMPTS) & (set(PROMPTS) | set(TUNE_PROMPTS))


def test_fresh_report_puts_the_served_default_under_the_issues_names(tmp_path):
    """``lds_prism_fast`` in the report is the split's served answer by value, not its first documents by
    score; the guards and the other corpora's measures come from their own files; a missing block says so."""
    import json

    from bench.attribution import fresh_report

    row = lambda x: [x, x - 0.01, x + 0.01]  # noqa: E731
    block = {"lds_prism_fast": 0.2, "lds_prism_fast_ci": row(0.2), "lds_prism_fast_value": 0.3,
             "lds_prism_fast_value_ci": row(0.3), "lds_diff_prism_fast_value_ekfac_ci": row(-0.05),
             "lds_prism_fast_influence": 0.4, "lds_diff_prism_fast_influence_ekfac_ci": row(0.05),
             "value_returned": 128, "split": {"queries": 3}}
    for n, m in enumerate(fresh_report.BASELINES):
        block[f"lds_{m}"], block[f"lds_{m}_ci"] = n / 10, row(n / 10)
    files = {"att.json": {"s": block}, "rules.json": {"guard": {"canary_recall_at_10_verbatim_served": 1.0,
                                                                 "canary_recall_at_10_paraphrase_served": 0.9}},
             "ties.json": {"near_tie_query_share": 0.05}, "mem.json": {"canary_recall_at_10_verbatim_memorised": 1.0,
                                                                     "candidate_recall_of_exact_top10_memorised": 1.0}}
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    args = ["--results", str(tmp_path / "att.json"), "--value-rules", str(tmp_path / "rules.json"),
            "--near-ties", str(tmp_path / "ties.json"), "--memorised", str(tmp_path / "mem.json")]
    fresh_report.main([*args, "--block", "s"])
    got = json.loads((tmp_path / "att.json").read_text())["fresh_split_report"]
    assert got["lds_prism_fast"] == 0.3 and got["lds_diff_prism_ekfac_ci"] == row(-0.05)
    assert got["lds_ekfac"] == 0.0 and got["lds_bm25_ci"] == row(0.3)
    assert (got["canary_recall_at_10_paraphrase"], got["near_tie_query_share"]) == (0.9, 0.05)
    assert got["sources"]["guards"] == "rules.json"
    with pytest.raises(KeyError, match="no block 'other'"):
        fresh_report.main([*args, "--block", "other"])


def test_speed_agreement_times_every_setting_against_exact_mode(index, tiny_corpus, tmp_path, monkeypatch):
    """bench/speed_agreement.py on the tiny index: every setting asks every query against one exact pass;
    a setting equal to the served one answers as it does, one that scores every token and re-ranks every
    document exactly returns exact mode's answer, and the attributor's first stages are put back."""
    import json

    import bench.speed_agreement as sa
    from prism_tda.engine import Attributor, FirstStages

    short = [("A computer", " is a"), ("Love is", " a"), ("The only way to", " be")]
    monkeypatch.setattr(sa, "held_out_queries", lambda *a, **k: [{"prompt": p, "completion": c, "id": str(i)}
                                                                 for i, (p, c) in enumerate(short)])
    opened: list[Attributor] = []

    def open_(*a, **k) -> Attributor:
        opened.append(Attributor(*a, **k))
        return opened[-1]

    monkeypatch.setattr(sa.Attributor, "open", open_)
    every = [{"exact_rerank": 1024, "adaptive_rerank": False, "exact_tokens": None},
             {"row_budget": 1 << 22, "token_candidates": 1 << 20, "proto_candidates": 1 << 16}]
    settings = {"served": [{}, {}], "again": [{}, {}], "every": every,
                "shallow": [{"exact_rerank": 10}, {"row_budget": 64, "token_candidates": 4}]}
    res = sa.main(["--index", str(index), "--heldout", str(tiny_corpus), "--prompts", "3", "--repeats", "2",
                   "--settings", json.dumps(settings), "--out", str(tmp_path / "r.json")])
    s = res["settings"]
    assert res["queries"] == 3 and list(s) == list(settings)
    assert s["again"]["overlap_at_10"] == s["served"]["overlap_at_10"]
    assert s["every"]["overlap_at_10"] == 1.0 and s["every"]["tie_aware_at_10"] == 1.0
    assert s["shallow"]["first_stages"]["row_budget"] == 64 and s["shallow"]["query_options"] == {"exact_rerank": 10}
    assert s["served"]["ms_p50_vs_served"] == 1.0 and all(v["ms_p50"] > 0 for v in s.values())
    assert opened[0].stages == FirstStages()
