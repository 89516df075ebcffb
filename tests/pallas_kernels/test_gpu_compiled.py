"""Compiled (non-interpret) kernels on a GPU at realistic sizes; skipped on CPU."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.launch_plan import LaunchOptions
from pallas_kernels.paged_attention import (draft_block_attention,
                                            draft_block_attention_reference, paged_attention,
                                            paged_attention_reference)
from tests.pallas_kernels.test_paged_attention import (assert_verify_equals_decode, make_case,
                                                      make_draft_case, rel_err)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("max_q", [1, 8, 64])
@pytest.mark.parametrize("compute_dtype", [None, jnp.bfloat16])
def test_compiled_attention_matches_reference_at_head_dim_128(kv_dtype, max_q, compute_dtype):
    rng = np.random.default_rng(max_q)
    q, pool, table, kv_lens, q_lens = make_case(
        rng, batch=16, max_q=max_q, num_q_heads=32, num_kv_heads=8, head_dim=128,
        page_size=16, kv_dtype=kv_dtype, window=512, kv_lens=rng.integers(max_q, 4000, 16))
    kw = dict(layer_offset=1, sliding_window=512)
    out = paged_attention(q, pool, table, kv_lens, q_lens,
                          options=LaunchOptions(compute_dtype=compute_dtype), interpret=False,
                          **kw)
    assert rel_err(out, paged_attention_reference(q, pool, table, kv_lens, q_lens, **kw)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 512])
def test_compiled_draft_block_matches_reference_at_head_dim_128(kv_dtype, causal, window):
    rng = np.random.default_rng(3)
    args, kw = make_draft_case(rng, ctx=[0, *rng.integers(1, 4000, 14)], num_q_heads=32,
                               num_kv_heads=8, head_dim=128, page_size=16, kv_dtype=kv_dtype,
                               window=window, causal=causal)
    out = draft_block_attention(*args, interpret=False, **kw)
    assert rel_err(out, draft_block_attention_reference(*args, **kw)) < 1e-2
    assert (np.asarray(out[-1], np.float32) == 0).all()  # the padding row


BLOCKINGS = [  # the default, and the other blockings the benchmarks time
    {},
    dict(pages_per_block=2, num_warps=2),
    dict(pages_per_block=8, num_warps=2),
    dict(pages_per_block=8, num_warps=4, num_stages=4),
    dict(prefetch_page_ids=True),
    dict(prefetch_page_ids=True, pages_per_block=2),
    dict(rescale_threshold=8.0),
    dict(rescale_threshold=8.0, prefetch_page_ids=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("blocking", BLOCKINGS, ids=lambda b: "-".join(map(str, b.values())))
def test_compiled_verify_equals_decode_bit_for_bit(kv_dtype, window, blocking):
    assert_verify_equals_decode(
        np.random.default_rng(3), max_q=8, batch=16, num_q_heads=32, num_kv_heads=8,
        head_dim=128, page_size=16, kv_dtype=kv_dtype, window=window, max_len=3000,
        blocking=blocking, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("window", [None, 100])
def test_compiled_verify_equals_decode_bit_for_bit_with_soft_cap(kv_dtype, window):
    """Gemma-style logit soft cap: the tanh and its scale sit between the q.K
    dot and the softmax, where the compiler may fuse differently around the
    mask; decode and verify must still round alike."""
    assert_verify_equals_decode(
        np.random.default_rng(6), max_q=8, batch=16, num_q_heads=32, num_kv_heads=8,
        head_dim=128, page_size=16, kv_dtype=kv_dtype, window=window, max_len=3000,
        blocking=dict(soft_cap=30.0), interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,max_q,head_dim", [
    (32, 4, 8, 128), (40, 8, 8, 128), (32, 8, 16, 128), (64, 8, 16, 128), (8, 8, 8, 128),
    (8, 2, 8, 32), (16, 2, 8, 32), (8, 2, 8, 64)])
def test_compiled_verify_equals_decode_bit_for_bit_across_gqa(kv_dtype, num_q_heads,
                                                               num_kv_heads, max_q, head_dim):
    """Default launch options. Verifies of more than 32 query rows per row (GQA
    5-8, or 16 tokens at GQA 4) take several query blocks; on the H200 a
    single 64-row block (4 warps) changed bits against decode, and so did a
    32-row block at head dim 32 (the default pair's), whose dots Triton lays
    out by rows where decode's 16 rows split head_dim."""
    assert_verify_equals_decode(
        np.random.default_rng(4), max_q=max_q, batch=16, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=16, kv_dtype=kv_dtype,
        window=None, max_len=3000, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("blocking", [
    {}, dict(num_stages=3, prefetch_page_ids=False, rescale_threshold=0.0)])
@pytest.mark.parametrize("head_dim", [32, 128])
@pytest.mark.parametrize("window", [None, 100])
def test_compiled_fp8_options_keep_verify_equal_to_decode(blocking, head_dim, window):
    """The fp8 defaults: decode with prefetched page ids, verify with 5 stages (at
    head dim 128; 16-row blocks at 32 prefetch too), both rescaling lazily; and the
    plain options. Verify must equal decode bit for bit under
    both (docs/decisions.md, "Exactness")."""
    assert_verify_equals_decode(
        np.random.default_rng(5), max_q=8, batch=16, num_q_heads=8, num_kv_heads=2,
        head_dim=head_dim, page_size=16, kv_dtype=jnp.float8_e4m3fn, window=window,
        max_len=600, interpret=False, blocking=blocking)


def large_pool_case(pages, max_q=8):
    """An fp8 pool [8, pages, 1, 2, 16, 128] and two rows: row 0 on its last 256 pages
    (the last kv head's last bytes), max_q queries; row 1 on its first, 1 query."""
    import jax

    pool = jax.random.normal(jax.random.key(0), (8, pages, 1, 2, 16, 128),
                             jnp.bfloat16).astype(jnp.float8_e4m3fn)
    table = jnp.stack([jnp.arange(pages - 256, pages), jnp.arange(256)]).astype(jnp.int32) * 2
    q = jax.random.normal(jax.random.key(1), (2, max_q, 32, 128), jnp.bfloat16)
    return q, pool, table, jnp.array([4096, 4000], jnp.int32), jnp.array([max_q, 1], jnp.int32)


@pytest.mark.gpu
def test_compiled_attention_on_a_pool_of_2_31_elements():
    """The largest pool the kernels take (32-bit offsets; larger ones are refused)."""
    args = large_pool_case(2**31 // (8 * 2 * 16 * 128))
    out = paged_attention(*args, layer_offset=0)
    assert rel_err(out, paged_attention_reference(*args, layer_offset=0)) < 1e-2
