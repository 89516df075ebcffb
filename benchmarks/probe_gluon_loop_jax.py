"""The Gluon decode / verify loop (`probe_gluon_loop.py`) called from JAX, beside the Pallas
kernel on the same pool, table and queries, in one process.

    PYTHONPATH=. python benchmarks/probe_gluon_loop_jax.py [--ctx 32768 4096] [--out DIR]

Data: bench_paged_attention's decode case (batch 64, 32 / 8 heads, head dim 128, 16-key
pages in random order, fp8 KV). The Pallas kernel (`paged_attention`, its default fp8
options) reads the unified pool [kv heads, pages, 1 layer, 2, 16, 128]; the Gluon loop
reads the same bytes (each page's K and V^T side by side) through `gluon_call`, with the
page ids (the table / 2) and q laid out as its rows (tokens x q heads per kv head, scaled
for base 2). Both are timed with `benchmarks.timing.time_call` (back-to-back calls), and
the loop's result is checked against the jnp reference on two rows. The Pallas kernel
refuses pools past 2^31 elements (fp8 at 32K, batch 64), where only the loop runs.
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp

from benchmarks.bench_paged_attention import FP8, HKV, HQ, ours, reference_rel_err, setup
from benchmarks.probe_gluon_loop import D, GQA, paged_loop_kernel
from benchmarks.timing import time_alternating, write_results
from pallas_kernels.gluon_call import gluon_call
from pallas_kernels.pool_layout import MAX_POOL_ELEMENTS

ROWS = {1: 16, 8: 32}  # query rows per program: tokens x GQA, at least 16


def gluon_inputs(q, pool, table):
    """The Pallas call's q [B, T, HQ, D], pool and table (page * 2) as the Gluon loop takes
    them: q f16 [B * HKV, rows, D] scaled for base 2, the pool as is, page ids [B, width]."""
    batch, tokens = q.shape[:2]
    rows = ROWS[tokens]
    q_rows = q.reshape(batch, tokens, HKV, GQA, D).transpose(0, 2, 1, 3, 4)
    q_rows = q_rows.reshape(batch * HKV, tokens * GQA, D).astype(jnp.float32)
    q_rows = q_rows * (math.log2(math.e) / math.sqrt(D))
    q_rows = jnp.pad(q_rows, ((0, 0), (0, rows - tokens * GQA), (0, 0))).astype(jnp.float16)
    return q_rows, pool, table // 2


def gluon_loop(q_rows, pool, page_ids, ctx, tokens, num_pages):
    """The probe's kernel over every row's first ctx keys: f32 [B * HKV, rows, D]."""
    return gluon_call(paged_loop_kernel, q_rows, pool, page_ids, ctx,
                      page_ids.shape[1], num_pages, grid=(q_rows.shape[0],), num_warps=2,
                      out_shape=jax.ShapeDtypeStruct(q_rows.shape, jnp.float32),
                      constexprs={"ROWS": q_rows.shape[1], "TOKENS": tokens, "STAGES": 3})


def as_pallas_output(out, batch, tokens):
    """[B * HKV, rows, D] -> [B, tokens, HQ, D], the Pallas kernel's layout."""
    out = out[:, :tokens * GQA].reshape(batch, HKV, tokens, GQA, D)
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, tokens, HQ, D)


def compare(ctx, batch=64):
    """Both kernels' ms and the loop's error against the jnp reference (rows 0 and 1); the
    Pallas kernel only where it takes the pool (at most 2^31 elements)."""
    q, pool, table, kv_lens, _ = setup(ctx, FP8, max_q=8, batch=batch)
    row = {"ctx": ctx, "batch": batch}
    num_pages = pool.shape[1]
    for name, tokens in (("decode", 1), ("verify8", 8)):
        q_t = q[:, :tokens]
        q_lens = jnp.full((batch,), tokens, jnp.int32)
        inputs = gluon_inputs(q_t, pool, table)
        gluon = jax.jit(gluon_loop, static_argnums=(3, 4, 5))
        kernels = {"gluon": lambda: gluon(*inputs, ctx, tokens, num_pages)}
        if pool.size <= MAX_POOL_ELEMENTS:
            pallas = ours(q_t, pool, table, kv_lens, q_lens)
            kernels["pallas"] = lambda: pallas(q_t, pool, table, kv_lens, q_lens)
        got = as_pallas_output(kernels["gluon"](), batch, tokens)
        row[f"{name}_rel_err"] = reference_rel_err(got, q_t, pool, table, kv_lens, q_lens)
        for kernel, ms in time_alternating(kernels).items():
            row[f"{kernel}_{name}_ms"] = ms
    for kernel in ("pallas", "gluon"):
        if f"{kernel}_decode_ms" in row:
            row[f"{kernel}_verify8_over_decode"] = (row[f"{kernel}_verify8_ms"]
                                                   / row[f"{kernel}_decode_ms"])
    row["gluon_decode_kv_tb_s"] = batch * ctx * HKV * D * 2 / row["gluon_decode_ms"] / 1e9
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ctx", type=int, nargs="*", default=[32768, 4096])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for ctx in args.ctx:
        rows.append(compare(ctx))
        print(rows[-1], flush=True)
    write_results("probe_gluon_loop_jax", {"rows": rows}, args.out)


if __name__ == "__main__":
    main()
