#!/usr/bin/env bash
# session probe runner (not kept)
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1
kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$kind"
timeout 100 python3 probe_calls.py 2>&1 | grep -v Warning | tail -8
for r in 1 2; do for arm in old new; do
  mkdir -p "$OUT/ab_${arm}_$r"
  timeout 90 python3 probe_ab.py $arm --parts demo --repeats 7 --demo-modes aggregated disagg-shared \
    --out "$OUT/ab_${arm}_$r" 2>&1 | grep -E "aggregated:|disagg-shared:|goals" | sed "s/^/$arm $r /"
  echo "t=$SECONDS"
done; done
timeout 40 python3 benchmarks/bench_dispatch.py --counts 1 8 16 48 64 128 256 --out "$OUT" 2>&1 | tail -6
left=$((585 - SECONDS))
if [[ "$kind" == *H200* && $left -gt 200 ]]; then
  timeout $left python3 -m drafter.evaluate --json "$OUT/eval_default_gpu.json" 2>&1 | tail -12
fi
