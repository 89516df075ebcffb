"""pallas_kernels/paged_attention_gluon.py against the pure-jnp reference. Compiled for
sm_90 on any machine with a Triton that has Gluon (`.[inspect]`); run on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton.experimental.gluon._runtime",
                    reason="pip install '.[inspect]' (a Triton with Gluon)")

from pallas_kernels import gluon_call as gc  # noqa: E402
from pallas_kernels import paged_attention_gluon as pg  # noqa: E402
from pallas_kernels.paged_attention import paged_attention_reference  # noqa: E402
from tests.pallas_kernels.test_paged_attention import (  # noqa: E402
    assert_verify_equals_decode, assert_zero_past_q_len, kv_scales, make_case, rel_err)

FP8 = jnp.float8_e4m3fn


def gluon_attention(*args, interpret=None, **kw):
    """paged_attention's signature (the verify == decode helper passes interpret)."""
    return jax.jit(lambda *a: pg.paged_attention_gluon(*a, **kw))(*args)


@pytest.mark.parametrize("kv_dtype,max_q,window,soft_cap,head_dim,page_size,gqa", [
    (FP8, 1, None, None, 128, 16, 4), (FP8, 8, None, None, 128, 16, 4),
    (FP8, 8, 100, 30.0, 128, 16, 4), (jnp.bfloat16, 8, None, None, 128, 16, 4),
    (FP8, 5, None, None, 64, 16, 8), (jnp.bfloat16, 4, 20, None, 32, 8, 1),
])
def test_compiles_for_hopper(kv_dtype, max_q, window, soft_cap, head_dim, page_size, gqa):
    q = jax.ShapeDtypeStruct((4, max_q, 2 * gqa, head_dim), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((2, 40, 2, 2, page_size, head_dim), kv_dtype)
    table = jax.ShapeDtypeStruct((4, 9), jnp.int32)
    lens = jax.ShapeDtypeStruct((4,), jnp.int32)
    scalars, constexprs, grid = pg.launch(q, pool, table, layer_offset=1,
                                          sliding_window=window, soft_cap=soft_cap)
    sig = gc.signature(pg.paged_attention_kernel, [q, pool, table, lens, lens],
                       (None,) * 5 + scalars, [q], tuple(sorted(constexprs.items())))
    compiled = gc.compile_gluon(pg.paged_attention_kernel, tuple(sig.items()),
                                tuple(sorted(constexprs.items())), pg.NUM_WARPS, 90)
    assert compiled.metadata.shared <= 100 * 1024  # shared memory for at least 2 CTAs/SM
    assert grid[1:] == (4, 2)


def test_refuses_what_it_does_not_take():
    q = jnp.zeros((2, 17, 8, 128), jnp.bfloat16)
    pool = jnp.zeros((2, 4, 1, 2, 16, 128), FP8)
    args = (pool, jnp.zeros((2, 4), jnp.int32), jnp.ones((2,), jnp.int32),
            jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match="17 query tokens per row"):
        pg.paged_attention_gluon(q, *args, layer_offset=0)
    with pytest.raises(ValueError, match="pool dtype float32"):
        pg.paged_attention_gluon(q[:, :1], pool.astype(jnp.float32), *args[1:], layer_offset=0)
    assert not pg.use_gluon(q[:, :1], pool) or jax.default_backend() == "gpu"


CASES = [  # kv dtype, max_q, window, soft cap, q heads per kv head
    (FP8, 1, None, None, 4), (FP8, 8, None, None, 4), (FP8, 8, 100, None, 4),
    (FP8, 4, None, 30.0, 1), (FP8, 3, 64, 50.0, 8), (jnp.bfloat16, 1, None, None, 4),
    (jnp.bfloat16, 8, 100, 30.0, 4), (jnp.bfloat16, 5, None, None, 8),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,max_q,window,soft_cap,gqa", CASES)
def test_matches_reference(kv_dtype, max_q, window, soft_cap, gqa):
    rng = np.random.default_rng(max_q * 7 + gqa)
    kv_lens = rng.integers(max_q, 3000, 12)
    kv_lens[:3] = [max_q, 16 * 40, 16 * 40 + 1]  # at and around page / block edges
    q, pool, table, kv_lens, q_lens = make_case(
        rng, batch=12, max_q=max_q, num_q_heads=8 * gqa, num_kv_heads=8, head_dim=128,
        page_size=16, kv_dtype=kv_dtype, window=window, kv_lens=kv_lens)
    q_lens = q_lens.at[-1].set(0)  # a padding row
    kw = dict(layer_offset=1, sliding_window=window, soft_cap=soft_cap, **kv_scales(pool))
    out = gluon_attention(q, pool, table, kv_lens, q_lens, **kw)
    assert rel_err(out, paged_attention_reference(q, pool, table, kv_lens, q_lens, **kw)) < 1e-2
    assert_zero_past_q_len(out, q_lens)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [FP8, jnp.bfloat16])
@pytest.mark.parametrize("window", [None, 100])
def test_verify_equals_decode_bit_for_bit(kv_dtype, window):
    assert_verify_equals_decode(np.random.default_rng(5), max_q=8, batch=16, max_len=3000,
                                num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                kv_dtype=kv_dtype, window=window, interpret=False,
                                attention=gluon_attention)


@pytest.mark.gpu
def test_pool_past_2_31_elements():
    """64-bit offsets: an fp8 pool over 2^31 elements (the Pallas kernels refuse it), read
    at its last pages."""
    from tests.pallas_kernels.test_gpu_compiled import large_pool_case

    q, pool, *rest = args = large_pool_case(2**31 // (8 * 2 * 16 * 128) + 64)
    out = gluon_attention(*args, layer_offset=0)
    assert rel_err(out, paged_attention_reference(*args, layer_offset=0)) < 1e-2
    assert pg.use_gluon(q, pool)
