"""PRISM vs the dense baseline: training throughput and held-out quality, side by side.

Both models share the backbone config, the initial backbone weights, the tokenizer, the data
and the batch of every step. Their steps are interleaved (alternating which goes first), so
drifts of the machine hit both alike; throughput is tokens / summed step time after warm-up.

    python -m bench.train_throughput --preset small --steps 600
    python -m bench.train_throughput --preset gpt2-small --steps 300 --set train.batch_size=16   # on a GPU

Writes ``bench/results/train.json`` (and the two checkpoints under ``--work``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bench._common import finish
from prism_tda import demo_corpus_path
from prism_tda.cli import build_configs
from prism_tda.model.data import split_documents
from prism_tda.model.metrics import evaluate
from prism_tda.model.tokenizer import train_tokenizer
from prism_tda.model.train import Trainer


def interleaved_step_times(step_fns: dict[str, Callable[[int], object]], steps: int, *,
                           progress: bool = True, deadline: float | None = None) -> dict[str, list[float]]:
    """Seconds of each step of each model (``step_fns[name](step)`` runs one step), the models' steps
    interleaved and alternating which goes first, the device synchronised around each step. With
    ``deadline`` (a ``time.perf_counter()`` value), stops before a step that would start after it."""
    times: dict[str, list[float]] = {name: [] for name in step_fns}
    names = list(step_fns)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for step in tqdm(range(steps), desc="interleaved steps", unit="step", disable=not progress):
        if deadline is not None and time.perf_counter() > deadline:
            break
        for name in names if step % 2 == 0 else names[::-1]:
            sync()
            t0 = time.perf_counter()
            step_fns[name](step)
            sync()
            times[name].append(time.perf_counter() - t0)
    return times


def step_time_summary(times: dict[str, list[float]], warmup: int, tokens_per_step: int) -> dict:
    """Tokens/s and median step time of each model after ``warmup`` steps (all steps when no more ran),
    and PRISM's throughput against the dense baseline's."""
    res: dict = {}
    for name, ts in times.items():
        steady = ts[warmup:] or ts
        res[f"{name}_tokens_per_s"] = tokens_per_step * len(steady) / sum(steady)
        res[f"{name}_median_step_s"] = statistics.median(steady)
    # Median step times are robust to the machine's other work; the total-time ratio is kept too.
    res["throughput_ratio"] = res["dense_median_step_s"] / res["prism_median_step_s"]
    res["throughput_ratio_total_time"] = res["prism_tokens_per_s"] / res["dense_tokens_per_s"]
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the throughput figure")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--corpus", nargs="+", default=None)
    ap.add_argument("--work", default="runs/bench_train")
    ap.add_argument("--out", default="bench/results/train.json")
    args = ap.parse_args(argv)

    model_cfg, train_cfg = build_configs(args.preset, None, args.set + [f"train.max_steps={args.steps}"])
    corpus = args.corpus or [demo_corpus_path()]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tok_path = work / "tokenizer.json"
    docs, _ = split_documents(corpus, train_cfg.val_fraction)
    train_tokenizer((d.text for is_val, d in docs if not is_val), model_cfg.vocab_size).save(str(tok_path))

    trainers = {}
    for head in ("prism", "dense"):
        trainers[head] = Trainer(model_cfg.replace(head=head), train_cfg, corpus, work / head,
                                 tokenizer_path=tok_path, progress=False, resume=False).setup()
    def trainer_step(t: Trainer) -> Callable[[int], None]:
        def run(step: int) -> None:
            t.train_step(step)
            t.step = step + 1
        return run

    times = interleaved_step_times({head: trainer_step(t) for head, t in trainers.items()}, args.steps)
    tok_per_step = train_cfg.batch_size * train_cfg.grad_accum * model_cfg.block_size
    res: dict = step_time_summary(times, args.warmup, tok_per_step)
    for head, t in trainers.items():
        ev = evaluate(t.model, t.data.val, batch_size=train_cfg.batch_size, max_tokens=train_cfg.eval_tokens,
                      device=t.device, autocast=t.autocast)
        res[f"val_loss_{head}"] = ev["val_loss"]
        if head == "prism":
            res |= {k: ev[k] for k in ("R1bar", "R2", "rec", "effective_prototypes", "dead_prototypes",
                                        "top10_mass_share")}
        t.last_eval = ev
        t.save({"bench": "train_throughput"})
    res["val_loss_ratio"] = res["val_loss_prism"] / res["val_loss_dense"]
    K = model_cfg.n_prototypes
    res["targets"] = {
        "throughput_ratio>=0.95": res["throughput_ratio"] >= 0.95,
        "val_loss_ratio<=1.05": res["val_loss_ratio"] <= 1.05,
        "R1bar>=0.9": res["R1bar"] >= 0.9,
        "R2>=0.9": res["R2"] >= 0.9,
        "effective_prototypes>=K/4": res["effective_prototypes"] >= K / 4,
        "dead_prototypes==0": res["dead_prototypes"] == 0,
    }
    res["config"] = {"model": model_cfg.to_dict(), "train": train_cfg.to_dict(), "steps": args.steps,
                     "tokens_per_model": tok_per_step * args.steps,
                     "n_params_prism": trainers["prism"].model.num_params(),
                     "n_params_dense": trainers["dense"].model.num_params()}
    res["machine"] = {"device": str(trainers["prism"].device)}
    return finish(res, "train_throughput.py", argv, args.out)


if __name__ == "__main__":
    main()
