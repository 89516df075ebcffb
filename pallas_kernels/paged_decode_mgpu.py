"""Decode / verify over paged fp8 KV in Pallas Mosaic GPU, scores transposed
(experimental; not called by the models).

mma.sync needs 16 query rows per dot, and wgmma 64: decode's 4 real rows
(GQA 4) pay 4x and 16x. Here the keys are wgmma's M and the query rows,
padded to a multiple of 16, its N: S^T [64 keys, N] = K [64, D] . q^T, O^T [D, N] += V^T
[D, 64] . P^T. The fp8 pages come in by TMA, go to registers, become f16
there, and are wgmma's A operand, so nothing but P is written back to
shared memory. A column is one query row: its max and sum run over axis 0
(the keys, across the warpgroup's 4 warps) and depend on no other column,
so decode (N = 16) and verify-8 (N = 32) share every column's arithmetic
(bit for bit, compiled on the H200).

One program per (batch row, kv head), one warpgroup; the loop streams the
row's pages 4 (64 keys) per step through `stages` slots of TMA copies,
their table entries (the row's table, in shared memory) read a step ahead.
Query row c is query token c // q_per_kv, head c % q_per_kv. No window, soft
cap or key splits yet.

Measured on the H200 (BENCHMARKS.md, tenth session), batch 64, GQA 4: at
4K keys decode 0.234 ms and verify-8 0.236 ms (1.01x) against the Triton
kernel's 0.137 / 0.159 ms (1.16x); at 32K keys, batch 32, 0.727 / 0.886 ms
(1.22x) against 0.539 / 0.662 ms (1.23x). Verify costs what decode costs,
but decode is 1.35-1.71x slower than Triton's. Mosaic GPU's profiler
(`profile_dir`) puts a decode step at 2.7 us: 0.53 issuing the step's 8
page copies, 0.35 in the cross-warp max, 0.35 + 0.27 in the q.K dot and
the fp8 conversions, 0.18 in the P.V dot, the rest spread thin.
Pools of 2 GiB or more are refused (MAX_POOL_BYTES).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attention import LOG2E, MASK_VALUE
from pallas_kernels.pool_layout import kernel_views, smem_tiles, static_validate_inputs
from unified_kv.spec import BAD_PAGE_INDEX, NULL_PAGE

KEYS = 64   # keys per step: wgmma's M
COLS = 16   # wgmma's N is the query rows padded to a multiple of this
# Pools of 2 GiB or more stay refused until an illegal address is explained: on the H200,
# after this kernel decoded batch 64 x 32K keys (a 4.3 GB fp8 pool) correctly, the next
# kernel in the process (Triton verify on a fresh pool) reported one; alone, 30 calls on
# such a pool were correct, and single TMA copies past byte 2^32 were too
# (benchmarks/probe_mgpu_large_pool.py, BENCHMARKS.md, eleventh session).
MAX_POOL_BYTES = 1 << 31


def _decode_kernel(table_gmem, lens_gmem, q_gmem, k_gmem, v_gmem, o_gmem, table_smem, q_smem,
                   k_smem, v_smem, p_smem, o_smem, q_barrier, kv_barriers, *a_smem, q_per_kv,
                   k_offset, page_size, head_dim, table_width, kernel_pages, cols, stages,
                   v_scale):
    b, h = jax.lax.axis_index("b"), jax.lax.axis_index("h")
    kv_len, q_len = lens_gmem[0, b], lens_gmem[1, b]
    q_start = kv_len - q_len
    pages = KEYS // page_size
    # The row's table comes to shared memory with q: a table read in the loop then costs
    # a shared-memory load, not a global one (0.3 us a step on the H200).
    plgpu.copy_gmem_to_smem(table_gmem.at[b], table_smem, q_barrier)
    plgpu.copy_gmem_to_smem(q_gmem.at[b, h], q_smem, q_barrier)
    num_steps = pl.cdiv(kv_len, KEYS)
    plgpu.barrier_wait(q_barrier)

    def table_entries(step):  # the step's table entries, as loaded (read a step ahead)
        cols = table_smem.shape[1]
        return tuple(table_smem[idx // cols, idx % cols]
                     for idx in (jnp.minimum(step * pages + j, table_width - 1)
                                 for j in range(pages)))

    def issue(step, entries):  # K pages and V^T pages: 2 * pages copies on the slot's barrier
        slot = step % stages
        for j, entry in enumerate(entries):
            page = step * pages + j
            entry = jnp.where((page < table_width) & (entry != BAD_PAGE_INDEX), entry,
                              NULL_PAGE) + k_offset
            page_row = h * kernel_pages + entry  # the page in the flat views
            plgpu.copy_gmem_to_smem(k_gmem.at[pl.ds(page_row * page_size, page_size)],
                                    k_smem.at[slot, pl.ds(j * page_size, page_size)],
                                    kv_barriers.at[slot])
            plgpu.copy_gmem_to_smem(v_gmem.at[pl.ds((page_row + 1) * head_dim, head_dim)],
                                    v_smem.at[slot, j], kv_barriers.at[slot])

    for s in range(stages - 1):
        @pl.when(s < num_steps)
        def _():
            issue(s, table_entries(s))

    layout = plgpu.Layout.WGMMA
    key = plgpu.broadcasted_iota(jnp.int32, (KEYS, cols), 0, layout=layout)
    tok = plgpu.broadcasted_iota(jnp.int32, (KEYS, cols), 1, layout=layout) // q_per_kv
    # A column sees keys at positions <= its upper (-1: none; rows past q_len, padding).
    upper = jnp.where(tok < q_len, jnp.minimum(q_start + tok, kv_len - 1), -1)

    def body(step, carry):
        with jax.named_scope("step"):
            return step_body(step, *carry)

    def step_body(step, acc, m_prev, l_part, next_entries):
        nxt = step + stages - 1

        with jax.named_scope("issue"):
            @pl.when(nxt < num_steps)
            def _():
                issue(nxt, next_entries)
        # The table entries a step later: loaded now and first used in the next step, so
        # no step waits on a table read (page ids a step ahead, as in the Triton kernel).
        with jax.named_scope("table"):
            next_entries = table_entries(nxt + 1)
        slot = step % stages
        with jax.named_scope("wait_kv"):
            plgpu.barrier_wait(kv_barriers.at[slot])
        with jax.named_scope("k_to_f16"):
            k = k_smem[slot].astype(jnp.float16)                              # [64, D]
        if a_smem:  # wgmma's A from shared memory (what jax's GPU interpreter runs)
            k16_smem, vt16_smem = a_smem
            k16_smem[...] = k
            plgpu.commit_smem()
            k = k16_smem

        def qk(acc_ref):  # S^T = K q^T; V^T goes to f16 while the dot runs
            plgpu.wgmma(acc_ref, k, q_smem.T)
            vts = [v_smem[slot, j].astype(jnp.float16) for j in range(pages)]  # [D, page]
            return acc_ref[...], vts
        with jax.named_scope("qk_dot"):
            s, vts = pl.run_scoped(qk, plgpu.ACC((KEYS, cols), jnp.float32))
        with jax.named_scope("mask"):
            s = jnp.where(step * KEYS + key <= upper, s, MASK_VALUE)
        with jax.named_scope("max"):
            m_next = jnp.maximum(m_prev, s.max(axis=0))
        with jax.named_scope("exp"):
            m_sub = jnp.where(m_next == MASK_VALUE, 0.0, m_next)
            correction = jnp.exp2(m_prev - m_sub)
            p = jnp.exp2(s - jax.lax.broadcast_in_dim(m_sub, s.shape, [1]))
            # Row sums stay per key slot until the end: one cross-warp reduction per step.
            l_part = l_part * jax.lax.broadcast_in_dim(correction, s.shape, [1]) + p
        with jax.named_scope("rescale"):
            acc = acc * jax.lax.broadcast_in_dim(correction, acc.shape, [1])
        with jax.named_scope("p_to_smem"):
            p_smem[...] = p.astype(jnp.float16)
            if a_smem:
                for j in range(pages):
                    vt16_smem[j] = vts[j]
                vts = [vt16_smem.at[j] for j in range(pages)]
            plgpu.commit_smem()

        def pv(acc_ref):  # O^T += V^T P^T, a page per dot
            for j in range(pages):
                plgpu.wgmma(acc_ref, vts[j], p_smem.at[pl.ds(j * page_size, page_size)])
        with jax.named_scope("pv_dot"):
            if a_smem:  # the interpreter runs no accumulator initialised from a value
                acc = acc + pl.run_scoped(lambda r: (pv(r), r[...])[1],
                                          plgpu.ACC((head_dim, cols), jnp.float32))
            else:
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        return acc, m_next, l_part, next_entries

    init = (plgpu.layout_cast(jnp.zeros((head_dim, cols), jnp.float32), layout),
            plgpu.layout_cast(jnp.full((cols,), MASK_VALUE, jnp.float32), layout.reduce(0)),
            plgpu.layout_cast(jnp.zeros((KEYS, cols), jnp.float32), layout),
            table_entries(stages - 1))
    acc, _, l_part, _ = jax.lax.fori_loop(0, num_steps, body, init)
    l = l_part.sum(axis=0)
    has_keys = l > 0
    scale = jnp.where(has_keys, v_scale / jnp.where(has_keys, l, 1.0), 0.0)
    o_smem[...] = (acc * jax.lax.broadcast_in_dim(scale, acc.shape, [1])).astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, h])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("layer_offset", "sm_scale", "k_scale", "v_scale",
                                             "stages", "a_via_smem", "profile_dir",
                                             "interpret"))
def paged_decode_mgpu(
    q: jax.Array,            # [batch, max_q, num_q_heads, head_dim]
    pool: jax.Array,         # [num_kv_heads, num_pages, num_layers, 2, page_size, head_dim] fp8
    batch_table: jax.Array,  # i32[batch, table_width]: page * 2 * num_layers, BAD = -1
    kv_lens: jax.Array,      # i32[batch]: cached positions, the queries' own included
    q_lens: jax.Array,       # i32[batch]: query tokens per row (0 = padding)
    *,
    layer_offset: int,
    sm_scale: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    stages: int = 2,
    a_via_smem: bool | None = None,
    profile_dir: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """`paged_attention`'s decode / verify (no window, no soft cap) over fp8
    pages, in Mosaic GPU. Returns [batch, max_q, num_q_heads, head_dim] in q's dtype."""
    static_validate_inputs(q, pool, batch_table, kv_lens, q_lens, layer_offset, None, 1, None,
                           max_pool_elements=None)  # its own MAX_POOL_BYTES guard speaks
    if pool.dtype != jnp.float8_e4m3fn:
        raise NotImplementedError(f"paged_decode_mgpu takes fp8 pools, got {pool.dtype=}; "
                                  "use paged_attention")
    if pool.size >= MAX_POOL_BYTES:
        raise NotImplementedError(
            f"paged_decode_mgpu takes pools under {MAX_POOL_BYTES >> 30} GiB, got "
            f"{pool.size / 2**30:.1f} GiB: on the H200 a run on a 4.3 GB pool was followed by an "
            "illegal address not yet explained (pools under 2 GiB ran); use paged_attention")
    batch, max_q, num_q_heads, head_dim = q.shape
    num_kv_heads, _, _, _, page_size, _ = pool.shape
    if head_dim % 64 or KEYS % page_size or page_size < 16:
        raise NotImplementedError(f"paged_decode_mgpu needs head_dim % 64 == 0 and page_size "
                                  f"16, 32 or 64, got {head_dim=} {page_size=}")
    q_per_kv = num_q_heads // num_kv_heads
    if a_via_smem is None:  # jax's GPU interpreter takes wgmma operands from refs only
        a_via_smem = interpret
    rows = max_q * q_per_kv
    cols = pl.cdiv(rows, COLS) * COLS
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    # q carries every logit scale (softmax, K dequantisation, base 2), in f16.
    q_rows = q.reshape(batch, max_q, num_kv_heads, q_per_kv, head_dim).transpose(0, 2, 1, 3, 4)
    q_rows = q_rows.reshape(batch, num_kv_heads, rows, head_dim)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, cols - rows), (0, 0)))
    q_rows = (q_rows.astype(jnp.float32) * (sm_scale * k_scale * LOG2E)).astype(jnp.float16)
    k_view, v_view = kernel_views(pool)
    # The table as rows of 128 entries (a copy moves at most 256 along a dimension),
    # padded with BAD entries, which the kernel reads as the null page.
    width = batch_table.shape[1]
    table = jnp.pad(batch_table, ((0, 0), (0, -width % 128)), constant_values=BAD_PAGE_INDEX)
    table = table.reshape(batch, -1, 128)
    if table.shape[1] > 256:
        raise NotImplementedError(f"paged_decode_mgpu takes tables up to 32768 entries, got "
                                  f"{width}")
    kernel = functools.partial(
        _decode_kernel, q_per_kv=q_per_kv, k_offset=2 * layer_offset, page_size=page_size,
        head_dim=head_dim, table_width=width, cols=cols,
        kernel_pages=k_view.shape[1] // page_size, stages=stages, v_scale=v_scale)
    pages = KEYS // page_size
    f16 = jnp.float16
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((batch, num_kv_heads, head_dim, cols), q.dtype),
        grid=(batch, num_kv_heads), grid_names=("b", "h"),
        scratch_types=[
            plgpu.SMEM(table.shape[1:], jnp.int32),
            plgpu.SMEM((cols, head_dim), f16, transforms=smem_tiles(f16, head_dim)),
            plgpu.SMEM((stages, KEYS, head_dim), pool.dtype,
                       transforms=smem_tiles(pool.dtype, head_dim)),
            plgpu.SMEM((stages, pages, head_dim, page_size), pool.dtype,
                       transforms=smem_tiles(pool.dtype, page_size)),
            # P^T as wgmma's B, a page of keys per dot: 32-byte swizzle, whose K group (16)
            # fits a 16-key page (64-byte swizzle wants K >= 32).
            plgpu.SMEM((KEYS, cols), f16, transforms=smem_tiles(f16, 16)),
            plgpu.SMEM((head_dim, cols), q.dtype, transforms=smem_tiles(q.dtype, cols)),
            plgpu.Barrier(num_arrivals=2),  # table and q
            plgpu.Barrier(num_arrivals=2 * pages, num_barriers=stages),
        ] + ([plgpu.SMEM((KEYS, head_dim), f16, transforms=smem_tiles(f16, head_dim)),
              plgpu.SMEM((pages, head_dim, page_size), f16,
                         transforms=smem_tiles(f16, page_size))]
             if a_via_smem else []),
        compiler_params=plgpu.CompilerParams(
            reduction_scratch_bytes=4 * 128 * 4 * 4,
            # A per-warpgroup trace of the named phases (Mosaic GPU's profiler), when asked.
            **(dict(profile_space=8 * batch_table.shape[1], profile_dir=profile_dir,
                    profile_bounds_check=True) if profile_dir else {})),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(table, jnp.stack([kv_lens, q_lens]), q_rows, k_view.reshape(-1, head_dim),
      v_view.reshape(-1, page_size))
    # [B, Hkv, D, cols] -> [B, max_q, Hq, D]
    out = out.transpose(0, 1, 3, 2)[:, :, :rows]
    out = out.reshape(batch, num_kv_heads, max_q, q_per_kv, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(q.shape).astype(q.dtype)
