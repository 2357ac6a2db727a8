#!/usr/bin/env bash
# scripts/fuzz.sh [SECONDS] [TARGET...]: every libFuzzer target of tests/fuzz/ (or the named
# ones: safetensors, tokenizer, ...) for SECONDS each (default 20), from a scratch copy of its
# committed corpus (tests/fuzz/corpus/<target>/ and tests/fuzz/regressions/<target>/, left
# unchanged). Needs clang (Debian's clang, libclang-rt-dev); configures build-fuzz
# (DSTRAIN_FUZZ=ON: the libraries under AddressSanitizer + UBSan) when it is not there.
#
# An input fails on a crash, an exception other than dstrain's UserError, a sanitizer report,
# more than 10 s (-timeout) or an allocation above 2048 MB (-malloc_limit_mb, -rss_limit_mb):
# a header claiming 2^60 bytes must be refused before anything is allocated.
# Exits non-zero on any finding; the crashing inputs are kept in build-fuzz/findings/<target>/
# (add each, once fixed, to tests/fuzz/regressions/<target>/ with a README line).
#
# Environment: DSTRAIN_FUZZ_BUILD (default ./build-fuzz), DSTRAIN_FUZZ_JOBS (build jobs, 2),
# DSTRAIN_FUZZ_SCRATCH (working corpora, default a temporary directory removed at exit),
# DSTRAIN_FUZZ_SEED (libFuzzer's -seed, default 1: a run repeats its mutations; 0: a new seed).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
seconds="${1:-20}"
shift || true
build="${DSTRAIN_FUZZ_BUILD:-$root/build-fuzz}"
jobs="${DSTRAIN_FUZZ_JOBS:-2}"
limit_mb=2048

if ! command -v clang++ >/dev/null; then
  echo "fuzz.sh: clang++ is not installed (Debian: apt-get install clang libclang-rt-dev)" >&2
  exit 2
fi
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
        -DCMAKE_BUILD_TYPE=Release -DDSTRAIN_CUDA=OFF -DDSTRAIN_FUZZ=ON >/dev/null
fi

if [ "$#" -gt 0 ]; then
  targets=("$@")
else
  # The entries, as tests/fuzz/CMakeLists.txt lists them.
  mapfile -t targets < <(sed -n '/set(dstrain_fuzz_targets/,/)/p' "$root/tests/fuzz/CMakeLists.txt" |
                           sed 's/set(dstrain_fuzz_targets//; s/)//' | tr -s ' \n' '\n' | sed '/^$/d')
fi
if ! ninja -C "$build" -j "$jobs" "${targets[@]/#/fuzz_}" >"$build/fuzz_build.log" 2>&1; then
  tail -40 "$build/fuzz_build.log" >&2
  echo "fuzz.sh: the fuzz targets did not build (log: $build/fuzz_build.log)" >&2
  exit 1
fi

scratch="${DSTRAIN_FUZZ_SCRATCH:-}"
if [ -z "$scratch" ]; then
  scratch="$(mktemp -d)"
  trap 'rm -rf "$scratch"' EXIT
fi

failed=()
printf '%-18s %10s %8s %8s %s\n' target executions cov ft result
for target in "${targets[@]}"; do
  corpus="$scratch/$target"
  findings="$build/findings/$target"
  mkdir -p "$corpus" "$findings"
  for dir in "$root/tests/fuzz/corpus/$target" "$root/tests/fuzz/regressions/$target"; do
    [ -d "$dir" ] && find "$dir" -maxdepth 1 -type f ! -name README.md -exec cp {} "$corpus/" \;
  done
  log="$build/findings/$target.log"
  # -fork is not used: one process, so the executions and cov lines are the run's totals.
  if "$build/tests/fuzz/fuzz_$target" -seed="${DSTRAIN_FUZZ_SEED:-1}" -max_total_time="$seconds" \
       -timeout=10 -rss_limit_mb=$limit_mb \
       -malloc_limit_mb=$limit_mb -print_final_stats=1 -artifact_prefix="$findings/" \
       "$corpus" >"$log" 2>&1; then
    result=ok
  else
    result="FINDING (see $log)"
    failed+=("$target")
  fi
  execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)"
  cov="$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)"
  ft="$(grep -o 'ft: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)"
  printf '%-18s %10s %8s %8s %s\n' "$target" "${execs:-?}" "${cov:-?}" "${ft:-?}" "$result"
done

if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzz.sh: findings in ${failed[*]} (inputs in $build/findings/)" >&2
  exit 1
fi
