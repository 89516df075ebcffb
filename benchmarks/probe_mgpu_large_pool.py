"""Where Mosaic GPU's page copies break on pools of 2 GiB or more.

    PYTHONPATH=. python benchmarks/probe_mgpu_large_pool.py [--gib 4.1]

`paged_decode_mgpu` hit an illegal address on a 4.3 GB fp8 pool (batch 64,
32K keys) and ran on 2.15 GB (BENCHMARKS.md, tenth session). Here one TMA
copy moves 16 rows of a [rows, columns] fp8 array of `--gib` GiB from a
given row into shared memory and back out, as the kernel copies a page: K
pages are 16 x 128 bytes (128-byte swizzle), V^T pages 128 x 16 (8-row
tiles, no swizzle), with and without those transforms, from rows below and
above byte offset 2^31 and 2^32. Then `paged_decode_mgpu` itself (its guard
lifted) on such a pool, its rows' pages at the pool's start or its end.
Each case runs in its own process (a faulting kernel takes its CUDA context
with it) and reports ok, wrong bytes or relative error, or the error.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

ROWS = 16


def one_case(gib: float, columns: int, row: int, transforms: bool,
             interpret: bool = False) -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.pool_layout import smem_tiles

    fp8 = jnp.float8_e4m3fn
    total_rows = int(gib * 2**30) // columns // 64 * 64  # whole 8-row tiles
    marker = (np.arange(ROWS * columns) % 7 + 1).astype(np.float32).reshape(ROWS, columns)
    x = jnp.zeros((total_rows, columns), fp8)
    x = jax.lax.dynamic_update_slice(x, jnp.asarray(marker, fp8), (row, 0))

    def kernel(index_gmem, x_gmem, o_gmem, smem, barrier):
        start = pl.multiple_of(index_gmem[0], ROWS)
        plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(start, ROWS)], smem, barrier)
        plgpu.barrier_wait(barrier)
        plgpu.copy_smem_to_gmem(smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    out = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((ROWS, columns), fp8),
        grid=(1,), grid_names=("g",),
        scratch_types=[plgpu.SMEM((ROWS, columns), fp8,
                                  transforms=smem_tiles(fp8, columns) if transforms else ()),
                       plgpu.Barrier(num_arrivals=1)],
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(jnp.asarray([row], jnp.int32), x)
    got = np.asarray(jax.block_until_ready(out)).astype(np.float32)
    return "ok" if np.array_equal(got, marker) else f"wrong bytes ({(got != marker).sum()})"


def decode_case(gib: float, where: str, batch: int = 4, pages_per_row: int = 4,
                repeat: int = 1, triton_first: bool = False, interpret: bool = False) -> str:
    """paged_decode_mgpu (its pool-size guard lifted) on a pool of `gib` GiB whose
    rows' pages sit at its start or its end, or ("spread") on a pool of exactly the
    rows' pages in random order (as bench_paged_attention lays them out); checked
    against the reference."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import paged_decode_mgpu as module
    from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
    from tests.pallas_kernels.test_paged_attention import rel_err

    module.MAX_POOL_BYTES = 1 << 62
    heads, kv_heads, head_dim, page = 32, 8, 128, 16
    if where == "spread":
        num_pages = batch * pages_per_row
    else:  # page 0 stays the null page
        num_pages = max(int(gib * 2**30) // (kv_heads * 2 * page * head_dim),
                        batch * pages_per_row + 1)
    key = jax.random.key(0)
    pool = jax.random.normal(key, (kv_heads, num_pages, 1, 2, page, head_dim),
                             jnp.bfloat16).astype(jnp.float8_e4m3fn)
    first = 1 if where == "start" else num_pages - batch * pages_per_row
    pages = np.arange(first, first + batch * pages_per_row).reshape(batch, pages_per_row)
    if where == "spread":
        pages = np.random.default_rng(0).permutation(num_pages).reshape(batch, pages_per_row)
    table = jnp.asarray(pages * 2, jnp.int32)  # page * 2L, L = 1
    q = jax.random.normal(jax.random.fold_in(key, 1), (batch, 1, heads, head_dim), jnp.bfloat16)
    kv_lens = jnp.full((batch,), pages_per_row * page, jnp.int32)
    q_lens = jnp.ones((batch,), jnp.int32)
    if triton_first:  # as probe_decode_mgpu runs it: the Triton kernel on the same inputs
        jax.block_until_ready(paged_attention(q, pool, table, kv_lens, q_lens, layer_offset=0,
                                              interpret=interpret))
    for _ in range(repeat):  # back to back, as a timing loop runs it
        out = module.paged_decode_mgpu(q, pool, table, kv_lens, q_lens, layer_offset=0,
                                       interpret=interpret)
    ref = paged_attention_reference(q, pool, table, kv_lens, q_lens, layer_offset=0)
    err = float(rel_err(out, ref))
    return f"ok (relative error {err:.2e})" if err < 1e-2 else f"wrong (relative error {err:.2e})"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=4.1)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in a child process
    parser.add_argument("--out", default=None)
    parser.add_argument("--spread-batch", type=int, nargs="*", default=[],
                        help="also decode these batches over pools of exactly their pages, "
                             "in random order (the benchmark's layout)")
    parser.add_argument("--spread-pages", type=int, default=2048, help="pages per row there")
    parser.add_argument("--repeat", type=int, default=1, help="back-to-back calls there")
    parser.add_argument("--decode-only", action="store_true",
                        help="only the paged_decode_mgpu cases, not the single copies")
    parser.add_argument("--interpret", action="store_true",
                        help="jax's GPU interpreter (a CPU check of the script; "
                             "use a small --gib)")
    args = parser.parse_args()
    if args.case:
        case = json.loads(args.case)
        run = decode_case if "where" in case else one_case
        print(json.dumps(run(args.gib, **case)))
        return
    total = int(args.gib * 2**30)
    cases = []
    for columns in () if args.decode_only else (128, 16):
        rows = total // columns
        for byte_offset in (0, 2**31 - 2**20, 2**31 + 2**20, 2**32 + 2**20):
            row = byte_offset // columns
            if row + ROWS <= rows:
                cases += [{"columns": columns, "row": row, "transforms": transforms,
                           "byte_offset": byte_offset} for transforms in (True, False)]
    cases += [{"where": where} for where in ("start", "end")]
    cases += [{"where": "spread", "batch": batch, "pages_per_row": args.spread_pages,
               "repeat": args.repeat, "triton_first": triton_first}
              for batch in args.spread_batch for triton_first in (False, True)]
    results = []
    for case in cases:
        child = {k: v for k, v in case.items() if k != "byte_offset"}
        child["interpret"] = args.interpret
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--gib", str(args.gib), "--case", json.dumps(child)],
                capture_output=True, text=True, timeout=180)
            lines = done.stdout.strip().splitlines()
            result = (json.loads(lines[-1]) if done.returncode == 0 and lines
                      else f"exit {done.returncode}: {done.stderr.strip()[-300:]}")
        except subprocess.TimeoutExpired:
            result = "timed out"
        results.append({**case, "result": result})
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        from benchmarks.timing import write_results
        print("wrote", write_results("probe_mgpu_large_pool",
                                     {"gib": args.gib, "cases": results}, args.out))


if __name__ == "__main__":
    main()
