#!/usr/bin/env bash
# One device call: compiled-kernel tests, then every benchmark. Results under $OUT.
# On a 2-GPU machine the transfer benchmark moves GPU 0 -> GPU 1; the rest use GPU 0.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1
OUT=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels tests/drafter/test_tensor_parallel.py 2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt"
python3 benchmarks/bench_batch_tables.py --out "$OUT" 2>&1 | tee "$OUT/batch_tables.txt"
python3 benchmarks/bench_paged_attention.py --out "$OUT" "$@" 2>&1 | tee "$OUT/paged_attention.txt"
python3 benchmarks/bench_paged_attention.py --out "$OUT" --prefill-only 2>&1 | tee "$OUT/paged_attention_prefill.txt"
python3 benchmarks/bench_cache_layouts.py --out "$OUT" --contexts 4096 131072 1048576 2>&1 | tee "$OUT/cache_layouts.txt"
python3 benchmarks/bench_decode_speed.py --out "$OUT" 2>&1 | tee "$OUT/decode_speed.txt"
python3 -m drafter.evaluate --json "$OUT/eval_default_gpu.json" 2>&1 | tee "$OUT/eval.txt"
python3 benchmarks/bench_transfer.py --out "$OUT" 2>&1 | tee "$OUT/transfer.txt"
python3 benchmarks/bench_transfer.py --out "$OUT/e2e" --e2e --no-transfer 2>&1 | tee "$OUT/transfer_e2e.txt"
