"""profile_paged_attention: case names, and --baseline (another kernel file as its own module)."""

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.paged_attention as current
from benchmarks.profile_paged_attention import load_kernel, parse_case
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


def test_case_names_parse_to_kernel_options_and_typos_fail_loudly():
    dtype, max_q, q_per_kv, batch, kw = parse_case("fp8_q8_p4w2s5_prefetch_lazy8")
    assert (dtype, max_q, q_per_kv, batch) == (jnp.float8_e4m3fn, 8, 4, 64)
    assert kw == dict(pages_per_block=4, num_warps=2, num_stages=5, prefetch_page_ids=True,
                      rescale_threshold=8.0)
    assert parse_case("bf16_q1") == (jnp.bfloat16, 1, 4, 64, {})
    assert parse_case("fp8_q8_plain") == (jnp.float8_e4m3fn, 8, 4, 64, {"fast_fp8": False})
    assert parse_case("bf16_q8_g8r32") == (jnp.bfloat16, 8, 8, 64, {"rows_per_block": 32})
    assert parse_case("bf16_q1_b4_k16") == (jnp.bfloat16, 1, 4, 4, {"num_splits": 16})
    assert parse_case("bf16_prefill2048_s3")[4]["num_stages"] == 3  # overrides prefill's 2
    for bad in ("fp9_q8", "fp8_q8_x", "fp8_q8_lazy", "fp8_q8p4"):
        with pytest.raises(ValueError, match="case name is KV_WORK"):
            parse_case(bad)


def test_jax_op_baseline_is_scaled_like_the_reference():
    """The benchmarks' jax-op baseline (`jax_op_decode`) computes the same attention as
    ours: the op applies no softmax scale, so unscaled q gave relative errors of 8-50."""
    import jax

    from benchmarks.bench_paged_attention import jax_op_decode, reference_rel_err, setup
    from pallas_kernels.kv_store import layer_kv

    q, pool, table, kv_lens, _ = setup(256, jnp.bfloat16, max_q=8, batch=2)
    fn, args = jax_op_decode(q[:, :1], *layer_kv(pool, 0), table, kv_lens,
                             interpret=jax.default_backend() == "cpu")
    err = reference_rel_err(fn(*args)[:, None], q[:, :1], pool, table, kv_lens,
                            jnp.ones_like(kv_lens))
    assert err < 1e-2
