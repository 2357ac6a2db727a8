#!/usr/bin/env bash
# scripts/sanitize.sh [--ci]: the code that races and the whole CPU suite under sanitizers
# (`scripts/test.sh --sanitize` runs this; CI runs `--ci`). g++'s sanitizers, CUDA off (the
# emulator's fibers switch stacks behind the sanitizers' back).
#
#   ThreadSanitizer (build-tsan/, -DDSTRAIN_SANITIZE=thread): every communicator test
#   (tests_comm: the local and staged communicators, the TCP store, rendezvous, Gloo in threads
#   and processes) and the trainer's rank threads (tests_train: pipeline stages, tensor and
#   expert parallelism, ZeRO with offload, the replica check), and the memory model's ranks.
#   AddressSanitizer + UBSan (build-asan/, -DDSTRAIN_SANITIZE=address,undefined): the whole CPU
#   suite through ctest.
# --ci: ThreadSanitizer over tests_comm and the pipeline tests only (CI's time budget).
#
# A report fails the run (halt_on_error). What is reported and is not a race is suppressed in
# tests/sanitizers/tsan.supp, each entry with its reason. OpenMP and OpenBLAS run one thread
# per rank (OMP_NUM_THREADS=1): libgomp is not instrumented, so its barriers are invisible to
# ThreadSanitizer and every parallel loop would be reported.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
ci=0
[ "${1:-}" = "--ci" ] && ci=1
((ci)) || scripts/install-deps.sh  # test.sh's build has installed them for --ci
jobs="$(nproc)"

configure() {  # configure DIR SANITIZERS
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSTRAIN_CUDA=OFF \
    -DDSTRAIN_SANITIZE="$2" >/dev/null
}

export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
suppressions="$root/tests/sanitizers/tsan.supp"
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$suppressions"
echo "== ThreadSanitizer (build-tsan/)"
configure build-tsan thread
cmake --build build-tsan -j"$jobs" --target tests_comm tests_train tests_parallel dstrain
build-tsan/tests_comm --gtest_brief=1
if ((ci)); then
  build-tsan/tests_train --gtest_brief=1 --gtest_filter='PipelineTest.*'
  exit 0
fi
rank_threads='PipelineTest.*:TensorParallelTest.*:EquivalenceBitwise.*:ExpertParallel*'
build-tsan/tests_train --gtest_brief=1 --gtest_filter="$rank_threads:ReplicaCheckTest.*"
# The memory model's ranks (threads sharing one MemoryModel, the allocators' bytes per rank).
build-tsan/tests_parallel --gtest_brief=1 --gtest_filter='MemoryModel.*EveryRank*'


echo "== AddressSanitizer + UBSan (build-asan/): the whole CPU suite"
export ASAN_OPTIONS="halt_on_error=1 detect_leaks=1"
export UBSAN_OPTIONS="halt_on_error=1 print_stacktrace=1"
configure build-asan address,undefined
cmake --build build-asan -j"$jobs"
ctest --test-dir build-asan --output-on-failure -j"$jobs"
