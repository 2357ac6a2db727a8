#!/usr/bin/env bash
# Configures and builds dstrain into build/ (Release). Extra arguments go to cmake, e.g.
# -DDSTRAIN_CUDA=OFF.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build build -j"$(nproc)"
