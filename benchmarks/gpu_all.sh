#!/usr/bin/env bash
# One device call: compiled-kernel tests, then every benchmark. Results under $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels 2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt"
python3 benchmarks/bench_batch_tables.py --out "$OUT" 2>&1 | tee "$OUT/batch_tables.txt"
python3 benchmarks/bench_paged_attention.py --out "$OUT" "$@" 2>&1 | tee "$OUT/paged_attention.txt"
