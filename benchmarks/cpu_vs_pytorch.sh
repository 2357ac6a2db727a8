#!/usr/bin/env bash
# The CPU backend against PyTorch's CPU training step (issue 34, item 6): the same GPT-2 models
# at the same batch and sequence, both on THREADS threads, fp32, eager PyTorch (Debian's
# python3-torch; scripts/install-test-references.sh installs it). Small widths show per-step
# overhead (thread wake-ups, small GEMMs, the elementwise kernels' math) that large ones hide.
#
#   bash benchmarks/cpu_vs_pytorch.sh            from the repository root, after scripts/build.sh
#
# Models: tiny (2 layers, 64 wide), benchmarks/models/gpt2-2x128.json and gpt2-4x256.json
# (vocabulary 256 like tiny) at 16 x 64 tokens, and gpt2-124m at 4 x 128. Prints one table:
# dstrain's tokens/s (build/bench_train, median of STEPS after WARMUP), PyTorch's, the ratio.
# Settings (environment): THREADS (2), STEPS (10), WARMUP (2), PYTHON (/usr/bin/python3),
# BUILD (build).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
THREADS=${THREADS:-2}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-2}
PYTHON=${PYTHON:-/usr/bin/python3}
BUILD=${BUILD:-build}
[ -x "$BUILD/bench_train" ] || { echo "cpu_vs_pytorch.sh: build $BUILD/bench_train first (scripts/build.sh)" >&2; exit 1; }
"$PYTHON" -c 'import torch' 2>/dev/null || {
  echo "cpu_vs_pytorch.sh: $PYTHON cannot import torch (scripts/install-test-references.sh)" >&2
  exit 1
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# tokens_per_s JSON: the first row's tokens/s of a bench_train or pytorch_gpt2.py --json file.
tokens_per_s() {
  "$PYTHON" -c 'import json, sys
d = json.load(open(sys.argv[1]))
rows = d["rows"] if isinstance(d, dict) else d
print("%.0f" % rows[0]["tokens_per_s"])' "$1"
}

echo "CPU: $(nproc) cores, $THREADS threads each; $("$PYTHON" -c 'import torch; print("torch", torch.__version__)'); load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| model | batch x seq | dstrain tokens/s | PyTorch eager tokens/s | dstrain / PyTorch |"
echo "|---|---|---|---|---|"
for spec in tiny:16:64 benchmarks/models/gpt2-2x128.json:16:64 \
  benchmarks/models/gpt2-4x256.json:16:64 gpt2-124m:4:128; do
  IFS=: read -r model batch seq <<<"$spec"
  name=$(basename "$model" .json)
  "$BUILD/bench_train" --device cpu --models "$model" --batch "$batch" --seq-len "$seq" \
    --steps "$STEPS" --warmup "$WARMUP" --threads "$THREADS" --json "$work/d.json" >/dev/null
  "$PYTHON" benchmarks/pytorch_gpt2.py --device cpu --model "$model" --batch "$batch" \
    --seq-len "$seq" --steps "$STEPS" --warmup "$WARMUP" --threads "$THREADS" --mode eager \
    --json "$work/p.json" >/dev/null
  ours=$(tokens_per_s "$work/d.json")
  theirs=$(tokens_per_s "$work/p.json")
  ratio=$(awk -v a="$ours" -v b="$theirs" 'BEGIN { printf "%.2f", a / b }')
  echo "| $name | $batch x $seq | $ours | $theirs | $ratio |"
done
