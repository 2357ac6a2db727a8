#!/usr/bin/env bash
# The soak (issue 35; documented, not in CI): hours of training on CPU ranks with a plan that
# exercises everything at once -- pp 2 x tp 2 x dp 2 on 8 ranks, ZeRO-3, the optimizer offloaded,
# full recompute, fp16 with a loss scale that keeps growing into overflows (window 4), a
# checkpoint every 25 steps kept two deep and mirrored, a replica check every 20 steps -- while
# the process's resident memory is sampled every 30 s. At the end (SIGTERM after HOURS: the run
# checkpoints and stops, as under a scheduler) benchmarks/soak_report.py prints the table:
# steps, overflows, checkpoints verified, replica checks, and whether memory stayed flat.
#
#   scripts/soak.sh [HOURS] [DIR]     (default 3 hours, DIR build/soak)
set -euo pipefail
cd "$(dirname "$0")/.."
hours=${1:-3}
dir=${2:-build/soak}
[ -x build/dstrain ] || scripts/build.sh
rm -rf "$dir"
mkdir -p "$dir"
seconds=$(awk -v h="$hours" 'BEGIN { printf "%d", h * 3600 }')
build/dstrain --model llama-tiny --device cpu --gpus 8 --pp 2 --tp 2 --zero 3 \
  --offload optimizer --recompute full --precision fp16 --loss-scale-init 65536 \
  --loss-scale-window 4 --batch 4 --seq-len 64 --steps 100000000 --lr-decay-steps 100000 \
  --eval-every 200 --save-every 25 --keep-last 2 --mirror "$dir/mirror" --check-replicas 20 \
  --out "$dir/run" --log "$dir/soak.jsonl" --sample 0 --quiet --threads 2 \
  >"$dir/stdout.txt" 2>"$dir/stderr.txt" &
pid=$!
echo "soak: dstrain (pid $pid) for $hours h into $dir"
start=$(date +%s)
echo -e "seconds\trss_kb\tsteps" >"$dir/memory.tsv"
while kill -0 "$pid" 2>/dev/null; do
  now=$(($(date +%s) - start))
  rss=$(awk '/^VmRSS:/ { print $2 }' "/proc/$pid/status" 2>/dev/null || true)
  steps=$(grep -c '"loss"' "$dir/soak.jsonl" 2>/dev/null || true)
  [ -n "$rss" ] && echo -e "$now\t$rss\t${steps:-0}" >>"$dir/memory.tsv"
  if ((now >= seconds)); then
    kill -TERM "$pid"
    break
  fi
  sleep 30
done
code=0
wait "$pid" || code=$?
echo "soak: dstrain exited with $code (143: stopped by SIGTERM after its checkpoint)"
python3 benchmarks/soak_report.py "$dir" "$code"
