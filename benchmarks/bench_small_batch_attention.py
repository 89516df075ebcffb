"""Decode and verify attention at small batch: how many key splits fill the GPU.

    PYTHONPATH=. python benchmarks/bench_small_batch_attention.py [--out DIR] [--quick]

At batch 1-4 with 8 kv heads a call has 8-32 programs per key split, and the launch
plan splits keys only in fixed 128-page pieces (`launch_plan.FEW_Q_SPLIT_PAGES`), so
a 1K-token row runs one split on a few SMs. This sweeps fixed split sizes (pages per
split) and larger key blocks (pages per block: fewer, longer loop iterations) for
decode (1 query token) and verify (16, DFlash-b16) over fp8 KV, 32 query / 8 kv
heads, head dim 128, contexts 1K / 8K / 32K, and sets each against the default
plan and the copy bandwidth measured in the same run (KV bytes read per second).
Writes small_batch_attention.json.
"""

from __future__ import annotations

import argparse

from benchmarks.bench_paged_attention import FP8, HKV, D, PAGE, setup, sweep_configs
from benchmarks.timing import device_copy_bandwidth, write_results


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="small sizes: a CPU smoke test")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    args = ap.parse_args(argv)
    contexts = [256] if args.quick else args.contexts
    batches = [1] if args.quick else args.batches
    copy_bw = device_copy_bandwidth(64 << 20, 3) if args.quick else device_copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    report = {"copy_bandwidth_Bps": copy_bw, "runs": []}
    for ctx in contexts:
        pages = ctx // PAGE
        for batch in batches:
            kv_read = batch * ctx * HKV * D * 2  # fp8: one byte a value, K and V
            for max_q in (1, 16):
                inputs = setup(ctx, FP8, max_q=max_q, batch=batch)
                split_sizes = [s for s in (8, 16, 32, 64, 128) if s <= pages] or [pages]
                # the default first and again last: a sweep's first timing can run on a
                # GPU still raising its clocks (the two then disagree)
                configs = ([{}] + [{"num_splits": -(-pages // s)} for s in split_sizes]
                           + [{"pages_per_block": ppb} for ppb in (8, 16) if ppb <= pages]
                           + [{}])
                label = f"b{batch} ctx {ctx} q{max_q}"
                best, best_s, sweep = sweep_configs(
                    inputs, configs, label, iters=20 if args.quick else 50,
                    rate=lambda t: f"{kv_read / t / copy_bw:.0%} of copy bandwidth")
                defaults = [row["ms"] for row in sweep if len(row) == 1]  # only "ms"
                default_ms = min(defaults) if defaults else None
                report["runs"].append({"batch": batch, "context": ctx, "max_q": max_q,
                                       "kv_bytes": kv_read, "default_ms": default_ms,
                                       "best": best, "best_ms": best_s * 1e3,
                                       "sweep": sweep})
    return write_results("small_batch_attention", report, args.out)


if __name__ == "__main__":
    main()
