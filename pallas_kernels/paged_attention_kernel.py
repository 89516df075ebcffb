"""The Pallas Triton paged-attention kernel and its launch, over one layer of a
unified-cache pool: decode, verify, chunked prefill and the DFlash draft block (also
runs in interpret mode on CPU). The entry points, their contracts and their references:
`paged_attention.py`.

Each batch row has 1..max_q query tokens at positions `kv_len - q_len .. kv_len - 1`
whose K/V are already in the cache; they are causal among themselves and see the row's
earlier keys (only the last `sliding_window` positions for windowed layers). One
program handles one (row, kv head, split) and a block of query rows (tokens x q heads
per kv head; up to 32 rows, and fewer than head_dim, for decode and verify, 128 for
prefill: `launch_plan.py`), so the K+1 verify queries of a row read each KV page once
per block; a row's blocks launch side by side and share those reads in L2.

The pool's layout and the kernel page index: `pool_layout.py`. K and V^T are gathered
with one table load per page, broadcast to the page's rows, as plain 2-D loads that
feed the dots and that Triton pipelines through shared memory.

Blocks are `pages_per_block` pages on a grid aligned to page 0 in every pass (a
windowed row starts at the block holding its first visible page), and split results
combine in a fixed order; with launch_plan's blocking, a query's arithmetic is then
the same in a 1-query decode pass and a K+1-query verify pass, so greedy speculative
decoding reproduces plain decoding bit for bit (tested compiled).

A windowed row's table has BAD (-1) entries in front of its live tail; the kernel
starts at the block of the first page the earliest query can see, so BAD entries are
never dereferenced: they and the entries padding a row's last block read the pool's
null page (page 0: reserved, never allocated, all zeros) and are masked. Query rows
past a row's `q_len` (and padding rows, q_len 0) get zeros.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.launch_plan import FEW_Q_ROWS, MIN_ROWS, LaunchOptions, plan_launch
from pallas_kernels.pool_layout import BAD_PAGE_INDEX, NULL_PAGE, kernel_views, pow2_at_least

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
LOG2E = math.log2(math.e)  # the softmax runs in base 2


def paged_attention_kernel(
    # inputs
    q_ref,          # [max_q * num_q_heads, head_dim]: this batch row's queries, as
                    # given; with q_in_rows [rows, head_dim], laid out and scaled by XLA
    k_view_ref,     # this kv head's pool as K rows: [kernel_pages * page_size, head_dim]
    v_view_ref,     # the same pool as V^T rows: [kernel_pages * head_dim, page_size]
    table_ref,      # i32[table_width]: this batch row's entries (page * 2L), BAD = -1
    kv_lens_ref,    # i32[batch]: cached positions
    q_lens_ref,     # i32[batch]: query tokens of the row
    layer_ref,      # i32[1]: the layer's offset in the pool (traced under a layer scan)
    *refs,          # [block_k_ref, block_v_ref: [block_pad, head_dim]] if has_block;
                    # then outputs: unsplit, o_ref in q's dtype and q_ref's layout;
                    # split, o_ref f32[rows, head_dim] and m_ref, l_ref f32[rows]
    rows: int,
    max_q: int,
    num_q_heads: int,
    q_per_kv: int,
    logit_scale: float,
    compute_dtype,
    q_in_rows: bool,
    queries_cached: bool,
    tokens_per_block: int,
    pages_per_block: int,
    pages_per_split: int,
    num_splits: int,
    soft_cap: float | None,
    sliding_window: int | None,
    block_logit_scale: float,
    v_scale: float,
    has_block: bool,
    block_causal: bool,
    page_size: int,
    prefetch_page_ids: bool,
    rescale_threshold: float,
):
    if has_block:
        block_k_ref, block_v_ref, *refs = refs
    o_ref, *split_stats_refs = refs  # m and l only when split: the combine wants them
    program, b, kv_head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_block, split = program // num_splits, program % num_splits
    head_dim = q_ref.shape[-1]
    table_width = table_ref.shape[0]
    block_k = pages_per_block * page_size
    kv_len, q_len = kv_lens_ref[b], q_lens_ref[b]
    k_offset = 2 * layer_ref[0]  # kernel page = table entry + 2 x layer offset
    q_start = kv_len - q_len if queries_cached else kv_len  # draft block: after its context

    row = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    q_tok = q_block * tokens_per_block + row // q_per_kv  # query token index in the row
    q_pos = q_start + q_tok                                # i32[rows]
    # Block row -> its (token, q head) row of q's own [max_q * num_q_heads] layout.
    q_index = q_tok * num_q_heads + kv_head * q_per_kv + row % q_per_kv
    in_q = (row < tokens_per_block * q_per_kv) & (q_tok < max_q)
    row_valid = in_q & (q_tok < q_len)
    first_tok = q_block * tokens_per_block
    last_tok = jnp.minimum(q_len, first_tok + tokens_per_block) - 1
    first_pos, last_pos = q_start + first_tok, q_start + last_tok
    # Cached keys this block can see: before its last query, and before kv_len.
    key_end = jnp.minimum(kv_len, last_pos + 1)
    first_page = 0
    if sliding_window is not None:  # the block holding the earliest query's window start
        first_page = (jnp.maximum(first_pos - sliding_window + 1, 0) // block_k
                      * pages_per_block)
    lo = jnp.maximum(first_page, split * pages_per_split)
    hi = jnp.minimum(pl.cdiv(key_end, page_size), (split + 1) * pages_per_split)
    num_blocks = jnp.where(last_tok >= first_tok,
                           pl.cdiv(jnp.maximum(hi - lo, 0), pages_per_block), 0)
    # A row sees cached keys at positions in (lower, upper]: upper is its own
    # position, the cache end or this split's end (keys past it belong to the
    # next split), lower its window start; rows past q_len (and padding rows)
    # see none. One compare per logit and bound, not one per condition: fp8
    # verify and prefill run faster (docs/decisions.md).
    upper = jnp.where(row_valid,
                      jnp.minimum(q_pos, jnp.minimum(key_end, hi * page_size) - 1), -1)

    if q_in_rows:  # else scaled here as by XLA; rows not in q read its row 0, see no key
        q = q_ref[...]
    else:
        q = q_ref[jnp.where(in_q, q_index, 0)].astype(jnp.float32) * logit_scale
        q = q.astype(compute_dtype)

    def softmax_step(carry, logits, visible, v_t):
        """Online-softmax update with base-2 logits f32[rows, keys] and V^T."""
        acc, m_prev, l_prev = carry
        logits = jnp.where(visible, logits, MASK_VALUE)
        m_block = logits.max(axis=1)
        if not rescale_threshold:
            m_next = jnp.maximum(m_prev, m_block)
        else:  # a row's reference max moves only when the block's max passes it by more
            m_next = jnp.where(m_block > m_prev + rescale_threshold, m_block, m_prev)
        # A row with nothing visible yet keeps m == MASK_VALUE: subtract 0 so
        # its masked logits still underflow to p == 0.
        m_sub = jnp.where(m_next == MASK_VALUE, 0.0, m_next)
        if not rescale_threshold:
            correction = jnp.exp2(m_prev - m_sub)
            acc = acc * correction[:, None]
        else:
            # Rows whose max stays scale by exactly 1, so skipping the block's
            # accumulator rescale when no row moved changes no bit of any row:
            # a row's result does not depend on the other rows of its block.
            # l's rescale stays outside the branch, as in the eager form.
            moved = m_next != m_prev
            correction = jnp.where(moved, jnp.exp2(m_prev - m_sub), 1.0)
            acc = lax.cond(jnp.max(moved.astype(jnp.int32)) > 0,
                           lambda acc: acc * correction[:, None], lambda acc: acc, acc)
        l_prev = l_prev * correction
        p = jnp.exp2(logits - m_sub[:, None])
        l_next = l_prev + p.sum(axis=1)
        acc = acc + plgpu.dot(p.astype(v_t.dtype), v_t, trans_b=True)
        return acc, m_next, l_next

    def cap(s):
        """Dot products of pre-scaled q -> base-2 logits (q carries the scales)."""
        if soft_cap is None:
            return s
        return jnp.tanh(s) * (soft_cap * LOG2E)

    def load_entries(first):
        """Table entries of the block's pages (BAD past this split's end)."""
        page_ids = first + jnp.arange(pages_per_block, dtype=jnp.int32)
        return plgpu.load(table_ref.at[pl.ds(first, pages_per_block)],
                          mask=(page_ids < hi) & (page_ids < table_width),
                          other=BAD_PAGE_INDEX)

    def load_kv(entries):
        """K [block_k, head_dim] and V^T [head_dim, block_k] of the block's keys."""
        k_page = jnp.where(entries == BAD_PAGE_INDEX, NULL_PAGE, entries) + k_offset
        in_page = jnp.arange(page_size, dtype=jnp.int32)
        k_rows = ((k_page * page_size)[:, None] + in_page[None, :]).reshape(block_k)
        d = jnp.arange(head_dim, dtype=jnp.int32)
        shape = (head_dim, pages_per_block, page_size)
        v_rows = jnp.broadcast_to(((k_page + 1) * head_dim)[None, :, None] + d[:, None, None],
                                  shape)
        v_cols = jnp.broadcast_to(in_page[None, None, :], shape)
        v_t = v_view_ref[v_rows, v_cols].reshape(head_dim, block_k)
        return k_view_ref[k_rows].astype(q.dtype), v_t.astype(q.dtype)

    def body(i, carry):
        first = lo + i * pages_per_block
        if prefetch_page_ids:  # this block's entries came with the carry
            *carry, entries = carry
            next_entries = load_entries(first + pages_per_block)
        else:
            entries = load_entries(first)
        # Blocks start on the block grid, so BAD entries in front of a windowed
        # row's tail and past its end read the all-zero null page; masked below.
        k, v_t = load_kv(entries)
        logits = cap(plgpu.dot(q, k, trans_b=True))  # f32[rows, block_k]
        k_pos = first * page_size + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        visible = k_pos[None, :] <= upper[:, None]
        if sliding_window is not None:
            visible &= k_pos[None, :] > (q_pos - sliding_window)[:, None]
        carry = softmax_step(carry, logits, visible, v_t)
        return (*carry, next_entries) if prefetch_page_ids else carry

    carry = (jnp.zeros((rows, head_dim), jnp.float32),
             jnp.full((rows,), MASK_VALUE, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    if prefetch_page_ids:
        carry = lax.fori_loop(0, num_blocks, body, (*carry, load_entries(lo)))[:3]
    else:
        carry = lax.fori_loop(0, num_blocks, body, carry)
    if has_block:  # the draft block's own K/V, not in the cache; split 0 owns it
        block_pad = block_k_ref.shape[0]
        bk = block_k_ref[...].astype(q.dtype)
        bv_t = block_v_ref[...].astype(q.dtype)  # [head_dim, block_pad], / v_scale
        j = lax.broadcasted_iota(jnp.int32, (block_pad,), 0)
        visible = (j[None, :] < q_len) & row_valid[:, None] & (split == 0)
        if block_causal:
            visible &= j[None, :] <= q_tok[:, None]
        if sliding_window is not None:
            visible &= j[None, :] > q_tok[:, None] - sliding_window
        logits = cap(plgpu.dot(q, bk, trans_b=True) * block_logit_scale)
        carry = softmax_step(carry, logits, visible, bv_t)
    acc, m, l = carry
    # Rows that saw no key (past q_len, padding, empty split) have l == 0 -> 0.
    has_keys = l > 0
    out = jnp.where(has_keys[:, None],
                    acc * (v_scale / jnp.where(has_keys, l, 1.0))[:, None], 0.0)
    if split_stats_refs:
        o_ref[...] = out
        m_ref, l_ref = split_stats_refs
        m_ref[...] = m
        l_ref[...] = l
    elif q_in_rows:
        o_ref[...] = out.astype(o_ref.dtype)
    else:  # straight into q's layout
        d = lax.broadcasted_iota(jnp.int32, (rows, head_dim), 1)
        o_index = jnp.where(in_q, q_index, max_q * num_q_heads)  # not in q: masked
        plgpu.store(o_ref.at[o_index[:, None], d], out.astype(o_ref.dtype), mask=in_q[:, None])


def attention_call(q, pool, batch_table, kv_lens, q_lens, block_kv, *, queries_cached,
                    layer_offset, sliding_window, sm_scale, soft_cap, k_scale, v_scale,
                    block_causal, options: LaunchOptions, interpret):
    """Run the kernel on validated inputs: plan, lay q out, call, combine the key splits.
    block_kv: None, or the draft block's own (K, V) [B, max_q, Hkv, D]; queries_cached:
    the queries' K/V are in the cache (decode, verify, prefill), else they follow kv_lens."""
    batch, max_q, num_q_heads, head_dim = q.shape
    num_kv_heads, _, _, _, page_size, _ = pool.shape
    table_width = batch_table.shape[1]
    q_per_kv = num_q_heads // num_kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    choices = {k: v for k, v in options._asdict().items() if k != "compute_dtype"}
    plan = plan_launch(batch=batch, max_q=max_q, q_per_kv=q_per_kv, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, table_width=table_width,
                       kv_fp8=pool.dtype == jnp.float8_e4m3fn, **choices)
    compute_dtype = options.compute_dtype
    tokens_per_block, num_q_blocks, rows = plan.tokens_per_block, plan.num_q_blocks, plan.rows
    num_splits = plan.num_splits
    # The dots run in q's dtype, or in f16 over fp8 KV: e4m3 -> f16 is one
    # packed hardware conversion per two keys, e4m3 -> bf16 several, and that
    # conversion, not the memory, bounds fp8 decode (docs/decisions.md).
    if compute_dtype is None:
        compute_dtype = jnp.float16 if pool.dtype == jnp.float8_e4m3fn else q.dtype
    k_view, v_view = kernel_views(pool)

    # q carries every logit scale (softmax, K dequantisation, base 2, and 1 /
    # soft cap ahead of the tanh), so the loop's logits come straight off the dot.
    logit_scale = sm_scale * k_scale * (LOG2E if soft_cap is None else 1.0 / soft_cap)
    # Decode and verify read q and write the result in q's own layout, so no
    # XLA op lays them out around the kernel. Prefill and the draft block get
    # q in rows, scaled, from XLA: there a q scaled in the kernel spills in the
    # loop (128 rows; the draft block's own keys use q after the loop).
    has_block = block_kv is not None
    q_in_rows = rows > FEW_Q_ROWS or has_block
    q_in, q_spec = _q_input(q, num_kv_heads, plan, logit_scale, compute_dtype, q_in_rows)
    kernel = functools.partial(
        paged_attention_kernel, rows=rows,
        num_q_heads=num_q_heads, q_per_kv=q_per_kv, queries_cached=queries_cached,
        max_q=max_q, logit_scale=logit_scale, compute_dtype=compute_dtype, q_in_rows=q_in_rows,
        tokens_per_block=tokens_per_block, pages_per_block=plan.pages_per_block,
        pages_per_split=plan.pages_per_split, num_splits=num_splits, soft_cap=soft_cap,
        sliding_window=sliding_window, block_logit_scale=1.0 / k_scale, v_scale=v_scale,
        has_block=has_block, block_causal=block_causal, page_size=page_size,
        prefetch_page_ids=plan.prefetch_page_ids, rescale_threshold=plan.rescale_threshold)
    whole = pl.BlockSpec(memory_space=None)
    in_specs = [
        q_spec,                                                              # q
        pl.BlockSpec((None,) + k_view.shape[1:], lambda p, b, h: (h, 0, 0)),  # pool as K rows
        pl.BlockSpec((None,) + v_view.shape[1:], lambda p, b, h: (h, 0, 0)),  # pool as V^T rows
        pl.BlockSpec((None, table_width), lambda p, b, h: (b, 0)),           # batch table
        whole, whole, whole,                                   # kv_lens, q_lens, layer offset
    ]
    layer = jnp.asarray(layer_offset, jnp.int32).reshape(1)
    inputs = [q_in, k_view, v_view, batch_table, kv_lens, q_lens, layer]
    if has_block:
        block_inputs, block_specs = _block_inputs(block_kv, v_scale, compute_dtype)
        inputs += block_inputs
        in_specs += block_specs
    if num_splits == 1 and not q_in_rows:  # the result in q's dtype and layout
        out_specs, out_shape = [q_spec], [jax.ShapeDtypeStruct(q_in.shape, q.dtype)]
    else:
        out_specs, out_shape = _row_outputs(plan, batch, num_kv_heads, head_dim, q.dtype)
    o, *split_stats = pl.pallas_call(
        kernel,
        # Query blocks and splits of one (row, kv head) launch side by side (CUDA
        # starts grid x first), so their reads of the same keys meet in L2.
        grid=(num_q_blocks * num_splits, batch, num_kv_heads),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps,
                                             num_stages=plan.num_stages),
        interpret=interpret,
        name=(f"paged_attention_q{max_q}_g{q_per_kv}_r{rows}_ppb{plan.pages_per_block}"
              f"_s{num_splits}{'_block' if has_block else ''}"),
    )(*inputs)
    if num_splits == 1 and not q_in_rows:
        return o.reshape(q.shape)
    out = o[0] if num_splits == 1 else combine_splits(o, *split_stats)
    return _rows_to_queries(out, q.shape, plan).astype(q.dtype)


def _q_input(q, num_kv_heads, plan, logit_scale, compute_dtype, in_rows: bool):
    """q as the kernel reads it, and its block spec: in rows, scaled, in the dots' dtype;
    or as given, [B, Q * Hq, D] (the kernel scales it)."""
    batch, max_q, num_q_heads, head_dim = q.shape
    if in_rows:
        q_rows = _queries_to_rows(q, num_kv_heads, plan).astype(jnp.float32) * logit_scale
        num_splits = plan.num_splits
        return q_rows.astype(compute_dtype), pl.BlockSpec(
            (None, None, plan.rows, head_dim), lambda p, b, h: (b, h, p // num_splits, 0))
    return (q.reshape(batch, max_q * num_q_heads, head_dim),
            pl.BlockSpec((None, max_q * num_q_heads, head_dim), lambda p, b, h: (b, 0, 0)))


def _block_inputs(block_kv, v_scale, compute_dtype):
    """The draft block's own K [B, Hkv, pad, D] and V^T [B, Hkv, D, pad] (V / v_scale),
    padded to a power of two of at least MIN_ROWS keys, and their block specs."""
    max_q, head_dim = block_kv[0].shape[1], block_kv[0].shape[3]
    pad = max(MIN_ROWS, pow2_at_least(max_q))
    block_k, block_v = (jnp.pad(x, ((0, 0), (0, pad - max_q), (0, 0), (0, 0))) for x in block_kv)
    inputs = [block_k.transpose(0, 2, 1, 3).astype(compute_dtype),
              (block_v.astype(jnp.float32) / v_scale).transpose(0, 2, 3, 1).astype(compute_dtype)]
    specs = [pl.BlockSpec((None, None, pad, head_dim), lambda p, b, h: (b, h, 0, 0)),
             pl.BlockSpec((None, None, head_dim, pad), lambda p, b, h: (b, h, 0, 0))]
    return inputs, specs


def _row_outputs(plan, batch, num_kv_heads, head_dim, dtype):
    """Output specs and shapes in rows [splits, B, Hkv, num_q_blocks * rows, (D)]: unsplit
    in q's dtype, or f32 per split with the softmax's m and l for the combine."""
    num_splits, rows = plan.num_splits, plan.rows
    out_rows = (num_splits, batch, num_kv_heads, plan.num_q_blocks * rows)

    def rows_index(p, b, h):  # the split's, and the query block's, rows
        return p % num_splits, b, h, p // num_splits
    specs = [pl.BlockSpec((None, None, None, rows, head_dim),
                          lambda *grid: (*rows_index(*grid), 0))]
    shapes = [jax.ShapeDtypeStruct(out_rows + (head_dim,),
                                   dtype if num_splits == 1 else jnp.float32)]
    if num_splits > 1:
        specs += 2 * [pl.BlockSpec((None, None, None, rows), rows_index)]
        shapes += 2 * [jax.ShapeDtypeStruct(out_rows, jnp.float32)]
    return specs, shapes


def _queries_to_rows(q, num_kv_heads: int, plan):
    """q [B, Q, Hkv * G, D] -> [B, Hkv, num_q_blocks * rows, D]: each query block's
    (token, q head) rows of one kv head, padded to `plan.rows`."""
    batch, max_q, num_q_heads, head_dim = q.shape
    q_per_kv, tokens, blocks = num_q_heads // num_kv_heads, plan.tokens_per_block, plan.num_q_blocks
    q = jnp.pad(q, ((0, 0), (0, blocks * tokens - max_q), (0, 0), (0, 0)))
    q = q.reshape(batch, blocks, tokens, num_kv_heads, q_per_kv * head_dim).transpose(0, 3, 1, 2, 4)
    q = jnp.pad(q.reshape(batch, num_kv_heads, blocks, -1, head_dim),
                ((0, 0),) * 3 + ((0, plan.rows - tokens * q_per_kv), (0, 0)))
    return q.reshape(batch, num_kv_heads, blocks * plan.rows, head_dim)


def _rows_to_queries(out, q_shape, plan):
    """The inverse of `_queries_to_rows`: [B, Hkv, num_q_blocks * rows, D] -> q's shape."""
    batch, max_q, num_q_heads, head_dim = q_shape
    num_kv_heads = out.shape[1]
    q_per_kv, tokens, blocks = num_q_heads // num_kv_heads, plan.tokens_per_block, plan.num_q_blocks
    out = out.reshape(batch, num_kv_heads, blocks, plan.rows, head_dim)
    out = out[:, :, :, :tokens * q_per_kv].reshape(
        batch, num_kv_heads, blocks * tokens, q_per_kv, head_dim)
    return out[:, :, :max_q].transpose(0, 2, 1, 3, 4).reshape(q_shape)


def combine_splits(o, m, l):
    """Merge per-split softmax parts: o [S, ..., D], m and l [S, ...] (m in base 2).

    Written as S unrolled elementwise terms, not reductions over the split
    axis: XLA picks a reduction's order by shape, and a row must combine the
    same way in a 1-query decode pass as in a K+1-query verify pass."""
    m_max = functools.reduce(jnp.maximum, list(m))
    weights = [jnp.exp2(m_s - m_max) * l_s for m_s, l_s in zip(m, l)]  # m in log2 units
    total = functools.reduce(jnp.add, weights)
    out = functools.reduce(jnp.add, [o_s * w[..., None] for o_s, w in zip(o, weights)])
    return jnp.where(total[..., None] > 0,
                     out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
