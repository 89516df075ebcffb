"""One layer's q/k head norm, RoPE and K/V store in one kernel launch.

    q' = rope(rmsnorm(q) * q_norm)                       -> returned, [N, Hq * D]
    k' = rope(rmsnorm(k) * k_norm);  v' = v
    K page row `slot` of kernel page  store_pages[n] + 2 * layer_offset    <- k' / k_scale
    V page column `slot` of the page after it                               <- v' / v_scale

for each of the step's N new tokens (rows of the projections' output). `store_targets`
turns a batch table and the rows' positions into (store_pages, store_slots) once per
step: a layer adds only its `layer_offset`, so every layer of a scan shares them.
Tokens with store_pages == -1 (padding, or a BAD page: `allocate_pages` reported the
row) write nothing; their q' is still returned.

Written as XLA ops the same work takes about eight launches a layer (two norm
reductions, the RoPE fusion, and a read, a bounds check and a write for each of K and
V), each latency-bound at decode; here one program per (token, kv head) does its group
of q heads, its K and its V. Arithmetic follows the models' XLA form step by step
(`rope_store_reference`): f32 norm rounded to the activations' dtype, f32 rotation
rounded again, then the store's f32 scale and fp8 saturation (`kv_store.quantize`).
A row's result never depends on the other rows, so a 1-token decode and a K+1-token
verify store the same bits.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_store import FP8_MAX, quantize
from pallas_kernels.pool_layout import (BAD_PAGE_INDEX, MAX_POOL_ELEMENTS, byte_view,
                                       from_byte_view, pow2_at_least)


def store_targets(batch_table, starts, num_tokens, page_size: int, max_tokens: int):
    """(store_pages, store_slots) i32[batch * max_tokens]: each new token's kernel page
    at layer offset 0 (the table entry) and its slot in the page; -1 where nothing is
    stored (padding tokens, positions past the table, BAD pages)."""
    pos = starts[:, None] + jnp.arange(max_tokens, dtype=jnp.int32)[None]
    live = jnp.arange(max_tokens)[None] < num_tokens[:, None]
    col = pos // page_size
    entry = jnp.take_along_axis(batch_table, jnp.clip(col, 0, batch_table.shape[1] - 1), axis=1)
    stored = live & (col < batch_table.shape[1]) & (entry != BAD_PAGE_INDEX)
    return (jnp.where(stored, entry, -1).reshape(-1).astype(jnp.int32),
            (pos % page_size).reshape(-1).astype(jnp.int32))


def unaddressable(pool_shape, dtype) -> str | None:
    """Why the kernel cannot address a pool of this shape and dtype, or None. Pallas
    Triton computes a store's offsets in 32 bits up to 2^32 bytes of array and in 64 bits
    past that; 32-bit offsets are signed, so they reach 2^31 elements: an fp8 pool of
    2^31 to 2^32 elements falls between the two."""
    size = math.prod(pool_shape)
    if size <= MAX_POOL_ELEMENTS or size * jnp.dtype(dtype).itemsize > 2**32:
        return None
    return (f"a pool of {size:,} one-byte elements (2^31 to 2^32): Pallas Triton offsets "
            "are 32-bit and signed there")


def split_projections(qkv, num_q_heads: int, num_kv_heads: int, head_dim: int):
    """The fused projections [..., (Hq + 2 Hkv) * D] as (q, k, v) along the last axis (a
    tuple already split: as is)."""
    if isinstance(qkv, (tuple, list)):
        return tuple(qkv)
    return tuple(jnp.split(qkv, [num_q_heads * head_dim, (num_q_heads + num_kv_heads) * head_dim],
                           axis=-1))


def _norm(x, weight, eps):
    """The models' rms_norm: f32, rounded to x's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def _rope(x, cos, sin):
    """NeoX halves in f32, rounded to x's dtype. x [N, heads, D]; cos, sin [N, D/2]."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[:, None], sin[:, None]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def norm_weight_row(weight, row):
    """A head-norm weight [D], or row `row` (int or traced i32) of a stack [L, D]."""
    if weight.ndim == 1:
        return weight
    return jax.lax.dynamic_index_in_dim(weight, jnp.asarray(row, jnp.int32).reshape(()),
                                        keepdims=False)


def rope_store_reference(qkv, q_norm, k_norm, cos, sin, pool, store_pages, store_slots,
                         layer_offset, *, num_q_heads: int, eps: float, k_scale: float = 1.0,
                         v_scale: float = 1.0, norm_row=0):
    """`rope_store` in plain jnp (scatters for the store): (q' [N, Hq * D], pool)."""
    num_kv_heads, num_pages, num_layers, _, page_size, head_dim = pool.shape
    q, k, v = split_projections(qkv, num_q_heads, num_kv_heads, head_dim)
    q_norm, k_norm = norm_weight_row(q_norm, norm_row), norm_weight_row(k_norm, norm_row)
    n = q.shape[0]
    q = _rope(_norm(q.reshape(n, num_q_heads, head_dim), q_norm, eps), cos, sin)
    k = _rope(_norm(k.reshape(n, num_kv_heads, head_dim), k_norm, eps), cos, sin)
    v = v.reshape(n, num_kv_heads, head_dim)
    kernel_pages = num_pages * num_layers * 2
    page = jnp.where(store_pages >= 0, store_pages + 2 * jnp.asarray(layer_offset, jnp.int32),
                     kernel_pages)   # out of range: dropped
    rows = page * page_size + store_slots
    # stored as bytes: XLA converts a whole fp8 pool to scatter into it (byte_view)
    by_head = lambda x, scale: byte_view(quantize(x, scale, pool.dtype).transpose(1, 0, 2))
    k_rows = byte_view(pool).reshape(num_kv_heads, kernel_pages * page_size, head_dim)
    k_rows = k_rows.at[:, rows].set(by_head(k, k_scale), mode="drop")
    v_pages = k_rows.reshape(num_kv_heads, kernel_pages, head_dim, page_size)
    v_pages = v_pages.at[:, page + 1, :, store_slots].set(
        byte_view(quantize(v, v_scale, pool.dtype)), mode="drop")
    return q.reshape(n, -1), from_byte_view(v_pages.reshape(pool.shape), pool.dtype)


def _rope_store_kernel(q_ref, k_ref, v_ref, q_norm_ref, k_norm_ref, norm_row_ref, cos_ref,
                       sin_ref, pages_ref, slots_ref, offset_ref, _pool_in, q_out_ref, pool_ref,
                       *, q_col, k_col, v_col, q_per_kv, group, eps, k_scale, v_scale,
                       head_dim, page_size, fp8):
    n, h = pl.program_id(0), pl.program_id(1)
    half = head_dim // 2
    j = jnp.arange(half, dtype=jnp.int32)
    cos, sin = cos_ref[...], sin_ref[...]
    w_first = norm_row_ref[0] * head_dim   # the layer's row of the flattened norm weights

    def norm_rope(x1, x2, w_ref):  # x1, x2 [heads, half] halves of each head
        act = x1.dtype
        x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
        inv = jax.lax.rsqrt((jnp.sum(x1 * x1, axis=-1) + jnp.sum(x2 * x2, axis=-1)) / head_dim
                            + eps)[:, None]
        w1 = w_ref[w_first + j].astype(jnp.float32)
        w2 = w_ref[w_first + half + j].astype(jnp.float32)
        x1 = (x1 * inv * w1[None]).astype(act).astype(jnp.float32)
        x2 = (x2 * inv * w2[None]).astype(act).astype(jnp.float32)
        return ((x1 * cos[None] - x2 * sin[None]).astype(act),
                (x2 * cos[None] + x1 * sin[None]).astype(act))

    # this kv head's group of q heads (padded to a power of two, masked)
    g = jnp.arange(group, dtype=jnp.int32)
    in_group = (g < q_per_kv)[:, None]
    q_cols = (h * q_per_kv + g)[:, None] * head_dim + j[None]
    q1 = plgpu.load(q_ref.at[q_col + q_cols], mask=in_group, other=0)
    q2 = plgpu.load(q_ref.at[q_col + half + q_cols], mask=in_group, other=0)
    q1, q2 = norm_rope(q1, q2, q_norm_ref)
    plgpu.store(q_out_ref.at[q_cols], q1.astype(q_out_ref.dtype), mask=in_group)
    plgpu.store(q_out_ref.at[half + q_cols], q2.astype(q_out_ref.dtype), mask=in_group)

    k_cols = k_col + h * head_dim + j
    k1, k2 = norm_rope(k_ref[k_cols][None], k_ref[half + k_cols][None], k_norm_ref)
    v_cols = v_col + h * head_dim + j
    v1, v2 = v_ref[v_cols], v_ref[half + v_cols]

    def quantize_in_kernel(x, scale):  # kv_store.quantize
        y = x.astype(jnp.float32) / scale
        if fp8:
            y = jnp.clip(y, -FP8_MAX, FP8_MAX)
        return y.astype(pool_ref.dtype)

    page = pages_ref[n]
    stored = jnp.broadcast_to(page >= 0, (half,))
    k_page = jnp.where(page >= 0, page, 0) + 2 * offset_ref[0]
    slot = slots_ref[n]
    row = k_page * page_size + slot                       # K: one row of the K-row view
    plgpu.store(pool_ref.at[row, j], quantize_in_kernel(k1[0], k_scale), mask=stored)
    plgpu.store(pool_ref.at[row, half + j], quantize_in_kernel(k2[0], k_scale), mask=stored)
    for first, x in ((0, v1), (half, v2)):               # V: column `slot` of V^T
        flat = (first + j) * page_size + slot            # in the V page's [D, page_size]
        v_rows = (k_page + 1) * page_size + flat // head_dim
        plgpu.store(pool_ref.at[v_rows, flat % head_dim], quantize_in_kernel(x, v_scale),
                    mask=stored)


def rope_store(qkv, q_norm, k_norm, cos, sin, pool, store_pages, store_slots, layer_offset,
               *, num_q_heads: int, eps: float, k_scale: float = 1.0, v_scale: float = 1.0,
               norm_row=0, interpret: bool = False):
    """Norm and rotate q and k, store K/V: (q' [N, Hq * D] in qkv's dtype, pool).

    Args:
      qkv: [N, (Hq + 2 Hkv) * D], the fused projections' output, or a tuple
        (q [N, Hq * D], k [N, Hkv * D], v [N, Hkv * D]) (a tensor-parallel shard).
      q_norm, k_norm: [D] head-norm weights, or every layer's [L, D] with `norm_row`
        (int or traced i32) the layer's row: a scanned step passes its stacks whole, so
        no per-layer slice of them runs as a launch of its own ahead of the kernel.
        cos, sin: f32[N, D / 2] for each token's position (`models.qwen3.rope_tables`,
        attention factor included).
      pool: [Hkv, num_pages, num_layers, 2, page_size, D] (donate it: written in place).
      store_pages, store_slots: i32[N] from `store_targets`.
      layer_offset: the layer's offset in the pool, an int or a traced i32[].
    """
    num_kv_heads, num_pages, num_layers, _, page_size, head_dim = pool.shape
    q, k, v = (qkv,) * 3 if not isinstance(qkv, (tuple, list)) else tuple(qkv)
    n = q.shape[0]
    if num_q_heads % num_kv_heads or head_dim % 2 or head_dim & (head_dim - 1):
        raise ValueError(f"rope_store needs q heads ({num_q_heads}) a multiple of kv heads "
                         f"({num_kv_heads}) and a power-of-two head_dim (got {head_dim})")
    if cos.shape != (n, head_dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [{n}, {head_dim // 2}], got {cos.shape} "
                         f"and {sin.shape}")
    if q_norm.shape[-1] != head_dim or k_norm.shape != q_norm.shape or q_norm.ndim > 2:
        raise ValueError(f"q_norm and k_norm must both be [{head_dim}] or [layers, "
                         f"{head_dim}], got {q_norm.shape} and {k_norm.shape}")
    if store_pages.shape != (n,) or store_slots.shape != (n,):
        raise ValueError(f"store_pages and store_slots must be [{n}], got "
                         f"{store_pages.shape} and {store_slots.shape}")
    reason = unaddressable(pool.shape, pool.dtype)
    if reason:
        raise ValueError(f"rope_store cannot address {reason}; use rope_store_reference")
    if isinstance(qkv, (tuple, list)):
        cols = (0, 0, 0)
    else:
        cols = (0, num_q_heads * head_dim, (num_q_heads + num_kv_heads) * head_dim)
    q_per_kv = num_q_heads // num_kv_heads
    kernel_rows = num_pages * num_layers * 2 * page_size
    k_rows = pool.reshape(num_kv_heads, kernel_rows, head_dim)
    offset = jnp.asarray(layer_offset, jnp.int32).reshape(1)
    norm_row = jnp.asarray(norm_row if q_norm.ndim == 2 else 0, jnp.int32).reshape(1)
    row = lambda x: pl.BlockSpec((None, x.shape[1]), lambda i, h: (i, 0))
    whole = pl.BlockSpec(memory_space=None)
    pool_spec = pl.BlockSpec((None, kernel_rows, head_dim), lambda i, h: (h, 0, 0))
    kernel = functools.partial(
        _rope_store_kernel, q_col=cols[0], k_col=cols[1], v_col=cols[2], q_per_kv=q_per_kv,
        group=pow2_at_least(q_per_kv), eps=float(eps), k_scale=float(k_scale),
        v_scale=float(v_scale), head_dim=head_dim, page_size=page_size,
        fp8=pool.dtype == jnp.float8_e4m3fn)
    q_out, k_rows = pl.pallas_call(
        kernel,
        grid=(n, num_kv_heads),
        in_specs=[row(q), row(k), row(v), whole, whole, whole, row(cos), row(sin), whole,
                  whole, whole, pool_spec],
        out_specs=[pl.BlockSpec((None, num_q_heads * head_dim), lambda i, h: (i, 0)),
                   pool_spec],
        out_shape=[jax.ShapeDtypeStruct((n, num_q_heads * head_dim), q.dtype),
                   jax.ShapeDtypeStruct(k_rows.shape, pool.dtype)],
        input_output_aliases={11: 1},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name=f"rope_store_g{q_per_kv}_d{head_dim}",
    )(q, k, v, q_norm.reshape(-1), k_norm.reshape(-1), norm_row, cos, sin, store_pages,
      store_slots, offset, k_rows)
    return q_out, k_rows.reshape(pool.shape)
