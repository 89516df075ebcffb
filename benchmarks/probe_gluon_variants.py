"""The Gluon kernel's constexpr variants (`launch(..., tuning=...)`) timed side by side, each
with its error against the reference on two rows (issue 3's shapes: batch 64, 32 / 8
heads, head dim 128, 16-key pages in random order; prefill at batch 4).

    PYTHONPATH=. python benchmarks/probe_gluon_variants.py [--ctx 16384 32768] [--out DIR]

Per KV dtype and context: decode, verify-8 and the draft block (8 queries) of every spec
variant, timed in turn (`timing.time_alternating`); each variant's verify-8 and draft
over its own decode. Then prefill (4096 cached + 2048 new tokens) per prefill variant.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from benchmarks.bench_gluon_attention import bench_prefill, draft_args, draft_rel_err
from benchmarks.bench_paged_attention import FP8, reference_rel_err, setup
from benchmarks.timing import time_alternating, write_results
from pallas_kernels.paged_attention_gluon import (draft_block_attention_gluon,
                                                  paged_attention_gluon)

# Fourteenth session (BENCHMARKS.md): none beat the then default over fp8; over bf16, 4
# warps ("w4") made the draft block faster (now its default), verify at 4K only. The
# fifteenth session's rows-along-warps default beat them all; the variants run on it.
SPEC_VARIANTS = {
    "base": {}, "q_smem": dict(Q_IN_SMEM=True), "w4": dict(NUM_WARPS=4),
    "bk32_s5": dict(PPB=2, STAGES=5), "w4_bk128_s2": dict(NUM_WARPS=4, PPB=8, STAGES=2),
    # 16-row query blocks (decode's): verify-8 and the draft block at GQA 4 take two
    # programs per (row, kv head), side by side so their reads meet in L2
    "r16": dict(ROWS=16), "r16_s2": dict(ROWS=16, STAGES=2), "s2": dict(STAGES=2),
    # 4 warps, 2 along the rows
    "w4m2": dict(NUM_WARPS=4, WARPS_M=2),
    # Fifteenth session. The default: warps along the rows (verify's 32 rows over 2
    # warps), masks at the edges only, row sums by dot. The fourteenth session's default
    # ("old": warps along the columns), and each change alone:
    "old": dict(WARPS_M=1, EDGE_MASKS=False, SUM_BY_MMA=False),
    "edge_only": dict(WARPS_M=1, SUM_BY_MMA=False),
    "cols_sum": dict(WARPS_M=1), "rows_no_sum": dict(SUM_BY_MMA=False),
    # bf16 decode has 99 KB of shared memory at 3 stages: 2 CTAs per SM, 512 programs in
    # two waves; 32-key blocks at 3 stages take 48 KB (4 per SM, one wave): no faster
    "bk32_s3": dict(PPB=2, STAGES=3), "bk32_s4": dict(PPB=2, STAGES=4),
}
# Prefill's default is 2 stages (it was 3: "s3"), masks on every block, summed rows
# ("edge_sum", the spec kernels' options, was 8% slower over fp8).
PREFILL_VARIANTS = {
    "base": {}, "edge_sum": dict(EDGE_MASKS=True, SUM_BY_MMA=True), "s3": dict(STAGES=3),
    "r128_w8": dict(ROWS=128, NUM_WARPS=8),
    "bk32_s4": dict(PPB=2, STAGES=4), "q_smem": dict(Q_IN_SMEM=True),
}


def spec_rows(ctx, dtype, variants):
    q, pool, table, kv_lens, _ = setup(ctx, dtype, max_q=8)
    batch = q.shape[0]
    row = {"ctx": ctx, "kv": "fp8" if dtype == FP8 else "bf16"}
    for name, tokens in (("decode", 1), ("verify8", 8), ("draft8", 8)):
        if name == "draft8":
            args, kernel, rel_err = (draft_args(q, pool, table, kv_lens),
                                     draft_block_attention_gluon, draft_rel_err)
        else:
            args = (q[:, :tokens], pool, table, kv_lens, jnp.full((batch,), tokens, jnp.int32))
            kernel, rel_err = paged_attention_gluon, reference_rel_err
        fns = {v: jax.jit(lambda *a, t=t: kernel(*a, layer_offset=0, tuning=t))
               for v, t in variants.items()}
        for v, fn in fns.items():
            try:
                row[f"{v}_{name}_rel_err"] = rel_err(fn(*args), *args)
            except Exception as e:  # a variant that does not compile is recorded
                row[f"{v}_{name}_error"] = f"{type(e).__name__}: {e!s:.300}"
        ok = {v: fn for v, fn in fns.items() if f"{v}_{name}_rel_err" in row}
        for v, ms in time_alternating(ok, *args).items():
            row[f"{v}_{name}_ms"] = ms
    for v in variants:
        for name in ("verify8", "draft8"):
            if f"{v}_{name}_ms" in row and f"{v}_decode_ms" in row:
                row[f"{v}_{name}_over_decode"] = row[f"{v}_{name}_ms"] / row[f"{v}_decode_ms"]
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ctx", type=int, nargs="*", default=[16384, 32768])
    parser.add_argument("--bf16-ctx", type=int, nargs="*", default=[4096, 32768])
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--variants", nargs="*", default=None,
                        help=f"spec variants to time (default: all of {list(SPEC_VARIANTS)})")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for dtype, contexts in ((FP8, args.ctx), (jnp.bfloat16, args.bf16_ctx)):
        for ctx in contexts:
            rows.append(spec_rows(ctx, dtype, {v: SPEC_VARIANTS[v]
                                               for v in args.variants or SPEC_VARIANTS}))
            print(json.dumps(rows[-1]), flush=True)
    prefill = []
    for dtype in () if args.no_prefill else (jnp.bfloat16, FP8):
        for v, t in PREFILL_VARIANTS.items():
            try:
                prefill.append({"variant": v, **bench_prefill(4096, 2048, dtype, tuning=t)})
            except Exception as e:
                prefill.append({"variant": v, "error": f"{type(e).__name__}: {e!s:.300}"})
            print(json.dumps(prefill[-1]), flush=True)
    write_results("gluon_variants", {"spec": rows, "prefill": prefill}, args.out)


if __name__ == "__main__":
    main()
