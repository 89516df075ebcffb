"""pallas_kernels/paged_attention_gluon.py against the pure-jnp reference. Compiled for
sm_90 on any machine with a Triton that has Gluon (the test extra's); run on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton.experimental.gluon._runtime",
                    reason="a Triton with Gluon (triton>=3.5)")

from pallas_kernels import attention as kernels  # noqa: E402
from pallas_kernels import gluon_call as gc  # noqa: E402
from pallas_kernels import paged_attention_gluon as pg  # noqa: E402
from pallas_kernels.launch_plan import small_batch_split_keys  # noqa: E402
from pallas_kernels.paged_attention import (  # noqa: E402
    draft_block_attention_reference, paged_attention_reference)
from tests.pallas_kernels.test_paged_attention import (  # noqa: E402
    assert_verify_equals_decode, assert_zero_past_q_len, kv_scales, make_case, make_draft_case,
    rel_err)

FP8 = jnp.float8_e4m3fn


def gluon_attention(*args, interpret=None, **kw):
    """paged_attention's signature (the verify == decode helper passes interpret)."""
    return jax.jit(lambda *a: pg.paged_attention_gluon(*a, **kw))(*args)


def compile_for_hopper(q, pool, *, block=None, **kw):
    """Compile the kernel for sm_90 as `gluon_call` would for these shapes (block: the
    draft block's K and V); returns (Triton's compiled kernel, the grid)."""
    table = jax.ShapeDtypeStruct((q.shape[0], 9), jnp.int32)
    lens = jax.ShapeDtypeStruct((q.shape[0],), jnp.int32)
    scalars, constexprs, grid = pg.launch(q, pool, table, **kw)
    layer = jax.ShapeDtypeStruct((1,), jnp.int32)
    arrays = [q, pool, table, lens, lens, *(block or (q, q)), layer]
    sig = gc.signature(pg.paged_attention_kernel, arrays, (None,) * len(arrays) + scalars,
                       pg.output_shapes(q, scalars[-1], constexprs),
                       tuple(sorted(constexprs.items())))
    compiled = gc.compile_gluon(pg.paged_attention_kernel, tuple(sig.items()),
                                tuple(sorted(constexprs.items())), constexprs["NUM_WARPS"], 90)
    return compiled, grid


@pytest.mark.parametrize("kv_dtype,max_q,window,soft_cap,head_dim,page_size,gqa", [
    (FP8, 1, None, None, 128, 16, 4), (FP8, 8, None, None, 128, 16, 4),
    (FP8, 8, 100, 30.0, 128, 16, 4), (jnp.bfloat16, 8, None, None, 128, 16, 4),
    (FP8, 5, None, None, 64, 16, 8), (jnp.bfloat16, 4, 20, None, 32, 8, 1),
    (FP8, 16, None, None, 128, 16, 4), (jnp.bfloat16, 16, 100, None, 128, 16, 4),  # verify-16
    (FP8, 40, 100, None, 128, 16, 4), (jnp.bfloat16, 100, None, 30.0, 128, 16, 8),  # prefill
])
def test_compiles_for_hopper(kv_dtype, max_q, window, soft_cap, head_dim, page_size, gqa):
    q = jax.ShapeDtypeStruct((4, max_q, 2 * gqa, head_dim), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((2, 40, 2, 2, page_size, head_dim), kv_dtype)
    compiled, grid = compile_for_hopper(q, pool, sliding_window=window, soft_cap=soft_cap)
    assert compiled.metadata.shared <= 100 * 1024  # shared memory for at least 2 CTAs/SM
    assert grid[1:] == (4, 2)
    if max_q > pg.FEW_Q_MAX:  # prefill: 64-row query blocks over 4 warps
        assert compiled.metadata.num_warps == pg.PREFILL_WARPS
        assert grid[0] == -(-max_q // (pg.PREFILL_ROWS // gqa))
    elif max_q * gqa > 32:  # verify-16: one program reads each key block for all 64 rows
        assert compiled.metadata.num_warps == 4 and grid[0] == 1


@pytest.mark.parametrize("kv_dtype", [FP8, jnp.bfloat16])
@pytest.mark.parametrize("block,causal,window", [(8, False, None), (16, True, 100),
                                                 (3, True, None)])
def test_draft_block_compiles_for_hopper(kv_dtype, block, causal, window):
    q = jax.ShapeDtypeStruct((4, block, 8, 128), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((2, 40, 2, 2, 16, 128), kv_dtype)
    pad = max(16, 1 << (block - 1).bit_length())
    block_kv = 2 * (jax.ShapeDtypeStruct((4, block, 2, 128), jnp.bfloat16),)
    compiled, _ = compile_for_hopper(q, pool, block=block_kv, sliding_window=window,
                                     draft_block=(pad, causal))
    assert compiled.metadata.shared <= 100 * 1024


def test_refuses_what_it_does_not_take():
    q = jnp.zeros((2, 17, 8, 128), jnp.bfloat16)
    pool = jnp.zeros((2, 4, 1, 2, 16, 128), FP8)
    args = (pool, jnp.zeros((2, 4), jnp.int32), jnp.ones((2,), jnp.int32),
            jnp.ones((2,), jnp.int32))
    block_kv = 2 * (jnp.zeros((2, 17, 2, 128), jnp.bfloat16),)
    with pytest.raises(ValueError, match="a draft block of 17 queries"):
        pg.draft_block_attention_gluon(q, *args, *block_kv, layer_offset=0)
    with pytest.raises(ValueError, match="block_k and block_v must be"):
        pg.draft_block_attention_gluon(q, *args, block_kv[0], block_kv[1][:, :3],
                                       layer_offset=0)
    with pytest.raises(ValueError, match="pool dtype float32"):
        pg.paged_attention_gluon(q[:, :1], pool.astype(jnp.float32), *args[1:], layer_offset=0)


def test_launch_configs():
    q1, q8, q16, q64 = (jax.ShapeDtypeStruct((64, n, 32, 128), jnp.bfloat16)
                        for n in (1, 8, 16, 64))
    table = jax.ShapeDtypeStruct((64, 16), jnp.int32)
    for kv, draft_warps in ((FP8, pg.NUM_WARPS), (jnp.bfloat16, pg.DRAFT_BF16_WARPS)):
        pool = jax.ShapeDtypeStruct((8, 1024, 1, 2, 16, 128), kv)
        verify = pg.launch(q8, pool, table)[1]
        decode = pg.launch(q1, pool, table)[1]
        assert verify["NUM_WARPS"] == decode["NUM_WARPS"] == pg.NUM_WARPS
        # 16 rows per warp along the rows: decode's 16 rows take the 2 warps along the
        # columns; the row sums by dot keep their arithmetic the same
        assert (verify["ROWS"], verify["WARPS_M"], decode["ROWS"], decode["WARPS_M"]) \
            == (32, 2, 16, 1)
        assert all(c["SUM_BY_MMA"] and c["EDGE_MASKS"] for c in (verify, decode))
        # block 16: 64 rows, still 16 a warp along the rows, in one program (each key
        # block read once, not once per 32-row query block)
        for draft_block in (None, (16, False)):
            _, wide, grid = pg.launch(q16, pool, table, draft_block=draft_block)
            assert (wide["ROWS"], wide["WARPS_M"], wide["NUM_WARPS"], grid[0]) == (64, 4, 4, 1)
            assert wide["SUM_BY_MMA"] and wide["EDGE_MASKS"]
        draft = pg.launch(q8, pool, table, draft_block=(16, False))[1]
        assert draft["NUM_WARPS"] == draft_warps and not draft["QUERIES_CACHED"]
        prefill = pg.launch(q64, pool, table)[1]
        assert (prefill["ROWS"], prefill["NUM_WARPS"], prefill["WARPS_M"], prefill["STAGES"]) \
            == (pg.PREFILL_ROWS, pg.PREFILL_WARPS, pg.PREFILL_WARPS, pg.PREFILL_STAGES)
        assert not (prefill["SUM_BY_MMA"] or prefill["EDGE_MASKS"])
        assert all(c["SPLIT_BLOCKS"] == 0 for c in (verify, decode, wide, draft, prefill))


@pytest.mark.parametrize("batch,table_width,split_keys,num_splits", [
    (1, 64, 256, 4), (1, 65, 256, 5), (2, 2048, 256, 128), (4, 64, 512, 2), (8, 64, 1024, 1),
    (9, 64, 0, 1)])
def test_small_batches_split_keys_by_the_batch_alone(batch, table_width, split_keys,
                                                     num_splits):
    """At most num_sms / 2 (row, kv head) programs: fixed-size key splits, whose size
    follows the batch (never the table width or the query count), and one split still
    runs split (the combine), so a row's bits never follow the table width."""
    table = jax.ShapeDtypeStruct((batch, table_width), jnp.int32)
    pool = jax.ShapeDtypeStruct((8, 4096, 1, 2, 16, 128), FP8)
    assert small_batch_split_keys(batch, 8, num_sms=132) == split_keys
    for max_q, draft_block in ((1, None), (8, None), (16, None), (8, (16, False))):
        q = jax.ShapeDtypeStruct((batch, max_q, 32, 128), jnp.bfloat16)
        scalars, constexprs, grid = pg.launch(q, pool, table, draft_block=draft_block)
        assert constexprs["SPLIT_BLOCKS"] * pg.BLOCK_KEYS == split_keys
        assert grid == (num_splits, batch, 8) and scalars[-1] == num_splits
    prefill = pg.launch(jax.ShapeDtypeStruct((batch, 64, 32, 128), jnp.bfloat16), pool,
                        table)
    assert prefill[1]["SPLIT_BLOCKS"] == 0 and prefill[0][-1] == 1
    unsplit = pg.launch(jax.ShapeDtypeStruct((batch, 1, 32, 128), jnp.bfloat16), pool, table,
                        split_keys=0)
    assert unsplit[1]["SPLIT_BLOCKS"] == 0 and unsplit[2] == (1, batch, 8)
    with pytest.raises(ValueError, match="multiple of 64"):
        pg.launch(jax.ShapeDtypeStruct((batch, 1, 32, 128), jnp.bfloat16), pool, table,
                  split_keys=100)


@pytest.mark.parametrize("max_q,split_keys", [(1, 256), (8, 128), (16, 256)])
def test_split_launches_compile_for_hopper(max_q, split_keys):
    q = jax.ShapeDtypeStruct((1, max_q, 32, 128), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((8, 40, 2, 2, 16, 128), FP8)
    compiled, grid = compile_for_hopper(q, pool, split_keys=split_keys)
    splits = -(-3 // (split_keys // pg.BLOCK_KEYS))  # 9 pages: 3 key blocks
    assert compiled.metadata.shared <= 100 * 1024 and grid == (splits, 1, 8)


CASES = [  # kv dtype, max_q, window, soft cap, q heads per kv head
    (FP8, 1, None, None, 4), (FP8, 8, None, None, 4), (FP8, 8, 100, None, 4),
    (FP8, 4, None, 30.0, 1), (FP8, 3, 64, 50.0, 8), (jnp.bfloat16, 1, None, None, 4),
    (jnp.bfloat16, 8, 100, 30.0, 4), (jnp.bfloat16, 5, None, None, 8),
    (FP8, 16, None, None, 4), (jnp.bfloat16, 16, 100, 30.0, 4), (FP8, 16, 64, None, 8),
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [12, 4], ids=["one_program", "key_splits"])
@pytest.mark.parametrize("kv_dtype,max_q,window,soft_cap,gqa", CASES)
def test_matches_reference(kv_dtype, max_q, window, soft_cap, gqa, batch):
    rng = np.random.default_rng(max_q * 7 + gqa)
    kv_lens = rng.integers(max_q, 3000, batch)
    kv_lens[:3] = [max_q, 16 * 40, 16 * 40 + 1]  # at and around page / block edges
    q, pool, table, kv_lens, q_lens = make_case(
        rng, batch=batch, max_q=max_q, num_q_heads=8 * gqa, num_kv_heads=8, head_dim=128,
        page_size=16, kv_dtype=kv_dtype, window=window, kv_lens=kv_lens)
    q_lens = q_lens.at[-1].set(0)  # a padding row
    kw = dict(layer_offset=1, sliding_window=window, soft_cap=soft_cap, **kv_scales(pool))
    out = gluon_attention(q, pool, table, kv_lens, q_lens, **kw)
    assert rel_err(out, paged_attention_reference(q, pool, table, kv_lens, q_lens, **kw)) < 1e-2
    assert_zero_past_q_len(out, q_lens)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [12, 4], ids=["one_program", "key_splits"])
def test_a_traced_layer_offset_reads_its_own_layer(batch):
    """Under a layer scan the offset is traced: each trip reads its own layer's pages."""
    q, pool, table, kv_lens, q_lens = make_case(
        np.random.default_rng(9), batch=batch, max_q=1, num_q_heads=32, num_kv_heads=8,
        head_dim=128, page_size=16, kv_dtype=FP8, num_layers=3,
        kv_lens=np.random.default_rng(9).integers(1, 3000, batch))
    kw = kv_scales(pool)

    def per_layer(_, offset):
        return None, pg.paged_attention_gluon(q, pool, table, kv_lens, q_lens,
                                              layer_offset=offset, **kw)
    _, outs = jax.jit(lambda: jax.lax.scan(per_layer, None, jnp.arange(3)))()
    for layer in range(3):
        ref = paged_attention_reference(q, pool, table, kv_lens, q_lens, layer_offset=layer,
                                        **kw)
        assert rel_err(outs[layer], ref) < 1e-2, f"layer {layer}"
    assert rel_err(outs[0], outs[2]) > 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [FP8, jnp.bfloat16])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("max_q", [8, 16])  # 16: one 64-row program over 4 warps
def test_verify_equals_decode_bit_for_bit(kv_dtype, window, max_q):
    assert_verify_equals_decode(np.random.default_rng(5), max_q=max_q, batch=16, max_len=3000,
                                num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                kv_dtype=kv_dtype, window=window, interpret=False,
                                attention=gluon_attention)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [FP8, jnp.bfloat16])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("max_q", [8, 16])
def test_split_verify_equals_decode_over_any_table_width(kv_dtype, window, max_q):
    """Key splits (batch 4 x 8 kv heads: 32 pages each): a row's decode over a narrow
    table (3 splits) and its verify over a wide one (5) give the same bits, and NaN in
    query tokens past q_len changes no live bit."""
    rng = np.random.default_rng(9)
    q, pool, table, kv_lens, q_lens = make_case(
        rng, batch=4, max_q=max_q, num_q_heads=32, num_kv_heads=8, head_dim=128,
        page_size=16, kv_dtype=kv_dtype, window=window, q_lens=np.full(4, max_q),
        kv_lens=[max_q, 16 * 16 + 3, 700, 1100], table_width=160)
    assert pg.launch(q, pool, table)[2][0] == 5
    kw = dict(layer_offset=1, sliding_window=window, k_scale=0.5, v_scale=0.25)
    verify = np.asarray(gluon_attention(q, pool, table, kv_lens, q_lens, **kw))
    narrow = table[:, :80]   # every row's pages
    ones = jnp.ones((4,), jnp.int32)
    for i in range(max_q):
        decode = gluon_attention(q[:, i:i + 1], pool, narrow, kv_lens - (max_q - 1 - i), ones,
                                 **kw)
        np.testing.assert_array_equal(np.asarray(decode)[:, 0], verify[:, i],
                                      err_msg=f"query {i}")
    ragged = q_lens.at[1].set(3).at[2].set(0)
    past = jnp.arange(max_q)[None, :] >= ragged[:, None]
    out = np.asarray(gluon_attention(q, pool, table, kv_lens, ragged, **kw))
    q_nan = jnp.where(past[:, :, None, None], jnp.nan, q)
    np.testing.assert_array_equal(
        np.asarray(gluon_attention(q_nan, pool, table, kv_lens, ragged, **kw)), out)
    assert_zero_past_q_len(out, ragged)


@pytest.mark.gpu
def test_pool_past_2_31_elements():
    """64-bit offsets: an fp8 pool over 2^31 elements (the Pallas kernels refuse it), read
    at its last pages."""
    from tests.pallas_kernels.test_gpu_compiled import large_pool_case

    q, pool, *rest = args = large_pool_case(2**31 // (8 * 2 * 16 * 128) + 64)
    out = gluon_attention(*args, layer_offset=0)
    assert rel_err(out, paged_attention_reference(*args, layer_offset=0)) < 1e-2
    assert kernels.select_backend(q, pool, impl="pallas") == "gluon"


PREFILL_CASES = [  # kv dtype, max_q, window, soft cap, q heads per kv head
    (FP8, 40, None, None, 4), (FP8, 100, 64, 30.0, 8), (jnp.bfloat16, 64, None, None, 1),
    (jnp.bfloat16, 33, 100, None, 4),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,max_q,window,soft_cap,gqa", PREFILL_CASES)
def test_prefill_matches_reference(kv_dtype, max_q, window, soft_cap, gqa):
    """Chunked prefill: ragged chunks over earlier pages, several query blocks per row."""
    rng = np.random.default_rng(max_q + gqa)
    kv_lens = rng.integers(max_q, 3000, 10)
    kv_lens[:2] = [max_q, 16 * 64 + max_q]
    q_lens = np.minimum(rng.integers(1, max_q + 1, 10), kv_lens)
    q_lens[:2], q_lens[-1] = max_q, 0  # whole chunks; a padding row
    q, pool, table, kv_lens, q_lens = make_case(
        rng, batch=10, max_q=max_q, num_q_heads=8 * gqa, num_kv_heads=8, head_dim=128,
        page_size=16, kv_dtype=kv_dtype, window=window, kv_lens=kv_lens, q_lens=q_lens)
    kw = dict(layer_offset=1, sliding_window=window, soft_cap=soft_cap, **kv_scales(pool))
    out = gluon_attention(q, pool, table, kv_lens, q_lens, **kw)
    assert rel_err(out, paged_attention_reference(q, pool, table, kv_lens, q_lens, **kw)) < 1e-2
    assert_zero_past_q_len(out, q_lens)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,block,causal,window,soft_cap,gqa", [
    (FP8, 8, False, None, None, 4), (FP8, 8, True, 512, None, 4), (FP8, 16, True, None, 30.0, 8),
    (jnp.bfloat16, 8, False, 100, None, 4), (jnp.bfloat16, 5, True, None, 30.0, 1),
    (jnp.bfloat16, 16, False, None, None, 4),  # DFlash-b16's draft layers: 64 rows, 4 warps
])
@pytest.mark.parametrize("batch", [12, 4], ids=["one_program", "key_splits"])
def test_draft_block_matches_reference(kv_dtype, block, causal, window, soft_cap, gqa, batch):
    rng = np.random.default_rng(block + gqa)
    args, kw = make_draft_case(rng, ctx=[0, 16 * 64, 16 * 64 + 1,
                                         *rng.integers(1, 4000, batch - 3)],
                               num_q_heads=8 * gqa, num_kv_heads=8, head_dim=128,
                               page_size=16, kv_dtype=kv_dtype, window=window, causal=causal,
                               block=block)
    kw["soft_cap"] = soft_cap
    out = jax.jit(lambda *a: pg.draft_block_attention_gluon(*a, **kw))(*args)
    assert rel_err(out, draft_block_attention_reference(*args, **kw)) < 1e-2
    assert (np.asarray(out[-1], np.float32) == 0).all()  # the padding row


@pytest.mark.gpu
def test_prefill_and_draft_block_on_a_pool_past_2_31_elements():
    from tests.pallas_kernels.test_gpu_compiled import large_pool_case

    pages = 2**31 // (8 * 2 * 16 * 128) + 64
    args = large_pool_case(pages, max_q=64)
    assert kernels.select_backend(args[0], args[1], impl="pallas") == "gluon"
    out = gluon_attention(*args, layer_offset=0)
    assert rel_err(out, paged_attention_reference(*args, layer_offset=0)) < 1e-2
    q, pool, table, ctx_lens, _ = large_pool_case(pages)
    block_k, block_v = (jax.random.normal(jax.random.key(i), (2, 8, 8, 128), jnp.bfloat16)
                        for i in (2, 3))
    draft = (q, pool, table, ctx_lens, jnp.array([8, 8], jnp.int32), block_k, block_v)
    assert kernels.select_backend(q, pool, impl="pallas", draft_block=True) == "gluon"
    out = jax.jit(lambda *a: pg.draft_block_attention_gluon(*a, layer_offset=0))(*draft)
    assert rel_err(out, draft_block_attention_reference(*draft, layer_offset=0)) < 1e-2
