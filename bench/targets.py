"""Where every open target stands, read from the results files: one table, written to
``docs/targets.md``, so the status page cannot drift from the measurements.

    python -m bench.targets            # rewrite docs/targets.md from bench/results/*.json
    python -m bench.targets --check    # exit 1 when docs/targets.md differs from what the files say

Each row names the results file and the key it reads, the date that file was written, and whether the
target is met: on the point estimate and, where the file gives a 95% interval, on its lower (or upper)
bound too. Nothing here measures anything; re-run the benchmark that writes a file to move a row.
"""

from __future__ import annotations

import argparse
import json
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prism_tda.corpus import _MISSING, field_value

RESULTS = Path("bench/results")
OUT = Path("docs/targets.md")

OPS: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, "<=": operator.le, "==": operator.eq}


@dataclass(frozen=True)
class Target:
    """One target: ``key`` is a dotted path into ``file`` (a number, or [point, low, high]); ``ci`` the path of
    its 95% interval, if any."""

    issue: int
    what: str
    file: str
    key: str
    op: str | None  # None: reported, no numeric target
    target: float | None = None
    ci: str | None = None
    note: str = ""
    dated_by: str | None = None  # the file whose date stamps the row, when the key was copied from it
    versus: str | None = None  # the target is this key's value in the same file, not ``target``


def lookup(data: dict, path: str):
    """``data``'s value at a dotted ``path`` (the corpus reader's field paths); KeyError naming it."""
    value = field_value(data, path)
    if value is _MISSING:
        raise KeyError(path)
    return value


def status(value: float, op: str | None, target: float | None, ci: list[float] | None = None) -> str:
    """``met``, ``met on the point, not on the interval`` or ``missed`` (``reported`` without a target)."""
    if op is None or target is None:
        return "reported"
    if not OPS[op](value, target):
        return "**missed**"
    if ci is not None and op != "==":
        bound = ci[0] if op == ">=" else ci[1]
        if not OPS[op](bound, target):
            return "met on the point, not on the interval"
    return "met"


def fmt(x: float) -> str:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return str(x)
    if float(x).is_integer():
        return f"{int(x):,}"
    a = abs(x)
    if a >= 100:
        return f"{x:,.0f}" if a >= 1000 else f"{x:.1f}"
    return f"{x:.3f}".rstrip("0").rstrip(".") if a < 10 else f"{x:.2f}"


TARGETS: list[Target] = [
    # issue 24: answers you can trust
    Target(24, "LDS: the served default as a query gets it (the index's damping, 128 documents returned, those "
           "whose `value` opposes the output left out, by value) minus EK-FAC, the fifth fresh split (seed 10, "
           "reported once; paired)", "attribution.json", "served_default_seed10.value_vs_ekfac.estimate", ">=", 0.0,
           "served_default_seed10.value_vs_ekfac.ci95", dated_by="attribution_influence_seed10.json"),
    Target(24, "LDS: the same answer with the `influence` option minus EK-FAC, the same split (paired)",
           "attribution.json", "served_default_seed10.lds_diff_prism_fast_influence_ekfac_ci", ">=", 0.0,
           dated_by="attribution_influence_seed10.json"),
    Target(24, "`canary_recall_at_10_paraphrase`, the served answer on the fresh split of seed 10 (verbatim: 1.0)",
           "attribution_value_rules_seed10.json", "guard.canary_recall_at_10_paraphrase_served", ">=",
           0.95),
    Target(24, "LDS: served fast path (documents by their score) minus EK-FAC, four fresh splits pooled (paired)",
           "attribution.json",
           "fresh_splits_influence_pooled.lds_diff_prism_fast_ekfac_ci.estimate", ">=", 0.0,
           "fresh_splits_influence_pooled.lds_diff_prism_fast_ekfac_ci.ci95",
           dated_by="attribution_influence_seed8.json"),
    Target(24, "LDS: served fast path, documents by their `value` (summed prototype-space influence) minus EK-FAC, "
           "fresh split of seed 7 (paired)", "attribution.json",
           "fresh_split_influence_seed7.value_vs_ekfac.estimate", ">=", 0.0,
           "fresh_split_influence_seed7.value_vs_ekfac.ci95",
           "by score on the same split: -0.093", dated_by="attribution_influence_seed7.json"),
    Target(24, "LDS: served fast path, 128 documents returned, those whose `value` opposes the output left out "
           "(the default since 2026-12-06), by value, minus EK-FAC, fresh split of seed 8 (paired)",
           "attribution_value_rules_seed8.json", "rules.value_pos_128.diff_vs_ekfac_all", ">=", 0.0,
           note="64 returned, every value kept (the previous measure): -0.060; by score: -0.082"),
    Target(24, "`canary_recall_at_10_paraphrase`, the served answer on the fresh split of seed 8 (verbatim: 1.0)",
           "attribution_value_rules_seed8.json", "guard.canary_recall_at_10_paraphrase_served", ">=", 0.95),
    Target(24, "`lds_prism_fast` against `lds_ekfac`, the report split of 2026-12-02", "attribution.json",
           "lds_prism_fast", ">=", versus="lds_ekfac"),
    Target(24, "LDS: fast path with the `influence` option minus EK-FAC, same splits pooled", "attribution.json",
           "fresh_splits_influence_pooled.lds_diff_prism_fast_influence_ekfac_ci.estimate", ">=", 0.0,
           "fresh_splits_influence_pooled.lds_diff_prism_fast_influence_ekfac_ci.ci95",
           "an option, not the default: about 3x a fast query's time (0.81 s against 0.25 s at 128 documents, "
           "seed 8)", dated_by="attribution_influence_seed8.json"),
    Target(24, "`near_tie_query_share`, the served answer (`cosine_max`, a near-tie at the cut settled by the "
               "documents' summed cosines), 48 fresh held-out queries and 8 planted facts (verbatim and "
               "paraphrased) at 5.18M tokens", "near_ties_settled_scale.json",
           "near_tie_query_share", "<=", 0.1, "near_tie_query_share_ci95",
           "the settling rule was chosen on the earlier draw's queries and the memorised-facts corpus"),
    Target(24, "`near_tie_query_share`, the score alone (`cosine_max`), the same 64 queries",
           "near_ties_settled_scale.json", "near_tie_query_share_by_score.cosine_max", "<=", 0.1),
    Target(24, "`overlap_at_10_fast_vs_exact`, strict, the same 48 fresh held-out queries at 5.18M tokens, "
               "against exact mode's answer (its near-tie settled too)", "near_ties_settled_scale.json",
           "overlap_at_10_fast_vs_exact", ">=", 0.9),
    Target(24, "`near_tie_query_share`, the served answer, a fresh draw (seed 23, 2026-12-07, the index's "
               "stored I(t, t) the stored token's): 48 held-out queries no run had asked and 8 planted facts "
               "(verbatim and paraphrased) at 5.18M tokens", "stored_cosine_scale.json", "near_tie_query_share",
           "<=", 0.1, "near_tie_query_share_ci95"),
    Target(24, "`overlap_at_10_fast_vs_exact`, strict, the same 48 fresh held-out queries at 5.18M tokens (the "
               "index as built before 2026-12-07, the exact I(t, t) stored: 0.915)", "stored_cosine_scale.json",
           "overlap_at_10_fast_vs_exact", ">=", 0.9),
    Target(24, "`near_tie_query_share`, the served answer, a fresh draw (seed 22, 2026-12-07): 48 held-out "
               "queries no run had asked and 8 planted facts (verbatim and paraphrased) at 5.18M tokens",
           "sketch_stage_scale.json", "near_tie_query_share", "<=", 0.1, "near_tie_query_share_ci95"),
    Target(24, "`overlap_at_10_fast_vs_exact`, strict, the same 48 held-out queries at 5.18M tokens (the draw the "
               "stored I(t, t) change was diagnosed on: 0.896 before it); with the FAISS sketch stage "
               "(n_candidates 256) the same", "sketch_stage_scale.json",
           "overlap_at_10_fast_vs_exact", ">=", 0.9),
    Target(24, "`near_tie_query_share`, the served answer (a near-tie at the cut settled), the earlier draw: 24 "
               "held-out queries and 8 planted facts (verbatim and paraphrased) at 5.18M tokens, the queries the "
               "settling rule was chosen on (re-run 2026-12-07)", "near_ties_scale.json", "near_tie_query_share",
           "<=", 0.1, "near_tie_query_share_ci95"),
    Target(24, "`near_tie_query_share`, the score alone (`cosine_max`), the same 40 queries",
           "near_ties_scale.json", "near_tie_query_share_by_score.cosine_max", "<=", 0.1),
    Target(24, "`overlap_at_10_fast_vs_exact`, strict, 96 held-out queries at 6.22M tokens (the report's draw, "
               "re-asked on the index rebuilt 2026-12-06, near-ties settled in both modes)",
           "scale.json", "overlap_fresh_report.overlap_at_10", ">=", 0.9, "overlap_fresh_report.ci95"),
    Target(24, "`overlap_at_10_fast_vs_exact`, strict, 48 fresh queries at 6.22M tokens (no run had asked them; the "
               "2026-12-05 index, not re-run)",
           "scale.json", "overlap_fresh_best_cells.arms.b.overlap_at_10", ">=", 0.9,
           "overlap_fresh_best_cells.arms.b.ci95", "arm b is the served first stages (`best_cells` 8)"),
    Target(24, "`overlap_at_10_fast_vs_exact`, strict, 72 fresh queries at 6.22M tokens (then diagnosed; the "
               "2026-12-05 index, not re-run)",
           "scale.json", "overlap_fresh.overlap_at_10", ">=", 0.9, "overlap_fresh.ci95"),
    Target(24, "`overlap_at_10_fast_vs_exact`, strict, the near-tie index: the same 24 held-out queries at 5.18M "
               "tokens (asked many times), near-ties settled in both modes", "near_ties_scale.json",
           "overlap_at_10_fast_vs_exact", ">=", 0.9),
    Target(24, "`canary_recall_at_10_verbatim`", "attribution.json", "canary_recall_at_10_verbatim", "==", 1.0),
    Target(24, "`canary_recall_at_10_paraphrase`", "attribution.json", "canary_recall_at_10_paraphrase", ">=", 0.95),
    Target(24, "`canary_recall_at_10_verbatim_memorised` (memorised-facts corpus)", "attribution_memorised.json",
           "canary_recall_at_10_verbatim_memorised", "==", 1.0),
    Target(24, "`candidate_recall_of_exact_top10_memorised`", "attribution_memorised.json",
           "candidate_recall_of_exact_top10_memorised", "==", 1.0),
    Target(24, "`canary_recall_at_10_verbatim_memorised`, a fresh memorised-facts corpus (facts of seed 12, the model "
               "trained anew), the default answer of 10 documents", "attribution_memorised_seed12.json",
           "canary_recall_at_10_verbatim_memorised_answer_of_10", "==", 1.0),
    # issue 25: speed at scale
    Target(25, "`/v1/attribute` p50 at one client, demo index (ms)", "service.json",
           "targets.attribute_p50_ms_1_client.value", "<=", 60),
    Target(25, "`/v1/attribute` p99 at 8 clients, demo index (ms)", "service.json",
           "targets.attribute_p99_ms_8_clients.value", "<=", 400),
    Target(25, "`/v1/attribute` errors", "service.json", "targets.errors.value", "==", 0),
    Target(25, "`p50_ms_largest` (298M served tokens; synthetic copies of the real index)", "scale.json",
           "p50_ms_largest", "<=", 100),
    Target(25, "`p99_ms_largest_8_clients`", "scale.json", "p99_ms_largest_8_clients", None),
    Target(25, "`latency_growth_16x`", "scale.json", "latency_growth_16x", "<=", 2.0),
    Target(25, "disk bytes per token", "scale.json", "disk_bytes_per_token", "<=", 64),
    Target(25, "serving anonymous memory, bytes per token", "scale.json", "serve_anon_bytes_per_token", "<=", 8),
    Target(25, "`overlap_at_10_fast_vs_exact`, scale.json's 24 headline queries (near-ties settled in both modes)", "scale.json",
           "overlap.overlap_at_10", ">=", 0.9, "overlap.ci95"),
    Target(25, "indexing: shard stage / bare forward (`throughput_ratio`)", "index.json", "throughput_ratio", ">=", 0.8),
    Target(25, "indexing: whole job / bare forward (`whole_job_ratio`)", "index.json", "whole_job_ratio", ">=", 0.6),
    Target(25, "`speedup_vs_ekfac_single_query` (18,129 sequences, seed 8's model)", "attribution_scaling_rerun.json",
           "speedup_vs_ekfac_single_query", ">=", 1000),
    # issue 27: control
    Target(27, "`topic_rate_drop`, set selected by effect, neutral prompts, default judge", "steering.json",
           "select_effect.heldout.topic_rate_drop", ">=", 0.75, "select_effect.heldout.topic_rate_drop_ci"),
    Target(27, "`other_ppl_ratio`, the same set", "steering.json", "select_effect.heldout.other_ppl_ratio", "<=", 1.02,
           "select_effect.heldout.other_ppl_ratio_ci"),
    Target(27, "share of the bank suppressed", "steering.json", "select_effect.share_of_bank", "<=", 0.02),
    Target(27, "`topic_rate_drop`, the same set, strict judge, 5,000 generations", "steering.json",
           "strict_judge.larger_draw.selected.topic_rate_drop", ">=", 0.75,
           "strict_judge.larger_draw.selected.topic_rate_drop_ci",
           "this judge can show at most 0.735 at this base rate"),
    Target(27, "`topic_rate_drop`, the same set, prompts that invite the topic, strict judge", "steering.json",
           "elicited_prompts.strict_judge.selected.topic_rate_drop", ">=", 0.75,
           "elicited_prompts.strict_judge.selected.topic_rate_drop_ci",
           "the topic's vocabulary: the window judge, which sees its style too, gives this set 0.017 here"),
    Target(27, "`topic_rate_drop`, the same set, prompts that invite the topic, default judge", "steering.json",
           "elicited_prompts.default_judge.selected.topic_rate_drop", ">=", 0.75,
           "elicited_prompts.default_judge.selected.topic_rate_drop_ci"),
    Target(27, "`topic_rate_drop`, a set selected under removal with re-routing, neutral prompts, default judge",
           "steering.json", "reroute.default_judge.selected_rerouted.topic_rate_drop", ">=", 0.75,
           "reroute.default_judge.selected_rerouted.topic_rate_drop_ci"),
    Target(27, "`other_ppl_ratio`, the same re-routed set", "steering.json",
           "reroute.default_judge.selected_rerouted.other_ppl_ratio", "<=", 1.02,
           "reroute.default_judge.selected_rerouted.other_ppl_ratio_ci"),
    Target(27, "`topic_rate_drop`, step 6's set, strict judge's larger draw re-judged by the window judge (style "
               "as well as words, 1% false-positive threshold)", "steering.json",
           "window_judge.larger_draw.selected.topic_rate_drop", ">=", 0.75,
           "window_judge.larger_draw.selected.topic_rate_drop_ci",
           "this judge can show at most 0.643 at this base rate; where the prompt invites the topic it sees this set "
           "drop it by 0.017, and discovery's top 10 by 0.80"),
    Target(27, "`topic_rate_drop`, a set selected with the window judge's labels, neutral prompts, 5,000 generations, "
               "window judge", "steering.json", "window_judge.select_effect.selected.larger_draw.topic_rate_drop",
           ">=", 0.75, "window_judge.select_effect.selected.larger_draw.topic_rate_drop_ci"),
    Target(27, "`other_ppl_ratio`, the same set", "steering.json",
           "window_judge.select_effect.selected.other_ppl_ratio", "<=", 1.02,
           "window_judge.select_effect.selected.other_ppl_ratio_ci"),
    Target(27, "`topic_rate_drop`, a set selected on generations either judge calls on the topic, neutral prompts, "
               "5,000 generations, strict (word) judge", "steering.json",
           "window_judge.both_judges.larger_draw.strict_judge.topic_rate_drop", ">=", 0.75,
           "window_judge.both_judges.larger_draw.strict_judge.topic_rate_drop_ci"),
    Target(27, "`topic_rate_drop`, the same set and generations, window judge", "steering.json",
           "window_judge.both_judges.larger_draw.window_judge.topic_rate_drop", ">=", 0.75,
           "window_judge.both_judges.larger_draw.window_judge.topic_rate_drop_ci"),
    Target(27, "`other_ppl_ratio`, the same set", "steering.json", "window_judge.both_judges.other_ppl_ratio", "<=",
           1.02, "window_judge.both_judges.other_ppl_ratio_ci"),
    Target(27, "`topic_rate_drop`, step 6's set suppressed only where the context carries it (gate 0.1 over 16 "
               "tokens, chosen on the tuning split), neutral prompts, 5,000 generations, strict (word) judge",
           "steering.json", "gated.step6_selected.set.larger_draw.strict_judge.topic_rate_drop", ">=", 0.75,
           "gated.step6_selected.set.larger_draw.strict_judge.topic_rate_drop_ci",
           "suppressed everywhere: 0.709; its random control gated the same way: 0.0 (the gate never opens)"),
    Target(27, "`topic_rate_drop`, the same gated set and generations, window judge", "steering.json",
           "gated.step6_selected.set.larger_draw.window_judge.topic_rate_drop", ">=", 0.75,
           "gated.step6_selected.set.larger_draw.window_judge.topic_rate_drop_ci"),
    Target(27, "`other_ppl_ratio`, the same gated set (suppressed everywhere: 1.027; graded to alpha 0.5 instead: "
               "1.006)", "steering.json", "gated.step6_selected.set.other_ppl_ratio", "<=", 1.02,
           "gated.step6_selected.set.other_ppl_ratio_ci"),
    Target(27, "`topic_rate_drop`, step 6's set in the configuration the tuning split chose (gate 0.1), a fresh split "
               "(50 new neutral prompts x 200 samples), the classifier at a 0.1% false-positive threshold (it sees the "
               "topic's blatant form only; the most it can show here: 0.796)", "steering_precise.json",
           "primary.topic_rate_drop", ">=", 0.75, "primary.topic_rate_drop_ci",
           "not the rule's choice, the same split: alpha 0.5 everywhere 0.776 at x1.006, alpha 0.25 0.939 at x1.014, "
           "alpha 0 1.0 at x1.027; the random set gated: 0.0"),
    Target(27, "`other_ppl_ratio`, the same configuration", "steering_precise.json", "primary.other_ppl_ratio", "<=",
           1.02, "primary.other_ppl_ratio_ci"),
    Target(27, "`controller_gain_points` (multiple choice, held out)", "control.json", "controller_gain_points", None,
           None, "controller_gain_points_ci"),
    Target(27, "random-direction controller of the same size, gain in points", "control.json", "random_gain_points",
           None, None, "random_gain_points_ci"),
]

ISSUES = {24: "Answers you can trust", 25: "Speed at scale", 27: "Control"}


def render(results: Path = RESULTS, targets: list[Target] = TARGETS) -> str:
    """The page: one table per issue; a missing file or key is an error naming both."""
    cache: dict[str, dict] = {}

    def read(name: str) -> dict:
        if name not in cache:
            path = results / name
            if not path.exists():
                raise FileNotFoundError(f"{path}: results file missing (a target row reads it)")
            cache[name] = json.loads(path.read_text())
        return cache[name]

    lines = [
        "# Where the targets stand",
        "",
        "Written by `python -m bench.targets` from `bench/results/*.json` (CI checks that this page",
        "matches them); each benchmark's command, machine and method are in `docs/benchmarks.md`.",
        "\"Met on the point, not on the interval\": the estimate meets the target, its 95% interval",
        "still crosses it.",
    ]
    for issue, title in ISSUES.items():
        lines += ["", f"## Issue {issue}: {title}", "",
                  "| measure | value (95% interval) | target | status | source (date) |",
                  "|---|---|---|---|---|"]
        for t in (t for t in targets if t.issue == issue):
            data = read(t.file)
            try:
                value = lookup(data, t.key)
                ci = lookup(data, t.ci) if t.ci else None
                target = lookup(data, t.versus) if t.versus else t.target
            except KeyError as e:
                raise KeyError(f"{results / t.file}: no key {e.args[0]!r} (target {t.what!r})") from None
            if isinstance(value, list) and len(value) == 3 and ci is None:  # [point, low, high]
                value, ci = value[0], value[1:]
            shown = fmt(value) + (f" ({fmt(ci[0])} to {fmt(ci[1])})" if ci else "")
            goal = f"{t.op} {fmt(target)}" if t.op and target is not None else "reported"
            if t.versus:
                goal += f" (`{t.versus}`)"
            note = f"; {t.note}" if t.note else ""
            # a block measured apart from the rest of its file (one carried over by a later run) has its own date
            block = data.get(t.key.split(".")[0]) if "." in t.key else None
            dated = block if isinstance(block, dict) and "date" in block and not t.dated_by else read(t.dated_by or t.file)
            date = str(dated.get("date", "?"))[:10]
            lines.append(f"| {t.what}{note} | {shown} | {goal} | {status(value, t.op, target, ci)} | "
                         f"`{t.file}` `{t.key}` ({date}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args(argv)
    from prism_tda.cli.serve import write_generated

    return write_generated(render(Path(args.results)), Path(args.out), args.check, "python -m bench.targets")


if __name__ == "__main__":
    sys.exit(main())
