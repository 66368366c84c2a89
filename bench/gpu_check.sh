#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): PRISM vs dense training steps at the gpt2-small preset, indexing
# throughput on the GPU, faiss GPU vs CPU search; each stage with its own time limit inside one budget.
#
#   bench/gpu_check.sh [--install] [--dry-run] [--budget SECONDS] [-- MORE ARGS FOR python -m bench.gpu_check]
#
# Run from anywhere on a machine with one NVIDIA GPU; leaves bench/results/gpu.json (and copies it to
# $OUT when that is set). --dry-run runs every stage on the CPU at tiny sizes (bench/results/gpu_dry_run.json).
# Nothing is installed unless --install is given: then torch==2.13.0 and -e .[gpu] (-e .[cpu] with
# --dry-run), after removing the other faiss build, as faiss-cpu and faiss-gpu must never both be installed.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd="bench/gpu_check.sh $*"  # how the check was started, for the JSON

install=0
dry=0
budget=""
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --install) install=1 ;;
    --dry-run) dry=1 ;;
    --budget) budget="$2"; shift ;;
    --budget=*) budget="${1#--budget=}" ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$budget" ]; then
  if [ "$dry" -eq 1 ]; then budget=170; else budget=480; fi
fi
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

echo "== GPU"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi || true
elif [ "$dry" -eq 0 ]; then
  echo "gpu_check.sh: nvidia-smi not found: not a GPU machine (use --dry-run for the CPU check)" >&2
  exit 1
else
  echo "no nvidia-smi (dry run on the CPU)"
fi

if [ "$install" -eq 1 ]; then
  if [ "$dry" -eq 1 ]; then want=cpu; other=faiss-gpu; else want=gpu; other=faiss-cpu; fi
  echo "== install: torch==2.13.0, -e .[$want]"
  if "$py" -m pip show "$other" >/dev/null 2>&1; then
    echo "removing $other first (faiss-cpu and faiss-gpu both install the faiss module)"
    "$py" -m pip uninstall -y -q "$other"
  fi
  "$py" -m pip install -q torch==2.13.0
  "$py" -m pip install -q -e ".[$want]"
fi

echo "== torch and faiss"
"$py" - "$dry" <<'EOF'
import sys
from importlib import metadata

dry = sys.argv[1] == "1"
import torch

print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device: "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'none visible'}")
builds = sorted(d.metadata["Name"] for d in metadata.distributions() if (d.metadata["Name"] or "").lower().startswith("faiss"))
print("faiss packages installed:", ", ".join(builds) or "none")
cpu_and_gpu = any("cpu" in b.lower() for b in builds) and any("gpu" in b.lower() for b in builds)
if cpu_and_gpu:
    sys.exit("gpu_check.sh: faiss-cpu and a faiss-gpu build are both installed; uninstall one (or use --install)")
try:
    import faiss
except ImportError as e:
    sys.exit(f"gpu_check.sh: faiss is not importable ({e}); install -e .[gpu] (or use --install)")
gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
print(f"faiss {faiss.__version__}, faiss.get_num_gpus() = {gpus}")
if not dry and not torch.cuda.is_available():
    sys.exit("gpu_check.sh: torch sees no CUDA device (a CPU build of torch?)")
if not dry and gpus == 0:
    print("warning: faiss sees no GPU (faiss-cpu?): the faiss stage will be recorded as failed", file=sys.stderr)
EOF

echo "== python -m bench.gpu_check (budget ${budget} s)"
args=(--budget "$budget")
[ "$dry" -eq 1 ] && args+=(--dry-run)
result="bench/results/gpu.json"
[ "$dry" -eq 1 ] && result="bench/results/gpu_dry_run.json"
started=$(mktemp)
trap 'rm -f "$started"' EXIT
# the check keeps to its budget (exit code 1 when a stage failed); this limit is only a backstop
rc=0
timeout --kill-after=30 "$((${budget%.*} + 120))" "$py" -m bench.gpu_check "${args[@]}" --command "$cmd" \
  "${extra[@]}" || rc=$?

if [ -n "${OUT:-}" ] && [ "$result" -nt "$started" ]; then
  mkdir -p "$OUT" && cp "$result" "$OUT/"
fi
echo "== $result (exit code $rc)"
exit "$rc"
