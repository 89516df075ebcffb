"""Decode, verify and the draft block (8 queries; `--block 16`: DFlash-b16's 16): the
Gluon kernel beside the Pallas kernel, on the same data, in one process (batch 64,
32 / 8 heads, head dim 128, 16-key pages in random order); then chunked prefill, both
kernels beside XLA's dense attention.

    PYTHONPATH=. python benchmarks/bench_gluon_attention.py [--ctx 4096 16384 32768] [--out DIR]
        [--bf16-ctx 4096 32768] [--no-prefill] [--pages-in-order] [--block 16]

Per context and KV dtype: ms per call of each kernel (`timing.time_call`: back-to-back
calls, median of 5), verify-8 / decode, KV read rate against the device copy bandwidth
measured in the same run, and each kernel's relative error against the pure-jnp reference
on two rows. Over bf16, also the issue's decode baselines on the same data
(`bench_paged_attention.decode_baselines`: jax's paged attention op, with its own
error, and cuDNN / XLA dense attention on the K/V laid out contiguously). The Pallas
kernel refuses pools past 2^31 elements (fp8 or bf16 at 32K, batch 64): its cells are
then absent. The draft block's figures sit beside the same kernel's decode
(`*_draft8_over_decode`). Prefill (`--prefill`:
prior context, chunk): TFLOP/s of each kernel and of XLA dense attention on the K/V laid
out contiguously, at batch 4. Pages lie in the pool in random order; `--pages-in-order`
lays each row's pages one after another (what the same data costs without scattered pages).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.bench_paged_attention import (FP8, HKV, D, decode_baselines, kv_bytes, ours,
                                              prefill_case, reference_rel_err, rel_l2,
                                              setup)
from benchmarks.timing import (device_copy_bandwidth, time_alternating, time_call,
                               write_results)
from pallas_kernels.paged_attention import (draft_block_attention,
                                            draft_block_attention_reference)
from pallas_kernels.paged_attention_gluon import (draft_block_attention_gluon,
                                                  paged_attention_gluon)
from pallas_kernels.launch_plan import FEW_Q_MAX
from pallas_kernels.pool_layout import MAX_POOL_ELEMENTS


def bench(ctx, dtype, copy_bw, pages_in_order=False, block=8):
    q, pool, table, kv_lens, _ = setup(ctx, dtype, max_q=block, pages_in_order=pages_in_order)
    verify, draft = f"verify{block}", f"draft{block}"
    batch = q.shape[0]
    kernels = {"gluon": jax.jit(lambda *a: paged_attention_gluon(*a, layer_offset=0))}
    if pool.size <= MAX_POOL_ELEMENTS:
        kernels["pallas"] = ours(q, pool, table, kv_lens, kv_lens)
    row = {"ctx": ctx, "kv": "fp8" if dtype == FP8 else "bf16", "batch": batch,
           "pages": "in order" if pages_in_order else "random"}
    for name, tokens in (("decode", 1), (verify, block)):
        args = (q[:, :tokens], pool, table, kv_lens, jnp.full((batch,), tokens, jnp.int32))
        for kernel, fn in kernels.items():
            row[f"{kernel}_{name}_rel_err"] = reference_rel_err(fn(*args), *args)
        for kernel, ms in time_alternating(kernels, *args).items():
            row[f"{kernel}_{name}_ms"] = ms
    row.update(bench_draft(q, pool, table, kv_lens, "pallas" in kernels, block))
    for kernel in kernels:
        for name in (verify, draft):
            row[f"{kernel}_{name}_over_decode"] = (row[f"{kernel}_{name}_ms"]
                                                   / row[f"{kernel}_decode_ms"])
        rate = kv_bytes(ctx, dtype) / (row[f"{kernel}_decode_ms"] * 1e-3)
        row[f"{kernel}_decode_kv_tb_s"] = rate / 1e12
        row[f"{kernel}_decode_pct_of_copy_bw"] = 100 * rate / copy_bw
    if "pallas" in kernels:
        for name in ("decode", verify, draft):
            row[f"pallas_over_gluon_{name}"] = row[f"pallas_{name}_ms"] / row[f"gluon_{name}_ms"]
    if dtype == jnp.bfloat16:  # the decode baselines: the jax op, cuDNN, XLA
        for name, value in decode_baselines(q, pool, table, kv_lens).items():
            row[name] = value
            if name.endswith("_ms"):
                row[f"gluon_speedup_vs_{name[:-3]}"] = value / row["gluon_decode_ms"]
    return row


def draft_args(q, pool, table, ctx_lens, block=8):
    """A draft block's arguments on `setup`'s data: `block` queries per row (q's first)
    after the row's whole context, and the block's own random K / V."""
    batch = q.shape[0]
    key = jax.random.key(3)
    block_k, block_v = (jax.random.normal(jax.random.fold_in(key, i),
                                          (batch, block, HKV, D), jnp.bfloat16)
                        for i in (1, 2))
    return (q[:, :block], pool, table, ctx_lens, jnp.full((batch,), block, jnp.int32),
            block_k, block_v)


def draft_rel_err(out, q, pool, table, ctx_lens, block_lens, block_k, block_v):
    """Relative error of rows 0 and 1 of a draft block's output against the reference."""
    return rel_l2(out[:2], draft_block_attention_reference(
        q[:2], pool, table[:2], ctx_lens[:2], block_lens[:2], block_k[:2], block_v[:2],
        layer_offset=0))


def bench_draft(q, pool, table, ctx_lens, with_pallas, block=8):
    """The draft block (`block` queries, bidirectional): ms and error of each kernel."""
    args = draft_args(q, pool, table, ctx_lens, block)
    kernels = {"gluon": jax.jit(lambda *a: draft_block_attention_gluon(*a, layer_offset=0))}
    if with_pallas:
        kernels["pallas"] = jax.jit(lambda *a: draft_block_attention(*a, layer_offset=0))
    row = {f"{name}_draft{block}_rel_err": draft_rel_err(fn(*args), *args)
           for name, fn in kernels.items()}
    for name, ms in time_alternating(kernels, *args).items():
        row[f"{name}_draft{block}_ms"] = ms
    return row


def bench_prefill(prior, chunk, dtype, batch=4):
    """Chunked prefill of `chunk` tokens after `prior` cached ones
    (`bench_paged_attention.prefill_case`): TFLOP/s of both kernels and of XLA dense
    attention on contiguous K/V, and each kernel's relative error against the dense
    result."""
    args, flops, (k_dense, v_dense), mask = prefill_case(prior, chunk, batch, dtype)
    q = args[0]
    xla = jax.jit(lambda q_, k_, v_: jax.nn.dot_product_attention(q_, k_, v_, mask=mask))
    kernels = {"gluon": jax.jit(lambda *a: paged_attention_gluon(*a, layer_offset=0)),
               "pallas": ours(*args)}
    want = xla(q, k_dense, v_dense)
    row = {"prior": prior, "chunk": chunk, "batch": batch, "kv": "fp8" if dtype == FP8
           else "bf16", "xla_dense_ms": time_call(xla, q, k_dense, v_dense) * 1e3}
    for name, fn in kernels.items():
        row[f"{name}_rel_err_vs_dense"] = rel_l2(fn(*args), want)
    for name, ms in time_alternating(kernels, *args).items():
        row[f"{name}_ms"] = ms
    for name in ("gluon", "pallas", "xla_dense"):
        row[f"{name}_TFLOPs"] = flops / (row[f"{name}_ms"] * 1e-3) / 1e12
    row["pallas_over_gluon"] = row["pallas_ms"] / row["gluon_ms"]
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ctx", type=int, nargs="*", default=[4096, 16384, 32768])
    parser.add_argument("--bf16-ctx", type=int, nargs="*", default=[4096, 32768])
    parser.add_argument("--prefill", type=int, nargs=2, action="append",
                        metavar=("PRIOR", "CHUNK"), help="default: 0 2048 and 4096 2048")
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--pages-in-order", action="store_true",
                        help="each row's pages one after another in the pool (default: "
                        "random order)")
    parser.add_argument("--block", type=int, default=8,
                        help="query tokens of verify and of the draft block (at most 16: "
                             "DFlash-b16's block); results go to gluon_attention_b<N>.json "
                             "unless 8")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not 1 < args.block <= FEW_Q_MAX:
        raise SystemExit(f"--block {args.block}: give 2 to {FEW_Q_MAX} query tokens")
    copy_bw = device_copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    rows = []
    for dtype, contexts in ((FP8, args.ctx), (jnp.bfloat16, args.bf16_ctx)):
        for ctx in contexts:
            rows.append(bench(ctx, dtype, copy_bw, args.pages_in_order, args.block))
            print(rows[-1], flush=True)
    prefill = []
    for prior, chunk in [] if args.no_prefill else args.prefill or [(0, 2048), (4096, 2048)]:
        for dtype in (jnp.bfloat16, FP8):
            prefill.append(bench_prefill(prior, chunk, dtype))
            print(prefill[-1], flush=True)
    name = "gluon_attention" if args.block == 8 else f"gluon_attention_b{args.block}"
    write_results(name, {"copy_bw_tb_s": copy_bw / 1e12, "block": args.block, "shape": dict(
        batch=64, q_heads=32, kv_heads=HKV, head_dim=D, page=16), "rows": rows,
        "prefill": prefill}, args.out)


if __name__ == "__main__":
    main()
