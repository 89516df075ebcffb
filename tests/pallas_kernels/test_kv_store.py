import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_store import FP8_MAX, layer_kv, write_kv
from unified_kv import BAD_PAGE_INDEX


def key_major(pool):
    """The pool with every V page read back key-major through `layer_kv`."""
    layers = [np.stack([np.asarray(x, np.float32) for x in layer_kv(pool, i)], axis=2)
              for i in range(pool.shape[2])]
    return np.stack(layers, axis=2)   # [heads, pages, layers, 2, page_size, head_dim]


def write_kv_loop(pool, table, starts, num_tokens, k, v, layer_offset, k_scale, v_scale):
    """Reference: one token at a time, in numpy, on key-major K and V pages
    (compared through `layer_kv`, which undoes the V pages' transpose)."""
    pool = np.array(pool, np.float32)
    num_layers, page_size = pool.shape[2], pool.shape[4]
    ok = []
    for b in range(k.shape[0]):
        row_ok = True
        for t in range(int(num_tokens[b])):
            pos = int(starts[b]) + t
            entry = table[b, pos // page_size] if pos // page_size < table.shape[1] else -1
            if entry == BAD_PAGE_INDEX:
                row_ok = False
                continue
            page = entry // (2 * num_layers)
            pool[:, page, layer_offset, 0, pos % page_size] = np.clip(k[b, t] / k_scale, -FP8_MAX, FP8_MAX)
            pool[:, page, layer_offset, 1, pos % page_size] = np.clip(v[b, t] / v_scale, -FP8_MAX, FP8_MAX)
        ok.append(row_ok)
    return pool, np.array(ok)


@pytest.mark.parametrize("dtype,k_scale,v_scale", [(jnp.bfloat16, 1.0, 1.0),
                                                   (jnp.float8_e4m3fn, 0.5, 0.125)])
def test_write_kv_matches_token_loop(dtype, k_scale, v_scale):
    rng = np.random.default_rng(0)
    heads, pages, layers, ps, dim = 2, 12, 3, 8, 16
    pool = jnp.asarray(rng.standard_normal((heads, pages, layers, 2, ps, dim)), dtype)
    table = np.full((4, 4), BAD_PAGE_INDEX, np.int32)
    table[0, :2] = np.array([3, 5]) * 2 * layers
    table[1, 1:3] = np.array([7, 1]) * 2 * layers   # windowed: BAD in front
    table[2, 0] = 9 * 2 * layers
    starts = np.array([5, 13, 0, 0], np.int32)       # row 0 crosses a page boundary
    num_tokens = np.array([6, 4, 9, 0], np.int32)    # row 2 runs past its only page
    k = rng.standard_normal((4, 9, heads, dim)) * 100  # fp8 saturates, never NaN
    v = rng.standard_normal((4, 9, heads, dim))
    before = key_major(pool)  # write_kv donates the pool
    out, ok = write_kv(pool, jnp.asarray(table), jnp.asarray(starts), jnp.asarray(num_tokens),
                       jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
                       layer_offset=1, k_scale=k_scale, v_scale=v_scale)
    want, want_ok = write_kv_loop(before, table, starts, num_tokens,
                                  k, v, 1, k_scale, v_scale)
    np.testing.assert_array_equal(np.asarray(ok), want_ok)
    assert np.asarray(ok).tolist() == [True, True, False, True]
    got = key_major(out)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np.asarray(jnp.asarray(want, dtype), np.float32))


def test_v_pages_are_stored_transposed():
    """One token's V lands in column `slot` of its [head_dim, page_size] V page."""
    heads, layers, ps, dim = 1, 2, 4, 8
    pool = jnp.zeros((heads, 3, layers, 2, ps, dim), jnp.float32)
    v = jnp.arange(1, dim + 1, dtype=jnp.float32).reshape(1, 1, 1, dim)
    out, _ = write_kv(pool, jnp.array([[2 * 2 * layers]], jnp.int32), jnp.array([1], jnp.int32),
                      jnp.array([1], jnp.int32), -v, v, layer_offset=1)
    v_page = np.asarray(out)[0, 2, 1, 1].reshape(dim, ps)    # page 2, layer 1, V
    np.testing.assert_array_equal(v_page[:, 1], np.arange(1, dim + 1))
    assert (np.delete(v_page, 1, axis=1) == 0).all()
    np.testing.assert_array_equal(np.asarray(out)[0, 2, 1, 0, 1], -np.arange(1, dim + 1))


def test_write_kv_rejects_bad_shapes():
    pool = jnp.zeros((2, 4, 1, 2, 8, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="k and v must be"):
        write_kv(pool, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32),
                 jnp.ones((1,), jnp.int32), jnp.zeros((1, 3, 4, 16)), jnp.zeros((1, 3, 4, 16)),
                 layer_offset=0)
    with pytest.raises(ValueError, match="layer_offset=1 outside"):
        write_kv(pool, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32),
                 jnp.ones((1,), jnp.int32), jnp.zeros((1, 3, 2, 16)), jnp.zeros((1, 3, 2, 16)),
                 layer_offset=1)
