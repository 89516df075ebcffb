"""Where one attention call's device time goes: its kernels, one by one, under ncu.

    ncu --clock-control none --cache-control none --csv \
        --metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread \
        python3 benchmarks/call_kernels.py --impl ours --ctx 4096 --calls 5
    python3 benchmarks/call_kernels.py --summarize ncu.csv --calls 5

The first command runs the benchmark's decode (or verify) call `--calls` times
after a warm-up; ncu times every kernel. The second finds the sequence of
kernel names that the end of the trace repeats (one call's kernels), keeps its
last `--calls` repeats, and prints each kernel's time per call: the Pallas
kernel against the XLA fusions that lay q out and the result back, or
cuDNN's kernels.
"""

from __future__ import annotations

import argparse
import csv
import io
import statistics
from collections import defaultdict

def run(args):
    import jax

    from benchmarks.bench_paged_attention import KV_DTYPES, dense_kv, ours, setup
    from pallas_kernels.kv_store import layer_kv

    q, pool, table, kv_lens, q_lens = setup(args.ctx, KV_DTYPES[args.kv], max_q=args.max_q)
    if args.impl == "ours":
        fn, fn_args = ours(q, pool, table, kv_lens, q_lens), (q, pool, table, kv_lens, q_lens)
    else:
        k, v = dense_kv(*layer_kv(pool, 0), table // 2)
        fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                  implementation=args.impl))
        fn_args = (q, k, v)
    for _ in range(3):
        jax.block_until_ready(fn(*fn_args))
    for _ in range(args.calls):
        out = fn(*fn_args)
    jax.block_until_ready(out)


def kernel_times(path, calls):
    """{kernel name: (ns per call, launches per call, median ns, grid, registers)} over
    the last `calls` repeats of the kernel sequence that ends the ncu CSV at `path`."""
    rows = list(csv.DictReader(io.StringIO(
        "".join(line for line in open(path) if line.startswith('"')))))
    kernels, by_id = [], {}  # (name, metric -> value) in launch order
    for r in rows:
        if r["ID"] not in by_id:
            by_id[r["ID"]] = (r["Kernel Name"], {})
            kernels.append(by_id[r["ID"]])
        by_id[r["ID"]][1][r["Metric Name"]] = r["Metric Value"].replace(",", "")
    names = [name for name, _ in kernels]
    period = next((p for p in range(1, len(names) // calls + 1)
                   if names[-calls * p:] == names[-p:] * calls), None)
    if period is None:
        raise ValueError(f"{path}: its last kernels are not {calls} repeats of one call's "
                         f"kernels ({len(names)} kernels); was --calls {calls} the run's?")
    times, meta = defaultdict(list), {}
    for name, m in kernels[-calls * period:]:
        times[name].append(float(m["gpu__time_duration.sum"]))
        meta[name] = (m.get("launch__grid_size"), m.get("launch__registers_per_thread"))
    return {name: (sum(ts) / calls, len(ts) // calls, statistics.median(ts), *meta[name])
            for name, ts in times.items()}


def summarize(path, calls):
    total = 0.0
    for name, (per_call, launches, median, grid, regs) in kernel_times(path, calls).items():
        total += per_call
        print(f"{per_call / 1e3:9.2f} us/call  x{launches}  median {median / 1e3:9.2f} us  "
              f"grid {grid} regs {regs}  {name[:90]}")
    print(f"{total / 1e3:9.2f} us/call in all")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["ours", "cudnn", "xla"], default="ours")
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--kv", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--max-q", type=int, default=1)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--summarize", metavar="NCU_CSV")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize, args.calls)
    else:
        run(args)


if __name__ == "__main__":
    main()
