"""KV store: write new K/V of one layer into its pages (bf16, or fp8 with scales).

    token t of row b -> position start[b] + t   (t < num_tokens[b])
    page  = batch_table[b, position // page_size] // (2 * num_layers)
    slot  = position % page_size
    pool[h, page, layer_offset, 0 (K) / 1 (V), slot, :] = k / k_scale, v / v_scale

Lowering: one XLA scatter into the pool viewed as rows of head_dim; under a
jitted step with the state donated it updates the pool in place and moves
only the new tokens' bytes. Writes whose page is BAD (never allocated) or
whose token is past num_tokens (padding) are dropped and reported per row, so
a missing allocation shows up as data instead of corrupting another row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from unified_kv.spec import BAD_PAGE_INDEX

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value; casting beyond gives NaN


def quantize(x: jax.Array, scale: float, dtype) -> jax.Array:
    """x / scale in the pool's dtype; fp8 saturates instead of overflowing to NaN."""
    y = x.astype(jnp.float32) / scale
    if dtype == jnp.float8_e4m3fn:
        y = jnp.clip(y, -FP8_MAX, FP8_MAX)
    return y.astype(dtype)


@functools.partial(jax.jit, static_argnames=("layer_offset", "k_scale", "v_scale"),
                   donate_argnames=("pool",))
def write_kv(
    pool: jax.Array,         # [num_kv_heads, num_pages, num_layers, 2, page_size, head_dim]
    batch_table: jax.Array,  # i32[batch, table_width]: page * 2 * num_layers, BAD = -1
    starts: jax.Array,       # i32[batch]: position of each row's first new token
    num_tokens: jax.Array,   # i32[batch]: new tokens per row (0 = padding row)
    k: jax.Array,            # [batch, max_tokens, num_kv_heads, head_dim]
    v: jax.Array,            # [batch, max_tokens, num_kv_heads, head_dim]
    *,
    layer_offset: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Returns (pool, ok: bool[batch]); ok is False for a row that had a token
    to write into a BAD page (nothing of that token was written)."""
    num_kv_heads, num_pages, num_layers, _, page_size, head_dim = pool.shape
    batch, max_tokens = k.shape[:2]
    if k.shape != (batch, max_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k and v must be [batch, max_tokens, {num_kv_heads}, {head_dim}], "
                         f"got {k.shape=} {v.shape=}")
    if batch_table.shape[0] != batch or starts.shape != (batch,) or num_tokens.shape != (batch,):
        raise ValueError(f"batch_table, starts, num_tokens need batch={batch}: "
                         f"{batch_table.shape=} {starts.shape=} {num_tokens.shape=}")
    if not 0 <= layer_offset < num_layers:
        raise ValueError(f"layer_offset={layer_offset} outside the pool's {num_layers} layers")
    pos = starts[:, None] + jnp.arange(max_tokens, dtype=jnp.int32)[None]   # [B, T]
    live = jnp.arange(max_tokens)[None] < num_tokens[:, None]
    col = jnp.clip(pos // page_size, 0, batch_table.shape[1] - 1)
    entry = jnp.take_along_axis(batch_table, col, axis=1)
    in_table = (pos // page_size) < batch_table.shape[1]
    writable = live & in_table & (entry != BAD_PAGE_INDEX)
    ok = ~(live & ~writable).any(axis=1)
    page = entry // (2 * num_layers)
    # Row index into the pool viewed as [num_kv_heads, rows, head_dim].
    base = ((page * num_layers + layer_offset) * 2) * page_size + pos % page_size
    rows = num_pages * num_layers * 2 * page_size
    k_rows = jnp.where(writable, base, rows)                 # out of range: dropped
    v_rows = jnp.where(writable, base + page_size, rows)
    flat = pool.reshape(num_kv_heads, rows, head_dim)
    k_new = quantize(k, k_scale, pool.dtype).transpose(2, 0, 1, 3).reshape(num_kv_heads, -1, head_dim)
    v_new = quantize(v, v_scale, pool.dtype).transpose(2, 0, 1, 3).reshape(num_kv_heads, -1, head_dim)
    flat = flat.at[:, k_rows.reshape(-1)].set(k_new, mode="drop")
    flat = flat.at[:, v_rows.reshape(-1)].set(v_new, mode="drop")
    return flat.reshape(pool.shape), ok
