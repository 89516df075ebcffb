"""Random paged-attention cases shared by the kernel tests and the benchmarks' error norms.

`make_case` draws a pool and batch tables the way the real cache lays them out
(page 0 the zero null page, windowed rows with BAD entries in front of their
live tail) and fills every page no live position uses with NaN, so a kernel
that reads one poisons its output and `rel_err` fails on it.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np

from pallas_kernels.pool_layout import BAD_PAGE_INDEX, NULL_PAGE

POISON = float("nan")  # in every page no live position uses: one read shows


def make_case(rng, *, batch, max_q, num_q_heads, num_kv_heads, head_dim=32, page_size=8,
              num_layers=2, kv_dtype=jnp.bfloat16, window=None, kv_lens=None, q_lens=None,
              table_width=None):
    """Random pool and tables; windowed rows get BAD entries in front of their tail.
    Pages no live position uses (retired, spare) are NaN, so reading one poisons
    the output; page 0 is the pool's null page (zeros), as in the real cache."""
    kv_lens = np.asarray(kv_lens if kv_lens is not None else
                         rng.integers(1, 60, batch), np.int32)
    q_lens = np.asarray(q_lens if q_lens is not None else
                        np.minimum(rng.integers(1, max_q + 1, batch), kv_lens), np.int32)
    pages_needed = [-(-int(n) // page_size) for n in kv_lens]
    width = table_width or max(max(pages_needed), 1)
    num_pages = sum(pages_needed) + 4
    pool = rng.standard_normal((num_kv_heads, num_pages, num_layers, 2, page_size, head_dim))
    if kv_dtype == jnp.float8_e4m3fn:
        pool = pool * 2.0  # stored = value / scale with scales below
    perm = 1 + rng.permutation(num_pages - 1)  # page 0 is never live
    live = np.zeros(num_pages, bool)
    table = np.full((batch, width), BAD_PAGE_INDEX, np.int32)
    used = 0
    for b in range(batch):
        first = 0
        if window is not None:
            first = max(int(kv_lens[b] - q_lens[b]) - window + 1, 0) // page_size
        pages = perm[used:used + pages_needed[b]]
        used += pages_needed[b]
        table[b, first:pages_needed[b]] = pages[first:] * 2 * num_layers
        live[pages[first:]] = True
    pool[:, ~live] = POISON
    pool[:, NULL_PAGE] = 0.0
    q = rng.standard_normal((batch, max_q, num_q_heads, head_dim))
    return (jnp.asarray(q, jnp.bfloat16), jnp.asarray(pool, kv_dtype), jnp.asarray(table),
            jnp.asarray(kv_lens), jnp.asarray(q_lens))


def kv_scales(pool):
    """The K/V scales make_case's pools are drawn for (fp8 stores value / scale)."""
    fp8 = pool.dtype == jnp.float8_e4m3fn
    return dict(k_scale=0.5 if fp8 else 1.0, v_scale=0.25 if fp8 else 1.0)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "non-finite output (an unwritten or poisoned read?)"
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-6)


def make_draft_case(rng, *, ctx, num_q_heads, num_kv_heads, window=None, block=8,
                    kv_dtype=jnp.bfloat16, head_dim=32, page_size=8, causal=False):
    """A draft block per row of `ctx` context positions, plus a padding row:
    (draft_block_attention's arrays, its keyword arguments)."""
    batch = len(ctx) + 1
    _, pool, table, ctx_lens, _ = make_case(
        rng, batch=batch, max_q=block, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=page_size, kv_dtype=kv_dtype, window=window,
        kv_lens=list(ctx) + [0], q_lens=[0] * batch)
    block_lens = jnp.asarray([block] * len(ctx) + [0], jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, block, num_q_heads, head_dim)), jnp.bfloat16)
    bk, bv = (jnp.asarray(rng.standard_normal((batch, block, num_kv_heads, head_dim)),
                          jnp.bfloat16) for _ in range(2))
    kw = dict(layer_offset=1, causal_in_block=causal, sliding_window=window,
              **kv_scales(pool))
    return (q, pool, table, ctx_lens, block_lens, bk, bv), kw


def whole_pool_conversions(compiled_hlo: str, pool_elements: int) -> list[str]:
    """Lines of a compiled program (`jax.jit(f).lower(...).compile().as_text()`) that make
    an f16 or f32 array of at least `pool_elements` elements: an fp8 pool converted whole
    (what XLA does to gather from or scatter into fp8 without `pool_layout.byte_view`)."""
    found = []
    for line in compiled_hlo.splitlines():
        for dims in re.findall(r"\b(?:f16|f32)\[([\d,]+)\]", line.split("=", 1)[-1][:200]):
            if int(np.prod([int(d) for d in dims.split(",")])) >= pool_elements:
                found.append(line.strip()[:160])
                break
    return found
