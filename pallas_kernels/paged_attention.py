"""The paged-attention entry points on the Pallas Triton kernel, each beside the
pure-jnp reference that states its contract; the Gluon kernel
(`paged_attention_gluon.py`) meets the same references.

    paged_attention          decode (max_q 1), verify (K+1), chunked prefill: the
                             queries' own K/V are already in the cache
    draft_block_attention    the DFlash draft block: queries after the row's context,
                             over the context and the block's own K/V (not cached)

The kernel and its launch: `paged_attention_kernel.py`; the launch choices:
`launch_plan.py`; the pool's layout and page ids: `pool_layout.py`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.kv_store import layer_kv
from pallas_kernels.launch_plan import LaunchOptions
from pallas_kernels.paged_attention_kernel import attention_call
from pallas_kernels.pool_layout import BAD_PAGE_INDEX, static_validate_inputs


# layer_offset is traced: one compiled kernel serves every layer of a pool, and a layer
# scan passes its offset as is.
_attention_call = jax.jit(attention_call, static_argnames=(
    "queries_cached", "sliding_window", "sm_scale", "soft_cap", "k_scale", "v_scale",
    "block_causal", "options", "interpret"))


def paged_attention(
    q: jax.Array,            # [batch, max_q, num_q_heads, head_dim]
    pool: jax.Array,         # [num_kv_heads, num_pages, num_layers, 2, page_size, head_dim]
    batch_table: jax.Array,  # i32[batch, table_width]: page * 2 * num_layers, BAD = -1
    kv_lens: jax.Array,      # i32[batch]: cached positions, the queries' own included
    q_lens: jax.Array,       # i32[batch]: query tokens per row, 0..max_q (0 = padding)
    *,
    layer_offset: int | jax.Array,  # the layer in the pool: an int, or a traced i32[]
    sliding_window: int | None = None,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    options: LaunchOptions = LaunchOptions(),
    interpret: bool = False,
) -> jax.Array:
    """Paged GQA attention: decode (max_q 1), verify (K+1), chunked prefill (chunk).

    The queries' own K/V are already in the cache (store first, then attend):
    query i of row b sits at position kv_lens[b] - q_lens[b] + i and sees
    cached keys at positions <= its own (and > position - sliding_window).
    Returns [batch, max_q, num_q_heads, head_dim] in q's dtype; entries of
    query tokens past a row's q_len are zero. The dots run in `compute_dtype`
    (default: q's dtype, or float16 over fp8 KV) with f32 accumulation and an
    f32 softmax.

    `options` (`launch_plan.LaunchOptions`, one static argument) holds the
    launch choices; fields left None take `launch_plan.plan_launch`'s defaults
    for the query count and the KV dtype, which keep a row's decode and verify
    passes bit-for-bit equal. `prefetch_page_ids` loads each block's page-table
    entries one iteration ahead, so Triton keeps the next blocks' K/V loads in
    flight; it changes no bit. `rescale_threshold` T > 0 moves a row's running max (and rescales
    its accumulator) only when a block's max passes it by more than T (base
    2), so p stays below 2**T and most blocks skip the rescale; 0 rescales
    whenever the max grows. It changes rounding.
    """
    static_validate_inputs(q, pool, batch_table, kv_lens, q_lens, layer_offset,
                           sliding_window, options.pages_per_block, options.compute_dtype)
    return _attention_call(
        q, pool, batch_table, kv_lens, q_lens, None, queries_cached=True,
        layer_offset=layer_offset, sliding_window=sliding_window, sm_scale=sm_scale,
        soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, block_causal=False,
        options=options, interpret=interpret)


def draft_block_attention(
    q: jax.Array,            # [batch, block_size, num_q_heads, head_dim]
    pool: jax.Array,         # [num_kv_heads, num_pages, num_layers, 2, page_size, head_dim]
    batch_table: jax.Array,  # i32[batch, table_width]
    ctx_lens: jax.Array,     # i32[batch]: draft context positions (= the anchor position)
    block_lens: jax.Array,   # i32[batch]: block_size for real rows, 0 for padding rows
    block_k: jax.Array,      # [batch, block_size, num_kv_heads, head_dim]: block's own K
    block_v: jax.Array,      # [batch, block_size, num_kv_heads, head_dim]: block's own V
    *,
    layer_offset: int | jax.Array,
    causal_in_block: bool = False,
    sliding_window: int | None = None,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    options: LaunchOptions = LaunchOptions(),
    interpret: bool = False,
) -> jax.Array:
    """DFlash draft block: block queries at positions ctx_len .. ctx_len + B - 1
    attend to the row's cached context (positions < ctx_len, windowed for
    sliding layers) and to the block's temporary K/V, bidirectionally or
    causally within the block. Block K/V stay out of the cache.
    """
    static_validate_inputs(q, pool, batch_table, ctx_lens, block_lens, layer_offset,
                           sliding_window, options.pages_per_block, options.compute_dtype,
                           block_kv=(block_k, block_v))
    return _attention_call(
        q, pool, batch_table, ctx_lens, block_lens, (block_k, block_v), queries_cached=False,
        layer_offset=layer_offset, sliding_window=sliding_window, sm_scale=sm_scale,
        soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, block_causal=causal_in_block,
        options=options, interpret=interpret)


def dequantized_kv(pool, layer_offset, k_scale=1.0, v_scale=1.0):
    """f32 K and V of one layer: [num_kv_heads, num_pages, page_size, head_dim] each."""
    k, v = layer_kv(pool, layer_offset)
    return k.astype(jnp.float32) * k_scale, v.astype(jnp.float32) * v_scale


def _attention_reference(q, pool, batch_table, kv_lens, q_starts, q_lens, block_kv=None, *,
                         layer_offset, causal_in_block=False, sliding_window=None,
                         sm_scale=None, soft_cap=None, k_scale=1.0, v_scale=1.0):
    """Plain-jnp f32: gather the rows' pages densely, append the block, mask, softmax."""
    batch, max_q, num_q_heads, head_dim = q.shape
    num_kv_heads, _, num_layers, _, page_size, _ = pool.shape
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    k_all, v_all = dequantized_kv(pool, layer_offset, k_scale, v_scale)
    ok_page = batch_table != BAD_PAGE_INDEX
    safe = jnp.where(ok_page, batch_table // (2 * num_layers), 0)  # back to page ids
    k = k_all[:, safe].reshape(num_kv_heads, batch, -1, head_dim).transpose(1, 2, 0, 3)
    v = v_all[:, safe].reshape(num_kv_heads, batch, -1, head_dim).transpose(1, 2, 0, 3)
    k_pos = jnp.arange(k.shape[1])
    q_tok = jnp.arange(max_q)
    q_pos = q_starts[:, None] + q_tok[None]                                  # [B, Q]
    visible = (jnp.repeat(ok_page, page_size, axis=1)[:, None, :]
               & (k_pos[None, None, :] <= q_pos[..., None])
               & (k_pos[None, None, :] < kv_lens[:, None, None]))            # [B, Q, T]
    if sliding_window is not None:
        visible &= k_pos[None, None, :] > q_pos[..., None] - sliding_window
    if block_kv is not None:  # the draft block's own keys, at positions q_start + j
        k = jnp.concatenate([k, block_kv[0].astype(jnp.float32)], axis=1)
        v = jnp.concatenate([v, block_kv[1].astype(jnp.float32)], axis=1)
        in_block = jnp.broadcast_to(q_tok[None, None, :] < q_lens[:, None, None],
                                    (batch, max_q, max_q))
        if causal_in_block:
            in_block &= q_tok[None, None, :] <= q_tok[None, :, None]
        if sliding_window is not None:
            in_block &= q_tok[None, None, :] > q_tok[None, :, None] - sliding_window
        visible = jnp.concatenate([visible, in_block], axis=2)
    visible &= (q_tok[None, :] < q_lens[:, None])[..., None]
    qh = q.astype(jnp.float32).reshape(batch, max_q, num_kv_heads,
                                       num_q_heads // num_kv_heads, head_dim)
    logits = jnp.einsum("bqhgd,bthd->bqhgt", qh, k) * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    mask = visible[:, :, None, None, :]
    probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    probs = jnp.where(mask, probs, 0.0)  # rows with no visible key -> zeros
    out = jnp.einsum("bqhgt,bthd->bqhgd", probs, v)
    return out.reshape(q.shape).astype(q.dtype)


def paged_attention_reference(q, pool, batch_table, kv_lens, q_lens, *, layer_offset,
                              sliding_window=None, sm_scale=None, soft_cap=None,
                              k_scale=1.0, v_scale=1.0, **_):
    """Reference for `paged_attention` (same arguments; tuning knobs ignored)."""
    return _attention_reference(
        q, pool, batch_table, kv_lens, kv_lens - q_lens, q_lens, layer_offset=layer_offset,
        sliding_window=sliding_window, sm_scale=sm_scale, soft_cap=soft_cap,
        k_scale=k_scale, v_scale=v_scale)


def draft_block_attention_reference(q, pool, batch_table, ctx_lens, block_lens, block_k,
                                    block_v, *, layer_offset, causal_in_block=False,
                                    sliding_window=None, sm_scale=None, soft_cap=None,
                                    k_scale=1.0, v_scale=1.0, **_):
    """Reference for `draft_block_attention` (same arguments; tuning knobs ignored)."""
    return _attention_reference(
        q, pool, batch_table, ctx_lens, ctx_lens, block_lens, (block_k, block_v),
        layer_offset=layer_offset, causal_in_block=causal_in_block,
        sliding_window=sliding_window, sm_scale=sm_scale, soft_cap=soft_cap,
        k_scale=k_scale, v_scale=v_scale)
