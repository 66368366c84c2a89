"""The GPU check: three short measurements on one NVIDIA GPU, each timed and recorded even when it fails.

1. ``train``: training-step throughput, PRISM against the dense baseline, at the ``gpt2-small`` preset
   (12 layers, d=768, K=8,192, k=8, context 1,024, batch 16), the step the trainer takes (bf16 autocast
   on CUDA, AdamW, gradient clipping, the loss terms read back each step) on **synthetic** batches
   (uniform random token ids; the same batch for both models), steps interleaved as in
   ``bench/train_throughput.py``.
2. ``index``: a randomly initialised model of the ``small`` preset (a BPE tokenizer trained on the same
   documents) indexes documents of the bundled demo corpus on the GPU; tokens/s of the shard stage and
   of the bare forward pass on the batches the indexer ran (``bench/index_throughput.py``).
3. ``faiss``: Flat, IVF-Flat and IVF-PQ (the indexer's choice for a large index) over synthetic
   clustered unit vectors of the width of the indexer's sequence sketches, built on the GPU, searched
   on the GPU and on the CPU: queries/s of each and the recall of the GPU's top-k against the CPU's.

Each stage runs in its own process under its own time limit (its share of ``--budget`` plus what the
stages before it left unused), so a slow or hung stage cannot eat the others; a stage past its limit is
killed and recorded with what it had measured.

    bench/gpu_check.sh                      # on the GPU machine: bench/results/gpu.json
    python -m bench.gpu_check --dry-run     # on CPU at tiny sizes: bench/results/gpu_dry_run.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STAGES = ("train", "index", "faiss")
# each stage's share of the budget (after RESERVE_S); unused seconds pass on to the next stage
SHARES = {"train": 0.40, "index": 0.35, "faiss": 0.25}
RESERVE_S = 15.0  # the check's own start and end: machine facts, the JSON
SOFT_FRACTION = 0.75  # a stage stops starting new work (steps, indexes) past this share of its limit

SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"train_preset": "gpt2-small", "train_steps": 300, "train_warmup": 20, "train_batch_size": None,
            "index_preset": "small", "index_docs": 2000, "index_set": [],
            "faiss_n": 262_144, "faiss_queries": 4096, "faiss_cpu_queries": 1024, "faiss_k": 10,
            "faiss_pq": None},
    # on 2 CPU cores, faiss's polysemous training of 8-bit PQ codes (the "PQ32" of the indexer's spec)
    # takes minutes, and the index's 12-bit token codebooks half a minute: smaller codes for the dry run
    "dry_run": {"train_preset": "tiny", "train_steps": 6, "train_warmup": 2, "train_batch_size": 8,
                "index_preset": "tiny", "index_docs": 300, "index_set": ["code_bits=8", "posting_cells=16"],
                "faiss_n": 4096, "faiss_queries": 256, "faiss_cpu_queries": 256, "faiss_k": 10,
                "faiss_pq": "PQ32x4np"},
}
BUDGET_S = {"gpu": 480.0, "dry_run": 170.0}


class Record(dict):
    """A stage's results; ``flush`` writes what is there so far (a stage killed at its limit keeps it)."""

    def __init__(self, path: Path | None = None) -> None:
        super().__init__()
        self.path = path

    def flush(self) -> None:
        if self.path is not None:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(self, indent=2, default=str))
            tmp.replace(self.path)


def _log(stage: str, msg: str) -> None:
    print(f"[gpu_check {stage}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------- stage 1
def stage_train(rec: Record, p: dict[str, Any], deadline: float, use_gpu: bool) -> None:
    import torch

    from bench.train_throughput import interleaved_step_times, step_time_summary
    from prism_tda.cli import build_configs
    from prism_tda.model.device import autocast_for
    from prism_tda.model.model import PRISM
    from prism_tda.model.train import lr_at

    device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
    sets = [f"train.max_steps={p['train_steps']}"]
    if p.get("train_batch_size"):
        sets.append(f"train.batch_size={p['train_batch_size']}")
    model_cfg, train_cfg = build_configs(p["train_preset"], None, sets)
    B, T, V = train_cfg.batch_size, model_cfg.block_size, model_cfg.vocab_size
    autocast = autocast_for(device, train_cfg.dtype, cpu_bf16_when_native=True)  # as the trainer sets it
    rec.update(device=str(device), preset=p["train_preset"],
               precision="bf16 autocast" if isinstance(autocast, torch.autocast) else "fp32",
               data="synthetic: uniform random token ids, a new batch each step, the same for both models",
               model={k: getattr(model_cfg, k) for k in ("n_layer", "d_model", "n_head", "vocab_size", "block_size",
                                                          "n_prototypes", "n_active")},
               batch_size=B, tokens_per_step=B * T, steps_asked=p["train_steps"], warmup=p["train_warmup"])
    rec.flush()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(train_cfg.seed * 1_000_003 + step)
        xy = torch.randint(0, V, (B, T + 1), generator=g)
        return xy[:, :-1].to(device), xy[:, 1:].to(device)

    def make_step(model: PRISM) -> tuple[Any, dict[str, float]]:
        decay, no_decay = [], []  # the trainer's parameter groups
        for name, q in model.named_parameters():
            (decay if q.dim() >= 2 and not name.endswith("prototypes") else no_decay).append(q)
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": train_cfg.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2))
        last: dict[str, float] = {}

        def run(step: int) -> None:
            for group in opt.param_groups:
                group["lr"] = lr_at(step, train_cfg)
            opt.zero_grad(set_to_none=True)
            x, y = batch(step)
            with autocast:
                out = model(x, y)
            assert out.loss is not None
            out.loss.backward()
            last.update({k: float(v.detach()) for k, v in {"loss": out.loss, **out.losses, **out.metrics}.items()})
            last["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip))
            opt.step()

        return run, last

    steps, lasts, params = {}, {}, {}
    t0 = time.perf_counter()
    for head in ("prism", "dense"):
        torch.manual_seed(train_cfg.seed)  # the same initial backbone for both
        model = PRISM(model_cfg.replace(head=head)).to(device).train()
        params[head] = model.num_params()
        steps[head], lasts[head] = make_step(model)
    rec.update(n_params=params, setup_s=round(time.perf_counter() - t0, 2))
    _log("train", f"{p['train_preset']} on {device}: {params}")
    times = interleaved_step_times(steps, p["train_steps"], progress=False, deadline=deadline)
    rec["steps_run"] = len(times["prism"])
    rec["stopped_at_soft_deadline"] = rec["steps_run"] < p["train_steps"]
    if not rec["steps_run"]:
        raise RuntimeError("no step finished before the stage's soft deadline")
    rec.update(step_time_summary(times, p["train_warmup"], B * T))
    rec["last_step"] = {h: {k: round(v, 4) for k, v in lasts[h].items()} for h in lasts}
    if device.type == "cuda":
        rec["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    _log("train", f"{rec['steps_run']} steps, throughput_ratio {rec['throughput_ratio']:.3f}")


# --------------------------------------------------------------------------------------- stage 2
def stage_index(rec: Record, p: dict[str, Any], deadline: float, use_gpu: bool, work: Path) -> None:
    import torch

    from bench.index_throughput import bare_forward_tokens_per_s, indexer_batches, make_corpus
    from prism_tda.cli import build_configs
    from prism_tda.cli.train import merge_overrides
    from prism_tda.indexer import IndexConfig
    from prism_tda.indexer.run import build_index
    from prism_tda.model.checkpoint import save_checkpoint
    from prism_tda.model.device import autocast_for, pick_device
    from prism_tda.model.model import PRISM
    from prism_tda.model.tokenizer import train_tokenizer

    device = pick_device()  # what the indexer itself runs on
    if use_gpu and device.type != "cuda":
        raise RuntimeError("no CUDA device visible to torch")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    corpus = make_corpus(work / "corpus.jsonl", p["index_docs"])
    texts = [json.loads(line)["text"] for line in open(corpus)]
    model_cfg, _ = build_configs(p["index_preset"], None, [])
    t0 = time.perf_counter()
    tok = train_tokenizer(texts, model_cfg.vocab_size)
    tokenizer_s = time.perf_counter() - t0
    torch.manual_seed(0)
    model = PRISM(model_cfg.replace(vocab_size=tok.get_vocab_size()))
    ck = save_checkpoint(work / "checkpoint", model, tok, training={"note": "random init (bench.gpu_check)"})
    sets = [f"index.{item}" for item in p["index_set"]]  # NAME=VALUE of IndexConfig, as `prism index --set`
    cfg = IndexConfig.from_dict(merge_overrides({"index": {}}, None, sets)["index"], where="index_set")
    rec.update(device=str(device), preset=p["index_preset"], documents_asked=p["index_docs"],
               model="random init (untrained): timings only, no attribution quality",
               tokenizer_vocab=tok.get_vocab_size(), tokenizer_s=round(tokenizer_s, 2),
               index_config={k: getattr(cfg, k) for k in ("batch_size", "dtype", "embed_dim", "sketch_buckets",
                                                          "code_bits", "posting_cells")})
    rec.flush()
    out = work / "index"
    t0 = time.perf_counter()
    s = build_index(ck, [str(corpus)], out, cfg, progress=False)
    wall = time.perf_counter() - t0
    rec.update(documents=s["documents"], sequences=s["sequences"], tokens=s["tokens"], shards=s["shards"],
               wall_s=round(wall, 2), timings=s["timings"], faiss_spec=s["calibration"]["faiss_spec"],
               shard_stage_tokens_per_s=s["tokens"] / s["timings"]["shards_s"],
               whole_job_tokens_per_s=s["tokens"] / wall)
    rec.flush()
    _log("index", f"{s['tokens']} tokens in {wall:.1f} s on {device}")
    batches = indexer_batches(out, cfg.batch_size, model_cfg.block_size)
    autocast = autocast_for(device, cfg.dtype)  # the indexer's precision
    bare_forward_tokens_per_s(ck, out, batches[:4], device=device, autocast=autocast)  # warm-up
    fwd = bare_forward_tokens_per_s(ck, out, batches, device=device, autocast=autocast)
    rec.update(forward_tokens_per_s=fwd, forward_batches=len(batches),
               shard_stage_ratio=rec["shard_stage_tokens_per_s"] / fwd,
               whole_job_ratio=rec["whole_job_tokens_per_s"] / fwd)
    _log("index", f"shard stage {rec['shard_stage_tokens_per_s']:.0f} tok/s, forward {fwd:.0f} tok/s")


# --------------------------------------------------------------------------------------- stage 3
def ivf_lists(n: int) -> int:
    """IVF lists for ``n`` vectors as ``indexer/calibrate.py: faiss_spec`` chooses them (about 4 sqrt(n),
    at least TRAIN_PER_LIST training points each, a power of two)."""
    from prism_tda.indexer.calibrate import TRAIN_PER_LIST

    want = min(4 * math.sqrt(n), n / TRAIN_PER_LIST, 1 << 16)
    return 2 ** max(4, int(math.log2(max(want, 1))))


def synthetic_vectors(n: int, n_queries: int, dim: int, seed: int = 0):
    """Unit vectors drawn around ``n // 256`` random unit centres (clustered, as sequence sketches are)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(16, n // 256), dim), dtype=np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)

    def draw(m: int) -> np.ndarray:
        x = centres[rng.integers(0, len(centres), m)]
        x += rng.standard_normal((m, dim), dtype=np.float32) * np.float32(0.6 / math.sqrt(dim))
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    return draw(n), draw(n_queries)


def recall_at_k(found, truth) -> float:
    """Mean share of each row of ``truth``'s ids (the -1 of a short list left out) that ``found`` has too."""
    hits = total = 0
    for f, t in zip(found, truth, strict=True):
        ts = set(t[t >= 0].tolist())
        hits += len(ts & set(f.tolist()))
        total += len(ts)
    return hits / max(total, 1)


def stage_faiss(rec: Record, p: dict[str, Any], deadline: float, use_gpu: bool) -> None:
    import faiss

    from prism_tda.indexer import IndexConfig

    n_gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    rec["faiss"] = {"version": faiss.__version__, "gpus": n_gpus, "omp_threads": faiss.omp_get_max_threads()}
    if use_gpu and n_gpus == 0:
        raise RuntimeError("faiss sees no GPU (faiss.get_num_gpus() == 0): faiss-cpu installed instead of faiss-gpu, "
                           "or no CUDA device")
    gpu = use_gpu and n_gpus > 0
    cfg = IndexConfig()
    dim = cfg.embed_dim * cfg.sketch_buckets  # the width of the indexer's sequence sketches
    n, k = p["faiss_n"], p["faiss_k"]
    nq, nq_cpu = p["faiss_queries"], min(p["faiss_cpu_queries"], p["faiss_queries"])
    nlist = ivf_lists(n)
    nprobe = max(1, nlist // 16)
    t0 = time.perf_counter()
    xb, xq = synthetic_vectors(n, nq, dim)
    rec.update(dim=dim, n=n, queries_gpu=nq if gpu else 0, queries_cpu=nq_cpu, k=k, nlist=nlist, nprobe=nprobe,
               metric="inner product", data="synthetic: unit vectors around random centres",
               data_s=round(time.perf_counter() - t0, 2), built_on="gpu" if gpu else "cpu", indexes={}, skipped=[])
    rec.flush()
    res = faiss.StandardGpuResources() if gpu else None
    pq = p["faiss_pq"] or f"PQ{max(8, dim // 32)}"  # None: the indexer's (indexer/calibrate.py: faiss_spec)
    n_train = min(n, 64 * nlist)
    rec["n_train"] = n_train
    exact = None
    for name, spec in (("flat", "Flat"), ("ivf_flat", f"IVF{nlist},Flat"), ("ivf_pq", f"IVF{nlist},{pq}")):
        if time.perf_counter() > deadline:
            rec["skipped"].append(name)
            continue
        v: dict[str, Any] = {"spec": spec}
        rec["indexes"][name] = v
        try:
            i_cpu = _search_one(faiss, res, spec, dim, nprobe, xb, n_train, xq, nq_cpu, k, v)
        except Exception as e:  # recorded; the other indexes still run
            v["error"] = f"{type(e).__name__}: {e}"
            _log("faiss", f"{spec} failed: {v['error']}")
            rec.flush()
            continue
        if name == "flat":
            exact = i_cpu
        elif exact is not None:
            v["recall_cpu_vs_exact"] = recall_at_k(i_cpu, exact)
        rec.flush()
        _log("faiss", f"{spec}: " + ", ".join(f"{a} {b:.4g}" for a, b in v.items() if isinstance(b, float)))
    failed = [f"{n}: {v['error']}" for n, v in rec["indexes"].items() if "error" in v]
    if failed:
        raise RuntimeError("; ".join(failed))


def _search_one(faiss, res, spec: str, dim: int, nprobe: int, xb, n_train: int, xq, nq_cpu: int, k: int,
                v: dict[str, Any]):
    """Build ``spec`` (trained on the first ``n_train`` vectors; on the GPU when ``res``), search it on the
    CPU (and the GPU); fill ``v``; return the CPU's ids."""
    index = faiss.index_factory(dim, spec, faiss.METRIC_INNER_PRODUCT)
    if res is not None:
        index = faiss.index_cpu_to_gpu(res, 0, index)
    t0 = time.perf_counter()
    index.train(xb[:n_train])
    index.add(xb)
    v["build_s"] = round(time.perf_counter() - t0, 3)
    cpu_index = faiss.index_gpu_to_cpu(index) if res is not None else index  # the same trained index
    if "IVF" in spec:
        faiss.ParameterSpace().set_index_parameter(cpu_index, "nprobe", nprobe)
        if res is not None:
            faiss.GpuParameterSpace().set_index_parameter(index, "nprobe", nprobe)
    cpu_index.search(xq[:8], k)  # warm-up
    t0 = time.perf_counter()
    _, i_cpu = cpu_index.search(xq[:nq_cpu], k)
    v["cpu_queries_per_s"] = nq_cpu / (time.perf_counter() - t0)
    if res is not None:
        index.search(xq[:64], k)  # warm-up
        t0 = time.perf_counter()
        _, i_gpu = index.search(xq, k)
        v["gpu_queries_per_s"] = len(xq) / (time.perf_counter() - t0)
        v["gpu_vs_cpu_speedup"] = v["gpu_queries_per_s"] / v["cpu_queries_per_s"]
        v["recall_gpu_vs_cpu"] = recall_at_k(i_gpu[:nq_cpu], i_cpu)
    return i_cpu


STAGE_FNS = {"train": stage_train, "index": stage_index, "faiss": stage_faiss}


# --------------------------------------------------------------------------------------- running
def run_stage(name: str, params: dict[str, Any], limit_s: float, use_gpu: bool, work: Path,
              out: Path | None = None) -> Record:
    """One stage in this process; its soft deadline is ``SOFT_FRACTION`` of ``limit_s`` from now."""
    rec = Record(out)
    t0 = time.perf_counter()
    deadline = t0 + SOFT_FRACTION * limit_s
    kwargs: dict[str, Any] = {"work": work / name} if name == "index" else {}
    try:
        STAGE_FNS[name](rec, params, deadline, use_gpu, **kwargs)
        rec["ok"], rec["error"] = True, None
    except Exception as e:  # recorded: the check goes on with the next stage
        rec["ok"], rec["error"] = False, f"{type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc(limit=-4)
        _log(name, f"failed: {rec['error']}")
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    rec.flush()
    return rec


def run_stage_process(name: str, params: dict[str, Any], limit_s: float, use_gpu: bool, work: Path) -> Record:
    """One stage in a process of its own, killed (with its process group) at ``limit_s``."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / f"stage_{name}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.gpu_check", "--stage", name, "--stage-params", json.dumps(params),
           "--stage-limit", str(limit_s), "--stage-out", str(out), "--work", str(work)]
    if not use_gpu:
        cmd.append("--dry-run")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
    rc: int | None = None
    try:
        rc = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        pass
    finally:  # past the limit, or this process stopped (SIGTERM, Ctrl-C): no stage outlives it
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    rec = Record()
    with contextlib.suppress(OSError, json.JSONDecodeError):
        rec.update(json.loads(out.read_text()))
    if rc is None:
        rec["ok"], rec["error"] = False, f"timed out: killed at the stage's limit of {limit_s:.0f} s"
    elif rc != 0 or "ok" not in rec:
        rec["ok"] = False
        rec["error"] = rec.get("error") or f"the stage's process exited with code {rc} and no result"
    rec["seconds"] = round(time.perf_counter() - t0, 2)  # with the process's start (imports, CUDA)
    rec["limit_s"] = round(limit_s, 1)
    return rec


def run_check(stages: list[str], params: dict[str, Any], budget_s: float, *, use_gpu: bool, work: Path,
              in_process: bool = False) -> dict[str, Any]:
    """Run ``stages`` in order, each under its share of ``budget_s`` plus what earlier stages left."""
    share_total = sum(SHARES[s] for s in stages)
    pool = max(budget_s - RESERVE_S, 1.0)
    carry = 0.0
    results: dict[str, Any] = {}
    for name in stages:
        limit = pool * SHARES[name] / share_total + carry
        _log(name, f"starting, limit {limit:.0f} s")
        if in_process:
            rec = run_stage(name, params, limit, use_gpu, work)
            rec["limit_s"] = round(limit, 1)
        else:
            rec = run_stage_process(name, params, limit, use_gpu, work)
        carry = max(limit - rec["seconds"], 0.0)
        results[name] = dict(rec)
    return results


def machine_facts() -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
                             "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    if torch.cuda.is_available():
        facts["gpus"] = []
        for i in range(torch.cuda.device_count()):
            pr = torch.cuda.get_device_properties(i)
            facts["gpus"].append({"name": pr.name, "memory_gib": round(pr.total_memory / 2**30, 1),
                                  "capability": f"{pr.major}.{pr.minor}", "multiprocessors": pr.multi_processor_count})
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            facts["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    try:
        import faiss

        facts["faiss"] = {"version": faiss.__version__,
                          "gpus": faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0}
    except ImportError as e:
        facts["faiss"] = {"error": str(e)}
    facts["faiss"]["packages"] = {d.metadata["Name"]: d.version for d in metadata.distributions()
                                  if (d.metadata["Name"] or "").lower().startswith("faiss")}
    return facts


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="every stage on the CPU at tiny sizes; writes "
                    "bench/results/gpu_dry_run.json")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole check "
                    f"(default {BUDGET_S['gpu']:.0f}; {BUDGET_S['dry_run']:.0f} with --dry-run)")
    ap.add_argument("--stages", default=",".join(STAGES), help="comma-separated, of " + ", ".join(STAGES))
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a size, e.g. train_steps=100 (names: " + ", ".join(SIZES["gpu"]) + ")")
    ap.add_argument("--in-process", action="store_true", help="run the stages in this process (no hard limits)")
    ap.add_argument("--work", default="runs/bench_gpu_check")
    ap.add_argument("--out", default=None)
    ap.add_argument("--command", default=None, help=argparse.SUPPRESS)  # how the check was started, for the JSON
    ap.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)  # one stage in this process (internal)
    ap.add_argument("--stage-params", help=argparse.SUPPRESS)
    ap.add_argument("--stage-limit", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--stage-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    mode = "dry_run" if args.dry_run else "gpu"
    if args.dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU even on a GPU machine (before CUDA starts)
    if args.stage:
        run_stage(args.stage, json.loads(args.stage_params), args.stage_limit, not args.dry_run, Path(args.work),
                  Path(args.stage_out))
        return None

    import torch

    if not args.in_process:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so a running stage's process is killed too
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check: torch sees no CUDA device (use --dry-run for the CPU check)")
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise SystemExit(f"gpu_check: unknown stage(s) {sorted(unknown)}; use {', '.join(STAGES)}")
    params = dict(SIZES[mode])
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or key not in params:
            raise SystemExit(f"gpu_check: --set {item!r}: expected NAME=VALUE with NAME one of {sorted(params)}")
        params[key] = _parse_value(raw)
    budget = args.budget or BUDGET_S[mode]
    t0 = time.perf_counter()
    res: dict[str, Any] = {"mode": "dry run on the CPU (tiny sizes)" if args.dry_run else "gpu",
                           "machine": machine_facts()}
    results = run_check(stages, params, budget, use_gpu=not args.dry_run, work=Path(args.work),
                        in_process=args.in_process)
    res["all_ok"] = all(r["ok"] for r in results.values())
    res["stages"] = results
    res["summary"] = summary(results)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["config"] = {"sizes": params, "budget_s": budget, "shares": SHARES, "soft_fraction": SOFT_FRACTION,
                     "in_process": args.in_process}
    out = args.out or f"bench/results/{'gpu_dry_run' if args.dry_run else 'gpu'}.json"
    command = args.command or "python -m bench.gpu_check " + " ".join(sys.argv[1:] if argv is None else argv)
    return _finish(res, argv, out, command)


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """The headline figures of each stage (None where a stage did not reach them)."""
    out: dict[str, Any] = {}
    for name, r in results.items():
        s: dict[str, Any] = {"ok": r["ok"], "seconds": r["seconds"], "error": r.get("error")}
        if name == "train":
            s |= {k: r.get(k) for k in ("steps_run", "prism_tokens_per_s", "dense_tokens_per_s", "throughput_ratio")}
        elif name == "index":
            s |= {k: r.get(k) for k in ("tokens", "shard_stage_tokens_per_s", "forward_tokens_per_s",
                                        "shard_stage_ratio")}
        elif name == "faiss":
            for ix, v in r.get("indexes", {}).items():
                s[ix] = {k: v.get(k) for k in ("gpu_queries_per_s", "cpu_queries_per_s", "recall_gpu_vs_cpu",
                                               "recall_cpu_vs_exact") if k in v}
        out[name] = s
    return out


def _finish(res: dict, argv: list[str] | None, out: str, command: str) -> dict:
    from bench._common import finish

    return finish(res, "gpu_check.py", argv, out, hide=("stages",), command=command)


if __name__ == "__main__":
    result = main()
    sys.exit(0 if result is None or result["all_ok"] else 1)
