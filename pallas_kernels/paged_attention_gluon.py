"""Paged attention in Gluon (Triton's layout-explicit language), for the GPU: decode,
verify, chunked prefill and the DFlash draft block.

The same contracts as `paged_attention.paged_attention` (decode, verify, prefill) and
`paged_attention.draft_block_attention`, whose pure-jnp references are this kernel's
references too: query i of row b sits at kv_lens[b] - q_lens[b] + i (at ctx_len + i in a
draft block), sees the cached keys at positions <= its own (and > position -
sliding_window), GQA, fp8 e4m3 or bf16 KV with per-layer scales, soft cap, ragged rows;
padding rows (q_len 0) and query tokens past q_len give zeros. A draft block also sees the
block's own K / V (not in the cache), bidirectionally or causally. One program: one (query
block, row, kv head); up to 32 query rows (tokens x q heads of the kv head) over 2 warps
for decode, verify and the draft block (64 over 4 when they have more: a block of 16
tokens), 64 rows over 4 warps for prefill. Warps take 16 rows each (the rest of them the
dots' columns: decode's 16 rows over 2 warps), so a verify's warps exchange nothing per
key block.

Why a second kernel: Pallas Triton picks the dots' register layouts itself, and over fp8
KV it reloads q from shared memory every key block and rebuilds the mma.sync fragments
with register moves; here q is loaded once, scaled, into the A-operand layout and held in
registers (docs/decisions.md). K is copied with cp.async into a swizzled [BK, D] tile;
each V^T page lands whole and unswizzled ([PPB * D, PAGE]), as it lies in the pool, so
the copies reach L2 a line at a time. Offsets into the pool are 64-bit, so pools past
2^31 elements (which Pallas Triton's 32-bit offsets refuse) work.

Blocks are PPB pages on a grid aligned to page 0, and a row's 1-query decode and its
K+1-query verify run the same per-row arithmetic (rows are independent in the dots and
the softmax; the row sums come from a dot, so they add in the same order whichever way
the warps are laid out), so greedy speculative decoding reproduces plain decoding bit for
bit (tested compiled). Few-query calls at small batch split keys in fixed-size pieces
(`launch_plan.small_batch_split_keys`), combined by `combine_splits` as the Pallas
kernel's are; at larger batches one program reads all of a (row, kv head)'s keys. What
it does per key block: `gluon_key_block.py`. GPU only (`gluon_call`); on CPU the Pallas
kernel runs in interpret mode.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from pallas_kernels.gluon_call import gluon_call
from pallas_kernels.gluon_key_block import (LOG2E, MASK_, cap_logits, copy_block, cta_barrier,
                                            mask_logits, pv_step, softmax_step)
from pallas_kernels.launch_plan import (FEW_Q_MAX, MIN_ROWS, plan_launch,
                                        small_batch_split_keys)
from pallas_kernels.paged_attention_kernel import combine_splits
from pallas_kernels.pool_layout import pow2_at_least, static_validate_inputs

GLUON_POOL_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.bfloat16))  # pools it reads
BLOCK_KEYS, STAGES, NUM_WARPS = 64, 3, 2  # keys per block: pages_per_block = 64 / page
# A few-query call of more rows than 2 warps hold (verify-16, the draft block of 16: 16
# tokens x 4 q heads per kv head) takes one program of up to this many rows, 16 per warp
# along the rows, so each key block is read once for all of them; per-warp work is
# verify-8's, and a row's arithmetic is decode's (rows are independent; sums by dot).
FEW_Q_WIDE_ROWS = 64
# Prefill: 16 query rows per warp, 2 stages (faster than 3 on the H200: docs/decisions.md).
PREFILL_ROWS, PREFILL_WARPS, PREFILL_STAGES = 64, 4, 2
# The draft block over bf16 KV: 4 warps along the dots' columns (faster on the H200 over
# bf16, slower over fp8).
DRAFT_BF16_WARPS = 4


@gluon.jit
def paged_attention_kernel(
        q_ptr, pool_ptr, table_ptr, kv_lens_ptr, q_lens_ptr, block_k_ptr, block_v_ptr,
        layer_ptr, table_width, head_pages, window, logit_scale, cap_log2e, v_scale,
        block_k_scale, block_v_scale, q_rows, num_splits, o_ptr, stats_ptr,
        MAX_Q: gl.constexpr, HQ: gl.constexpr, GQA: gl.constexpr, D: gl.constexpr,
        PAGE: gl.constexpr, PPB: gl.constexpr, ROWS: gl.constexpr, TOKENS: gl.constexpr,
        STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, WARPS_M: gl.constexpr,
        KV_FP8: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_CAP: gl.constexpr,
        QUERIES_CACHED: gl.constexpr, BLOCK_KEYS_PAD: gl.constexpr,
        BLOCK_CAUSAL: gl.constexpr, EDGE_MASKS: gl.constexpr, SUM_BY_MMA: gl.constexpr,
        SPLIT_BLOCKS: gl.constexpr):
    """Program (query block x num_splits + split, row b, kv head h). q and o [batch,
    MAX_Q, HQ, D] in q's layout; the pool [kv heads, head_pages, PAGE * D] (head_pages =
    pages x layers x 2, K then V^T per page and layer); table i32[batch, table_width] of
    page * 2L (BAD = -1); layer_ptr i32[1] the layer's offset in the pool; window 0 unless HAS_WINDOW; q x
    logit_scale gives base-2 logits (divided by the soft cap when HAS_CAP: then tanh(s) x
    cap_log2e).
    QUERIES_CACHED: query i sits at kv_len - q_len + i (decode, verify, prefill), else at
    kv_len + i (the draft block: kv_len is the context length). BLOCK_KEYS_PAD > 0: the
    draft block's own keys, block K and V [batch, MAX_Q, kv heads, D] as the caller has
    them (read padded to BLOCK_KEYS_PAD keys, times block_k_scale = 1 / k_scale and
    block_v_scale = 1 / v_scale, in the dots' dtype), key j at kv_len + j, the first q_len
    of them live (all of them, or j <= i with BLOCK_CAUSAL).
    The dots' warps: WARPS_M along the rows, NUM_WARPS / WARPS_M along their columns.
    q (scaled) is loaded once into the dots' operand layout and held in registers.
    EDGE_MASKS: only key blocks at the causal and window
    edges are masked (the others are visible to every valid row: the same arithmetic).
    SUM_BY_MMA: p's row sums come from a dot (p @ ones), whose order of additions is the
    tensor cores', not the warps' layout's: with it a [1, 2] decode and a [2, 1] verify
    agree bit for bit.
    SPLIT_BLOCKS > 0: split s reads key blocks [s x SPLIT_BLOCKS, (s + 1) x SPLIT_BLOCKS)
    (split 0 also the draft block's own keys) and writes its normalized f32 result to
    o [num_splits, batch, MAX_Q, HQ, D] and its softmax max and sum (base 2) to
    stats [num_splits, batch, MAX_Q, HQ, 2] for `combine_splits`; else o is the result
    in q's dtype and stats is unused."""
    KW: gl.constexpr = 4 if KV_FP8 else 2
    CDT: gl.constexpr = gl.float16 if KV_FP8 else gl.bfloat16
    KV_DT: gl.constexpr = gl.float8e4nv if KV_FP8 else gl.bfloat16
    VEC: gl.constexpr = 16 if KV_FP8 else 8                 # elements per 16-byte copy
    K_LANES: gl.constexpr = D // VEC if D // VEC < 32 else 32  # lanes along a K row
    V_VEC: gl.constexpr = VEC if VEC < PAGE else PAGE
    V_LANES: gl.constexpr = PAGE // V_VEC
    ROW_BYTES: gl.constexpr = D * (1 if KV_FP8 else 2)
    BK: gl.constexpr = PPB * PAGE
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[WARPS_M, NUM_WARPS // WARPS_M], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)
    k_ld: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // K_LANES, K_LANES], [NUM_WARPS, 1],
                                          [1, 0])
    v_ld: gl.constexpr = gl.BlockedLayout([1, 1, V_VEC], [1, 32 // V_LANES, V_LANES],
                                          [1, NUM_WARPS, 1], [2, 1, 0])
    k_sl: gl.constexpr = gl.SwizzledSharedLayout(
        vec=VEC, per_phase=128 // ROW_BYTES if ROW_BYTES < 128 else 1,
        max_phase=ROW_BYTES // 16 if ROW_BYTES < 128 else 8, order=[1, 0])
    # V^T pages unswizzled: each page's [D, PAGE] tile lands contiguous, as in the pool.
    v_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    k_smem = gl.allocate_shared_memory(KV_DT, [STAGES, BK, D], k_sl)
    v_smem = gl.allocate_shared_memory(KV_DT, [STAGES, PPB * D, PAGE], v_sl)

    program, b, h = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    q_block, split = program // num_splits, program % num_splits
    kv_len = gl.load(kv_lens_ptr + b)
    q_len = gl.load(q_lens_ptr + b)
    layer_pages = 2 * gl.load(layer_ptr)   # kernel page = table entry + 2 x layer offset
    q_start = kv_len - q_len if QUERIES_CACHED else kv_len
    table_row = table_ptr + b * table_width
    head_pool = pool_ptr + h.to(gl.int64) * head_pages * (PAGE * D)  # 64-bit base

    # q rows: (token, q head of this kv head), loaded once, scaled, held in registers.
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, a_layout))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, a_layout))
    tok = q_block * TOKENS + r // GQA
    # q_rows = TOKENS x GQA, a run-time value: folded to zeros, decode's padding rows' q
    # fragments would share one zero register and ptxas would rebuild each dot's operand
    # with register moves (no faster on the H200 either way).
    if TOKENS * GQA < ROWS:
        in_q = (r < q_rows) & (tok < MAX_Q)
    else:
        in_q = tok < MAX_Q
    q_row = (b * MAX_Q + tok) * HQ + h * GQA + r % GQA
    q = gl.load(q_ptr + q_row[:, None] * D + c[None, :], mask=in_q[:, None], other=0.0)
    q = (q.to(gl.float32) * logit_scale).to(CDT)

    # The keys this block's queries can see: blocks [lo_block, hi_block).
    first_tok = q_block * TOKENS
    last_tok = gl.minimum(q_len, first_tok + TOKENS) - 1
    key_end = gl.minimum(kv_len, q_start + last_tok + 1)
    lo_block = 0
    if HAS_WINDOW:  # the block holding the earliest query's window start
        lo_block = gl.maximum(q_start + first_tok - window + 1, 0) // BK
    hi_block = gl.cdiv(gl.cdiv(key_end, PAGE), PPB)
    if SPLIT_BLOCKS > 0:  # this split's blocks only; blocks stay aligned to page 0
        lo_block = gl.maximum(lo_block, split * SPLIT_BLOCKS)
        hi_block = gl.minimum(hi_block, (split + 1) * SPLIT_BLOCKS)
    num_blocks = gl.maximum(hi_block - lo_block, 0) * (last_tok >= first_tok).to(gl.int32)

    kj = gl.arange(0, BK, layout=gl.SliceLayout(1, k_ld))
    kd = gl.max_contiguous(gl.multiple_of(gl.arange(0, D, layout=gl.SliceLayout(0, k_ld)),
                                          VEC), VEC)
    vpage = gl.arange(0, PPB, layout=gl.SliceLayout(1, gl.SliceLayout(2, v_ld)))
    vd = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, v_ld)))
    vj = gl.arange(0, PAGE, layout=gl.SliceLayout(0, gl.SliceLayout(1, v_ld)))
    for stage in gl.static_range(STAGES - 1):  # the pipeline's first blocks
        copy_block(k_smem.index(stage), v_smem.index(stage), head_pool, table_row,
                    lo_block + stage, hi_block, table_width, layer_pages, kj, kd, vpage, vd,
                    vj, PAGE, PPB, D)

    rows_m = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    tok_m = q_block * TOKENS + rows_m // GQA
    q_pos = q_start + tok_m
    valid = (rows_m < TOKENS * GQA) & (tok_m < q_len)
    upper = gl.where(valid, gl.minimum(q_pos, key_end - 1), -1)  # last key each row sees
    # Every valid row sees keys window_edge < k <= all_see_upto (the first and last
    # valid queries bound them).
    all_see_upto = gl.minimum(q_start + first_tok, key_end - 1)
    window_edge = q_start + last_tok - window
    keys_m = gl.arange(0, BK, layout=gl.SliceLayout(0, mma))
    acc = gl.zeros([ROWS, D], gl.float32, layout=mma)
    m_i = gl.full([ROWS], MASK_, gl.float32, layout=gl.SliceLayout(1, mma))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, mma))
    # SUM_BY_MMA: row sums of p as one more dot (p @ ones, every column the sum), so they
    # add in the tensor cores' order whatever the warps' layout.
    SUM_COLS: gl.constexpr = 8 * (NUM_WARPS // WARPS_M)
    l_acc = gl.zeros([ROWS, SUM_COLS], gl.float32, layout=mma)
    for i in range(num_blocks):
        # Block i is in once its copy group is; past the barrier every warp is done with
        # block i - 1, whose slot then takes block i + STAGES - 1.
        async_copy.wait_group(STAGES - 2)
        cta_barrier()
        nxt = i + STAGES - 1
        copy_block(k_smem.index(nxt % STAGES), v_smem.index(nxt % STAGES), head_pool,
                    table_row, lo_block + nxt, hi_block, table_width, layer_pages, kj, kd,
                    vpage, vd, vj, PAGE, PPB, D)
        slot = i % STAGES
        k_t = k_smem.index(slot).permute((1, 0)).load(b_layout)
        logits = cap_logits(mma_v2(q, k_t.to(CDT), gl.zeros([ROWS, BK], gl.float32,
                                                        layout=mma)), cap_log2e, HAS_CAP)
        k_lo = (lo_block + i) * BK
        if EDGE_MASKS:  # only blocks some valid row does not see whole take the mask
            masked = k_lo + BK - 1 > all_see_upto
            if HAS_WINDOW:
                masked = masked | (k_lo <= window_edge)
            if masked:
                logits = mask_logits(logits, k_lo + keys_m, upper, q_pos, window, HAS_WINDOW)
        else:
            logits = mask_logits(logits, k_lo + keys_m, upper, q_pos, window, HAS_WINDOW)
        p, corr, m_new, l_i = softmax_step(logits, m_i, l_i, SUM_BY_MMA)
        v_pages = v_smem.index(slot).reshape([PPB, D, PAGE]).permute((0, 2, 1))
        v = v_pages.reshape([BK, D]).load(b_layout)
        acc, l_acc = pv_step(p, v, corr, acc, l_acc, CDT, a_layout, b_layout, SUM_COLS,
                              SUM_BY_MMA)
        m_i = m_new
    async_copy.wait_group(0)  # no copy outlives the program
    if BLOCK_KEYS_PAD > 0:  # the draft block's own keys, straight into the dots' operands
        # Key j of row b, kv head h: element d at ((b * MAX_Q + j) * kv heads + h) * D + d.
        bj = gl.arange(0, BLOCK_KEYS_PAD, layout=gl.SliceLayout(0, b_layout))
        bd = gl.arange(0, D, layout=gl.SliceLayout(1, b_layout))
        block_k_t = gl.load(block_k_ptr + ((b * MAX_Q + bj[None, :]) * (HQ // GQA) + h) * D
                            + bd[:, None], mask=bj[None, :] < MAX_Q, other=0.0)  # [D, keys]
        block_k_t = (block_k_t.to(gl.float32) * block_k_scale).to(CDT)
        logits = mma_v2(q, block_k_t, gl.zeros([ROWS, BLOCK_KEYS_PAD], gl.float32,
                                               layout=mma))
        j = gl.arange(0, BLOCK_KEYS_PAD, layout=gl.SliceLayout(0, mma))
        visible = valid[:, None] & (j[None, :] < q_len) & (split == 0)
        if BLOCK_CAUSAL:
            visible = visible & (j[None, :] <= tok_m[:, None])
        if HAS_WINDOW:
            visible = visible & (j[None, :] > (tok_m - window)[:, None])
        logits = gl.where(visible, cap_logits(logits, cap_log2e, HAS_CAP), MASK_)
        p, corr, m_i, l_i = softmax_step(logits, m_i, l_i, SUM_BY_MMA)
        vj = gl.arange(0, BLOCK_KEYS_PAD, layout=gl.SliceLayout(1, b_layout))
        vd = gl.arange(0, D, layout=gl.SliceLayout(0, b_layout))
        block_v = gl.load(block_v_ptr + ((b * MAX_Q + vj[:, None]) * (HQ // GQA) + h) * D
                          + vd[None, :], mask=vj[:, None] < MAX_Q, other=0.0)   # [keys, D]
        block_v = (block_v.to(gl.float32) * block_v_scale).to(CDT)
        acc, l_acc = pv_step(p, block_v, corr, acc, l_acc, CDT, a_layout, b_layout,
                              SUM_COLS, SUM_BY_MMA)

    # Rows that saw no key have l == 0, rows past q_len (and padding rows) no meaning
    # (EDGE_MASKS leaves them unmasked): zeros.
    if SUM_BY_MMA:
        l_i = gl.max(l_acc, axis=1)
    has_keys = l_i > 0
    if EDGE_MASKS:
        has_keys = has_keys & valid
    out = gl.where(has_keys[:, None],
                   acc * (v_scale / gl.where(has_keys, l_i, 1.0))[:, None], 0.0)
    in_q_m = (rows_m < TOKENS * GQA) & (tok_m < MAX_Q)
    o_row = (b * MAX_Q + tok_m) * HQ + h * GQA + rows_m % GQA
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, mma))
    if SPLIT_BLOCKS > 0:  # this split's part, and its max and sum for the combine
        o_row = o_row + split.to(gl.int64) * gl.num_programs(1) * (MAX_Q * HQ)
        gl.store(stats_ptr + o_row * 2, gl.where(has_keys, m_i, MASK_), mask=in_q_m)
        gl.store(stats_ptr + o_row * 2 + 1, gl.where(has_keys, l_i, 0.0), mask=in_q_m)
    gl.store(o_ptr + o_row[:, None] * D + cols[None, :], out.to(o_ptr.dtype.element_ty),
             mask=in_q_m[:, None])


def supports(q, pool, *, draft_block: bool = False) -> str | None:
    """None if the Gluon kernel takes this call, else why not
    (`pallas_kernels.attention.select_backend` asks)."""
    if jnp.dtype(pool.dtype) not in GLUON_POOL_DTYPES:
        return f"pool dtype {pool.dtype} (the Gluon kernel reads fp8 e4m3 or bf16 KV)"
    if draft_block and q.shape[1] > FEW_Q_MAX:
        return f"a draft block of {q.shape[1]} queries (at most {FEW_Q_MAX})"
    head_dim, page_size = pool.shape[-1], pool.shape[-2]
    if head_dim not in (32, 64, 128) or page_size not in (8, 16, 32, 64):
        return f"head_dim {head_dim} / page_size {page_size} (32-128 / 8-64)"
    return None


def launch(q, pool, batch_table, *, sliding_window=None, sm_scale=None,
           soft_cap=None, k_scale=1.0, v_scale=1.0, draft_block=None, split_keys=None):
    """The kernel's scalar arguments (after q, pool, table, kv_lens, q_lens, the block
    K / V and the layer offset pointers), constexprs and grid for a call; `supports` must hold. draft_block:
    None, or (padded block keys, causal within the block). Decode, verify and the draft
    block (up to FEW_Q_MAX queries) take 2 warps (the bf16 draft block
    DRAFT_BF16_WARPS; more rows than 2 warps hold: FEW_Q_WIDE_ROWS rows a program, a
    warp per 16), edge-only masks and row sums by dot; prefill PREFILL_ROWS rows per
    program over PREFILL_WARPS warps, every block masked and rows summed by `gl.sum`
    (faster for prefill than the few-query options). Warps go along the rows, 16 rows each.
    Few-query calls split keys by `launch_plan.small_batch_split_keys` (split_keys: keys
    per split, a multiple of BLOCK_KEYS, to override it; 0 for none); prefill never does."""
    batch, max_q, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, num_layers, _, page_size, _ = pool.shape
    q_per_kv = num_q_heads // num_kv_heads
    few_q = max_q <= FEW_Q_MAX
    rows = pow2_at_least(max_q * q_per_kv)
    wide = few_q and rows > NUM_WARPS * 16   # more rows than 2 warps hold along the rows
    if not few_q:
        rows_per_block = PREFILL_ROWS
    elif wide:
        rows_per_block = min(rows, FEW_Q_WIDE_ROWS)
    else:
        rows_per_block = None   # plan_launch's few-query default
    plan = plan_launch(batch=batch, max_q=max_q, q_per_kv=q_per_kv, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, table_width=batch_table.shape[1], num_splits=1,
                       rows_per_block=rows_per_block)
    fp8 = pool.dtype == jnp.float8_e4m3fn
    num_warps = NUM_WARPS if few_q else PREFILL_WARPS
    if draft_block is not None and not fp8:
        num_warps = DRAFT_BF16_WARPS
    if wide:
        num_warps = max(num_warps, plan.rows // 16)
    # Warps along the rows, 16 rows each, the rest along the dots' columns: a program's
    # warps then exchange nothing per key block.
    warps_m = max(1, min(num_warps, plan.rows // 16))
    if split_keys is None:
        split_keys = small_batch_split_keys(batch, num_kv_heads) if few_q else 0
    if split_keys % BLOCK_KEYS:
        raise ValueError(f"split_keys={split_keys} must be a multiple of {BLOCK_KEYS}")
    split_blocks = split_keys // BLOCK_KEYS
    pages_per_block = BLOCK_KEYS // page_size
    blocks = pl.cdiv(batch_table.shape[1], pages_per_block)
    num_splits = pl.cdiv(blocks, split_blocks) if split_blocks else 1
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    logit_scale = sm_scale * k_scale * (LOG2E if soft_cap is None else 1.0 / soft_cap)
    scalars = (batch_table.shape[1], num_pages * num_layers * 2, sliding_window or 0, float(logit_scale),
               float(0.0 if soft_cap is None else soft_cap * LOG2E), float(v_scale),
               float(1.0 / k_scale), float(1.0 / v_scale), plan.tokens_per_block * q_per_kv,
               num_splits)
    block_keys_pad, block_causal = draft_block or (0, False)
    constexprs = dict(MAX_Q=max_q, HQ=num_q_heads, GQA=q_per_kv, D=head_dim, PAGE=page_size,
                      PPB=pages_per_block, ROWS=plan.rows,
                      TOKENS=plan.tokens_per_block, STAGES=STAGES if few_q else PREFILL_STAGES,
                      NUM_WARPS=num_warps, WARPS_M=warps_m, KV_FP8=fp8,
                      HAS_WINDOW=sliding_window is not None, HAS_CAP=soft_cap is not None,
                      QUERIES_CACHED=draft_block is None, BLOCK_KEYS_PAD=block_keys_pad,
                      BLOCK_CAUSAL=block_causal, EDGE_MASKS=few_q, SUM_BY_MMA=few_q,
                      SPLIT_BLOCKS=split_blocks)
    return scalars, constexprs, (plan.num_q_blocks * num_splits, batch, num_kv_heads)


def output_shapes(q, num_splits: int, constexprs: dict) -> tuple:
    """The kernel's outputs (o, stats) for a `launch`: split, f32 parts
    [num_splits, *q.shape] and their (max, sum) [num_splits, *q.shape[:-1], 2]; else
    o in q's shape and dtype and a 1-element stats the kernel never writes. Split or not
    follows the batch alone: one split still takes the combine, so a row's bits never
    depend on how many splits the table width makes."""
    if constexprs["SPLIT_BLOCKS"]:
        return (jax.ShapeDtypeStruct((num_splits, *q.shape), jnp.float32),
                jax.ShapeDtypeStruct((num_splits, *q.shape[:-1], 2), jnp.float32))
    return jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((1,), jnp.float32)


def _call(q, pool, batch_table, kv_lens, q_lens, block_k_t, block_v_t, *, layer_offset, **kw):
    scalars, constexprs, grid = launch(q, pool, batch_table, **kw)
    kind = ("draft" if kw.get("draft_block") else "q") + str(q.shape[1])
    split = constexprs["SPLIT_BLOCKS"] > 0
    layer = jnp.asarray(layer_offset, jnp.int32).reshape(1)   # traced under a layer scan
    o, stats = gluon_call(
        paged_attention_kernel, q, pool, batch_table, kv_lens, q_lens, block_k_t, block_v_t,
        layer, *scalars, out_shape=output_shapes(q, scalars[-1], constexprs), grid=grid,
        num_warps=constexprs["NUM_WARPS"], constexprs=constexprs,
        name=(f"paged_attention_gluon_{kind}_g{constexprs['GQA']}_r{constexprs['ROWS']}"
              f"{'_split' if split else ''}"))
    if not split:
        return o
    return combine_splits(o, stats[..., 0], stats[..., 1]).astype(q.dtype)


def _refuse(q, pool, draft_block=False):
    reason = supports(q, pool, draft_block=draft_block)
    if reason is not None:
        raise ValueError(f"the Gluon attention kernel does not take {reason}; use the "
                         "Pallas kernels (paged_attention.py)")


def paged_attention_gluon(q, pool, batch_table, kv_lens, q_lens, *, layer_offset,
                          sliding_window=None, sm_scale=None, soft_cap=None, k_scale=1.0,
                          v_scale=1.0):
    """`paged_attention` (decode, verify, chunked prefill) compiled from Gluon (module
    docstring). Trace-time errors name what it does not take (`supports`)."""
    static_validate_inputs(q, pool, batch_table, kv_lens, q_lens, layer_offset,
                           sliding_window, 1, None, max_pool_elements=None)
    _refuse(q, pool)
    # The block pointers are unused (BLOCK_KEYS_PAD = 0): q stands in for them.
    return _call(q, pool, batch_table, kv_lens, q_lens, q, q, layer_offset=layer_offset,
                 sliding_window=sliding_window, sm_scale=sm_scale, soft_cap=soft_cap,
                 k_scale=k_scale, v_scale=v_scale)


def draft_block_attention_gluon(q, pool, batch_table, ctx_lens, block_lens, block_k, block_v,
                                *, layer_offset, causal_in_block=False, sliding_window=None,
                                sm_scale=None, soft_cap=None, k_scale=1.0, v_scale=1.0):
    """`draft_block_attention` compiled from Gluon: block queries at ctx_len + i over the
    row's cached context and the block's own K / V [batch, block, kv heads, D]."""
    static_validate_inputs(q, pool, batch_table, ctx_lens, block_lens, layer_offset,
                           sliding_window, 1, None, max_pool_elements=None,
                           block_kv=(block_k, block_v))
    _refuse(q, pool, draft_block=True)
    # The block's K / V go in as they are: the kernel pads, scales and converts them, so no
    # XLA op runs beside it.
    pad = max(MIN_ROWS, pow2_at_least(q.shape[1]))
    return _call(q, pool, batch_table, ctx_lens, block_lens, block_k, block_v,
                 layer_offset=layer_offset, sliding_window=sliding_window, sm_scale=sm_scale,
                 soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
                 draft_block=(pad, causal_in_block))
