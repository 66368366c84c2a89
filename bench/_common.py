"""Shared tail of every benchmark: record machine, command and date, write the JSON, print it."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def finish(res: dict, script: str, argv: list[str] | None, out: str, hide: tuple[str, ...] = (), *,
           command: str | None = None) -> dict:
    res.setdefault("machine", {}).update({
        "platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        # other work on the machine skews timings: the 1/5/15-minute load averages at the end of the run
        "load_average": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
        # the same machine kind runs the same code up to ~2x apart from one day to the next: two fixed
        # workloads measured at the end of the run, so results of different runs can be put side by side
        "speed_reference": speed_reference(),
    })
    res["command"] = command or f"python bench/{script} " + " ".join(sys.argv[1:] if argv is None else argv)
    res["date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k not in ("config", "machine", *hide)}, indent=2))
    return res


def speed_reference(repeats: int = 5) -> dict[str, float]:
    """Two fixed workloads on this machine now (best of ``repeats``): single-thread float32 GFLOPS of a
    512 x 512 matrix product (compute-bound, as the model's forward), and nanoseconds per element of
    a random gather from a 64 MiB array (memory-bound, as the scoring of stored codes)."""
    import time

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(20):
                a @ b
            best = min(best, (time.perf_counter() - t) / 20)
    finally:
        torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    big = rng.random(1 << 23).astype(np.float64)  # 64 MiB
    at = rng.integers(0, len(big), 1 << 20)
    gather = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        big[at].sum()
        gather = min(gather, time.perf_counter() - t)
    return {"matmul_gflops_1_thread": round(2 * 512**3 / best / 1e9, 1),
            "gather_ns_per_element": round(1e9 * gather / len(at), 2)}


def peak_rss_mb() -> float:
    """Peak resident memory of this process, in MB (``VmHWM``; unlike ``ru_maxrss`` it starts afresh
    in a spawned process instead of inheriting the parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def index_complete(index_dir: str | Path) -> bool:
    """Whether a complete index is there (a build that stopped half way leaves an incomplete manifest,
    which ``build_index`` finishes when called again)."""
    from prism_tda.engine import layout

    m = layout.read_manifest(Path(index_dir)) if Path(index_dir).is_dir() else None
    return m is not None and m.complete


def index_documents(index_dir: str | Path, columns: list[str]) -> dict[str, list]:
    """Columns of every document of an index, in global id order (``engine.reads.document_table``)."""
    from prism_tda.engine.reads import document_table

    return document_table(Path(index_dir), columns).to_pydict()


def index_sequences(index_dir: str | Path) -> dict[str, list]:
    """Every sequence of an index as the model saw it: ``doc_id``, ``token_ids``, ``target_ids``."""
    from prism_tda.engine.reader import IndexReader

    r = IndexReader(index_dir)
    toks = [r.sequence_tokens(s) for s in range(r.n_seqs)]
    return {"doc_id": r.doc_of_seqs(np.arange(r.n_seqs)).tolist(), "token_ids": [t for t, _ in toks],
            "target_ids": [y for _, y in toks]}


@contextlib.contextmanager
def served(index: str | Path, name: str = "bench", *, poll_s: float = 0.1, options: tuple[str, ...] = (),
           env: dict[str, str] | None = None):
    """``prism serve`` on one index as its own process (loopback, no rate limit, its own state
    directory, more ``options`` of `prism serve`, more ``env``ironment); yields (process, base URL, seconds until
    ``/readyz`` answered); stops it on exit."""
    import shutil
    import signal
    import subprocess
    import tempfile
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    state = tempfile.mkdtemp(prefix="prism-bench-state-")
    env = {**os.environ, "PRISM_RATE_LIMIT_PER_MINUTE": "0", **(env or {})}
    t0 = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "prism_tda.cli", "--log-level", "warning", "serve", "--index",
                               f"{name}={index}", "--port", str(port), "--state-dir", state, *options], env=env)
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server on {index} exited")
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(poll_s)
        yield server, url, time.perf_counter() - t0
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(state, ignore_errors=True)


def alternating_arms(n: int, arms: dict[str, Callable[[int], Any]], reranked: bool = False) -> dict:
    """Query ``i`` of ``n`` asked of every arm (``arms``: a name to a function of ``i`` returning an
    ``Attribution``), the arms' order alternating query by query so that a drift in the machine's speed
    falls on both; the first arm is the baseline. Returns the share of each query's top documents the
    arms agree on, the queries whose answers differ, and per arm the median and mean wall milliseconds,
    the median candidates / shortlist / re-rank milliseconds and (``reranked``) the documents re-ranked."""
    import time

    names = list(arms)
    ms: dict[str, list[float]] = {a: [] for a in names}
    stages: dict[str, list[list[float]]] = {a: [] for a in names}
    rr: dict[str, list[int]] = {a: [] for a in names}
    docs: list[dict[str, set[int]]] = [{} for _ in range(n)]
    for i in range(n):
        for a in names if i % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            res = arms[a](i)
            ms[a].append(1e3 * (time.perf_counter() - t0))
            t = res.timings_ms
            stages[a].append([t.candidates, t.shortlist, t.score - t.shortlist])
            rr[a].append(res.documents_reranked)
            docs[i][a] = {d.doc_id for d in res.documents}
    base, other = names[0], names[-1]
    overlap = np.array([len(d[base] & d[other]) / max(len(d[base]), 1) for d in docs])
    out: dict[str, Any] = {"answer_overlap_at_10_between_arms": round(float(overlap.mean()), 4),
                           "queries_whose_answers_differ": int((overlap < 1).sum())}
    for a in names:
        med = np.median(stages[a], 0)
        out[a] = {"p50_ms": round(float(np.median(ms[a])), 1), "mean_ms": round(float(np.mean(ms[a])), 1),
                  **({"documents_reranked_mean": round(float(np.mean(rr[a])), 2)} if reranked else {}),
                  "stages_ms_median": {"candidates": round(float(med[0]), 1), "shortlist": round(float(med[1]), 1),
                                       "rerank": round(float(med[2]), 1)}}
    return out


def interleaved_queries(att, specs: list, opt, arms: dict, repeats: int, stages: tuple[str, ...]) -> tuple[dict, dict]:
    """Each query asked once per arm per repeat, the arms' order alternating query by query, in one
    process: ``arms`` maps a name to a function that puts the engine in that arm. Returns, per arm,
    the wall and ``stages`` milliseconds of each query over the repeats, and each query's last answer
    as (doc_id, score) pairs. Two queries per arm warm up first."""
    import time

    names = list(arms)
    times = {a: {k: [[] for _ in specs] for k in ("wall", *stages)} for a in names}
    answers: dict[str, list] = {a: [None] * len(specs) for a in names}
    for s in specs[:2]:
        for a in names:
            arms[a]()
            att.attribute(s, opt)
    for r in range(repeats):
        for i, s in enumerate(specs):
            for a in names if (r + i) % 2 else names[::-1]:
                arms[a]()
                t0 = time.perf_counter()
                res = att.attribute(s, opt)
                times[a]["wall"][i].append(1e3 * (time.perf_counter() - t0))
                for k in stages:
                    times[a][k][i].append(getattr(res.timings_ms, k))
                answers[a][i] = [(d.doc_id, d.score) for d in res.documents]
    return times, answers


def paired_summary(times: dict, answers: dict, keys: tuple[str, ...], seed: int = 0) -> dict:
    """For the two arms of :func:`interleaved_queries` (first the baseline): per arm the median and p90
    of each key; the paired difference (second minus first) of the per-query medians with a 95%
    bootstrap interval over queries; whether both arms gave the same documents in the same order, and
    the largest score difference."""
    base, new = list(times)
    rng = np.random.default_rng(seed)

    def summary(v: list[list[float]]) -> dict:
        flat = np.concatenate(v)
        return {"p50": round(float(np.median(flat)), 2), "p90": round(float(np.percentile(flat, 90)), 2)}

    def paired(k: str) -> dict:
        d = np.array([np.median(b) - np.median(w) for w, b in zip(times[base][k], times[new][k], strict=True)])
        boot = [float(np.median(rng.choice(d, len(d)))) for _ in range(2000)]
        return {"median_ms": round(float(np.median(d)), 2),
                "ci95_ms": [round(float(np.percentile(boot, 2.5)), 2), round(float(np.percentile(boot, 97.5)), 2)]}

    pairs = list(zip(answers[base], answers[new], strict=True))
    same_order = sum([x[0] for x in w] == [x[0] for x in b] for w, b in pairs)
    score_diff = max((abs(x[1] - y[1]) for w, b in pairs for x, y in zip(w, b, strict=False)), default=0.0)
    return {"arms": {a: {k: summary(v) for k, v in times[a].items()} for a in (base, new)},
            "diff": {k: paired(k) for k in keys},
            "same_documents_and_order": f"{same_order}/{len(pairs)}", "max_score_diff": float(score_diff)}


def add_demo_query_args(ap, out: str, repeats: int) -> None:
    """The options of the benchmarks that ask the demo queries of ``bench/service_load.py`` in process."""
    ap.add_argument("--index", default="runs/demo/index")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--first-prompt", type=int, default=0,
                    help="skip this many of the demo prompts first (32: prompts 33-48, a tuning set disjoint "
                         "from the default 16)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--completion", default=" is a machine")
    ap.add_argument("--out", default=out)


def demo_queries(args) -> tuple:
    """(the index's Attributor, the query specs, the options: top 10) for :func:`add_demo_query_args`'s
    options: ``--prompts`` prompts (after the first ``--first-prompt``) of ``--prompt-tokens`` tokens cut
    from the demo corpus, each followed by ``--completion``; torch on every core."""
    from bench.service_load import prompts_of
    from prism_tda.engine import Attributor, QueryOptions, QuerySpec

    torch.set_num_threads(os.cpu_count() or 1)
    att = Attributor.open(args.index)
    first = args.first_prompt
    prompts = prompts_of(Path(att.manifest.checkpoint) / "tokenizer.json", first + args.prompts,
                         args.prompt_tokens)[first:]
    return att, [QuerySpec(p, args.completion) for p in prompts], QueryOptions(n_documents=10)


def served_ranking(s: np.ndarray, second: np.ndarray, keep: np.ndarray, k: int = 10) -> tuple[np.ndarray, int]:
    """Exact mode's answer from exact per-document scores: (every kept document, best first, as the
    served default returns them: the ``k`` that ``settle_near_ties`` takes from ``s`` (``cosine_max``)
    and ``second`` (``cosine_sum``), then the rest by score; the documents of the near-tie at the cut
    that neither measure separates from those taken, counted as ``near_ties.near_ties`` counts: ``k``
    plus them, ``k`` without any)."""
    from prism_tda.engine.aggregate import settle_near_ties

    order = np.flatnonzero(keep)[np.argsort(-s[keep], kind="stable")]
    v = s[order]
    if len(v) < k or not (np.isfinite(v[k - 1]) and v[k - 1] > 0):
        return order, 0
    m = int((v >= v[k - 1] - 1e-3 * abs(v[k - 1])).sum())
    st = settle_near_ties(v[:m], second[order[:m]], k)
    top = order[st.order]
    return np.concatenate([top, order[~np.isin(order, top)]]), (k + st.unsettled) if st.unsettled else k
