"""Paged decode/verify attention vs its jnp reference on random pools.

Poisoning: pages no live position uses hold NaN (a read shows), and Pallas
interpret mode starts every float output as NaN, so rel_err's finiteness
check catches unwritten output rows (pinned below)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.launch_plan import LaunchOptions
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.testing import (POISON, kv_scales, make_case, make_draft_case,  # noqa: F401
                                    rel_err)

def past_q_len(q_lens, max_q):
    """bool[batch, max_q]: the query tokens past each row's q_len (all of a padding row)."""
    return np.arange(max_q)[None, :] >= np.asarray(q_lens)[:, None]


def assert_zero_past_q_len(out, q_lens):
    """Query tokens past q_len (and padding rows) are zeros, not garbage."""
    assert (np.asarray(out, np.float32)[past_q_len(q_lens, out.shape[1])] == 0).all()


def test_interpret_mode_starts_outputs_poisoned():
    def write_half(o_ref):
        o_ref[pl.ds(0, 4)] = jnp.zeros(4, jnp.float32)
    out = np.asarray(pl.pallas_call(write_half, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                                    interpret=True)())
    assert (out[:4] == 0).all() and np.isnan(out[4:]).all()


CASES = [
    # name, kwargs
    ("decode_gqa4", dict(batch=5, max_q=1, num_q_heads=8, num_kv_heads=2)),
    ("decode_mha", dict(batch=3, max_q=1, num_q_heads=2, num_kv_heads=2)),
    ("verify_gqa8", dict(batch=4, max_q=8, num_q_heads=8, num_kv_heads=1)),
    ("verify_window", dict(batch=6, max_q=5, num_q_heads=4, num_kv_heads=1, window=16)),
    ("window_page_edges", dict(batch=4, max_q=3, num_q_heads=4, num_kv_heads=2, window=8,
                               kv_lens=[8, 9, 16, 17], q_lens=[1, 3, 3, 2])),
    ("page_boundaries", dict(batch=5, max_q=2, num_q_heads=4, num_kv_heads=4,
                             kv_lens=[7, 8, 9, 15, 16], q_lens=[2, 1, 2, 2, 1])),
    ("fp8", dict(batch=4, max_q=4, num_q_heads=8, num_kv_heads=2,
                 kv_dtype=jnp.float8_e4m3fn)),
    ("fp8_window", dict(batch=4, max_q=1, num_q_heads=8, num_kv_heads=2, window=24,
                        kv_dtype=jnp.float8_e4m3fn)),
    ("padding_rows", dict(batch=4, max_q=3, num_q_heads=4, num_kv_heads=1,
                          kv_lens=[20, 0, 33, 0], q_lens=[3, 0, 2, 0])),
    ("wide_table", dict(batch=3, max_q=2, num_q_heads=4, num_kv_heads=2, table_width=32)),
]


@pytest.mark.parametrize("name,kwargs", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("soft_cap", [None, 20.0])
def test_kernel_matches_reference(interpret, name, kwargs, soft_cap):
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    q, pool, table, kv_lens, q_lens = make_case(rng, **kwargs)
    args = dict(layer_offset=1, sliding_window=kwargs.get("window"), soft_cap=soft_cap,
                **kv_scales(pool))
    ref = paged_attention_reference(q, pool, table, kv_lens, q_lens, **args)
    # Rescale thresholds: 1 moves a row's reference max at some blocks and not
    # at others; 8 (what the benchmarks time) mostly keeps the first block's.
    lazy = ((3, None, 1.0), (1, None, 8.0)) if soft_cap is None else ()
    for splits, compute, threshold in ((1, None, None), (3, None, None), (1, jnp.bfloat16, None),
                                       *lazy):
        options = LaunchOptions(pages_per_block=2, num_splits=splits, compute_dtype=compute,
                                rescale_threshold=threshold)
        out = paged_attention(q, pool, table, kv_lens, q_lens, options=options,
                              interpret=interpret, **args)
        assert out.shape == q.shape
        assert rel_err(out, ref) < 2e-2, f"{name} splits={splits} {compute} {threshold=}"
        assert_zero_past_q_len(out, q_lens)


def test_a_traced_layer_offset_reads_its_own_layer(interpret):
    """A layer scan passes the offset traced: each trip of the scan reads its own
    layer's pages (the kernel takes the offset as an input, not as a constant)."""
    q, pool, table, kv_lens, q_lens = make_case(
        np.random.default_rng(5), batch=3, max_q=2, num_q_heads=4, num_kv_heads=2,
        num_layers=3)

    def per_layer(_, offset):
        return None, paged_attention(q, pool, table, kv_lens, q_lens, layer_offset=offset,
                                     interpret=interpret)
    _, outs = jax.jit(lambda: jax.lax.scan(per_layer, None, jnp.arange(3)))()
    for layer in range(3):
        ref = paged_attention_reference(q, pool, table, kv_lens, q_lens, layer_offset=layer)
        assert rel_err(outs[layer], ref) < 2e-2, f"layer {layer}"
    assert rel_err(outs[0], outs[2]) > 0.1   # the layers differ: the test can tell them apart


def test_verify_rows_are_causal_among_themselves(interpret):
    """Query i of a verify row must not see keys of queries after it."""
    rng = np.random.default_rng(7)
    q, pool, table, kv_lens, q_lens = make_case(rng, batch=1, max_q=4, num_q_heads=2,
                                                num_kv_heads=1, kv_lens=[12], q_lens=[4])
    out = paged_attention(q, pool, table, kv_lens, q_lens, layer_offset=0, interpret=interpret)
    # Same first query with the later three tokens' keys dropped (kv_len 9, q_len 1).
    solo = paged_attention(q[:, :1], pool, table, jnp.array([9]), jnp.array([1]),
                           layer_offset=0, interpret=interpret)
    np.testing.assert_allclose(np.asarray(out[:, 0], np.float32),
                               np.asarray(solo[:, 0], np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("blocking", [dict(), dict(num_splits=2), dict(rows_per_block=64),
                                      dict(rescale_threshold=8.0)],
                         ids=["direct", "split", "rows", "lazy"])
def test_queries_past_q_len_change_no_other_bit(interpret, blocking):
    """Query tokens past q_len (and padding rows) hold whatever the caller left
    there. NaN in them must leave every live query's bits alone and still give
    zeros (a kernel that skips the mask in blocks every live row sees whole must
    still keep those rows out)."""
    rng = np.random.default_rng(11)
    q, pool, table, kv_lens, q_lens = make_case(
        rng, batch=4, max_q=3, num_q_heads=8, num_kv_heads=2, window=40,
        kv_lens=[70, 0, 55, 64], q_lens=[1, 0, 3, 2])
    past = past_q_len(q_lens, q.shape[1])
    kw = dict(layer_offset=1, sliding_window=40, interpret=interpret,
              options=LaunchOptions(pages_per_block=2, **blocking))
    out = np.asarray(paged_attention(q, pool, table, kv_lens, q_lens, **kw), np.float32)
    q_nan = jnp.where(jnp.asarray(past)[:, :, None, None], jnp.nan, q)
    out_nan = np.asarray(paged_attention(q_nan, pool, table, kv_lens, q_lens, **kw), np.float32)
    np.testing.assert_array_equal(out_nan, out)
    assert (out[past] == 0).all() and np.isfinite(out).all()


def _with_options(blocking):
    """A blocking dict as keywords: LaunchOptions fields as `options`, the rest as they are."""
    blocking = dict(blocking or {})
    fields = {k: blocking.pop(k) for k in list(blocking) if k in LaunchOptions._fields}
    return {**blocking, **({"options": LaunchOptions(**fields)} if fields else {})}


def assert_verify_equals_decode(rng, *, max_q, batch, max_len, interpret, window,
                                blocking=None, decode_blocking=None, attention=paged_attention,
                                **case):
    """Greedy speculative decoding is lossless only if query i of a K+1-query
    verify pass gets exactly what a 1-query decode pass at its position gets:
    the same key blocks and arithmetic, whatever the masks (windowed rows
    included, whose earliest visible page differs per query). Decode takes
    `decode_blocking` where given (launch options that only schedule loads
    may differ), else `blocking` (LaunchOptions fields; other keywords, such
    as soft_cap, go to both passes). `attention` is the kernel (another
    lowering with paged_attention's signature; a window is passed only where
    given)."""
    q, pool, table, kv_lens, q_lens = make_case(
        rng, batch=batch, max_q=max_q, window=window, q_lens=np.full(batch, max_q),
        kv_lens=rng.integers(max_q, max_len, batch), **case)
    kw = dict(layer_offset=1, k_scale=0.5, v_scale=0.25, interpret=interpret)
    if window is not None:
        kw["sliding_window"] = window
    verify = np.asarray(attention(q, pool, table, kv_lens, q_lens, **kw,
                                  **_with_options(blocking)))
    kw.update(_with_options(blocking if decode_blocking is None else decode_blocking))
    ones = jnp.ones((batch,), jnp.int32)
    for i in range(max_q):
        decode = attention(q[:, i:i + 1], pool, table, kv_lens - (max_q - 1 - i), ones, **kw)
        np.testing.assert_array_equal(np.asarray(decode)[:, 0], verify[:, i],
                                      err_msg=f"query {i}")


@pytest.mark.parametrize("kv_dtype,threshold", [
    (jnp.bfloat16, None), (jnp.float8_e4m3fn, None), (jnp.float8_e4m3fn, 0.0),
    (jnp.float8_e4m3fn, 1.0)])
@pytest.mark.parametrize("window", [None, 20])
def test_verify_equals_decode_bit_for_bit(interpret, kv_dtype, threshold, window):
    # 2 pages of 8 keys per block: windows start mid-block for some queries.
    # Rescale threshold: the default (0, eager, over bf16; 8 over fp8), 0 over
    # fp8, and 1, where some rows of a block move their max while others keep theirs.
    assert_verify_equals_decode(np.random.default_rng(3), max_q=4, batch=8, max_len=90,
                                num_q_heads=8, num_kv_heads=2, kv_dtype=kv_dtype,
                                window=window, interpret=interpret,
                                blocking=dict(pages_per_block=2, rescale_threshold=threshold))


def test_fp8_launch_options_keep_verify_equal_to_decode(interpret):
    """Decode with prefetched page ids, verify without, both lazy (the fp8 options)."""
    lazy = dict(pages_per_block=2, rescale_threshold=8.0)
    assert_verify_equals_decode(np.random.default_rng(8), max_q=4, batch=6, max_len=90,
                                num_q_heads=8, num_kv_heads=2, kv_dtype=jnp.float8_e4m3fn,
                                window=20, interpret=interpret, blocking=dict(lazy, num_stages=5),
                                decode_blocking=dict(lazy, prefetch_page_ids=True))


@pytest.mark.parametrize("kv_dtype,want", [(jnp.float8_e4m3fn, True), (jnp.bfloat16, False)])
def test_fp8_launch_options_are_the_default_over_fp8_kv_only(monkeypatch, kv_dtype, want):
    """The kernel tells plan_launch the pool is fp8 only over fp8 pools; the plan then
    picks the fp8 options."""
    import pallas_kernels.paged_attention as entry
    import pallas_kernels.paged_attention_kernel as module
    plans, plan_launch = [], module.plan_launch

    def recording_plan(**kw):
        plans.append(plan_launch(**kw))
        return plans[-1]
    monkeypatch.setattr(module, "plan_launch", recording_plan)
    q, pool, table, kv_lens, q_lens = make_case(
        np.random.default_rng(2), batch=2, max_q=1, num_q_heads=4, num_kv_heads=2,
        kv_dtype=kv_dtype)
    entry._attention_call.clear_cache()   # the plan is made when the call traces
    paged_attention(q, pool, table, kv_lens, q_lens, layer_offset=1, interpret=True)
    (plan,) = plans
    assert (plan.prefetch_page_ids, plan.rescale_threshold) == ((True, 8.0) if want
                                                                else (False, 0.0))


def test_wider_tables_change_no_bit(interpret, monkeypatch):
    """A row's result must not follow the table width (the batch's longest row
    sets it): decode and verify split the keys at fixed page boundaries, and
    splits past a row's keys add exact zeros."""
    import pallas_kernels.launch_plan as launch_plan
    monkeypatch.setattr(launch_plan, "FEW_Q_SPLIT_PAGES", 4)  # several splits per row
    q, pool, table, kv_lens, q_lens = make_case(
        np.random.default_rng(9), batch=3, max_q=3, num_q_heads=4, num_kv_heads=2,
        kv_lens=[120, 41, 9], q_lens=[3, 2, 1], table_width=16, kv_dtype=jnp.float8_e4m3fn)
    wide = jnp.pad(table, ((0, 0), (0, 32)), constant_values=-1)  # 48 pages, all BAD past 16
    kw = dict(layer_offset=1, options=LaunchOptions(pages_per_block=2), interpret=interpret)
    np.testing.assert_array_equal(
        np.asarray(paged_attention(q, pool, table, kv_lens, q_lens, **kw)),
        np.asarray(paged_attention(q, pool, wide, kv_lens, q_lens, **kw)))


def test_verify_equals_decode_bit_for_bit_over_several_query_blocks(interpret):
    """GQA 8: a verify of 8 tokens is 64 query rows, four 16-row blocks per row
    at head dim 32; all split the keys as decode does (the split count once
    followed the number of query blocks)."""
    assert_verify_equals_decode(np.random.default_rng(6), max_q=8, batch=4, max_len=150,
                                num_q_heads=16, num_kv_heads=2, kv_dtype=jnp.float8_e4m3fn,
                                window=None, blocking=dict(pages_per_block=2),
                                interpret=interpret)


@pytest.mark.parametrize("change,match", [
    (dict(q=jnp.zeros((2, 1, 3, 32), jnp.bfloat16)), "multiple of num_kv_heads"),
    (dict(q=jnp.zeros((2, 1, 4, 16), jnp.bfloat16)), "head_dim"),
    (dict(q=jnp.zeros((2, 1, 4, 32), jnp.int32)), "q must be bf16"),
    (dict(batch_table=jnp.zeros((3, 4), jnp.int32)), "batch_table must be i32"),
    (dict(kv_lens=jnp.zeros((2,), jnp.float32)), "kv_lens must be i32"),
    (dict(layer_offset=2), "layer_offset=2 outside"),
    (dict(options=LaunchOptions(pages_per_block=3)), "pages_per_block must be a power of two"),
    (dict(options=LaunchOptions(compute_dtype=jnp.int8)), "compute_dtype must be None, float16"),
    (dict(options=LaunchOptions(rescale_threshold=-1.0)), "rescale_threshold must be in"),
])
def test_invalid_inputs_raise_at_trace_time(change, match):
    args = dict(q=jnp.zeros((2, 1, 4, 32), jnp.bfloat16),
                pool=jnp.zeros((2, 6, 2, 2, 8, 32), jnp.bfloat16),
                batch_table=jnp.zeros((2, 4), jnp.int32), kv_lens=jnp.ones((2,), jnp.int32),
                q_lens=jnp.ones((2,), jnp.int32), layer_offset=0)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        paged_attention(interpret=True, **args)


def test_pools_past_32_bit_offsets_are_refused():
    """Pallas Triton's element offsets are 32-bit: a pool past 2^31 elements would be read
    at wrapped offsets without an error on the GPU, so it is refused at trace time."""
    def trace(num_pages):
        pool = jax.ShapeDtypeStruct((8, num_pages, 1, 2, 16, 128), jnp.float8_e4m3fn)
        return jax.eval_shape(
            lambda pool: paged_attention(jnp.zeros((2, 1, 32, 128), jnp.bfloat16), pool,
                                         jnp.zeros((2, 4), jnp.int32), jnp.ones((2,), jnp.int32),
                                         jnp.ones((2,), jnp.int32), layer_offset=0), pool)

    assert trace(2**31 // (8 * 2 * 16 * 128)).shape == (2, 1, 32, 128)  # exactly 2^31: fits
    with pytest.raises(ValueError, match="at most 2\\^31 elements"):
        trace(2**31 // (8 * 2 * 16 * 128) + 1)


PREFILL_CASES = [
    ("prefill_full", dict(batch=3, max_q=40, num_q_heads=8, num_kv_heads=2,
                          kv_lens=[40, 70, 23], q_lens=[40, 33, 7])),
    ("prefill_window", dict(batch=3, max_q=40, num_q_heads=4, num_kv_heads=1, window=16,
                            kv_lens=[40, 95, 17], q_lens=[40, 37, 16])),
    ("prefill_fp8_gqa1", dict(batch=2, max_q=24, num_q_heads=2, num_kv_heads=2,
                              kv_dtype=jnp.float8_e4m3fn, kv_lens=[30, 24], q_lens=[24, 0])),
]


@pytest.mark.parametrize("rows_per_block", [16, 64])  # q scaled in the kernel / by XLA
@pytest.mark.parametrize("name,kwargs", PREFILL_CASES, ids=[c[0] for c in PREFILL_CASES])
def test_chunked_prefill_matches_reference(interpret, name, kwargs, rows_per_block):
    """Chunks longer than one query block: several query blocks per row, ragged."""
    rng = np.random.default_rng(len(name))
    q, pool, table, kv_lens, q_lens = make_case(rng, **kwargs)
    args = dict(layer_offset=0, sliding_window=kwargs.get("window"), **kv_scales(pool))
    ref = paged_attention_reference(q, pool, table, kv_lens, q_lens, **args)
    options = LaunchOptions(rows_per_block=rows_per_block, pages_per_block=2)
    out = paged_attention(q, pool, table, kv_lens, q_lens, options=options,
                          interpret=interpret, **args)
    assert rel_err(out, ref) < 2e-2
    assert_zero_past_q_len(out, q_lens)


DRAFT_CASES = [
    ("draft_full", dict(num_q_heads=8, num_kv_heads=2, window=None)),
    ("draft_window", dict(num_q_heads=4, num_kv_heads=1, window=16)),
    ("draft_fp8_window", dict(num_q_heads=8, num_kv_heads=2, window=24,
                              kv_dtype=jnp.float8_e4m3fn)),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name,kwargs", DRAFT_CASES, ids=[c[0] for c in DRAFT_CASES])
def test_draft_block_matches_reference(interpret, name, kwargs, causal):
    from pallas_kernels.paged_attention import (draft_block_attention,
                                                draft_block_attention_reference)
    # ctx 0: a row drafting with no context yet
    args, kw = make_draft_case(np.random.default_rng(len(name) + causal),
                               ctx=[0, 9, 16, 41, 57], causal=causal, **kwargs)
    ref = draft_block_attention_reference(*args, **kw)
    for splits, prefetch in ((1, False), (2, True)):
        options = LaunchOptions(pages_per_block=2, num_splits=splits,
                                prefetch_page_ids=prefetch)
        out = draft_block_attention(*args, options=options, interpret=interpret, **kw)
        assert rel_err(out, ref) < 2e-2, f"splits={splits} {prefetch=}"
        assert (np.asarray(out[-1], np.float32) == 0).all()  # padding row


@pytest.mark.parametrize("name", ["verify_window", "fp8_window", "padding_rows", "wide_table"])
def test_prefetched_page_ids_change_no_bit(interpret, name):
    """prefetch_page_ids moves the table loads, not the arithmetic."""
    kwargs = dict(CASES)[name]
    q, pool, table, kv_lens, q_lens = make_case(np.random.default_rng(5), **kwargs)
    args = dict(layer_offset=1, sliding_window=kwargs.get("window"), interpret=interpret)
    options = LaunchOptions(pages_per_block=2, num_splits=3)
    np.testing.assert_array_equal(
        np.asarray(paged_attention(q, pool, table, kv_lens, q_lens,
                                   options=options._replace(prefetch_page_ids=True), **args)),
        np.asarray(paged_attention(q, pool, table, kv_lens, q_lens, options=options, **args)))


def test_a_prefill_rows_bits_follow_neither_its_call_nor_the_table_width(interpret,
                                                                         monkeypatch):
    """Under a stream, which prompts share a prefill call and the longest of them
    (the table width) follow arrival timing: a prompt's attention must not."""
    import pallas_kernels.launch_plan as launch_plan
    monkeypatch.setattr(launch_plan, "FEW_Q_SPLIT_PAGES", 4)  # several splits per row
    q, pool, table, kv_lens, q_lens = make_case(
        np.random.default_rng(11), batch=3, max_q=24, num_q_heads=4, num_kv_heads=2,
        kv_lens=[120, 300, 40], q_lens=[24, 24, 10])
    kw = dict(layer_offset=1, options=LaunchOptions(pages_per_block=2), interpret=interpret)
    together = paged_attention(q, pool, table, kv_lens, q_lens, **kw)
    alone = paged_attention(q[:1], pool, table[:1, :15], kv_lens[:1], q_lens[:1], **kw)
    np.testing.assert_array_equal(np.asarray(together[0]), np.asarray(alone[0]))
