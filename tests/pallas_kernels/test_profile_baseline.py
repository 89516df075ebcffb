"""profile_paged_attention --baseline: another kernel file loads as its own module."""

import jax.numpy as jnp
import numpy as np

import pallas_kernels.paged_attention as current
from benchmarks.profile_paged_attention import load_kernel
from tests.pallas_kernels.test_paged_attention import make_case


def test_baseline_kernel_file_loads_as_a_separate_module_and_runs():
    baseline = load_kernel(current.__file__)
    assert baseline is not current.paged_attention
    assert baseline.__wrapped__.__module__ == "baseline_paged_attention"
    q, pool, table, kv_lens, q_lens = make_case(np.random.default_rng(0), batch=3, max_q=2,
                                                num_q_heads=4, num_kv_heads=2,
                                                kv_dtype=jnp.float8_e4m3fn)
    kw = dict(layer_offset=1, k_scale=0.5, v_scale=0.25, pages_per_block=2, interpret=True)
    np.testing.assert_array_equal(
        np.asarray(baseline(q, pool, table, kv_lens, q_lens, **kw)),
        np.asarray(current.paged_attention(q, pool, table, kv_lens, q_lens, **kw)))
