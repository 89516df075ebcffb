"""The Mosaic GPU decode / verify (scores transposed) against the jnp reference:
GPU interpret mode on CPU, compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention_reference
from pallas_kernels.paged_decode_mgpu import paged_decode_mgpu
from tests.pallas_kernels.test_paged_attention import (assert_verify_equals_decode,
                                                      assert_zero_past_q_len, kv_scales,
                                                      make_case, rel_err)

FP8 = jnp.float8_e4m3fn
CASES = [  # ragged rows, a padding row, rows shorter than max_q; unused pages are NaN
    ("gqa4_verify5", dict(num_q_heads=8, num_kv_heads=2, max_q=5,
                          kv_lens=[150, 64, 7, 0], q_lens=[5, 2, 5, 0]), 1),
    ("gqa1_decode_wide_table", dict(num_q_heads=2, num_kv_heads=2, max_q=1,
                                    kv_lens=[65, 16], q_lens=[1, 1], table_width=9), 0),
    ("gqa8_verify3_page32", dict(num_q_heads=8, num_kv_heads=1, max_q=3, page_size=32,
                                 kv_lens=[100, 33], q_lens=[3, 1]), 1),
]


def call(q, pool, table, kv_lens, q_lens, layer_offset, interpret):
    return paged_decode_mgpu(q, pool, table, kv_lens, q_lens, layer_offset=layer_offset,
                             interpret=interpret, **kv_scales(pool))


@pytest.mark.parametrize("name,case,layer_offset", CASES, ids=[c[0] for c in CASES])
def test_mosaic_decode_matches_reference(interpret, name, case, layer_offset):
    case = {"page_size": 16, **case}
    q, pool, table, kv_lens, q_lens = make_case(np.random.default_rng(len(name)), head_dim=64,
                                                batch=len(case["kv_lens"]), kv_dtype=FP8,
                                                **case)
    out = call(q, pool, table, kv_lens, q_lens, layer_offset, interpret)
    ref = paged_attention_reference(q, pool, table, kv_lens, q_lens, layer_offset=layer_offset,
                                    **kv_scales(pool))
    assert rel_err(out, ref) < 1e-2
    assert_zero_past_q_len(out, q_lens)


def test_mosaic_verify_equals_decode_bit_for_bit(interpret):
    """Query i of a verify pass == the decode pass at its position, every bit
    (32 query rows against decode's 16: wgmma's N differs)."""
    assert_verify_equals_decode(np.random.default_rng(3), max_q=8, batch=2, max_len=140,
                                interpret=interpret, window=None, attention=paged_decode_mgpu,
                                num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                                kv_dtype=FP8)


@pytest.mark.parametrize("change,match", [
    (dict(kv_dtype=jnp.bfloat16), "fp8 pools"),
    (dict(head_dim=32), "head_dim % 64"),
    (dict(page_size=8), "page_size"),
])
def test_mosaic_decode_names_what_it_does_not_cover(change, match):
    case = dict(batch=1, max_q=1, num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=16,
                kv_dtype=FP8, kv_lens=[20], q_lens=[1])
    q, pool, table, kv_lens, q_lens = make_case(np.random.default_rng(0), **{**case, **change})
    with pytest.raises(NotImplementedError, match=match):
        paged_decode_mgpu(q, pool, table, kv_lens, q_lens, layer_offset=0, interpret=True)


@pytest.mark.gpu
def test_compiled_mosaic_decode_matches_reference_at_head_dim_128():
    q, pool, table, kv_lens, q_lens = make_case(
        np.random.default_rng(7), batch=4, max_q=8, num_q_heads=32, num_kv_heads=8,
        head_dim=128, page_size=16, kv_dtype=FP8, kv_lens=[1200, 300, 999, 0],
        q_lens=[8, 8, 3, 0])
    out = call(q, pool, table, kv_lens, q_lens, 1, False)
    ref = paged_attention_reference(q, pool, table, kv_lens, q_lens, layer_offset=1,
                                    **kv_scales(pool))
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("pages,table_width,match", [
    (1 << 17, 8, "GiB"),      # a 4 GiB pool
    (1 << 10, 40000, "32768 entries"),
])
def test_mosaic_decode_refuses_what_it_has_not_run(pages, table_width, match):
    """Traced only (eval_shape): refused by name before any copy."""
    pool = jax.ShapeDtypeStruct((8, pages, 1, 2, 16, 128), FP8)
    q = jax.ShapeDtypeStruct((2, 1, 32, 128), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((2, table_width), jnp.int32)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    with pytest.raises(NotImplementedError, match=match):
        jax.eval_shape(lambda *a: paged_decode_mgpu(*a, layer_offset=0, interpret=True),
                       q, pool, table, lens, lens)
