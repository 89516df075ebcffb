"""Paged decode / verify attention over one layer of a unified-cache pool.

Each batch row has 1..max_q query tokens at positions `kv_len - q_len ..
kv_len - 1` whose K/V are already in the cache; they are causal among
themselves and see the row's earlier keys (only the last `sliding_window`
positions for windowed layers). One program handles one (row, kv head, split)
and all `max_q * (q heads per kv head)` query rows at once, so the K+1 verify
queries of a row read each KV page once.

Pool layout and kernel page index (see unified_kv/spec.py):

    pool        [num_kv_heads, num_pages, num_layers, 2, page_size, head_dim]
    kernel view [num_kv_heads, num_pages * num_layers * 2, page_size, head_dim]
    K page      batch_table[b, j] + 2 * layer_offset     (table holds page * 2L)
    V page      batch_table[b, j] + 2 * layer_offset + 1

A windowed row's table has BAD (-1) entries in front of its live tail; the
kernel starts at the first page the earliest query can see, so they are never
read. BAD entries padding a row's last block read the pool's null page (page
0: reserved, never allocated, all zeros) and are masked. Query rows past a row's `q_len` (and padding rows, q_len 0) get zeros.

Lowering: Pallas Triton (also runs in interpret mode on CPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from unified_kv.spec import BAD_PAGE_INDEX, NULL_PAGE

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
MIN_ROWS = 16  # Triton's dot needs at least 16 rows


def paged_attention_kernel(
    # inputs
    q_ref,          # [rows, head_dim]: row = query token * q_per_kv + head in group
    kv_pages_ref,   # [num_kernel_pages, page_size, head_dim] of this kv head
    table_ref,      # i32[table_width]: this batch row's entries (page * 2L), BAD = -1
    kv_lens_ref,    # i32[batch]
    q_lens_ref,     # i32[batch]
    # outputs
    o_ref,          # [rows, head_dim], normalised within this split
    m_ref,          # f32[rows], running max of log2-scaled logits (split combine)
    l_ref,          # f32[rows], running denominator
    *,
    k_offset: int,
    q_per_kv: int,
    pages_per_block: int,
    pages_per_split: int,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    k_scale: float,
    v_scale: float,
):
    b, split = pl.program_id(0), pl.program_id(2)
    rows, head_dim = q_ref.shape
    page_size = kv_pages_ref.shape[1]
    table_width = table_ref.shape[0]
    block_k = pages_per_block * page_size
    kv_len, q_len = kv_lens_ref[b], q_lens_ref[b]

    q_tok = lax.broadcasted_iota(jnp.int32, (rows,), 0) // q_per_kv
    q_pos = kv_len - q_len + q_tok                     # i32[rows]
    row_valid = q_tok < q_len
    first_page = 0  # the first page the earliest query can see
    if sliding_window is not None:
        first_page = jnp.maximum(kv_len - q_len - sliding_window + 1, 0) // page_size
    lo = jnp.maximum(first_page, split * pages_per_split)
    hi = jnp.minimum(pl.cdiv(kv_len, page_size), (split + 1) * pages_per_split)
    num_blocks = pl.cdiv(jnp.maximum(hi - lo, 0), pages_per_block)

    q = q_ref[...]
    logit_scale = sm_scale * k_scale
    log2e = math.log2(math.e)

    def body(i, carry):
        acc, m_prev, l_prev = carry
        page_ids = lo + i * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32)
        entries = plgpu.load(table_ref.at[pl.ds(lo + i * pages_per_block, pages_per_block)],
                             mask=(page_ids < hi) & (page_ids < table_width),
                             other=BAD_PAGE_INDEX)
        # Blocks start at the first live page, so BAD entries only pad the last
        # block; they read the pool's all-zero null page and are masked below.
        safe = jnp.where(entries == BAD_PAGE_INDEX, NULL_PAGE, entries)
        k = kv_pages_ref[safe + k_offset].reshape(block_k, head_dim).astype(q.dtype)
        v = kv_pages_ref[safe + k_offset + 1].reshape(block_k, head_dim).astype(q.dtype)
        logits = plgpu.dot(q, k, trans_b=True) * logit_scale   # f32[rows, block_k]
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        k_pos = (lo + i * pages_per_block) * page_size + lax.broadcasted_iota(
            jnp.int32, (block_k,), 0)
        # Keys past this split's last page belong to the next split.
        visible = ((k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < hi * page_size)
                   & row_valid[:, None])
        if sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        logits = jnp.where(visible, logits * log2e, MASK_VALUE)  # base-2 softmax
        m_next = jnp.maximum(m_prev, logits.max(axis=1))
        # A row with nothing visible yet keeps m == MASK_VALUE: subtract 0 so its
        # masked logits still underflow to p == 0.
        m_sub = jnp.where(m_next == MASK_VALUE, 0.0, m_next)
        correction = jnp.exp2(m_prev - m_sub)
        p = jnp.exp2(logits - m_sub[:, None])
        l_next = l_prev * correction + p.sum(axis=1)
        acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_next, l_next

    init = (jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, l = lax.fori_loop(0, num_blocks, body, init)
    # Rows that saw no key (past q_len, padding, empty split) have l == 0 -> 0.
    has_keys = l > 0
    out = jnp.where(has_keys[:, None], acc / jnp.where(has_keys, l, 1.0)[:, None], 0.0)
    o_ref[...] = (out * v_scale).astype(o_ref.dtype)
    m_ref[...] = m
    l_ref[...] = l


def _num_splits(batch: int, num_kv_heads: int, table_width: int, pages_per_block: int,
                num_sms: int = 132) -> int:
    """Split the keys when rows x heads alone cannot fill the GPU twice over."""
    programs = batch * num_kv_heads
    max_splits = max(table_width // (4 * pages_per_block), 1)
    splits = 1
    while programs * splits < 2 * num_sms and splits * 2 <= max_splits:
        splits *= 2
    return splits


@functools.partial(jax.jit, static_argnames=(
    "layer_offset", "sliding_window", "sm_scale", "soft_cap", "k_scale", "v_scale",
    "pages_per_block", "num_splits", "num_warps", "num_stages", "interpret"))
def paged_attention(
    q: jax.Array,            # [batch, max_q, num_q_heads, head_dim]
    pool: jax.Array,         # [num_kv_heads, num_pages, num_layers, 2, page_size, head_dim]
    batch_table: jax.Array,  # i32[batch, table_width]: page * 2 * num_layers, BAD = -1
    kv_lens: jax.Array,      # i32[batch]: cached positions, the queries' own included
    q_lens: jax.Array,       # i32[batch]: query tokens per row, 0..max_q (0 = padding)
    *,
    layer_offset: int,
    sliding_window: int | None = None,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    pages_per_block: int = 8,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Paged GQA attention for decode (max_q = 1) and verify (max_q = K+1).

    Returns [batch, max_q, num_q_heads, head_dim] in q's dtype; entries of
    query tokens past a row's q_len are zero.
    """
    static_validate_inputs(q, pool, batch_table, kv_lens, q_lens, layer_offset,
                           sliding_window, pages_per_block)
    batch, max_q, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, num_layers, _, page_size, _ = pool.shape
    table_width = batch_table.shape[1]
    q_per_kv = num_q_heads // num_kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    pages_per_block = min(pages_per_block, table_width)
    if num_splits is None:
        num_splits = _num_splits(batch, num_kv_heads, table_width, pages_per_block)
    pages_per_split = pl.cdiv(pl.cdiv(table_width, num_splits), pages_per_block) * pages_per_block

    # [B, Q, Hkv*G, D] -> [B, Hkv, Q*G, D]: one program owns a kv head's whole group.
    rows = max_q * q_per_kv
    rows_padded = max(MIN_ROWS, 1 << (rows - 1).bit_length())
    q_rows = q.reshape(batch, max_q, num_kv_heads, q_per_kv, head_dim)
    q_rows = q_rows.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, rows, head_dim)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows_padded - rows), (0, 0)))
    kv_pages = pool.reshape(num_kv_heads, num_pages * num_layers * 2, page_size, head_dim)

    kernel = functools.partial(
        paged_attention_kernel, k_offset=2 * layer_offset, q_per_kv=q_per_kv,
        pages_per_block=pages_per_block, pages_per_split=pages_per_split,
        sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        k_scale=k_scale, v_scale=v_scale)
    whole = pl.BlockSpec(memory_space=None)
    split_shape = (num_splits, batch, num_kv_heads, rows_padded)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((None, None, rows_padded, head_dim),
                         lambda b, h, s: (b, h, 0, 0)),                       # q rows
            pl.BlockSpec((None, kv_pages.shape[1], page_size, head_dim),
                         lambda b, h, s: (h, 0, 0, 0)),                       # kv pages
            pl.BlockSpec((None, table_width), lambda b, h, s: (b, 0)),       # batch table
            whole,                                                           # kv_lens
            whole,                                                           # q_lens
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows_padded, head_dim),
                         lambda b, h, s: (s, b, h, 0, 0)),                    # o
            pl.BlockSpec((None, None, None, rows_padded), lambda b, h, s: (s, b, h, 0)),
            pl.BlockSpec((None, None, None, rows_padded), lambda b, h, s: (s, b, h, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct(split_shape + (head_dim,), jnp.float32),
                   jax.ShapeDtypeStruct(split_shape, jnp.float32),
                   jax.ShapeDtypeStruct(split_shape, jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_attention_q{max_q}_g{q_per_kv}_ppb{pages_per_block}_s{num_splits}",
    )(q_rows, kv_pages, batch_table, kv_lens, q_lens)
    out = o[0] if num_splits == 1 else _combine_splits(o, m, l)
    out = out[:, :, :rows].reshape(batch, num_kv_heads, max_q, q_per_kv, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(q.shape).astype(q.dtype)


def _combine_splits(o, m, l):
    """Merge per-split softmax parts: o [S, B, H, R, D], m and l [S, B, H, R]."""
    weight = jnp.exp2(m - m.max(axis=0, keepdims=True)) * l  # m is in log2 units
    total = weight.sum(axis=0)
    out = (o * weight[..., None]).sum(axis=0)
    return jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


def static_validate_inputs(q, pool, batch_table, kv_lens, q_lens, layer_offset,
                           sliding_window, pages_per_block) -> None:
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, max_q, num_q_heads, head_dim], got {q.shape=}")
    if pool.ndim != 6 or pool.shape[3] != 2:
        raise ValueError("pool must be [num_kv_heads, num_pages, num_layers, 2, page_size, "
                         f"head_dim], got {pool.shape=}")
    batch, _, num_q_heads, head_dim = q.shape
    num_kv_heads, _, num_layers, _, page_size, pool_head_dim = pool.shape
    if head_dim != pool_head_dim:
        raise ValueError(f"q head_dim={head_dim} != pool head_dim={pool_head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of "
                         f"num_kv_heads={num_kv_heads} (GQA)")
    if q.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"q must be bf16, f16 or f32, got {q.dtype=}")
    if pool.dtype not in (jnp.bfloat16, jnp.float8_e4m3fn, jnp.float16, jnp.float32):
        raise ValueError(f"pool must be bf16 or fp8 e4m3 (or f16/f32), got {pool.dtype=}")
    if batch_table.ndim != 2 or batch_table.shape[0] != batch or batch_table.dtype != jnp.int32:
        raise ValueError(f"batch_table must be i32[batch={batch}, table_width], got "
                         f"{batch_table.shape=} {batch_table.dtype=}")
    for name, lens in (("kv_lens", kv_lens), ("q_lens", q_lens)):
        if lens.shape != (batch,) or lens.dtype != jnp.int32:
            raise ValueError(f"{name} must be i32[batch={batch}], got {lens.shape=} {lens.dtype=}")
    if not 0 <= layer_offset < num_layers:
        raise ValueError(f"layer_offset={layer_offset} outside the pool's {num_layers} layers")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window=}")
    if pages_per_block <= 0 or pages_per_block & (pages_per_block - 1):
        raise ValueError(f"pages_per_block must be a power of two, got {pages_per_block=}")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim=}")


def dequantized_kv(pool, layer_offset, k_scale=1.0, v_scale=1.0):
    """f32 K and V of one layer: [num_kv_heads, num_pages, page_size, head_dim] each."""
    layer = pool[:, :, layer_offset].astype(jnp.float32)
    return layer[:, :, 0] * k_scale, layer[:, :, 1] * v_scale


def paged_attention_reference(q, pool, batch_table, kv_lens, q_lens, *, layer_offset,
                              sliding_window=None, sm_scale=None, soft_cap=None,
                              k_scale=1.0, v_scale=1.0, **_):
    """Plain-jnp reference in f32: gather the row's pages densely, mask, softmax."""
    batch, max_q, num_q_heads, head_dim = q.shape
    num_kv_heads, _, num_layers, _, page_size, _ = pool.shape
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    k_all, v_all = dequantized_kv(pool, layer_offset, k_scale, v_scale)
    pages = batch_table // (2 * num_layers)                   # back to page ids
    ok_page = batch_table != BAD_PAGE_INDEX
    safe = jnp.where(ok_page, pages, 0)
    k = k_all[:, safe].reshape(num_kv_heads, batch, -1, head_dim)  # [H, B, T, D]
    v = v_all[:, safe].reshape(num_kv_heads, batch, -1, head_dim)
    num_keys = k.shape[2]
    k_pos = jnp.arange(num_keys)
    key_ok = jnp.repeat(ok_page, page_size, axis=1)              # [B, T]
    q_pos = kv_lens[:, None] - q_lens[:, None] + jnp.arange(max_q)[None]  # [B, Q]
    visible = key_ok[:, None, :] & (k_pos[None, None, :] <= q_pos[..., None])
    visible &= (k_pos[None, None, :] < kv_lens[:, None, None])
    if sliding_window is not None:
        visible &= k_pos[None, None, :] > q_pos[..., None] - sliding_window
    visible &= (jnp.arange(max_q)[None, :] < q_lens[:, None])[..., None]
    qh = q.astype(jnp.float32).reshape(batch, max_q, num_kv_heads, num_q_heads // num_kv_heads,
                                       head_dim)
    logits = jnp.einsum("bqhgd,hbtd->bqhgt", qh, k) * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(visible[:, :, None, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(visible[:, :, None, None, :], probs, 0.0)  # rows with no keys -> 0
    out = jnp.einsum("bqhgt,hbtd->bqhgd", probs, v)
    return out.reshape(q.shape).astype(q.dtype)
