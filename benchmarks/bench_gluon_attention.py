"""Decode and verify-8: the Gluon kernel beside the Pallas kernel, on the same data, in one
process (issue 3's shapes: batch 64, 32 / 8 heads, head dim 128, 16-key pages in random
order).

    PYTHONPATH=. python benchmarks/bench_gluon_attention.py [--ctx 4096 16384 32768] [--out DIR]

Per context and KV dtype: ms per call of each kernel (`timing.time_call`: back-to-back
calls, median of 5), verify-8 / decode, KV read rate against the device copy bandwidth
measured in the same run, and each kernel's relative error against the pure-jnp reference
on two rows. Over bf16, also the issue's decode baselines on the same data
(`bench_paged_attention.decode_baselines`: jax's paged attention op, with its own
error, and cuDNN / XLA dense attention on the K/V laid out contiguously). The Pallas
kernel refuses pools past 2^31 elements (fp8 or bf16 at 32K, batch 64): its cells are
then absent.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.bench_paged_attention import (FP8, HKV, D, decode_baselines, kv_bytes,
                                              ours, reference_rel_err, setup)
from benchmarks.timing import device_copy_bandwidth, time_alternating, write_results
from pallas_kernels.paged_attention_gluon import paged_attention_gluon
from pallas_kernels.pool_layout import MAX_POOL_ELEMENTS


def bench(ctx, dtype, copy_bw):
    q, pool, table, kv_lens, _ = setup(ctx, dtype, max_q=8)
    batch = q.shape[0]
    kernels = {"gluon": jax.jit(lambda *a: paged_attention_gluon(*a, layer_offset=0))}
    if pool.size <= MAX_POOL_ELEMENTS:
        kernels["pallas"] = ours(q, pool, table, kv_lens, kv_lens)
    row = {"ctx": ctx, "kv": "fp8" if dtype == FP8 else "bf16", "batch": batch}
    for name, tokens in (("decode", 1), ("verify8", 8)):
        args = (q[:, :tokens], pool, table, kv_lens, jnp.full((batch,), tokens, jnp.int32))
        for kernel, fn in kernels.items():
            row[f"{kernel}_{name}_rel_err"] = reference_rel_err(fn(*args), *args)
        for kernel, ms in time_alternating(kernels, *args).items():
            row[f"{kernel}_{name}_ms"] = ms
    for kernel in kernels:
        row[f"{kernel}_verify8_over_decode"] = (row[f"{kernel}_verify8_ms"]
                                               / row[f"{kernel}_decode_ms"])
        rate = kv_bytes(ctx, dtype) / (row[f"{kernel}_decode_ms"] * 1e-3)
        row[f"{kernel}_decode_kv_tb_s"] = rate / 1e12
        row[f"{kernel}_decode_pct_of_copy_bw"] = 100 * rate / copy_bw
    if "pallas" in kernels:
        for name in ("decode", "verify8"):
            row[f"pallas_over_gluon_{name}"] = row[f"pallas_{name}_ms"] / row[f"gluon_{name}_ms"]
    if dtype == jnp.bfloat16:  # the decode baselines: the jax op, cuDNN, XLA
        for name, value in decode_baselines(q, pool, table, kv_lens).items():
            row[name] = value
            if name.endswith("_ms"):
                row[f"gluon_speedup_vs_{name[:-3]}"] = value / row["gluon_decode_ms"]
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ctx", type=int, nargs="*", default=[4096, 16384, 32768])
    parser.add_argument("--bf16-ctx", type=int, nargs="*", default=[4096, 32768])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    copy_bw = device_copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    rows = []
    for dtype, contexts in ((FP8, args.ctx), (jnp.bfloat16, args.bf16_ctx)):
        for ctx in contexts:
            rows.append(bench(ctx, dtype, copy_bw))
            print(rows[-1], flush=True)
    write_results("gluon_attention", {"copy_bw_tb_s": copy_bw / 1e12, "shape": dict(
        batch=64, q_heads=32, kv_heads=HKV, head_dim=D, page=16), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
