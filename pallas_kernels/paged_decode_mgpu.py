"""Decode / verify over paged fp8 KV in Pallas Mosaic GPU, scores transposed
(experimental; not called by the models).

mma.sync needs 16 query rows per dot, and wgmma 64: decode's 4 real rows
(GQA 4) pay 4x and 16x. Here the keys are wgmma's M and the query rows its
N, 16 per unit: S^T [64 keys, 16] = K [64, D] . q^T, O^T [D, 16] += V^T
[D, 64] . P^T. Decode (GQA 4) is one unit, verify-8 two, sharing one step's
K / V: the fp8 pages come in by TMA, go to registers, become f16 there, and
are wgmma's A operand, so nothing is written back to shared memory but P.
A unit's column is one query row: its max and sum run over axis 0 (the
keys, across the warpgroup's 4 warps), and nothing in it depends on the
other columns or units, so decode and verify share every column's
arithmetic.

One program per (batch row, kv head), one warpgroup; the loop streams the
row's pages 4 (64 keys) per step through `stages` slots of TMA copies.
Query row c of a unit is query token c // q_per_kv, head c % q_per_kv.
No window or soft cap yet.

Measured on the H200 (BENCHMARKS.md, tenth session): correct, and a row's
verify queries equal its decode passes bit for bit, but at batch 64, 4K
keys, GQA 4 it takes 0.25-0.28 ms for decode and 0.36 ms for verify-8
against the Triton kernel's 0.137 / 0.163 ms. One warpgroup runs each step
in order (copies, conversions, two dots, two cross-warp reductions); a
faster version needs the loads and the softmax of one unit to overlap the
other's dots (warp specialisation), which this does not try.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attention import LOG2E, MASK_VALUE
from pallas_kernels.pool_layout import kernel_views, static_validate_inputs
from unified_kv.spec import BAD_PAGE_INDEX, NULL_PAGE

KEYS = 64   # keys per step: wgmma's M
COLS = 16   # query rows per unit: wgmma's N
# On the H200, batch 64 x 32K keys (a 4.3 GB fp8 pool) made the page copies hit an illegal
# address, indexed by head then row or flat (BENCHMARKS.md); 4K keys (0.5 GB) ran. Most
# likely a 32-bit byte offset, so pools stay under 2 GiB until that is found.
MAX_POOL_BYTES = 1 << 31


def _tiles(dtype, columns):
    """8-row tiles swizzled over one row's bytes (what TMA and wgmma read)."""
    row_bytes = columns * jnp.dtype(dtype).itemsize
    swizzle = min(128, row_bytes)
    tiling = plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize))
    return (tiling, plgpu.SwizzleTransform(swizzle)) if swizzle >= 32 else (tiling,)


def _decode_kernel(table_gmem, lens_gmem, q_gmem, k_gmem, v_gmem, o_gmem, q_smem, k_smem,
                   v_smem, p_smem, o_smem, q_barrier, kv_barriers, *a_smem, q_per_kv, k_offset,
                   page_size, head_dim, table_width, kernel_pages, units, stages, v_scale):
    b, h = jax.lax.axis_index("b"), jax.lax.axis_index("h")
    kv_len, q_len = lens_gmem[0, b], lens_gmem[1, b]
    q_start = kv_len - q_len
    pages = KEYS // page_size
    copies = 2 * pages  # barriers per slot: K pages, then V^T pages
    for u in range(units):
        plgpu.copy_gmem_to_smem(q_gmem.at[b, h, u], q_smem.at[u], q_barrier.at[u])
    num_steps = pl.cdiv(kv_len, KEYS)

    def issue(step):
        slot = step % stages
        for j in range(pages):
            page = step * pages + j
            entry = table_gmem[b, jnp.minimum(page, table_width - 1)]
            entry = jnp.where((page < table_width) & (entry != BAD_PAGE_INDEX), entry,
                              NULL_PAGE) + k_offset
            page_row = h * kernel_pages + entry
            plgpu.copy_gmem_to_smem(k_gmem.at[pl.ds(page_row * page_size, page_size)],
                                    k_smem.at[slot, pl.ds(j * page_size, page_size)],
                                    kv_barriers.at[slot * copies + j])
            plgpu.copy_gmem_to_smem(v_gmem.at[pl.ds((page_row + 1) * head_dim, head_dim)],
                                    v_smem.at[slot, j],
                                    kv_barriers.at[slot * copies + pages + j])

    for s in range(stages - 1):
        @pl.when(s < num_steps)
        def _():
            issue(s)
    for u in range(units):
        plgpu.barrier_wait(q_barrier.at[u])

    layout = plgpu.Layout.WGMMA
    key = plgpu.broadcasted_iota(jnp.int32, (KEYS, COLS), 0, layout=layout)
    col = plgpu.broadcasted_iota(jnp.int32, (KEYS, COLS), 1, layout=layout)
    uppers = []  # a column sees keys at positions <= its upper (-1: none)
    for u in range(units):
        tok = (u * COLS + col) // q_per_kv
        uppers.append(jnp.where(tok < q_len, jnp.minimum(q_start + tok, kv_len - 1), -1))

    def body(step, carry):
        nxt = step + stages - 1

        @pl.when(nxt < num_steps)
        def _():
            issue(nxt)
        slot = step % stages
        for i in range(copies):
            plgpu.barrier_wait(kv_barriers.at[slot * copies + i])
        k = k_smem[slot].astype(jnp.float16)                                  # [64, D]
        vts = [v_smem[slot, j].astype(jnp.float16) for j in range(pages)]     # [D, page]
        if a_smem:  # wgmma's A from shared memory (what jax's GPU interpreter runs)
            k16_smem, vt16_smem = a_smem
            k16_smem[...] = k
            for j in range(pages):
                vt16_smem[j] = vts[j]
            plgpu.commit_smem()
            k, vts = k16_smem, [vt16_smem.at[j] for j in range(pages)]
        out = []
        for u, (acc, m_prev, l_prev) in enumerate(carry):
            def qk(acc_ref, u=u):
                plgpu.wgmma(acc_ref, k, q_smem.at[u].T)
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((KEYS, COLS), jnp.float32))
            s = jnp.where(step * KEYS + key <= uppers[u], s, MASK_VALUE)
            m_next = jnp.maximum(m_prev, s.max(axis=0))
            m_sub = jnp.where(m_next == MASK_VALUE, 0.0, m_next)
            correction = jnp.exp2(m_prev - m_sub)
            p = jnp.exp2(s - jax.lax.broadcast_in_dim(m_sub, s.shape, [1]))
            l_next = l_prev * correction + p.sum(axis=0)
            acc = acc * jax.lax.broadcast_in_dim(correction, acc.shape, [1])
            p_smem[u] = p.astype(jnp.float16)
            plgpu.commit_smem()

            def pv(acc_ref, u=u):
                for j in range(pages):
                    plgpu.wgmma(acc_ref, vts[j], p_smem.at[u, pl.ds(j * page_size, page_size)])
                return acc_ref[...]
            acc = acc + pl.run_scoped(pv, plgpu.ACC((head_dim, COLS), jnp.float32))
            out.append((acc, m_next, l_next))
        return tuple(out)

    col_layout = layout.reduce(0)
    init = tuple((plgpu.layout_cast(jnp.zeros((head_dim, COLS), jnp.float32), layout),
                  plgpu.layout_cast(jnp.full((COLS,), MASK_VALUE, jnp.float32), col_layout),
                  plgpu.layout_cast(jnp.zeros((COLS,), jnp.float32), col_layout))
                 for _ in range(units))
    final = jax.lax.fori_loop(0, num_steps, body, init)
    for u, (acc, _, l) in enumerate(final):
        has_keys = l > 0
        scale = jnp.where(has_keys, v_scale / jnp.where(has_keys, l, 1.0), 0.0)
        o_smem[u] = (acc * jax.lax.broadcast_in_dim(scale, acc.shape, [1])).astype(o_smem.dtype)
    plgpu.commit_smem()
    for u in range(units):
        plgpu.copy_smem_to_gmem(o_smem.at[u], o_gmem.at[b, h, u])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("layer_offset", "sm_scale", "k_scale", "v_scale",
                                             "stages", "a_via_smem", "interpret"))
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
    stages: int = 3,
    a_via_smem: bool | None = None,
    interpret: bool = False,
) -> jax.Array:
    """`paged_attention`'s decode / verify (no window, no soft cap) over fp8
    pages, in Mosaic GPU. Returns [batch, max_q, num_q_heads, head_dim] in q's dtype."""
    static_validate_inputs(q, pool, batch_table, kv_lens, q_lens, layer_offset, None, 1, None)
    if pool.dtype != jnp.float8_e4m3fn:
        raise NotImplementedError(f"paged_decode_mgpu takes fp8 pools, got {pool.dtype=}; "
                                  "use paged_attention")
    if pool.size >= MAX_POOL_BYTES:
        raise NotImplementedError(
            f"paged_decode_mgpu takes pools under {MAX_POOL_BYTES >> 30} GiB, got "
            f"{pool.size / 2**30:.1f} GiB: on the H200 a 4.3 GB pool made its page copies hit "
            "an illegal address (a 0.5 GB one ran); use paged_attention")
    batch, max_q, num_q_heads, head_dim = q.shape
    num_kv_heads, _, _, _, page_size, _ = pool.shape
    if head_dim % 64 or KEYS % page_size or page_size < 16:
        raise NotImplementedError(f"paged_decode_mgpu needs head_dim % 64 == 0 and page_size "
                                  f"16, 32 or 64, got {head_dim=} {page_size=}")
    q_per_kv = num_q_heads // num_kv_heads
    if a_via_smem is None:  # jax's GPU interpreter takes wgmma operands from refs only
        a_via_smem = interpret
    rows = max_q * q_per_kv
    units = pl.cdiv(rows, COLS)
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    # q carries every logit scale (softmax, K dequantisation, base 2), in f16.
    q_rows = q.reshape(batch, max_q, num_kv_heads, q_per_kv, head_dim).transpose(0, 2, 1, 3, 4)
    q_rows = q_rows.reshape(batch, num_kv_heads, rows, head_dim)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, units * COLS - rows), (0, 0)))
    q_rows = (q_rows.astype(jnp.float32) * (sm_scale * k_scale * LOG2E)).astype(jnp.float16)
    q_rows = q_rows.reshape(batch, num_kv_heads, units, COLS, head_dim)
    k_view, v_view = kernel_views(pool)
    kernel = functools.partial(
        _decode_kernel, q_per_kv=q_per_kv, k_offset=2 * layer_offset, page_size=page_size,
        head_dim=head_dim, table_width=batch_table.shape[1], units=units,
        kernel_pages=k_view.shape[1] // page_size, stages=stages, v_scale=v_scale)
    pages = KEYS // page_size
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((batch, num_kv_heads, units, head_dim, COLS), q.dtype),
        grid=(batch, num_kv_heads), grid_names=("b", "h"),
        scratch_types=[
            plgpu.SMEM((units, COLS, head_dim), jnp.float16,
                       transforms=_tiles(jnp.float16, head_dim)),
            plgpu.SMEM((stages, KEYS, head_dim), pool.dtype,
                       transforms=_tiles(pool.dtype, head_dim)),
            plgpu.SMEM((stages, pages, head_dim, page_size), pool.dtype,
                       transforms=_tiles(pool.dtype, page_size)),
            plgpu.SMEM((units, KEYS, COLS), jnp.float16, transforms=_tiles(jnp.float16, COLS)),
            plgpu.SMEM((units, head_dim, COLS), q.dtype, transforms=_tiles(q.dtype, COLS)),
            plgpu.Barrier(num_barriers=units),
            plgpu.Barrier(num_barriers=2 * pages * stages),
        ] + ([plgpu.SMEM((KEYS, head_dim), jnp.float16, transforms=_tiles(jnp.float16, head_dim)),
              plgpu.SMEM((pages, head_dim, page_size), jnp.float16,
                         transforms=_tiles(jnp.float16, page_size))] if a_via_smem else []),
        compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=4 * 128 * 4 * 4),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(batch_table, jnp.stack([kv_lens, q_lens]), q_rows, k_view.reshape(-1, head_dim),
      v_view.reshape(-1, page_size))
    # [B, Hkv, units, D, COLS] -> [B, max_q, Hq, D]
    out = out.transpose(0, 1, 2, 4, 3).reshape(batch, num_kv_heads, units * COLS, head_dim)
    out = out[:, :, :rows].reshape(batch, num_kv_heads, max_q, q_per_kv, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(q.shape).astype(q.dtype)
