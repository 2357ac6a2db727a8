#!/usr/bin/env bash
# The GPU measurements of issues 5 and 34 in one call (a device machine gives at most 10
# minutes): build for sm_90, run the CUDA tests, time every kernel against the measured copy and
# GEMM peaks, time dstrain's training step and the same model trained by PyTorch (eager and
# torch.compile): GPT-2 (gpt2-124m, gpt2-1.5b: benchmarks/pytorch_gpt2.py) and the LLaMA family
# (qwen2.5-0.5b, llama3.2-1b: transformers' own model, benchmarks/pytorch_llama.py), a 7B trained
# by dstrain itself with the plan it picks for this GPU, each kernel's share of a step (Nsight
# Compute), and write the summary (beside llmq's published numbers).
#
#   bash benchmarks/gpu_session.sh              from the repository root; results go to $OUT
#   bash benchmarks/gpu_session.sh --dry-run    print what would run, run nothing
#   bash benchmarks/gpu_session.sh --fetch-deps on a Debian 12 machine with apt (this project's
#        dev machine): download the build dependencies as .deb files into .gpu-deps/ (ignored by
#        git), for a device machine that lacks them: carry .gpu-deps there with the call.
#
# $OUT (default ./gpu-out) receives four files: session.log (every step's output), status.tsv
# (step, exit status, seconds, a test binary's tally), results.json (every benchmark's rows) and
# summary.md (the tables, with the dstrain / PyTorch ratios). A failed step is recorded and the
# next one runs. Each step runs under `timeout`, capped by what is left of DEADLINE_S (default
# 540 s, the whole session, build included); a step with too little time left is recorded as
# skipped.
#
# Settings (environment):
#   OUT, BUILD (build-gpu), JOBS (all cores), BUILD_TIMEOUT (360 s), DEADLINE_S (540 s)
#   COMMIT         the commit measured; pass it where the tree has no .git:
#                  COMMIT=$(git rev-parse --short HEAD)
#   PYTHON         python3
#   SEQ, STEPS, WARMUP          1024 tokens, 10 timed steps after 3 untimed
#   ATTENTION32_MODELS  the models whose bf16 step is timed again with 32 rows per warp in the
#                  attention (default: MODELS)
#   DTYPES         the dtypes of the training steps (default fp16,bf16; bench_cuda_ops runs in
#                  fp16 only when they name it)
#   MODELS         the GPT-2 models timed, in order (default "gpt2-1.5b gpt2-124m")
#   LLAMA_MODELS   the LLaMA-family models timed against transformers' model, in order
#                  (default "qwen2.5-0.5b llama3.2-1b"), at BATCH_LLAMA (16) x SEQ
#   FP8_MODELS     the LLaMA-family models whose step is timed again with --dtype fp8 (the
#                  layers' GEMMs on FP8 tensor cores, --precision fp8), at BATCH_LLAMA x SEQ,
#                  beside llmq's published fp8 numbers (default "qwen2.5-0.5b"; empty: none)
#   BIG_MODELS     models trained by dstrain itself (`dstrain --device cuda`, the plan it picks
#                  for this GPU, BIG_TOKENS = 16384 tokens a step, BIG_STEPS = 8 steps; tokens/s
#                  is the median of the steps after the second), default "qwen2.5-7b"
#   BIG_FLAGS      more flags for those runs, e.g. "--gpu-memory 24G" (plan and run as if the GPU
#                  had only 24 GB: qwen2.5-7b then trains with its parameters and optimizer in
#                  host memory, issue 31's item 5; the summary sets tokens/s and peak memory
#                  against the plan's prediction)
#   OFFLOAD_MODELS models trained by dstrain as on a 24 GB card (OFFLOAD_FLAGS): a 7B then
#                  keeps its parameters and optimizer in host memory (issue 31, item 5); tokens/s
#                  and the device's peak memory in the summary beside the plan's prediction
#                  (default "qwen2.5-7b"; empty: none)
#   OFFLOAD_FLAGS  their flags (default "--gpu-memory 24G --bf16-optimizer-states": the device
#                  machine has 128 GiB of RAM, 94.4 GiB usable, and a 7B offloaded whole needs
#                  113.5 GiB with fp32 Adam moments, 85.1 GiB with bf16 ones)
#   STEP_PROFILE   the models whose bf16 step is profiled kernel by kernel with Nsight Compute
#                  (gpu__time_duration of every launch of one step): each kernel's share of the
#                  step in the summary (default: the first of LLAMA_MODELS; empty: none)
#   TRACE_MODELS   models whose steps 3-4 the dstrain binary traces (`--trace`, spans timed on
#                  the GPU's stream: each layer's forward and backward, the head, the optimizer),
#                  at BIG_TOKENS a step: the summary sets the spans' time against the step's, to
#                  split what Nsight Compute's kernel sums leave out (default: none)
#   OPS            0: no bench_cuda_ops run (the kernels alone); default 1
#   OPS_ONLY       NAME: one bench_cuda_ops run, of the ops whose name holds NAME (`--only`;
#                  "moe": the MoE ops at a DeepSeekMoE-16B layer's shape); default: every op at
#                  every shape
#   PYTORCH        0: time dstrain only (no PyTorch runs, no prewarm)
#   BATCH_124M, BATCH_1_5B      32 and 16: they fit dstrain and PyTorch eager on a 141 GB H200
#                  (dstrain's planner: 14.7 and 63.1 GiB per GPU in bf16, no recompute)
#   COMPILE_SCOPE  blocks: each transformer block and the head torch.compile'd on their own,
#                  one compilation shared by all blocks (a 48-layer model compiles inside the
#                  budget); model: the whole model as one graph
#   PREWARM        1: fill PyTorch's compile caches in the background during the build and the
#                  tests, so the timed torch.compile runs compile from cache
#   KERNELS_ONLY   1: build and run tests_kernels_cuda and the sanitizers only (no benchmark,
#                  no PyTorch): a short call that checks a kernel fix on hardware
#   PROFILE        1: build bench_cuda_ops and profile the kernels of PROFILE_KERNELS with
#                  Nsight Compute (ncu --set full, one launch each, bf16): $OUT/ncu.tar.gz holds
#                  each kernel's details page and its per-instruction source page (SASS, stall
#                  samples) as text; nothing else runs
#   PROFILE_KERNELS  OP:KERNEL:SHAPE items (bench_cuda_ops --only OP, ncu's regex KERNEL, SHAPE
#                  hd64 = gpt2-1.5b's B=16 C=1600 NH=25 or hd128 = B=8 C=2048 NH=16); default the
#                  tensor-core attention's three kernels at hd64 and its forward at hd128
#   SANITIZE       1: last, compute-sanitizer's racecheck on the tensor-core attention tests and
#                  memcheck on all kernel tests (0: skip)
#   NCCL_FROM_PIP  1: when the CUDA toolkit has no NCCL, build against the NCCL of python's
#                  nvidia-nccl package if it has one
#   DEPS           .gpu-deps: carried .deb files of the build dependencies (see --fetch-deps)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

usage="usage: bash benchmarks/gpu_session.sh [--dry-run | --fetch-deps]"
dry_run=0
fetch_deps=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    --fetch-deps) fetch_deps=1 ;;
    -h | --help)
      echo "$usage"
      exit 0
      ;;
    *)
      echo "gpu_session.sh: unknown argument '$arg'; $usage" >&2
      exit 2
      ;;
  esac
done

OUT=${OUT:-./gpu-out}
BUILD=${BUILD:-build-gpu}
JOBS=${JOBS:-$(nproc)}
DEADLINE_S=${DEADLINE_S:-540}
PYTHON=${PYTHON:-python3}
SEQ=${SEQ:-1024}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-3}
BATCH_124M=${BATCH_124M:-32}
BATCH_1_5B=${BATCH_1_5B:-16}
PREWARM=${PREWARM:-1}
MODELS=${MODELS-gpt2-1.5b gpt2-124m}
LLAMA_MODELS=${LLAMA_MODELS-qwen2.5-0.5b llama3.2-1b}
BATCH_LLAMA=${BATCH_LLAMA:-16}
FP8_MODELS=${FP8_MODELS-qwen2.5-0.5b}
BIG_MODELS=${BIG_MODELS-qwen2.5-7b}
BIG_TOKENS=${BIG_TOKENS:-16384}
BIG_STEPS=${BIG_STEPS:-8}
BIG_FLAGS=${BIG_FLAGS:-}
OFFLOAD_MODELS=${OFFLOAD_MODELS-qwen2.5-7b}
OFFLOAD_FLAGS=${OFFLOAD_FLAGS-"--gpu-memory 24G --bf16-optimizer-states"}
read -r -a llama_list <<<"$LLAMA_MODELS"
STEP_PROFILE=${STEP_PROFILE-${llama_list[0]:-}}
OPS=${OPS:-1}
TRACE_MODELS=${TRACE_MODELS:-}
OPS_ONLY=${OPS_ONLY:-}
DTYPES=${DTYPES:-fp16,bf16}
ATTENTION32_MODELS=${ATTENTION32_MODELS-$MODELS}
PYTORCH=${PYTORCH:-1}
SANITIZE=${SANITIZE:-1}
KERNELS_ONLY=${KERNELS_ONLY:-0}
PROFILE=${PROFILE:-0}
PROFILE_KERNELS=${PROFILE_KERNELS:-attention_forward:forward_mma:hd64 \
attention_backward:dq_mma:hd64 attention_backward:dkdv_mma:hd64 \
attention_forward:forward_mma:hd128}
if ((KERNELS_ONLY || PROFILE)); then PYTORCH=0; fi
if ((PROFILE)); then KERNELS_ONLY=1 SANITIZE=0; fi
COMPILE_SCOPE=${COMPILE_SCOPE:-blocks}
NCCL_FROM_PIP=${NCCL_FROM_PIP:-1}
DEPS=${DEPS:-.gpu-deps}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1
# Debian 12 names of what CMakeLists.txt finds (scripts/install-deps.sh installs the same with
# apt): Boost.Program_options, nlohmann-json, OpenBLAS (pthreads), GoogleTest, pkg-config,
# PCRE2 and utf8proc (the tokenizers'), zlib (checkpoint checksums).
deb_packages=(libboost1.74-dev libboost-program-options1.74-dev libboost-program-options1.74.0
              nlohmann-json3-dev libopenblas-pthread-dev libopenblas0-pthread libgfortran5
              libquadmath0 libgtest-dev pkgconf pkgconf-bin libpkgconf3
              libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3
              libutf8proc-dev libutf8proc2 zlib1g-dev zlib1g)

if ((fetch_deps)); then
  mkdir -p "$DEPS" || exit 1
  (cd "$DEPS" && apt-get download "${deb_packages[@]}") || {
    echo "gpu_session.sh: apt-get download failed; run --fetch-deps on a Debian 12 machine" >&2
    exit 1
  }
  # Ignored by git (a worktree's exclude file lies in the common git directory).
  exclude=$(git rev-parse --git-path info/exclude 2>/dev/null)
  if [ -n "$exclude" ] && ! grep -qx "/$DEPS/" "$exclude" 2>/dev/null; then
    mkdir -p "$(dirname "$exclude")" && echo "/$DEPS/" >>"$exclude"
  fi
  echo "gpu_session.sh: $(find "$DEPS" -name '*.deb' | wc -l) packages in $DEPS/" \
    "($(du -sh "$DEPS" | cut -f1)); carry '$DEPS' with the device call"
  exit 0
fi

work=$(mktemp -d /tmp/dstrain-gpu-session.XXXXXX)
log=$OUT/session.log
status=$OUT/status.tsv
if ((!dry_run)); then
  mkdir -p "$OUT" || exit 1
  : >"$log"
  : >"$status"
fi

# say TEXT: a line on stdout and in the log.
say() {
  if ((dry_run)); then echo "$*"; else echo "$*" | tee -a "$log"; fi
}

# run_step NAME BUDGET_S COMMAND...: runs COMMAND under timeout (BUDGET_S, or less when the
# session's deadline is nearer), its output into the log; records NAME, exit status, seconds.
run_step() {
  local name=$1 budget=$2
  shift 2
  local left=$((DEADLINE_S - SECONDS - 10))  # 10 s kept for the summary
  if ((budget > left)); then budget=$left; fi
  if ((dry_run)); then
    echo "[$name] (at most ${budget} s) $*"
    return 0
  fi
  if ((budget < 15)); then
    say "=== $name: skipped, $((DEADLINE_S - SECONDS)) s left of DEADLINE_S=$DEADLINE_S"
    printf '%s\tskipped (out of time)\t0\t\n' "$name" >>"$status"
    return 0
  fi
  say "=== $name (timeout ${budget} s, at ${SECONDS} s): $*"
  local start=$SECONDS
  timeout --kill-after=10 "$budget" "$@" 2>&1 | tee -a "$log" "$work/step.out"
  local rc=${PIPESTATUS[0]}
  local seconds=$((SECONDS - start))
  local text=$rc
  if ((rc == 124 || rc == 137)); then text="$rc (timed out after ${budget} s)"; fi
  # A GoogleTest binary's tally: a GPU test skips without a GPU, so "0" alone says little.
  local tally
  tally=$(grep -oE '^\[ +(PASSED|SKIPPED|FAILED) +\] [0-9]+ tests?' "$work/step.out" |
    sed -E 's/^\[ +([A-Z]+) +\] ([0-9]+) tests?/\2 \L\1/' | paste -sd, - | sed 's/,/, /g')
  : >"$work/step.out"
  say "=== $name: exit status $text after ${seconds} s${tally:+ ($tally)}"
  printf '%s\t%s\t%s\t%s\n' "$name" "$text" "$seconds" "$tally" >>"$status"
  return "$rc"
}

# record NAME TEXT: a step that was not a command (a missing tool, a skipped part).
record() {
  local name=$1
  shift
  if ((dry_run)); then
    echo "[$name] $*"
  else
    say "=== $name: $*"
    printf '%s\t%s\t0\t\n' "$name" "$*" >>"$status"
  fi
}

# ---- what this machine has ------------------------------------------------------------------
say "gpu_session.sh: commit $COMMIT, $(date -u '+%Y-%m-%d %H:%M UTC'), $JOBS cores, OUT=$OUT"
if ((!dry_run)); then
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
    nvcc --version 2>&1 | tail -1
    cmake --version 2>&1 | head -1
    ninja --version 2>&1 | sed 's/^/ninja /'
    g++ --version 2>&1 | head -1
    "$PYTHON" --version 2>&1
  } | tee -a "$log"
fi

# ---- build dependencies: carried .debs, NCCL from pip ---------------------------------------
cmake_deps_args=()
if ((dry_run)) && compgen -G "$DEPS/*.deb" >/dev/null; then
  echo "[deps] would unpack the $(compgen -G "$DEPS/*.deb" | wc -l) packages of $DEPS"
elif compgen -G "$DEPS/*.deb" >/dev/null; then
  # A fixed place, kept after the script: the build records these paths (CMake cache, RPATH).
  prefix=/tmp/dstrain-deps
  rm -rf "$prefix"
  for deb in "$DEPS"/*.deb; do dpkg-deb -x "$deb" "$prefix"; done
  # Their pkg-config files and the libraries' paths name /usr: point them at the prefix.
  # (PCRE2's say prefix=/usr, with no slash after it).
  find "$prefix" -name '*.pc' -exec sed -i -e "s|/usr/|$prefix/usr/|g" \
    -e "s|^prefix=/usr\$|prefix=$prefix/usr|" {} +
  triplet_lib=$prefix/usr/lib/x86_64-linux-gnu
  export CMAKE_PREFIX_PATH=$prefix/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  # A machine with another Boost's CMake files but without its program_options (Ubuntu
  # 24.04's 1.83, seen 2026-11-26): CMake's FindBoost takes the machine's BoostConfig before
  # CMAKE_PREFIX_PATH's (Boost_ROOT did not change that), so name the carried one.
  boost_dir=$(compgen -G "$prefix/usr/lib/x86_64-linux-gnu/cmake/Boost-*" | head -1)
  cmake_deps_args+=("-DBoost_DIR=$boost_dir")
  pc_path=$triplet_lib/openblas-pthread/pkgconfig:$triplet_lib/pkgconfig
  export PKG_CONFIG_PATH=$pc_path${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  lib_path=$triplet_lib/openblas-pthread:$triplet_lib
  export LD_LIBRARY_PATH=$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PATH=$PATH:$prefix/usr/bin  # pkg-config, only where the machine has none
  record deps "unpacked $(compgen -G "$DEPS/*.deb" | wc -l) carried packages of $DEPS into $prefix"
fi
nvcc_path=$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)
cuda_include=$(dirname "$(dirname "$nvcc_path")")/include
if ((NCCL_FROM_PIP && !dry_run)) && [ ! -e "$cuda_include/nccl.h" ] &&
  [ ! -e /usr/include/nccl.h ]; then
  # NCCL is not part of the CUDA toolkit; PyTorch's pip package nvidia-nccl brings one.
  site_text=$("$PYTHON" -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)
  read -r -a site <<<"$site_text"
  nccl_header=$(find "${site[@]}" -path '*nvidia*' -name nccl.h 2>/dev/null | head -1)
  nccl_library=$(find "${site[@]}" -path '*nvidia*' -name 'libnccl.so*' 2>/dev/null | head -1)
  if [ -n "$nccl_header" ] && [ -n "$nccl_library" ]; then
    nccl=/tmp/dstrain-nccl  # kept after the script, like the deps
    mkdir -p "$nccl/lib"
    ln -sfn "$(dirname "$nccl_header")" "$nccl/include"
    ln -sf "$nccl_library" "$nccl/lib/libnccl.so"
    ln -sf "$nccl_library" "$nccl/lib/libnccl.so.2"
    export CMAKE_PREFIX_PATH=$nccl${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
    export LD_LIBRARY_PATH=$nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    record nccl "from pip: $nccl_library"
  else
    record nccl "none in the CUDA toolkit or pip: built without NCCL (one rank then uses the" \
      "local communicator)"
  fi
fi

# ---- PyTorch: there or not, and its compile caches warmed while the build runs --------------
torch_ok=0
torch_probe='import torch; print(torch.__version__, "CUDA", torch.cuda.is_available())'
if ((!PYTORCH)); then
  record pytorch "not run (PYTORCH=0)"
elif torch_version=$("$PYTHON" -c "$torch_probe" 2>&1); then
  torch_ok=1
  say "torch: $torch_version"
else
  record pytorch "python3 -c 'import torch' failed: $(echo "$torch_version" | tail -1)"
fi
dtypes=$DTYPES
pytorch=("$PYTHON" benchmarks/pytorch_gpt2.py --device cuda --seq-len "$SEQ" --dtype "$dtypes"
         --compile-scope "$COMPILE_SCOPE")
# The LLaMA family in bf16 only (issue 34's comparison; fp16 needs the scaler on both sides).
pytorch_llama=("$PYTHON" benchmarks/pytorch_llama.py --device cuda --seq-len "$SEQ" --dtype bf16
               --compile-scope "$COMPILE_SCOPE")
gpt2_batch() {
  if [ "$1" = gpt2-1.5b ]; then echo "$BATCH_1_5B"; else echo "$BATCH_124M"; fi
}
prewarm_pid=""
if ((torch_ok && PREWARM)); then
  # One untimed step per case with --mode compile: the timed runs later find the FX graph,
  # AOTAutograd and Triton caches filled. Runs beside the build and the tests (which time
  # nothing); it is waited for, or stopped, before the first timed benchmark.
  once="--mode compile --steps 1 --warmup 1"
  prewarm_text=""
  for model in $LLAMA_MODELS; do
    prewarm_text+="timeout 300 ${pytorch_llama[*]} --model $model --batch $BATCH_LLAMA $once; "
  done
  for model in $MODELS; do
    prewarm_text+="timeout 300 ${pytorch[*]} --model $model --batch $(gpt2_batch "$model") $once; "
  done
  prewarm=(bash -c "$prewarm_text")
  if ((dry_run)); then
    echo "[prewarm] (background) ${prewarm[*]}"
  else
    "${prewarm[@]}" >"$work/prewarm.log" 2>&1 &
    prewarm_pid=$!
    say "=== prewarm: started in the background (pid $prewarm_pid)"
  fi
fi

# ---- build ------------------------------------------------------------------------------------
targets=(tests_kernels_cuda tests_comm tests_train bench_cuda_ops bench_train dstrain)
if ((KERNELS_ONLY)); then targets=(tests_kernels_cuda); fi
if ((PROFILE)); then targets=(bench_cuda_ops); fi
run_step configure 120 cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DDSTRAIN_CUDA=ON -DDSTRAIN_CUDA_ARCHITECTURES=90 "${cmake_deps_args[@]}" &&
  run_step build "${BUILD_TIMEOUT:-360}" ninja -C "$BUILD" -j"$JOBS" "${targets[@]}"
built=$?
if ((built != 0 && !dry_run)); then
  # Nothing of dstrain can run: stop here, the device's time being short (a PyTorch
  # comparison without dstrain's numbers is not what this session is for).
  record stopped "configure or build failed (exit status $built): nothing of dstrain to run"
  [ -n "$prewarm_pid" ] && { pkill -TERM -P "$prewarm_pid"; kill -TERM "$prewarm_pid"; } 2>/dev/null
  printf '# dstrain GPU session: the build failed\n\nSee session.log and status.tsv.\n' \
    >"$OUT/summary.md"
  rm -rf "$work"
  exit 1
fi

# Nsight Compute's ncu: on PATH, beside nvcc or in its own folder (empty: none).
find_ncu() {
  command -v ncu 2>/dev/null || ls "$(dirname "$nvcc_path")/ncu" \
    /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1
}

# ---- Nsight Compute profiles (PROFILE=1) ------------------------------------------------------
if ((PROFILE)); then
  ncu_bin=$(find_ncu)
  if [ -z "$ncu_bin" ] && ((!dry_run)); then
    record ncu "not run: no ncu on PATH, beside nvcc or in /opt/nvidia/nsight-compute"
  else
    profiles=$work/ncu
    mkdir -p "$profiles"
    for item in $PROFILE_KERNELS; do
      IFS=: read -r op kernel shape <<<"$item"
      if [ -z "$op" ] || [ -z "$kernel" ] || { [ "$shape" != hd64 ] && [ "$shape" != hd128 ]; }
      then
        record "ncu_$item" "not run: a PROFILE_KERNELS item is OP:KERNEL_REGEX:hd64|hd128"
        continue
      fi
      shape_args=(--batch 16 --seq-len 1024 --channels 1600 --heads 25)  # hd64: gpt2-1.5b
      if [ "$shape" = hd128 ]; then
        shape_args=(--batch 8 --seq-len 1024 --channels 2048 --heads 16)
      fi
      name=${kernel}_$shape
      # The kernel's second launch (past a cold first one) in the op's first form.
      run_step "ncu_$name" 60 "${ncu_bin:-ncu}" --set full --import-source no \
        --kernel-name "regex:$kernel" --launch-skip 1 --launch-count 1 -o "$profiles/$name" \
        "$BUILD/bench_cuda_ops" --dtype bf16 --quick --only "$op" "${shape_args[@]}"
      ((dry_run)) && continue
      "$ncu_bin" --import "$profiles/$name.ncu-rep" --page details >"$profiles/${name}.txt" 2>&1
      "$ncu_bin" --import "$profiles/$name.ncu-rep" --page source --csv --print-source sass \
        >"$profiles/${name}_sass.csv" 2>&1
    done
    ((dry_run)) || tar -czf "$OUT/ncu.tar.gz" -C "$profiles" --exclude='*.ncu-rep' .
  fi
fi

# ---- tests (a GPU test that cannot run skips with its reason) ---------------------------------
((PROFILE)) || run_step tests_kernels_cuda 120 "$BUILD/tests_kernels_cuda"
json=$work/json  # every benchmark's rows, for the summary
mkdir -p "$json"
if ((!KERNELS_ONLY)); then
  run_step tests_comm 60 "$BUILD/tests_comm" --gtest_filter='Nccl*:StagedCommunicator*'
  run_step tests_train 90 "$BUILD/tests_train" --gtest_filter='CudaTraining*'

  # ---- nothing else on the GPU while the timed benchmarks run -----------------------------------
  if [ -n "$prewarm_pid" ]; then
    limit=$((SECONDS + 60))
    while kill -0 "$prewarm_pid" 2>/dev/null && ((SECONDS < limit)); do sleep 1; done
    if kill -0 "$prewarm_pid" 2>/dev/null; then
      pkill -TERM -P "$prewarm_pid" 2>/dev/null
      kill -TERM "$prewarm_pid" 2>/dev/null
      wait "$prewarm_pid" 2>/dev/null
      record prewarm "stopped unfinished at ${SECONDS} s"
    else
      wait "$prewarm_pid"
      record prewarm "finished (exit status $?) by ${SECONDS} s"
    fi
    {
      echo "--- prewarm output ---"
      cat "$work/prewarm.log"
    } >>"$log"
  fi

  # ---- benchmarks -------------------------------------------------------------------------------
  # The peak PyTorch's MFU is taken against: the one bench_train used (the GPU table's).
  peak_of() {
    "$PYTHON" -c 'import json, sys
  rows = json.load(open(sys.argv[1]))["rows"]
  print(next((r["peak_tflops"] for r in rows if r.get("peak_tflops")), ""))' "$1" 2>/dev/null
  }
  # time_pair NAME BATCH DTYPES PYTORCH_COMMAND...: dstrain's bench_train, then PyTorch's step of
  # the same model (eager and torch.compile) at the same batch and sequence.
  time_pair() {
    local model=$1 batch=$2 model_dtypes=$3
    shift 3
    run_step "bench_train_$model" 180 "$BUILD/bench_train" --device cuda --models "$model" \
      --dtype "$model_dtypes" --batch "$batch" --seq-len "$SEQ" --steps "$STEPS" \
      --warmup "$WARMUP" --json "$json/dstrain_$model.json"
    if ((torch_ok)); then
      local peak
      peak=$(peak_of "$json/dstrain_$model.json")
      run_step "pytorch_$model" 240 "$@" --model "$model" --batch "$batch" --mode both \
        --steps "$STEPS" --warmup "$WARMUP" ${peak:+--peak-tflops "$peak"} \
        --json "$json/pytorch_$model.json"
    else
      record "pytorch_$model" "not run: torch is not importable"
    fi
  }
  # The LLaMA family first (issue 34), then GPT-2 (issue 5's comparison, kept up to date).
  for model in $LLAMA_MODELS; do
    time_pair "$model" "$BATCH_LLAMA" bf16 "${pytorch_llama[@]}"
  done
  # --precision fp8 (issue 34, item 5): the same step with the layers' GEMMs in FP8.
  for model in $FP8_MODELS; do
    run_step "bench_train_${model}_fp8" 120 "$BUILD/bench_train" --device cuda --models "$model" \
      --dtype fp8 --batch "$BATCH_LLAMA" --seq-len "$SEQ" --steps "$STEPS" --warmup "$WARMUP" \
      --json "$json/dstrain_${model}_fp8.json"
  done
  # A 7B the way a user trains it: the dstrain binary, the plan it picks for this GPU.
  for model in $BIG_MODELS; do
    run_step "dstrain_$model" 180 "$BUILD/dstrain" --model "$model" --device cuda \
      --global-batch-tokens "$BIG_TOKENS" --seq-len "$SEQ" --steps "$BIG_STEPS" \
      --eval-every 0 --sample 0 --log "$json/trainer_$model.jsonl" $BIG_FLAGS
  done
  # Issue 31: a 7B as on a 24 GB card, its parameters (and optimizer) in host memory.
  for model in $OFFLOAD_MODELS; do
    run_step "dstrain_offload_$model" 240 "$BUILD/dstrain" --model "$model" --device cuda \
      --global-batch-tokens "$BIG_TOKENS" --seq-len "$SEQ" --steps "$BIG_STEPS" \
      --eval-every 0 --sample 0 --log "$json/trainer_offload_$model.jsonl" $OFFLOAD_FLAGS
  done
  # Timelines of two steps: the time of each span on the GPU's stream.
  for model in $TRACE_MODELS; do
    run_step "trace_$model" 120 "$BUILD/dstrain" --model "$model" --device cuda \
      --global-batch-tokens "$BIG_TOKENS" --seq-len "$SEQ" --steps 5 --eval-every 0 \
      --sample 0 --trace "$json/trace_$model.json" --trace-steps 3:4
  done
  # Each kernel's share of one bf16 step (Nsight Compute times every launch, one at a time).
  for model in $STEP_PROFILE; do
    ncu_bin=$(find_ncu)
    if [ -z "$ncu_bin" ] && ((!dry_run)); then
      record "step_profile" "not run: no ncu on PATH, beside nvcc or in /opt/nvidia/nsight-compute"
      break
    fi
    batch=$BATCH_LLAMA
    if [[ $model == gpt2-* ]]; then batch=$(gpt2_batch "$model"); fi
    run_step "step_profile_$model" 120 "${ncu_bin:-ncu}" --csv \
      --metrics gpu__time_duration.sum --print-units base --print-kernel-base function \
      --cache-control none --clock-control none --log-file "$json/kernels_$model.csv" \
      "$BUILD/bench_train" --device cuda --models "$model" --dtype bf16 --batch "$batch" \
      --seq-len "$SEQ" --steps 1 --warmup 0
  done
  for model in $MODELS; do
    time_pair "$model" "$(gpt2_batch "$model")" "$dtypes" "${pytorch[@]}"
  done
  if ((OPS)) && [ -n "$OPS_ONLY" ]; then
    run_step "bench_cuda_ops_bf16_$OPS_ONLY" 60 "$BUILD/bench_cuda_ops" --dtype bf16 \
      --only "$OPS_ONLY" --json "$json/ops_bf16_$OPS_ONLY.json"
  elif ((OPS)); then
    run_step bench_cuda_ops_bf16 60 "$BUILD/bench_cuda_ops" --dtype bf16 \
      --json "$json/ops_bf16.json"
    if [[ ,$dtypes, == *,fp16,* ]]; then
      run_step bench_cuda_ops_fp16 60 "$BUILD/bench_cuda_ops" --dtype fp16 \
        --json "$json/ops_fp16.json"
    fi
    # The kernels at the shapes of gpt2-1.5b (C=1600, 25 heads).
    run_step bench_cuda_ops_bf16_1.5b_shapes 60 "$BUILD/bench_cuda_ops" --dtype bf16 --batch \
      "$BATCH_1_5B" --channels 1600 --heads 25 --json "$json/ops_bf16_c1600.json"
    # The attention kernels at the other head dims they are built for: 128 (Llama, C=2048, 16
    # heads) and 256 (the 6b preset, C=4096, 16 heads).
    run_step bench_cuda_ops_bf16_hd128 45 "$BUILD/bench_cuda_ops" --dtype bf16 --batch 8 \
      --channels 2048 --heads 16 --json "$json/ops_bf16_hd128.json"
    run_step bench_cuda_ops_bf16_hd256 45 "$BUILD/bench_cuda_ops" --dtype bf16 --batch 4 \
      --channels 4096 --heads 16 --json "$json/ops_bf16_hd256.json"
    # 192: latent attention's qk head dim (DeepSeek-V2-Lite and V3: 128 + 64, v padded to it),
    # 16 heads as V2-Lite has (C here is the heads' width, 3072).
    run_step bench_cuda_ops_bf16_hd192 45 "$BUILD/bench_cuda_ops" --dtype bf16 --batch 4 \
      --channels 3072 --heads 16 --json "$json/ops_bf16_hd192.json"
  fi
  # The attention with 32 rows per warp (set_cuda_attention_warp_rows; the default is 16) in a
  # whole bf16 step of each model of ATTENTION32_MODELS, against its row above: the measurement
  # that picks the default (the bench_cuda_ops rows "(32 rows per warp)" time the kernels alone).
  for model in $ATTENTION32_MODELS; do
    run_step "bench_train_${model}_attention32" 120 "$BUILD/bench_train" --device cuda \
      --models "$model" --dtype bf16 --batch "$(gpt2_batch "$model")" --seq-len "$SEQ" \
      --steps "$STEPS" --warmup "$WARMUP" --attention-warp-rows 32 \
      --json "$json/dstrain_${model}_attention32.json"
  done
fi  # KERNELS_ONLY

# ---- the hardware checks the emulator cannot make: shared-memory races (cp.async double
# buffering, ldmatrix after the barrier) and out-of-bounds accesses, on the kernel tests ----------
sanitizer=$(command -v compute-sanitizer 2>/dev/null ||
  ls "$(dirname "$nvcc_path")/compute-sanitizer" 2>/dev/null)
if ((!SANITIZE)); then
  record sanitizer "not run (SANITIZE=0)"
elif [ -z "$sanitizer" ] && ((!dry_run)); then
  record sanitizer "not run: no compute-sanitizer beside nvcc or on PATH"
else
  run_step racecheck_attention_mma 150 "${sanitizer:-compute-sanitizer}" --tool racecheck \
    --error-exitcode 3 "$BUILD/tests_kernels_cuda" --gtest_filter='CudaAttentionMma*'
  run_step memcheck_kernels 120 "${sanitizer:-compute-sanitizer}" --tool memcheck \
    --report-api-errors no --error-exitcode 3 "$BUILD/tests_kernels_cuda"
fi

# ---- the summary and the combined results -----------------------------------------------------
if ((dry_run)); then
  echo "[summary] $PYTHON benchmarks/pytorch_gpt2.py summarize --out $OUT/summary.md" \
    "--merged $OUT/results.json ... $json/*"
  rm -rf "$work"
  exit 0
fi
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
"$PYTHON" benchmarks/pytorch_gpt2.py summarize --out "$OUT/summary.md" \
  --merged "$OUT/results.json" --commit "$COMMIT" --date "$(date -u +%Y-%m-%d)" \
  --gpu "$gpu_name" \
  --status "$status" "$json"/* 2>&1 | tee -a "$log"
if [ ! -s "$OUT/summary.md" ]; then
  echo "summary: python could not write it; see status.tsv and session.log" >"$OUT/summary.md"
fi
say "gpu_session.sh: done in ${SECONDS} s; $OUT holds $(cd "$OUT" && echo *)"
rm -rf "$work"
