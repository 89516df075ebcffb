"""Batch-only tables vs full-capacity rebuilds, max_seq_len 4K..1M.

    PYTHONPATH=. python benchmarks/bench_batch_tables.py [--out DIR]

Fixed batch of 64 rows out of 256 slots, 3 pools (full fp8 target, windowed
fp8 target, windowed bf16 draft), page size 16. For each max_seq_len:
  * batch_4k: the kernel for the batch rows at 4K-token contexts (width 256)
  * batch_widest: the kernel when the widest row is max_seq_len long
  * full_rebuild: converting every pool's whole [slots + 1, max_pages] table
    (what a system without batch-only tables does every step), jitted XLA.
Each figure is device time per build: 200 builds run in one jitted loop.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import print_row, time_call, write_results
from pallas_kernels.batch_tables import build_batch_tables
from unified_kv import bucket_width

NUM_SLOTS, BATCH, PAGE = 256, 64, 16
SCALES = (8, 8, 4)


ITERS = 200  # builds per timed call: device time, not host dispatch, dominates
LINE = ("max_seq_len={max_seq_len:>8}  batch_4k={batch_4k_us:8.1f} us  "
        "batch_widest={batch_widest_us:8.1f} us (w={batch_widest_width})  "
        "full_rebuild={full_rebuild_us:9.1f} us  ratio={full_over_batch_4k:.1f}x")


def looped(build):
    """Run `build(i)` ITERS times in one jitted loop; each iteration's inputs
    differ (so nothing is hoisted) and its whole output is the loop carry (so
    no element is dropped)."""
    def run(*args):
        init = jax.eval_shape(lambda: build(0, *args))
        init = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), init)
        return jax.lax.fori_loop(0, ITERS, lambda i, _: build(i, *args), init)
    return jax.jit(run)


def full_rebuild(i, zero, tables):
    # zero[i] is 0 but unknown to XLA, so the rebuild cannot leave the loop.
    return tuple(jnp.where(t < 0, -1, t * s + zero[i]) for t, s in zip(tables, SCALES))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    interpret = jax.default_backend() == "cpu"
    rng = np.random.default_rng(0)
    rows = []
    for max_seq_len in (4096, 16384, 65536, 262144, 1048576):
        max_pages = max_seq_len // PAGE + 1
        tables = tuple(jnp.asarray(rng.integers(-1, 1 << 20, (NUM_SLOTS + 1, max_pages)),
                                   jnp.int32) for _ in SCALES)
        slot_ids = jnp.asarray(np.stack([rng.permutation(NUM_SLOTS)[:BATCH]
                                         for _ in range(ITERS)]), jnp.int32)
        result = {"max_seq_len": max_seq_len, "max_pages_per_seq": max_pages}
        for name, width in (("batch_4k", bucket_width(4096 // PAGE, max_pages)),
                            ("batch_widest", bucket_width(max_pages, max_pages))):
            fn = looped(lambda i, ids, t, w=width: build_batch_tables(
                ids[i], t, table_width=w, scales=SCALES, interpret=interpret))
            result[f"{name}_us"] = time_call(fn, slot_ids, tables, iters=3) / ITERS * 1e6
            result[f"{name}_width"] = width
        zero = jnp.zeros((ITERS,), jnp.int32)
        result["full_rebuild_us"] = time_call(looped(full_rebuild), zero, tables,
                                              iters=3) / ITERS * 1e6
        result["full_over_batch_4k"] = result["full_rebuild_us"] / result["batch_4k_us"]
        print_row(rows, result, LINE)
    print("wrote", write_results("batch_tables", {"batch": BATCH, "num_slots": NUM_SLOTS,
                                                 "page_size": PAGE, "rows": rows}, args.out))


if __name__ == "__main__":
    main()
