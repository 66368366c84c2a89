#!/usr/bin/env bash
# The GPU check: PRISM vs dense at GPT-2-small scale (12 layers, d=768, K=8192, k=8) in bf16,
# one run, results to $OUT (or bench/results). Meant for a lent GPU machine with CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
python3 -m pip install -q --no-deps -e . 2>/dev/null || true
export PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
python3 -m bench.train_throughput --preset gpt2-small --steps "${STEPS:-300}" --warmup 20 \
  --set model.vocab_size=16384 --set model.block_size=512 --set train.batch_size=16 --set train.dtype=bf16 \
  --set train.eval_tokens=131072 --work /tmp/bench_gpu --out "$out/train_gpt2_small_gpu.json"
