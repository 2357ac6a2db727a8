#!/usr/bin/env bash
# The demo: build, then train the tiny model on the built-in synthetic corpus until its loss
# reaches the corpus's entropy floor, and print a sample.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
exec build/dstrain --model tiny --log build/demo.jsonl "$@"
