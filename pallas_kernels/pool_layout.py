"""The unified pool as the kernels see it: page ids, K-row and V^T-row views,
and the input checks every attention call shares.

    pool        [num_kv_heads, num_pages, num_layers, 2, page_size, head_dim]
    K page      [page_size, head_dim]  (key-major)
    V page      [head_dim, page_size]  (stored transposed, same bytes)
    K page id   batch_table[b, j] + 2 * layer_offset     (table holds page * 2L)
    V page id   batch_table[b, j] + 2 * layer_offset + 1
    K of key t  row (K page id of t // page_size) * page_size + t % page_size
                of the view [num_kv_heads, kernel_pages * page_size, head_dim]
    V of key t  column t % page_size of rows (V page id) * head_dim + d
                of the view [num_kv_heads, kernel_pages * head_dim, page_size]

with kernel_pages = num_pages * num_layers * 2 (see unified_kv/spec.py). V
pages are transposed so that the attention kernels' P.V dot reads V^T with
its reduction (key) axis contiguous: an fp8 operand has no transposed
shared-memory fragment load on Hopper (docs/decisions.md). `kv_store` writes
through the same views; `kv_store.layer_kv` reads both back key-major.

The page-id constants live here, at the bottom of the package graph, and
`unified_kv` re-exports them: the kernels import nothing from above.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BAD_PAGE_INDEX = -1  # an unallocated page, or one retired behind a window
# Page 0 of every pool is reserved: never allocated, never written, all zeros.
# Kernels read it in place of BAD entries that pad a block, so a stray read
# can never pull NaN/Inf garbage into a masked softmax.
NULL_PAGE = 0
MAX_POOL_ELEMENTS = 2**31  # element offsets up to 2^31 - 1 fit Pallas Triton's int32


def pow2_at_least(n: int) -> int:
    """The least power of two >= n (1 for n <= 1): table widths, transfer sizes
    and kernel blocks round up to these so each compiles for few shapes."""
    return 1 << max(n - 1, 0).bit_length()


def byte_view(x: jax.Array) -> jax.Array:
    """An fp8 array (a pool, or pages for it) as uint8, bits unchanged; other dtypes as
    they are. Gathers and scatters of pages go through this view: XLA has no fp8 gather
    or scatter, and on an fp8 operand converts the whole operand to f16 and back, a
    pass over every page of the pool (and twice its bytes in memory) to move a few."""
    if x.dtype.itemsize == 1 and jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(x, jnp.uint8)
    return x


def from_byte_view(x: jax.Array, dtype) -> jax.Array:
    """`byte_view` undone: `x` (uint8, or already `dtype`) as `dtype`, bits unchanged."""
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def kernel_views(pool):
    """The pool as K rows [num_kv_heads, kernel_pages * page_size, head_dim] and as
    V^T rows [num_kv_heads, kernel_pages * head_dim, page_size] (module docstring)."""
    num_kv_heads, num_pages, num_layers, _, page_size, head_dim = pool.shape
    kernel_pages = num_pages * num_layers * 2
    return (pool.reshape(num_kv_heads, kernel_pages * page_size, head_dim),
            pool.reshape(num_kv_heads, kernel_pages * head_dim, page_size))


def static_validate_inputs(q, pool, batch_table, kv_lens, q_lens, layer_offset,
                           sliding_window, pages_per_block, compute_dtype,
                           max_pool_elements=MAX_POOL_ELEMENTS, block_kv=None) -> None:
    """Trace-time checks of an attention call's arguments (shapes, dtypes,
    static options); each error names the argument and what it must be.
    max_pool_elements: the kernel's addressing limit (None: 64-bit offsets).
    block_kv: a draft block's own (K, V), each [batch, block_size, num_kv_heads, head_dim]."""
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, max_q, num_q_heads, head_dim], got {q.shape=}")
    if pool.ndim != 6 or pool.shape[3] != 2:
        raise ValueError("pool must be [num_kv_heads, num_pages, num_layers, 2, page_size, "
                         f"head_dim], got {pool.shape=}")
    batch, _, num_q_heads, head_dim = q.shape
    num_kv_heads, _, num_layers, _, page_size, pool_head_dim = pool.shape
    if max_pool_elements is not None and pool.size > max_pool_elements:
        # Pallas Triton computes the kernels' element offsets in 32 bits: past 2^31 they
        # wrap and the kernel reads other memory without an error, so such pools are
        # refused here.
        gib = max_pool_elements * pool.dtype.itemsize / 2**30
        raise ValueError(
            f"pool has {pool.size:,} elements ({pool.shape}); the Pallas attention kernels "
            f"address at most 2^31 elements (32-bit offsets): {gib:g} GiB of "
            f"{pool.dtype}. Size the pools under that (pools follow "
            "CacheSpec.memory_budget_bytes)")
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
    if isinstance(layer_offset, int) and not 0 <= layer_offset < num_layers:
        raise ValueError(f"layer_offset={layer_offset} outside the pool's {num_layers} layers")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window=}")
    if pages_per_block <= 0 or pages_per_block & (pages_per_block - 1):
        raise ValueError(f"pages_per_block must be a power of two, got {pages_per_block=}")
    if compute_dtype not in (None, jnp.float16, jnp.bfloat16, jnp.float32):
        raise ValueError(f"compute_dtype must be None, float16, bfloat16 or float32, got "
                         f"{compute_dtype!r}")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim=}")
    want = (batch, q.shape[1], num_kv_heads, head_dim)
    if block_kv is not None and any(x.shape != want for x in block_kv):
        raise ValueError("block_k and block_v must be [batch, block_size, num_kv_heads, "
                         f"head_dim] = {want}, got {[x.shape for x in block_kv]}")
