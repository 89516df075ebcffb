"""The Mosaic GPU prefill against the jnp reference: GPU interpret mode on CPU
(compiled on a GPU)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention_reference
from pallas_kernels.paged_prefill_mgpu import paged_prefill_mgpu
from tests.pallas_kernels.test_paged_attention import assert_zero_past_q_len, make_case, rel_err

CASES = [  # ragged chunks after earlier context, a padding row; unused pages are NaN
    ("gqa2_page16", dict(num_q_heads=4, num_kv_heads=2, page_size=16, max_q=70,
                         kv_lens=[100, 70, 23], q_lens=[70, 33, 0]), 1),
    ("gqa1_page32_wide_table", dict(num_q_heads=2, num_kv_heads=2, page_size=32, max_q=64,
                                    kv_lens=[64, 150], q_lens=[64, 17], table_width=9), 0),
    ("gqa4_one_page_rows", dict(num_q_heads=4, num_kv_heads=1, page_size=16, max_q=20,
                                kv_lens=[16, 5, 20], q_lens=[16, 5, 20]), 1),
]


@pytest.mark.parametrize("name,case,layer_offset", CASES, ids=[c[0] for c in CASES])
def test_mosaic_prefill_matches_reference(interpret, name, case, layer_offset):
    q, pool, table, kv_lens, q_lens = make_case(np.random.default_rng(len(name)), head_dim=64,
                                                batch=len(case["kv_lens"]), **case)
    out = paged_prefill_mgpu(q, pool, table, kv_lens, q_lens, layer_offset=layer_offset,
                             interpret=interpret)
    ref = paged_attention_reference(q, pool, table, kv_lens, q_lens, layer_offset=layer_offset)
    assert rel_err(out, ref) < 1e-2
    assert_zero_past_q_len(out, q_lens)


@pytest.mark.parametrize("change,match", [
    (dict(kv_dtype=jnp.float8_e4m3fn), "bf16 q and pool"),
    (dict(head_dim=32), "head_dim % 64"),
    (dict(page_size=8), "page_size"),
])
def test_mosaic_prefill_names_what_it_does_not_cover(change, match):
    case = dict(batch=1, max_q=20, num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=16,
                kv_lens=[20], q_lens=[20])
    q, pool, table, kv_lens, q_lens = make_case(np.random.default_rng(0), **{**case, **change})
    with pytest.raises(NotImplementedError, match=match):
        paged_prefill_mgpu(q, pool, table, kv_lens, q_lens, layer_offset=0, interpret=True)


@pytest.mark.gpu
def test_compiled_mosaic_prefill_matches_reference_at_head_dim_128():
    rng = np.random.default_rng(7)
    q, pool, table, kv_lens, q_lens = make_case(
        rng, batch=4, max_q=300, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
        kv_lens=[1200, 300, 999, 64], q_lens=[300, 300, 150, 0])
    out = paged_prefill_mgpu(q, pool, table, kv_lens, q_lens, layer_offset=1)
    ref = paged_attention_reference(q, pool, table, kv_lens, q_lens, layer_offset=1)
    assert rel_err(out, ref) < 1e-2
