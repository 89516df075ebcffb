"""Paged decode/verify attention on the H200, each figure beside same-run baselines.

    PYTHONPATH=. python benchmarks/bench_paged_attention.py [--out DIR] [--quick]

The Pallas kernels. Decode: batch 64, 32 query / 8 kv heads, head dim 128, page 16,
contexts 4K and 16K (the largest pool their 32-bit offsets address at batch 64); KV bytes
read per second vs the device copy bandwidth; vs `jax.experimental.pallas.ops.gpu.
paged_attention` on the same K/V; vs cuDNN dense attention on the same K/V laid out
contiguously. fp8 vs bf16. Verify (8 queries per row) and the draft block vs decode (1
query). Chunked prefill vs XLA / cuDNN / jax's Mosaic GPU dense attention. Error norms vs
the reference.
"""

from __future__ import annotations

import argparse
import itertools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import device_copy_bandwidth, time_call, write_results
from pallas_kernels.kv_store import layer_kv
from pallas_kernels.launch_plan import LaunchOptions
from pallas_kernels.paged_attention import (draft_block_attention,
                                            draft_block_attention_reference, paged_attention,
                                            paged_attention_reference)
from pallas_kernels.testing import kv_scales, make_case, make_draft_case, rel_err

BATCH, HQ, HKV, D, PAGE = 64, 32, 8, 128, 16
# The long context the Pallas kernels take at batch 64: 16K keys make a pool of exactly
# 2^31 elements, their 32-bit offsets' limit (32K's 2^32 are refused). 32K:
# bench_gluon_attention.py.
LONG_CTX = 16384
FP8 = jnp.float8_e4m3fn


def make_pool(key, num_pages, dtype, num_layers=1, head_dim=D):
    x = jax.random.normal(key, (HKV, num_pages, num_layers, 2, PAGE, head_dim), jnp.bfloat16)
    return x.astype(dtype)


def setup(ctx, dtype, max_q=1, seed=0, num_q_heads=HQ, head_dim=D, batch=BATCH,
          pages_in_order=False):
    """Inputs for `batch` rows of `ctx` cached tokens: the rows' pages lie in the pool in
    random order (each row's pages one after another with `pages_in_order`)."""
    pages_per_seq = ctx // PAGE
    num_pages = batch * pages_per_seq
    key = jax.random.key(seed)
    pool = make_pool(key, num_pages, dtype, head_dim=head_dim)
    perm = (np.arange(num_pages, dtype=np.int32) if pages_in_order else
            np.random.default_rng(seed).permutation(num_pages).astype(np.int32))
    table = jnp.asarray(perm.reshape(batch, pages_per_seq) * 2)  # page * 2L, L = 1
    q = jax.random.normal(jax.random.fold_in(key, 1), (batch, max_q, num_q_heads, head_dim),
                          jnp.bfloat16)
    kv_lens = jnp.full((batch,), ctx, jnp.int32)
    q_lens = jnp.full((batch,), max_q, jnp.int32)
    return q, pool, table, kv_lens, q_lens


def dense_kv(k_pages, v_pages, pages):
    """K and V of `layer_kv` gathered by the rows' page ids [batch, pages per row]
    into contiguous [batch, seq, num_kv_heads, head_dim], as dense attention takes them."""
    num_kv_heads, _, _, head_dim = k_pages.shape
    return tuple(x[:, pages].transpose(1, 2, 3, 0, 4).reshape(pages.shape[0], -1, num_kv_heads,
                                                               head_dim)
                 for x in (k_pages, v_pages))


def kv_bytes(ctx, dtype):
    return BATCH * ctx * HKV * D * 2 * jnp.dtype(dtype).itemsize


def ours(q, pool, table, kv_lens, q_lens, kernel=paged_attention, **options):
    """The kernel jitted for these inputs, with `options` (LaunchOptions fields)."""
    interpret = jax.default_backend() == "cpu"  # lets the script be smoke-tested on CPU
    return jax.jit(lambda *a: kernel(*a, layer_offset=0, interpret=interpret,
                                     options=LaunchOptions(**options)))


def sweep_configs(args, configs, label, rate=None, iters=50):
    """Time the kernel on `args` for each config (kwargs dicts). Returns
    (best config, its seconds, [config + ms] for every config that compiled),
    dtypes by name; `rate(seconds)` adds a throughput to each printed line; a
    config Triton cannot compile is reported and skipped."""
    best, sweep = None, []
    for cfg in configs:
        try:
            t = time_call(ours(*args, **cfg), *args, iters=iters)
        except Exception as e:
            print(f"  {label} {cfg} failed: {e!s:.200}")
            continue
        named = {k: (jnp.dtype(v).name if isinstance(v, type) else v) for k, v in cfg.items()}
        print(f"  {label} {named}: {t*1e3:.3f} ms{' ' + rate(t) if rate else ''}", flush=True)
        sweep.append({**named, "ms": t * 1e3})
        if best is None or t < best[0]:
            best = (t, named)
    return best[1], best[0], sweep


def bench_decode(ctx, copy_bw, configs):
    args = setup(ctx, jnp.bfloat16)
    q, pool, table, kv_lens, q_lens = args
    row = {"ctx": ctx, "kv_bytes": kv_bytes(ctx, jnp.bfloat16)}
    cfg, t, row["sweep"] = sweep_configs(args, [
        dict(pages_per_block=ppb, num_warps=warps, num_stages=stages, num_splits=splits)
        for ppb, warps, stages, splits in configs],
        f"ctx={ctx}", lambda t: f"{row['kv_bytes'] / t / 1e12:.2f} TB/s")
    row.update(ours_ms=t * 1e3, ours_cfg=cfg, ours_TBps=row["kv_bytes"] / t / 1e12,
               frac_of_copy_bw=row["kv_bytes"] / t / copy_bw)
    for name, value in decode_baselines(q, pool, table, kv_lens).items():
        row[name] = value
        if name.endswith("_ms"):  # speedup_vs_jax_op, speedup_vs_cudnn_dense, ...
            row[f"speedup_vs_{name[:-3]}"] = value * 1e-3 / t
    return row


def rel_l2(got, want) -> float:
    """||got - want|| / ||want||, in f32."""
    want = want.astype(jnp.float32)
    return float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))


def reference_rel_err(out, q, pool, table, kv_lens, q_lens):
    """Relative error of rows 0 and 1 of an attention output [batch, max_q, heads, D]
    against the f32 reference (layer 0): the whole reference at 32K would not fit."""
    return rel_l2(out[:2], paged_attention_reference(q[:2], pool, table[:2], kv_lens[:2],
                                                     q_lens[:2], layer_offset=0))


def jax_op_decode(q, k_pages, v_pages, table, kv_lens, *, interpret=False):
    """jax's Pallas paged attention op (`jax.experimental.pallas.ops.gpu`) as a decode
    baseline over layer 0 of a `setup` pool, its K and V key-major (`layer_kv(pool, 0)`):
    (jitted fn, its args), for each row's first query token. The op applies no softmax
    scale (its callers fold 1 / sqrt(head_dim) into q), so q is scaled here, outside the
    timed call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_op
    q_scaled = (q[:, 0].astype(jnp.float32) / math.sqrt(q.shape[-1])).astype(q.dtype)
    fn = jax.jit(lambda *a: jax_op.paged_attention(*a, interpret=interpret))
    return fn, (q_scaled, k_pages, v_pages, table // 2, kv_lens)


def decode_baselines(q, pool, table, kv_lens):
    """bf16 decode baselines on the same data (each row's first query token), ms (or
    *_error): jax's Pallas paged attention (`jax_op_ms`, `jax_op_decode`) with its
    relative error against the reference on rows 0 and 1 (`jax_op_rel_err`), and cuDNN
    and XLA dense attention on the same K/V laid out contiguously (`cudnn_dense_ms`,
    `xla_dense_ms`)."""
    row = {}
    q1 = q[:, :1]  # decode: one query token per row, whatever q's caller set up
    k_pages, v_pages = layer_kv(pool, 0)  # one copy of the layer for every baseline
    try:
        fn, args = jax_op_decode(q1, k_pages, v_pages, table, kv_lens)
        row["jax_op_ms"] = time_call(fn, *args) * 1e3
        row["jax_op_rel_err"] = reference_rel_err(fn(*args)[:, None], q1, pool, table,
                                                  kv_lens, jnp.ones_like(kv_lens))
    except Exception as e:
        row["jax_op_error"] = f"{e!s:.300}"
    fn = args = None  # drop the op's references to the layer before the dense copy
    # cuDNN dense attention on contiguous K/V: [B, T, Hkv, D].
    k_dense, v_dense = dense_kv(k_pages, v_pages, table // 2)
    del k_pages, v_pages
    for impl in ("cudnn", "xla"):
        try:
            dfn = jax.jit(lambda q1, k, v, impl=impl: jax.nn.dot_product_attention(
                q1, k, v, implementation=impl))
            row[f"{impl}_dense_ms"] = time_call(dfn, q1, k_dense, v_dense) * 1e3
        except Exception as e:
            row[f"{impl}_dense_error"] = f"{e!s:.300}"
    return row


def bench_fp8_and_verify(ctx, cfg):
    out = {"ctx": ctx}
    for dtype, name in ((jnp.bfloat16, "bf16"), (jnp.float8_e4m3fn, "fp8")):
        for max_q in (1, 8):
            args = setup(ctx, dtype, max_q=max_q)
            out[f"{name}_q{max_q}_ms"] = time_call(ours(*args, **cfg), *args) * 1e3
            if dtype == jnp.float8_e4m3fn:  # how far from fp8's best config per query count
                # pages per block (fp8 pages are half the bytes), warps, and the
                # dots' dtype (f16, the default over fp8, vs bf16)
                best, _, out[f"fp8_q{max_q}_sweep"] = sweep_configs(args, [
                    {**cfg, "pages_per_block": p, "num_warps": w, "compute_dtype": c}
                    for p in (4, 8) for w in (2, 4) for c in (None, jnp.bfloat16)],
                    f"fp8 q{max_q} ctx={ctx}")
                out[f"fp8_q{max_q}_best_cfg"] = best
            del args
    out["fp8_speedup"] = out["bf16_q1_ms"] / out["fp8_q1_ms"]
    out["verify8_over_decode_bf16"] = out["bf16_q8_ms"] / out["bf16_q1_ms"]
    out["verify8_over_decode_fp8"] = out["fp8_q8_ms"] / out["fp8_q1_ms"]
    return out


def bench_draft_block(ctx, cfg, block=8):
    """Draft block (8 queries + the block's own K/V) vs 1-query decode, same context."""
    q1, pool, table, kv_lens, _ = setup(ctx, jnp.bfloat16)
    key = jax.random.key(3)
    qb = jax.random.normal(key, (BATCH, block, HQ, D), jnp.bfloat16)
    bk = jax.random.normal(jax.random.fold_in(key, 1), (BATCH, block, HKV, D), jnp.bfloat16)
    bv = jax.random.normal(jax.random.fold_in(key, 2), (BATCH, block, HKV, D), jnp.bfloat16)
    blens = jnp.full((BATCH,), block, jnp.int32)
    interpret = jax.default_backend() == "cpu"
    draft = jax.jit(lambda *a: draft_block_attention(*a, layer_offset=0, interpret=interpret,
                                                     options=LaunchOptions(**cfg)))
    t_draft = time_call(draft, qb, pool, table, kv_lens, blens, bk, bv)
    t_decode = time_call(ours(q1, pool, table, kv_lens, None, **cfg), q1, pool, table, kv_lens,
                         jnp.ones((BATCH,), jnp.int32))
    return {"ctx": ctx, "block": block, "draft_ms": t_draft * 1e3, "decode_ms": t_decode * 1e3,
            "draft_over_decode": t_draft / t_decode}


def prefill_case(prior, chunk, batch, dtype):
    """A chunked prefill of `chunk` tokens after `prior` cached ones per row (pages in
    random order): (q, pool, table, kv_lens, q_lens), its FLOPs (4 * heads * head_dim per
    visible (query, key) pair), and the same K / V laid out contiguously in bf16 with the
    causal mask, for dense attention."""
    total = prior + chunk
    pages = total // PAGE
    key = jax.random.key(5)
    pool = make_pool(key, batch * pages, dtype)
    table = jnp.asarray(np.random.default_rng(1).permutation(batch * pages).astype(np.int32)
                        ).reshape(batch, pages) * 2
    q = jax.random.normal(jax.random.fold_in(key, 1), (batch, chunk, HQ, D), jnp.bfloat16)
    args = (q, pool, table, jnp.full((batch,), total, jnp.int32),
            jnp.full((batch,), chunk, jnp.int32))
    flops = 4 * batch * HQ * D * (chunk * prior + chunk * (chunk + 1) // 2)
    dense = tuple(x.astype(jnp.bfloat16) for x in dense_kv(*layer_kv(pool, 0), table // 2))
    mask = (jnp.arange(total)[None, :] <= prior + jnp.arange(chunk)[:, None])[None, None]
    return args, flops, dense, mask


def bench_prefill(prior, chunk=2048, batch=4, dtype=jnp.bfloat16):
    """Chunked prefill TFLOP/s vs XLA dense attention on contiguous K/V (same
    values, in bf16)."""
    (q, pool, table, kv_lens, q_lens), flops, (kd, vd), mask = prefill_case(
        prior, chunk, batch, dtype)
    row = {"prior": prior, "chunk": chunk, "batch": batch, "flops": flops,
           "kv_dtype": jnp.dtype(dtype).name}
    # (rows per block, pages per block, warps), 2 pipeline stages
    cfg, t, row["sweep"] = sweep_configs(
        (q, pool, table, kv_lens, q_lens),
        [dict(rows_per_block=r, pages_per_block=p, num_warps=w, num_stages=2)
         for r, p, w in ((64, 4, 4), (128, 4, 4), (128, 8, 8))],
        f"prefill prior={prior} {jnp.dtype(dtype).name}",
        lambda t: f"{flops / t / 1e12:.1f} TFLOP/s", iters=10)
    row.update(ours_ms=t * 1e3, ours_cfg=cfg, ours_TFLOPs=flops / t / 1e12)
    for impl in ("xla", "cudnn"):
        try:
            dfn = jax.jit(lambda q_, k_, v_, impl=impl: jax.nn.dot_product_attention(
                q_, k_, v_, mask=mask, implementation=impl))
            td = time_call(dfn, q, kd, vd, iters=10)
            row.update({f"{impl}_dense_ms": td * 1e3, f"{impl}_dense_TFLOPs": flops / td / 1e12,
                        f"speedup_vs_{impl}_dense": td / t})
        except Exception as e:
            row[f"{impl}_dense_error"] = f"{e!s:.300}"
    if prior == 0:  # square causal: what jax's Mosaic GPU (wgmma) flash attention reaches
        row.update(mosaic_gpu_dense(q, kd, vd, flops, t))
    return row


def mosaic_gpu_dense(q, k, v, flops, ours_seconds):
    """jax.experimental.pallas.ops.gpu.attention_mgpu, causal, on contiguous K/V
    (q and keys start together): the lowering the kernels would move to. Best
    of its key block sizes; errors (no Hopper GPU, shapes it rejects) are
    recorded, not raised."""
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu
    except Exception as e:  # the module needs the CUDA plugin's Mosaic GPU
        return {"mosaic_gpu_dense_error": f"{e!s:.300}"}
    # jax 0.11.2's forward allocates its shared-memory tiles as f16 whatever
    # the inputs (bf16 failed on the H200: "src had type bfloat16 and dst had
    # type float16"); f16 runs the same wgmma at the same rate.
    q, k, v = (x.astype(jnp.float16) for x in (q, k, v))
    best, errors = None, []
    for block_kv in (128, 64):
        config = attention_mgpu.TuningConfig(block_q=64, block_kv=block_kv,
                                             max_concurrent_steps=2, causal=True)
        try:
            t = time_call(jax.jit(lambda q_, k_, v_, c=config: attention_mgpu.attention(
                q_, k_, v_, c)), q, k, v, iters=10)
        except Exception as e:
            errors.append(f"block_kv={block_kv}: {type(e).__name__}: {e!s:.200}")
            continue
        if best is None or t < best[0]:
            best = (t, block_kv)
    if best is None:
        return {"mosaic_gpu_dense_error": "; ".join(errors)}
    t, block_kv = best
    return {"mosaic_gpu_dense_ms": t * 1e3, "mosaic_gpu_dense_TFLOPs": flops / t / 1e12,
            "mosaic_gpu_block_kv": block_kv, "speedup_vs_mosaic_gpu_dense": t / ours_seconds}


def error_norms():
    """Relative L2 error vs the f32 reference, compiled on the device: decode (max_q 1),
    verify (8), a prefill chunk (256) and the draft block (8, `draft`)."""
    rng = np.random.default_rng(0)
    interpret = jax.default_backend() == "cpu"
    rows = []
    for dtype, window, cap, max_q in itertools.product(
            (jnp.bfloat16, jnp.float8_e4m3fn), (None, 256), (None, 30.0),
            (1, 8, 256, "draft")):
        if max_q == "draft":
            args, kw = make_draft_case(rng, ctx=rng.integers(1, 3000, 7), num_q_heads=32,
                                       num_kv_heads=8, head_dim=128, page_size=16,
                                       kv_dtype=dtype, window=window)
            kw["soft_cap"] = cap
            out = draft_block_attention(*args, interpret=interpret, **kw)
            ref = draft_block_attention_reference(*args, **kw)
        else:
            args = make_case(rng, batch=8, max_q=max_q, num_q_heads=32, num_kv_heads=8,
                             head_dim=128, page_size=16, kv_dtype=dtype, window=window,
                             kv_lens=rng.integers(max_q, 3000, 8))
            kw = dict(layer_offset=1, sliding_window=window, soft_cap=cap,
                      **kv_scales(args[1]))
            out = paged_attention(*args, interpret=interpret, **kw)
            ref = paged_attention_reference(*args, **kw)
        rows.append({"dtype": jnp.dtype(dtype).name, "window": window, "soft_cap": cap,
                     "max_q": max_q, "rel_err": float(rel_err(out, ref))})
        print(rows[-1], flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="one config, fewer cases")
    parser.add_argument("--prefill-only", action="store_true",
                        help="only chunked prefill, over bf16 and fp8 pools")
    parser.add_argument("--decode-configs", nargs="+", default=None,
                        metavar="PPB,WARPS,STAGES,SPLITS",
                        help="decode configs to sweep (SPLITS 0 = automatic), e.g. 4,2,3,2")
    parser.add_argument("--decode-only", type=int, nargs="+", default=None, metavar="CTX",
                        help="only bf16 decode and its baselines, at these contexts: the "
                             "gap to cuDNN that stays fixed across contexts is per-call cost")
    parser.add_argument("--draft-and-errors", action="store_true",
                        help="only the draft block's timing and every kernel's error norms")
    args = parser.parse_args()
    if args.draft_and_errors:
        draft = [bench_draft_block(ctx, {}) for ctx in (4096, LONG_CTX)]
        print(draft, flush=True)
        print("wrote", write_results("paged_attention_draft_errors", {
            "draft_block": draft, "error_norms": error_norms()}, args.out))
        return
    if args.prefill_only:
        rows = [bench_prefill(prior, dtype=dtype) for dtype in (jnp.bfloat16, FP8)
                for prior in (0, 8192)]
        for r in rows:
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
        print("wrote", write_results("paged_attention_prefill", {"prefill": rows}, args.out))
        return
    copy_bw = device_copy_bandwidth()
    print(f"device copy bandwidth (read + write): {copy_bw/1e12:.2f} TB/s", flush=True)
    configs = ([(4, 2, 3, None)] if args.quick else
               [(p, w, st, None) for p in (2, 4, 8) for w in (2, 4) for st in (3, 4)]
               + [(4, 2, 4, 2)])             # two key splits
    if args.decode_configs:
        configs = []
        for c in args.decode_configs:
            ppb, w, st, sp = (int(x) for x in c.split(","))
            configs.append((ppb, w, st, sp or None))
    decode = []
    for ctx in args.decode_only or (4096, LONG_CTX):
        row = bench_decode(ctx, copy_bw, configs)
        decode.append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()},
              flush=True)
    if args.decode_only:
        print("wrote", write_results("paged_attention_decode", {
            "copy_bandwidth_Bps": copy_bw, "decode": decode}, args.out))
        return
    fp8_verify = [bench_fp8_and_verify(ctx, {}) for ctx in (4096, LONG_CTX)]  # kernel defaults
    for r in fp8_verify:
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    draft = [bench_draft_block(ctx, {}) for ctx in (4096, LONG_CTX)]
    for r in draft:
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    prefill = [bench_prefill(prior) for prior in (0, 8192)]
    for r in prefill:
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    errors = error_norms()
    print("wrote", write_results("paged_attention", {
        "copy_bandwidth_Bps": copy_bw, "decode": decode, "fp8_and_verify": fp8_verify,
        "draft_block": draft, "prefill": prefill,
        "error_norms": errors, "shape": dict(batch=BATCH, num_q_heads=HQ, num_kv_heads=HKV,
                                             head_dim=D, page_size=PAGE)}, args.out))


if __name__ == "__main__":
    main()
