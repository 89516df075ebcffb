"""Batch-only device page tables: one kernel builds every pool's table for a step.

The cache keeps one page table per pool, `[num_slots + 1, max_pages_per_seq]`.
A step needs only its batch rows, and only up to the widest row's extent, in
the index the attention kernels read:

    out[p][b, j] = BAD                                   if entry is BAD
                 = entry * scale[p] + offset[p]          otherwise
    where entry  = page_tables[p][slot_ids[b], j],  j < table_width

So the cost grows with batch rows x table_width, never with slots x
max_pages_per_seq.

`table_width` is static (it shapes the output); pick it with `unified_kv.bucket_width`
from the host's upper bound on the rows' extents, so recompiles stay few.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.pool_layout import BAD_PAGE_INDEX

DEFAULT_BLOCK_PAGES = 128


def _convert(entries, scale: int, offset: int):
    return jnp.where(entries == BAD_PAGE_INDEX, BAD_PAGE_INDEX, entries * scale + offset)


def batch_tables_kernel(
    slot_ids_ref,   # i32[batch]
    *refs,          # num_pools page tables i32[num_slots + 1, max_pages_per_seq],
                    # then num_pools outputs i32[block_pages] (row b, block j)
    scales: tuple[int, ...],
    offsets: tuple[int, ...],
    block_pages: int,
):
    num_pools = len(scales)
    table_refs, out_refs = refs[:num_pools], refs[num_pools:]
    b, j = pl.program_id(0), pl.program_id(1)
    slot = slot_ids_ref[b]
    cols = j * block_pages + jnp.arange(block_pages, dtype=jnp.int32)
    for table_ref, out_ref, scale, offset in zip(table_refs, out_refs, scales, offsets):
        max_pages_per_seq = table_ref.shape[1]
        entries = plgpu.load(
            table_ref.at[slot, pl.ds(j * block_pages, block_pages)],
            mask=cols < max_pages_per_seq, other=BAD_PAGE_INDEX)
        out_ref[...] = _convert(entries, scale, offset)


@functools.partial(jax.jit, static_argnames=("table_width", "scales", "offsets",
                                             "block_pages", "interpret"))
def build_batch_tables(
    slot_ids: jax.Array,                   # i32[batch]
    page_tables: tuple[jax.Array, ...],    # per pool i32[num_slots + 1, max_pages_per_seq]
    *,
    table_width: int,
    scales: tuple[int, ...] | None = None,
    offsets: tuple[int, ...] | None = None,
    block_pages: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Per pool, i32[batch, table_width]: the batch rows, converted (BAD stays BAD).

    `block_pages` defaults to the largest power of two <= 128 dividing table_width.
    """
    num_pools = len(page_tables)
    if block_pages is None:
        block_pages = min(DEFAULT_BLOCK_PAGES, table_width & -table_width) or DEFAULT_BLOCK_PAGES
    scales = scales or (1,) * num_pools
    offsets = offsets or (0,) * num_pools
    static_validate_inputs(slot_ids, page_tables, table_width, scales, offsets, block_pages)
    batch = slot_ids.shape[0]
    kernel = functools.partial(batch_tables_kernel, scales=scales, offsets=offsets,
                               block_pages=block_pages)
    whole = pl.BlockSpec(memory_space=None)  # whole array; rows picked in-kernel
    return tuple(pl.pallas_call(
        kernel,
        grid=(batch, table_width // block_pages),
        in_specs=[whole] * (1 + num_pools),       # slot_ids, page tables
        out_specs=[pl.BlockSpec((None, block_pages), lambda b, j: (b, j))] * num_pools,
        out_shape=[jax.ShapeDtypeStruct((batch, table_width), jnp.int32)] * num_pools,
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name=f"batch_tables_pools{num_pools}_block{block_pages}",
    )(slot_ids, *page_tables))


def static_validate_inputs(slot_ids, page_tables, table_width, scales, offsets,
                           block_pages) -> None:
    if slot_ids.ndim != 1 or slot_ids.dtype != jnp.int32:
        raise ValueError(f"slot_ids must be i32[batch], got {slot_ids.shape=} {slot_ids.dtype=}")
    if not page_tables:
        raise ValueError("page_tables is empty; pass one table per pool")
    for t in page_tables:
        if t.ndim != 2 or t.dtype != jnp.int32:
            raise ValueError(f"each page table must be i32[num_slots + 1, max_pages_per_seq], "
                             f"got {t.shape=} {t.dtype=}")
    if len(scales) != len(page_tables) or len(offsets) != len(page_tables):
        raise ValueError(f"need one scale and offset per pool: {len(page_tables)=} "
                         f"{scales=} {offsets=}")
    if block_pages <= 0 or block_pages & (block_pages - 1):
        raise ValueError(f"block_pages must be a power of two, got {block_pages=}")
    if table_width <= 0 or table_width % block_pages:
        raise ValueError(f"table_width must be a positive multiple of {block_pages=}, got "
                         f"{table_width=}; pick one with unified_kv.bucket_width()")


def build_batch_tables_reference(slot_ids, page_tables, *, table_width, scales=None,
                                 offsets=None, **_):
    """Plain-jnp reference: gather rows, pad/crop to table_width, convert."""
    num_pools = len(page_tables)
    scales = scales or (1,) * num_pools
    offsets = offsets or (0,) * num_pools
    outs = []
    for table, scale, offset in zip(page_tables, scales, offsets):
        rows = table[slot_ids]
        pad = max(table_width - rows.shape[1], 0)
        rows = jnp.pad(rows, ((0, 0), (0, pad)), constant_values=BAD_PAGE_INDEX)
        outs.append(_convert(rows[:, :table_width], scale, offset))
    return tuple(outs)
