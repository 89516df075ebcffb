import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_store import write_kv
from pallas_kernels.testing import whole_pool_conversions
from pallas_kernels.rope_store import (rope_store, rope_store_reference, store_targets,
                                      unaddressable)
from unified_kv import BAD_PAGE_INDEX

HEADS, KV_HEADS, DIM, PAGE, LAYERS, PAGES = 8, 2, 32, 8, 3, 12
EPS = 1e-6
UNWRITTEN = 448.0


def case(rng, dtype, batch=4, max_tokens=5, heads=HEADS, kv_heads=KV_HEADS, dim=DIM):
    """Random projections, norms, rotation tables and a pool with BAD pages and
    padding rows: row 0 crosses a page boundary, row 1 sits behind BAD entries (a
    window), row 2 runs past its only page, row 3 is padding."""
    table = np.full((batch, 3), BAD_PAGE_INDEX, np.int32)
    table[0, :2] = np.array([3, 5]) * 2 * LAYERS
    table[1, 1:3] = np.array([7, 1]) * 2 * LAYERS
    table[2, 0] = 9 * 2 * LAYERS
    starts = np.array([6, 13, 4, 0], np.int32)[:batch]
    num_tokens = np.array([4, 3, 5, 0], np.int32)[:batch]
    n = batch * max_tokens
    qkv = jnp.asarray(rng.standard_normal((n, (heads + 2 * kv_heads) * dim)) * 3, jnp.bfloat16)
    q_norm = jnp.asarray(1 + 0.1 * rng.standard_normal(dim), jnp.bfloat16)
    k_norm = jnp.asarray(1 + 0.1 * rng.standard_normal(dim), jnp.bfloat16)
    angles = rng.uniform(0, 50, (n, dim // 2)).astype(np.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    # a value no stored K or V takes (they are near unit scale), so writes show
    pool = jnp.full((kv_heads, PAGES, LAYERS, 2, PAGE, dim), UNWRITTEN, dtype)
    pages, slots = store_targets(jnp.asarray(table), jnp.asarray(starts),
                                 jnp.asarray(num_tokens), PAGE, max_tokens)
    return dict(qkv=qkv, q_norm=q_norm, k_norm=k_norm, cos=cos, sin=sin, pool=pool,
                store_pages=pages, store_slots=slots), (table, starts, num_tokens, max_tokens)


def test_store_targets_drop_padding_bad_pages_and_positions_past_the_table():
    table = np.array([[12, BAD_PAGE_INDEX], [BAD_PAGE_INDEX, 30]], np.int32)
    pages, slots = store_targets(jnp.asarray(table), jnp.array([6, 9]), jnp.array([3, 1]), 4, 3)
    # row 0: positions 6, 7 in entry 1 (BAD), 8 past the table; row 1: position 9
    # in entry 2 (past), then padding
    assert pages.tolist() == [-1, -1, -1, -1, -1, -1]
    pages, slots = store_targets(jnp.asarray(table), jnp.array([2, 5]), jnp.array([3, 2]), 4, 3)
    assert pages.tolist() == [12, 12, -1, 30, 30, -1]
    assert slots.tolist() == [2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("dtype,k_scale,v_scale", [(jnp.bfloat16, 1.0, 1.0),
                                                   (jnp.float8_e4m3fn, 0.5, 0.125)])
def test_reference_is_the_models_norm_rope_and_write_kv(dtype, k_scale, v_scale):
    """The reference equals the unfused form (per-head rms_norm, NeoX rotation in f32,
    then kv_store.write_kv) bit for bit."""
    rng = np.random.default_rng(0)
    args, (table, starts, num_tokens, t) = case(rng, dtype)
    q, pool = rope_store_reference(**args, layer_offset=1, num_q_heads=HEADS, eps=EPS,
                                   k_scale=k_scale, v_scale=v_scale)

    def norm(x, w):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + EPS)
        return (x32 * w.astype(jnp.float32)).astype(x.dtype)

    def rot(x, cos, sin):
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        cos, sin = cos[:, :, None], sin[:, :, None]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)

    b = len(starts)
    qkv = args["qkv"].reshape(b, t, HEADS + 2 * KV_HEADS, DIM)
    cos, sin = (a.reshape(b, t, DIM // 2) for a in (args["cos"], args["sin"]))
    want_q = rot(norm(qkv[:, :, :HEADS], args["q_norm"]), cos, sin)
    want_k = rot(norm(qkv[:, :, HEADS:HEADS + KV_HEADS], args["k_norm"]), cos, sin)
    want_pool, ok = write_kv(args["pool"] + 0, jnp.asarray(table), jnp.asarray(starts),
                             jnp.asarray(num_tokens), want_k, qkv[:, :, HEADS + KV_HEADS:],
                             layer_offset=1, k_scale=k_scale, v_scale=v_scale)
    assert np.asarray(ok).tolist() == [True, True, False, True]
    np.testing.assert_array_equal(np.asarray(q, np.float32),
                                  np.asarray(want_q.reshape(b * t, -1), np.float32))
    np.testing.assert_array_equal(np.asarray(pool, np.float32), np.asarray(want_pool, np.float32))


def check_kernel(args, split, interpret, heads, kv_heads, dim, **kw):
    """The kernel (compiled, or interpret mode) against the reference, with a traced
    layer offset; `split`: the projections as a (q, k, v) tuple (a tensor-parallel
    shard's form)."""
    if split:
        args["qkv"] = tuple(jnp.split(args["qkv"], [heads * dim, (heads + kv_heads) * dim], -1))
    kw = dict(num_q_heads=heads, eps=EPS, **kw)
    want_q, want_pool = rope_store_reference(**dict(args, pool=args["pool"] + 0),
                                             layer_offset=2, **kw)
    got_q, got_pool = jax.jit(
        lambda a, o: rope_store(**a, layer_offset=o, interpret=interpret, **kw))(args,
                                                                               jnp.int32(2))
    # the kernel's sum of squares adds in another order: a bf16 ulp at most
    np.testing.assert_allclose(np.asarray(got_q, np.float32), np.asarray(want_q, np.float32),
                               rtol=1e-2, atol=1e-2)
    got, want = np.asarray(got_pool, np.float32), np.asarray(want_pool, np.float32)
    np.testing.assert_allclose(got, want, rtol=7e-2, atol=1e-2)
    assert ((got != UNWRITTEN) == (want != UNWRITTEN)).all()
    # K and V of 4 + 3 + 4 tokens (row 2's fifth falls on a BAD page; row 3 is padding)
    assert (want != UNWRITTEN).sum() == 2 * kv_heads * dim * 11
    # Every layer's norm weights with a traced row (a scan's form): the same bits as the
    # row's own [D] weights, in the kernel and in the reference.
    rng = np.random.default_rng(7)
    stacks = {name: jnp.stack([jnp.asarray(1 + 0.1 * rng.standard_normal(dim), w.dtype), w,
                               jnp.asarray(1 + 0.1 * rng.standard_normal(dim), w.dtype)])
              for name, w in (("q_norm", args["q_norm"]), ("k_norm", args["k_norm"]))}
    stacked_q, stacked_pool = jax.jit(
        lambda a, o, r: rope_store(**dict(a, **stacks), layer_offset=o, norm_row=r,
                                   interpret=interpret, **kw))(args, jnp.int32(2), jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(stacked_q, np.float32), np.asarray(got_q, np.float32))
    np.testing.assert_array_equal(np.asarray(stacked_pool, np.float32), got)
    ref_q, ref_pool = rope_store_reference(**dict(args, pool=args["pool"] + 0, **stacks),
                                           layer_offset=2, norm_row=jnp.int32(1), **kw)
    np.testing.assert_array_equal(np.asarray(ref_q, np.float32), np.asarray(want_q, np.float32))
    np.testing.assert_array_equal(np.asarray(ref_pool, np.float32), want)


@pytest.mark.parametrize("dtype,k_scale,v_scale", [(jnp.bfloat16, 1.0, 1.0),
                                                   (jnp.float8_e4m3fn, 0.5, 0.125)])
@pytest.mark.parametrize("split", [False, True])
def test_kernel_matches_reference(dtype, k_scale, v_scale, split, interpret):
    args, _ = case(np.random.default_rng(1), dtype)
    check_kernel(args, split, interpret, HEADS, KV_HEADS, DIM, k_scale=k_scale, v_scale=v_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_compiled_kernel_at_the_8b_head_shape(dtype):
    """32 q heads over 8 kv heads of 128 (Qwen3-8B), compiled."""
    args, _ = case(np.random.default_rng(3), dtype, heads=32, kv_heads=8, dim=128)
    check_kernel(args, False, False, 32, 8, 128, k_scale=0.25, v_scale=0.5)


def test_rejects_mismatched_tables():
    rng = np.random.default_rng(2)
    args, _ = case(rng, jnp.bfloat16)
    with pytest.raises(ValueError, match="cos and sin must be"):
        rope_store(**dict(args, cos=args["cos"][:3]), layer_offset=0, num_q_heads=HEADS,
                   eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="store_pages and store_slots"):
        rope_store(**dict(args, store_slots=args["store_slots"][:3]), layer_offset=0,
                   num_q_heads=HEADS, eps=EPS, interpret=True)


def test_offsets_reach_every_element_or_the_pool_is_refused():
    """32-bit signed offsets up to 2^31 elements, 64-bit past 2^32 bytes; fp8 pools in
    between are refused by the kernel (the models then store through XLA, warned)."""
    assert unaddressable((8, 1024, 36, 2, 16, 128), jnp.float8_e4m3fn) is None   # 1.2e9
    assert unaddressable((8, 10_000, 36, 2, 16, 128), jnp.bfloat16) is None      # 64-bit
    assert unaddressable((8, 10_000, 36, 2, 16, 128), jnp.float8_e4m3fn) is None  # 11.8 GB
    reason = unaddressable((8, 2_000, 36, 2, 16, 128), jnp.float8_e4m3fn)        # 2.4e9
    assert reason and "2^31 to 2^32" in reason
    pool = jax.ShapeDtypeStruct((KV_HEADS, 60_000, 36, 2, PAGE, DIM), jnp.float8_e4m3fn)  # 2.2e9
    args, _ = case(np.random.default_rng(4), jnp.bfloat16)
    with pytest.raises(ValueError, match="cannot address"):
        jax.eval_shape(lambda p: rope_store(**dict(args, pool=p), layer_offset=0,
                                            num_q_heads=HEADS, eps=EPS), pool)


@pytest.mark.gpu
def test_compiled_kernel_past_4_gib_stores_what_it_stores_below():
    """A bf16 pool of 2.5e9 elements (4.9 GB) takes Pallas Triton's 64-bit offsets: tokens
    stored into its last page land as they do in a small pool's (32-bit offsets)."""
    rng = np.random.default_rng(5)
    n, heads, kv_heads, dim, page = 4, 8, 2, 128, 16
    big_pages = 300_000                                   # 2 * 300,000 * 2 * 16 * 128 > 2^31
    qkv = jnp.asarray(rng.standard_normal((n, (heads + 2 * kv_heads) * dim)), jnp.bfloat16)
    norms = [jnp.asarray(1 + 0.1 * rng.standard_normal(dim), jnp.bfloat16) for _ in range(2)]
    angles = rng.uniform(0, 50, (n, dim // 2)).astype(np.float32)
    slots = jnp.arange(n, dtype=jnp.int32)
    kw = dict(num_q_heads=heads, eps=EPS, layer_offset=0)

    def stored(num_pages):
        pool = jnp.zeros((kv_heads, num_pages, 1, 2, page, dim), jnp.bfloat16)
        pages = jnp.full((n,), 2 * (num_pages - 1), jnp.int32)   # the pool's last page
        q, pool = jax.jit(lambda p: rope_store(qkv, *norms, jnp.cos(angles), jnp.sin(angles),
                                               p, pages, slots, **kw))(pool)
        return np.asarray(q, np.float32), np.asarray(pool[:, -1], np.float32)

    small_q, small_page = stored(4)
    big_q, big_page = stored(big_pages)
    assert unaddressable((kv_heads, big_pages, 1, 2, page, dim), jnp.bfloat16) is None
    np.testing.assert_array_equal(big_q, small_q)
    np.testing.assert_array_equal(big_page, small_page)
    assert (small_page != 0).sum() == 2 * kv_heads * dim * n


def test_the_reference_store_scatters_an_fp8_pool_as_bytes():
    """XLA has no fp8 scatter: into an fp8 pool it converts the whole pool to f16 and
    back, a pass over every page a layer. The XLA store (rope_store_reference, and
    kv_store.write_kv under it) scatters the pool's uint8 view instead, bits alike."""
    args, _ = case(np.random.default_rng(0), jnp.float8_e4m3fn)
    store = lambda a: rope_store_reference(**a, layer_offset=1, num_q_heads=HEADS, eps=EPS,
                                           k_scale=0.5, v_scale=0.125)
    text = jax.jit(store).lower(args).compile().as_text()
    assert whole_pool_conversions(text, args["pool"].size) == []
    _, (table, starts, num_tokens, t) = case(np.random.default_rng(0), jnp.float8_e4m3fn)
    k = jnp.ones((len(starts), t, KV_HEADS, DIM), jnp.float32)
    write = lambda pool: write_kv(pool, jnp.asarray(table), jnp.asarray(starts),
                                  jnp.asarray(num_tokens), k, k, layer_offset=1)
    text = jax.jit(write).lower(args["pool"]).compile().as_text()
    assert whole_pool_conversions(text, args["pool"].size) == []
