import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.batch_tables import (build_batch_tables,
                                         build_batch_tables_reference)
from unified_kv import BAD_PAGE_INDEX


def random_table(rng, num_slots, max_pages, window_pages=None):
    """Ragged rows; windowed rows have BAD in front of a live tail."""
    table = np.full((num_slots + 1, max_pages), BAD_PAGE_INDEX, np.int32)
    for s in range(num_slots):  # the last row is the dummy slot: stays BAD
        extent = int(rng.integers(0, max_pages + 1))
        first = 0 if window_pages is None else max(extent - window_pages, 0)
        table[s, first:extent] = rng.integers(0, 10_000, extent - first)
    holes = rng.random(table.shape) < 0.05  # stray BAD entries anywhere
    table[holes] = BAD_PAGE_INDEX
    return jnp.asarray(table)


@pytest.mark.parametrize("max_pages,width,block", [(300, 384, 128), (40, 128, 128),
                                                   (1000, 256, 128), (64, 64, 16)])
def test_kernel_matches_reference_for_full_windowed_and_draft_pools(interpret, max_pages,
                                                                    width, block):
    rng = np.random.default_rng(max_pages)
    tables = (random_table(rng, 12, max_pages),                 # full target pool
              random_table(rng, 12, max_pages, window_pages=5),  # windowed target pool
              random_table(rng, 12, max_pages, window_pages=3))  # windowed draft pool
    slot_ids = jnp.asarray(rng.permutation(12)[:7].tolist() + [12, 12], jnp.int32)
    kwargs = dict(table_width=width, scales=(4, 6, 2), offsets=(0, 2, 1), block_pages=block)
    got = build_batch_tables(slot_ids, tables, interpret=interpret, **kwargs)
    want = build_batch_tables_reference(slot_ids, tables, **kwargs)
    for g, w in zip(got, want):
        assert g.shape == (9, width)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert (np.asarray(g)[-2:] == BAD_PAGE_INDEX).all()  # padding rows
        # BAD stays BAD, never BAD * scale + offset.
        assert not np.isin(np.asarray(g), [BAD_PAGE_INDEX * s + o for s, o in
                                           [(4, 0), (6, 2), (2, 1)] if BAD_PAGE_INDEX * s + o != -1]).any()


def test_default_block_divides_any_width(interpret):
    table = jnp.arange(3 * 48, dtype=jnp.int32).reshape(3, 48)
    got = build_batch_tables(jnp.array([2, 0], jnp.int32), (table,), table_width=48,
                             interpret=interpret)[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(table)[[2, 0]])


@pytest.mark.parametrize("kwargs,match", [
    (dict(table_width=100, block_pages=128), "table_width must be a positive multiple"),
    (dict(table_width=0), "table_width must be a positive multiple"),
    (dict(table_width=128, scales=(1, 2)), "one scale and offset per pool"),
    (dict(table_width=128, block_pages=96), "block_pages must be a power of two"),
])
def test_invalid_arguments_raise_at_trace_time(kwargs, match):
    table = jnp.zeros((3, 10), jnp.int32)
    with pytest.raises(ValueError, match=match):
        build_batch_tables(jnp.array([0], jnp.int32), (table,), interpret=True, **kwargs)


def test_wrong_dtypes_raise():
    with pytest.raises(ValueError, match="slot_ids must be i32"):
        build_batch_tables(jnp.array([0.0]), (jnp.zeros((3, 10), jnp.int32),),
                           table_width=128, interpret=True)
    with pytest.raises(ValueError, match="each page table must be i32"):
        build_batch_tables(jnp.array([0], jnp.int32), (jnp.zeros((3, 10), jnp.float32),),
                           table_width=128, interpret=True)
