"""Chunked causal prefill over paged bf16 KV, lowered with Pallas Mosaic GPU.

An experimental second lowering of `paged_attention`'s prefill (max_q > 16),
for bf16 pools without a window or soft cap: what jax's Mosaic GPU flash
attention shows (wgmma, TMA) applied to the unified cache's pages
(BENCHMARKS.md). It is not the default; `paged_attention` stays the kernel
the models call.

One program per (64-query block, batch row, query head), one warpgroup.
The q block comes in by TMA; `plgpu.emit_pipeline` then streams the row's
pages, `pages_per_step` per step: each step's K pages [page_size, head_dim]
and V^T pages [head_dim, page_size] are picked by the row's table entries
(read from GMEM in the index maps), so the gather is the pipeline's own
TMA copies. Per step the q.K dots of the pages (wgmma, N = page_size) give
base-2 logits [64, page_size] each; one online-softmax update covers the
step's keys, and the P.V dots accumulate into one wgmma accumulator. The
softmax state rides in the pipeline's carry (registers), which keeps the
kernel inside what jax 0.11.2's GPU interpret mode runs, so the CPU suite
tests it against the reference.

Query i of row b sits at position kv_lens[b] - q_lens[b] + i and sees keys
at positions <= its own; query rows past q_lens[b] (and padding rows) get
zeros. BAD entries read the null page and are masked.
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

BLOCK_Q = 64        # query rows per program: one warpgroup's wgmma M


def _prefill_kernel(table_gmem, lens_gmem, q_gmem, k_gmem, v_gmem, o_gmem, q_smem, o_smem,
                    p_smem, barrier, *, q_per_kv, k_offset, page_size, head_dim, table_width,
                    pages_per_step, max_concurrent_steps):
    q_block, b, h = (jax.lax.axis_index(name) for name in ("q", "b", "h"))
    kv_len, q_len = lens_gmem[0, b], lens_gmem[1, b]
    q_start = kv_len - q_len
    plgpu.copy_gmem_to_smem(q_gmem.at[b, pl.ds(q_block * BLOCK_Q, BLOCK_Q), h], q_smem,
                            barrier.at[0])
    plgpu.barrier_wait(barrier.at[0])

    layout = plgpu.Layout.WGMMA
    row = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, page_size), 0, layout=layout)
    col = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, page_size), 1, layout=layout)
    first_tok = q_block * BLOCK_Q
    last_tok = jnp.minimum(q_len, first_tok + BLOCK_Q) - 1
    # A row sees keys at positions <= upper: its own position, or -1 past q_len.
    q_tok = first_tok + row
    upper = jnp.where(q_tok < q_len, jnp.minimum(q_start + q_tok, kv_len - 1), -1)
    key_end = jnp.where(last_tok >= first_tok, jnp.minimum(kv_len, q_start + last_tok + 1), 0)
    num_steps = jnp.maximum(pl.cdiv(key_end, page_size * pages_per_step), 1)

    def kernel_page(step, j):
        """Kernel page of the step's j-th page: K at it, V^T at it + 1."""
        page = step * pages_per_step + j
        entry = table_gmem[b, jnp.minimum(page, table_width - 1)]
        entry = jnp.where((page < table_width) & (entry != BAD_PAGE_INDEX), entry, NULL_PAGE)
        return entry + k_offset

    def body(idx, *refs):
        (step,) = idx
        k_pages, vt_pages, carry = refs[:pages_per_step], refs[pages_per_step:-1], refs[-1]
        acc, m_prev, l_prev = carry
        logits = []
        for j, k_page in enumerate(k_pages):
            def qk(acc_ref, k_page=k_page):
                plgpu.wgmma(acc_ref, q_smem, k_page.transpose((1, 0)))
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, page_size), jnp.float32))
            k_pos = (step * pages_per_step + j) * page_size + col
            logits.append(jnp.where(k_pos <= upper, s, MASK_VALUE))
        m_next = functools.reduce(jnp.maximum, [s.max(axis=1) for s in logits] + [m_prev])
        m_sub = jnp.where(m_next == MASK_VALUE, 0.0, m_next)
        correction = jnp.exp2(m_prev - m_sub)
        probs = [jnp.exp2(s - jax.lax.broadcast_in_dim(m_sub, s.shape, [0])) for s in logits]
        l_next = l_prev * correction + functools.reduce(jnp.add, [p.sum(axis=1) for p in probs])
        acc = acc * jax.lax.broadcast_in_dim(correction, acc.shape, [0])

        # P goes through shared memory: jax 0.11.2's GPU interpreter takes
        # wgmma operands from refs only.
        for j, p in enumerate(probs):
            p_smem[j] = p.astype(p_smem.dtype)
        plgpu.commit_smem()

        def pv(acc_ref):
            for j, vt_page in enumerate(vt_pages):
                plgpu.wgmma(acc_ref, p_smem.at[j], vt_page.transpose((1, 0)))
            return acc_ref[...]
        acc = acc + pl.run_scoped(pv, plgpu.ACC((BLOCK_Q, head_dim), jnp.float32))
        return acc, m_next, l_next

    k_tiles, vt_tiles = smem_tiles(jnp.bfloat16, 64), smem_tiles(jnp.bfloat16, page_size)
    in_specs = ([plgpu.BlockSpec((page_size, head_dim),
                                 lambda s, j=j: (kernel_page(s, j), 0), transforms=k_tiles)
                 for j in range(pages_per_step)]
                + [plgpu.BlockSpec((head_dim, page_size),
                                   lambda s, j=j: (kernel_page(s, j) + 1, 0),
                                   transforms=vt_tiles)
                   for j in range(pages_per_step)])
    init = (plgpu.layout_cast(jnp.zeros((BLOCK_Q, head_dim), jnp.float32), layout),
            plgpu.layout_cast(jnp.full((BLOCK_Q,), MASK_VALUE, jnp.float32), layout.reduce(1)),
            plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), layout.reduce(1)))
    kv_head = h // q_per_kv
    acc, _, l = plgpu.emit_pipeline(
        body, grid=(num_steps,), in_specs=in_specs, max_concurrent_steps=max_concurrent_steps,
        init_carry=init)(*([k_gmem.at[kv_head]] * pages_per_step
                           + [v_gmem.at[kv_head]] * pages_per_step))
    has_keys = l > 0
    scale = jnp.where(has_keys, 1.0 / jnp.where(has_keys, l, 1.0), 0.0)
    o_smem[...] = (acc * jax.lax.broadcast_in_dim(scale, acc.shape, [0])).astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, pl.ds(q_block * BLOCK_Q, BLOCK_Q), h])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("layer_offset", "sm_scale", "pages_per_step",
                                             "max_concurrent_steps", "interpret"))
def paged_prefill_mgpu(
    q: jax.Array,            # [batch, max_q, num_q_heads, head_dim] bf16
    pool: jax.Array,         # [num_kv_heads, num_pages, num_layers, 2, page_size, head_dim] bf16
    batch_table: jax.Array,  # i32[batch, table_width]: page * 2 * num_layers, BAD = -1
    kv_lens: jax.Array,      # i32[batch]: cached positions, the queries' own included
    q_lens: jax.Array,       # i32[batch]: query tokens per row (0 = padding)
    *,
    layer_offset: int,
    sm_scale: float | None = None,
    pages_per_step: int = 4,
    max_concurrent_steps: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """`paged_attention`'s causal prefill (no window, no soft cap) over bf16
    pages, in Mosaic GPU. Returns [batch, max_q, num_q_heads, head_dim] bf16."""
    static_validate_inputs(q, pool, batch_table, kv_lens, q_lens, layer_offset, None, 1, None)
    if pool.dtype != jnp.bfloat16 or q.dtype != jnp.bfloat16:
        raise NotImplementedError(f"paged_prefill_mgpu takes bf16 q and pool, got {q.dtype=} "
                                  f"{pool.dtype=}; use paged_attention for fp8 pools")
    batch, max_q, num_q_heads, head_dim = q.shape
    num_kv_heads, _, _, _, page_size, _ = pool.shape
    if head_dim % 64 or page_size not in (16, 32, 64):
        raise NotImplementedError(f"paged_prefill_mgpu needs head_dim % 64 == 0 and page_size "
                                  f"16, 32 or 64 (V^T pages swizzle at 2 * page_size bytes), "
                                  f"got {head_dim=} {page_size=}")
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    padded_q = pl.cdiv(max_q, BLOCK_Q) * BLOCK_Q
    # q carries the softmax scale in base 2, so the logits come straight off the dot.
    q_scaled = (q.astype(jnp.float32) * (sm_scale * LOG2E)).astype(jnp.bfloat16)
    q_scaled = jnp.pad(q_scaled, ((0, 0), (0, padded_q - max_q), (0, 0), (0, 0)))
    k_view, v_view = kernel_views(pool)
    tiles, p_tiles = smem_tiles(jnp.bfloat16, 64), smem_tiles(jnp.bfloat16, page_size)
    kernel = functools.partial(
        _prefill_kernel, q_per_kv=num_q_heads // num_kv_heads, k_offset=2 * layer_offset,
        page_size=page_size, head_dim=head_dim, table_width=batch_table.shape[1],
        pages_per_step=pages_per_step, max_concurrent_steps=max_concurrent_steps)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((batch, padded_q, num_q_heads, head_dim), jnp.bfloat16),
        grid=(padded_q // BLOCK_Q, batch, num_q_heads), grid_names=("q", "b", "h"),
        scratch_types=[plgpu.SMEM((BLOCK_Q, head_dim), jnp.bfloat16, transforms=tiles),
                       plgpu.SMEM((BLOCK_Q, head_dim), jnp.bfloat16, transforms=tiles),
                       plgpu.SMEM((pages_per_step, BLOCK_Q, page_size), jnp.bfloat16,
                                  transforms=p_tiles),
                       plgpu.Barrier(num_barriers=1)],
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(batch_table, jnp.stack([kv_lens, q_lens]), q_scaled, k_view, v_view)
    return out[:, :max_q]
