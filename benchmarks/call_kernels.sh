#!/usr/bin/env bash
# Per-kernel device time of attention calls under ncu (benchmarks/call_kernels.py).
#   OUT=DIR bash benchmarks/call_kernels.sh ours:bf16:1:4096 cudnn:bf16:1:4096 ...
# Each case is IMPL:KV:MAX_Q:CTX; its ncu CSV and summary land in $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1
OUT=${OUT:-/tmp/call_kernels}; mkdir -p "$OUT"
CALLS=${CALLS:-5}
for case in "$@"; do
  IFS=: read -r impl kv max_q ctx <<< "$case"
  name="${impl}_${kv}_q${max_q}_${ctx}"
  timeout 240 ncu --clock-control none --cache-control none --csv \
    --metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread \
    python3 benchmarks/call_kernels.py --impl "$impl" --kv "$kv" --max-q "$max_q" \
    --ctx "$ctx" --calls "$CALLS" > "/tmp/ncu_$name.csv" 2> "/tmp/ncu_$name.err"
  echo "== $name (ncu exit $?)" | tee -a "$OUT/call_kernels.txt"
  python3 benchmarks/call_kernels.py --summarize "/tmp/ncu_$name.csv" --calls "$CALLS" \
    2>&1 | tee -a "$OUT/call_kernels.txt" || tail -5 "/tmp/ncu_$name.err"
done
