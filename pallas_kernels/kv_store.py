"""KV store: write new K/V of one layer into its pages (bf16, or fp8 with scales).

    token t of row b -> position start[b] + t   (t < num_tokens[b])
    page  = batch_table[b, position // page_size] // (2 * num_layers)
    slot  = position % page_size
    K page [page_size, head_dim]:  K[slot, :] = k / k_scale
    V page [head_dim, page_size]:  V[:, slot] = v / v_scale   (stored transposed)

V pages hold V^T (the same bytes as [page_size, head_dim], read as
[head_dim, page_size]) so the attention kernels' P.V dot reads its key axis
contiguous (see pool_layout.py); `layer_kv` reads both back key-major.

Lowering: two XLA scatters (K rows, V columns) on the pool's bytes (an fp8 pool's uint8
view, `pool_layout.byte_view`: XLA would otherwise convert the whole pool); under a
jitted step with the state donated they update the pool in place and move only the new
tokens' bytes. Writes whose page is BAD (never allocated) or whose token is past
num_tokens (padding) are dropped and reported per row, so a missing allocation shows up
as data instead of corrupting another row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.pool_layout import BAD_PAGE_INDEX, byte_view, from_byte_view, kernel_views

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value; casting beyond gives NaN


def quantize(x: jax.Array, scale: float, dtype) -> jax.Array:
    """x / scale in the pool's dtype; fp8 saturates instead of overflowing to NaN."""
    y = x.astype(jnp.float32) / scale
    if dtype == jnp.float8_e4m3fn:
        y = jnp.clip(y, -FP8_MAX, FP8_MAX)
    return y.astype(dtype)


def write_kv(
    pool: jax.Array,         # [num_kv_heads, num_pages, num_layers, 2, page_size, head_dim]
    batch_table: jax.Array,  # i32[batch, table_width]: page * 2 * num_layers, BAD = -1
    starts: jax.Array,       # i32[batch]: position of each row's first new token
    num_tokens: jax.Array,   # i32[batch]: new tokens per row (0 = padding row)
    k: jax.Array,            # [batch, max_tokens, num_kv_heads, head_dim]
    v: jax.Array,            # [batch, max_tokens, num_kv_heads, head_dim]
    *,
    layer_offset,            # int, or a traced i32[] (layers run as a scan)
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Returns (pool, ok: bool[batch]); ok is False for a row that had a token
    to write into a BAD page (nothing of that token was written). A Python int
    `layer_offset` is checked against the pool; a traced one is the caller's to keep
    in range (the models take it from the cache spec)."""
    num_kv_heads, num_pages, num_layers, _, page_size, head_dim = pool.shape
    batch, max_tokens = k.shape[:2]
    if k.shape != (batch, max_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k and v must be [batch, max_tokens, {num_kv_heads}, {head_dim}], "
                         f"got {k.shape=} {v.shape=}")
    if batch_table.shape[0] != batch or starts.shape != (batch,) or num_tokens.shape != (batch,):
        raise ValueError(f"batch_table, starts, num_tokens need batch={batch}: "
                         f"{batch_table.shape=} {starts.shape=} {num_tokens.shape=}")
    if isinstance(layer_offset, int) and not 0 <= layer_offset < num_layers:
        raise ValueError(f"layer_offset={layer_offset} outside the pool's {num_layers} layers")
    return _write_kv(pool, batch_table, starts, num_tokens, k, v,
                     jnp.asarray(layer_offset, jnp.int32), k_scale=k_scale, v_scale=v_scale)


@functools.partial(jax.jit, static_argnames=("k_scale", "v_scale"), donate_argnames=("pool",))
def _write_kv(pool, batch_table, starts, num_tokens, k, v, layer_offset, *, k_scale, v_scale):
    num_kv_heads, num_pages, num_layers, _, page_size, head_dim = pool.shape
    max_tokens = k.shape[1]
    pos = starts[:, None] + jnp.arange(max_tokens, dtype=jnp.int32)[None]   # [B, T]
    live = jnp.arange(max_tokens)[None] < num_tokens[:, None]
    col = jnp.clip(pos // page_size, 0, batch_table.shape[1] - 1)
    entry = jnp.take_along_axis(batch_table, col, axis=1)
    in_table = (pos // page_size) < batch_table.shape[1]
    writable = live & in_table & (entry != BAD_PAGE_INDEX)
    ok = ~(live & ~writable).any(axis=1)
    page = entry // (2 * num_layers)
    kernel_pages = num_pages * num_layers * 2
    k_page = jnp.where(writable, (page * num_layers + layer_offset) * 2, kernel_pages)
    slot = (pos % page_size).reshape(-1)
    # K: rows of the pool's K-row view (pool_layout); out of range drops.
    k_rows = (k_page * page_size).reshape(-1) + slot
    dtype = pool.dtype
    k_new = quantize(k, k_scale, dtype).transpose(2, 0, 1, 3).reshape(num_kv_heads, -1, head_dim)
    pool = byte_view(pool)   # scattered as bytes (byte_view)
    k_view, _ = kernel_views(pool)
    pool = k_view.at[:, k_rows].set(byte_view(k_new), mode="drop").reshape(pool.shape)
    # V: column `slot` of V page k_page + 1 in the V^T-row view, as [kv heads,
    # kernel_pages, head_dim, page_size].
    v_new = quantize(v, v_scale, dtype).reshape(-1, num_kv_heads, head_dim)
    _, v_view = kernel_views(pool)
    v_pages = v_view.reshape(num_kv_heads, kernel_pages, head_dim, page_size)
    v_pages = v_pages.at[:, (k_page + 1).reshape(-1), :, slot].set(byte_view(v_new),
                                                                    mode="drop")
    return from_byte_view(v_pages.reshape(pool.shape), dtype), ok


def layer_kv(pool: jax.Array, layer_offset: int) -> tuple[jax.Array, jax.Array]:
    """K and V of one layer, key-major: [num_kv_heads, num_pages, page_size, head_dim]
    each (V pages are stored [head_dim, page_size]; this transposes them back)."""
    num_kv_heads, num_pages, _, _, page_size, head_dim = pool.shape
    layer = pool[:, :, layer_offset]
    v_t = layer[:, :, 1].reshape(num_kv_heads, num_pages, head_dim, page_size)
    return layer[:, :, 0], v_t.swapaxes(-1, -2)
