#!/usr/bin/env bash
# The demo: build, then train a tiny model on the built-in synthetic corpus until its loss
# reaches the corpus's entropy floor, and print a sample. The model: llama-tiny (the LLaMA
# architecture: RMSNorm, rotary positions, grouped-query attention, SwiGLU), or the preset
# named first, e.g. `scripts/demo.sh tiny` for the tiny GPT-2. Further flags go to dstrain.
set -euo pipefail
cd "$(dirname "$0")/.."
model=llama-tiny
if [[ $# -gt 0 && $1 != -* ]]; then
  model=$1
  shift
fi
scripts/build.sh
# --overwrite: each demo replaces the last one's log.
exec build/dstrain --model "$model" --log build/demo.jsonl --overwrite "$@"
