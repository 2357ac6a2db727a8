#!/usr/bin/env bash
# Builds dstrain and runs the whole test suite; with the CUDA toolkit (no GPU needed), runs it
# a second time on the CUDA emulator, where the trainer's CUDA code path is taken.
#
# scripts/test.sh --sanitize: instead, ThreadSanitizer over the code that races and
# AddressSanitizer + UBSan over the whole CPU suite (scripts/sanitize.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--sanitize" ]; then
  exec scripts/sanitize.sh
fi
scripts/build.sh
scripts/install-test-references.sh  # torch + transformers, hadolint, chromium: their checks skip without them
ctest --test-dir build --output-on-failure -j"$(nproc)"

# With the CUDA toolkit, build/ also has the CUDA kernel tests on the emulator
# (tests_kernels_cuda_emu, run above). build-emulator/ (DSTRAIN_CUDA=EMULATOR) is the whole
# trainer with one emulated GPU as its CUDA device: there every test that trains with
# `--device auto` trains on it, and the CUDA tests that skip above run (20 steps on the CUDA
# backend against the CPU backend, two ranks sharing the GPU with ZeRO-3 + offload, the staged
# communicator). The comm, train and cuda_emu tests get 4 emulated GPUs (CMakeLists.txt) for the
# NCCL communicator on the emulator's NCCL, one GPU per rank.
if [ -x build/tests_kernels_cuda_emu ]; then
  echo "== the whole suite again, on the CUDA emulator (build-emulator/)"
  cmake -S . -B build-emulator -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSTRAIN_CUDA=EMULATOR \
    >/dev/null
  cmake --build build-emulator -j"$(nproc)"
  ctest --test-dir build-emulator --output-on-failure -j"$(nproc)"
fi

# ThreadSanitizer over the communicators and the pipeline's rank threads (build-tsan/; the
# fuller run with AddressSanitizer + UBSan over everything: scripts/test.sh --sanitize).
echo "== ThreadSanitizer: the communicators and the pipeline (scripts/sanitize.sh --ci)"
scripts/sanitize.sh --ci

# With clang and its libFuzzer runtime: every parser's and wire format's fuzz target for a short
# budget (scripts/fuzz.sh: build-fuzz/ under AddressSanitizer + UBSan; a finding fails). The
# committed corpus and findings also run in every build above (tests_fuzz). A longer run:
# scripts/fuzz.sh 300 (benchmarks/RESULTS.md records one).
if command -v clang++ >/dev/null && ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a \
    >/dev/null 2>&1; then
  echo "== the fuzz targets, ${DSTRAIN_FUZZ_SECONDS:-10} s each (build-fuzz/)"
  scripts/fuzz.sh "${DSTRAIN_FUZZ_SECONDS:-10}"
fi

# The Dockerfile built with podman (about 20 minutes): opt-in, beyond CI's time budget.
if [ "${DSTRAIN_DOCKER_CHECK:-0}" = 1 ]; then
  scripts/check-dockerfile-podman.sh
fi
