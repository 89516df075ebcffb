"""Launch plans: a row's decode and verify passes must do the same arithmetic."""

import pytest

from pallas_kernels.device import device_info
from pallas_kernels.launch_plan import (FEW_Q_MAX, FEW_Q_ROWS, FEW_Q_SPLIT_PAGES, arithmetic,
                                        plan_launch)


@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("q_per_kv", [1, 2, 4, 5, 8, 16, 32])
@pytest.mark.parametrize("batch,num_kv_heads,table_width", [
    (64, 8, 2048), (16, 4, 188), (1, 2, 4096), (3, 8, 9)])
def test_decode_and_verify_plans_share_their_arithmetic(kv_fp8, head_dim, q_per_kv, batch,
                                                        num_kv_heads, table_width):
    shape = dict(batch=batch, q_per_kv=q_per_kv, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, table_width=table_width, kv_fp8=kv_fp8)
    decode = plan_launch(max_q=1, **shape)
    for max_q in range(2, FEW_Q_MAX + 1):
        verify = plan_launch(max_q=max_q, **shape)
        assert arithmetic(verify) == arithmetic(decode), f"{max_q=}"
        assert verify.rows <= max(FEW_Q_ROWS, q_per_kv * 2)  # one token may exceed 32 rows
        assert verify.tokens_per_block * verify.num_q_blocks >= max_q


def test_measured_defaults():
    shape = dict(batch=64, q_per_kv=4, num_kv_heads=8, head_dim=128, table_width=2048)
    decode, verify = plan_launch(max_q=1, **shape), plan_launch(max_q=8, **shape)
    assert (decode.rows, verify.rows, decode.num_warps, verify.num_warps) == (16, 32, 2, 2)
    for plan in (decode, verify):  # the fast fp8 options only where the kernel passes them
        assert (plan.num_stages, plan.prefetch_page_ids, plan.rescale_threshold) == (3, False, 0)
    fast_decode = plan_launch(max_q=1, kv_fp8=True, **shape)
    fast_verify = plan_launch(max_q=8, kv_fp8=True, **shape)
    assert (fast_decode.num_stages, fast_decode.prefetch_page_ids) == (3, True)
    assert (fast_verify.num_stages, fast_verify.prefetch_page_ids) == (5, False)
    assert fast_decode.rescale_threshold == fast_verify.rescale_threshold == 8.0
    assert plan_launch(max_q=2048, kv_fp8=True, **shape) == plan_launch(max_q=2048, **shape)
    prefill = plan_launch(max_q=2048, **shape)
    assert (prefill.rows, prefill.num_warps, prefill.num_q_blocks, prefill.num_splits) == (
        128, 4, 64, 2048 // FEW_Q_SPLIT_PAGES)
    # A 16-token verify at GQA 8 is 128 rows: four 32-row blocks, decode's
    # splits (4 rows x kv heads: splits of FEW_Q_SPLIT_PAGES pages).
    small = dict(batch=2, q_per_kv=8, num_kv_heads=2, head_dim=128, table_width=4096)
    v16 = plan_launch(max_q=16, **small)
    assert (v16.num_q_blocks, v16.rows, v16.num_warps) == (4, 32, 2)
    assert v16.num_splits == plan_launch(max_q=1, **small).num_splits == 4096 // FEW_Q_SPLIT_PAGES
    # At head dim 32 a 32-row block would lay its dots out by rows, decode's
    # 16 rows by head_dim: verify-8 at GQA 4 takes two 16-row blocks.
    v8 = plan_launch(max_q=8, **dict(shape, head_dim=32))
    assert (v8.num_q_blocks, v8.rows, v8.warps_split_rows) == (2, 16, False)


def test_explicit_options_win_and_bad_threshold_is_named():
    plan = plan_launch(batch=4, max_q=8, q_per_kv=4, num_kv_heads=2, head_dim=64,
                       table_width=64, num_warps=4, num_stages=2, num_splits=3,
                       prefetch_page_ids=True, rescale_threshold=0.0, rows_per_block=16)
    assert (plan.num_warps, plan.num_stages, plan.num_splits, plan.prefetch_page_ids,
            plan.rescale_threshold, plan.tokens_per_block) == (4, 2, 3, True, 0.0, 4)
    with pytest.raises(ValueError, match="rescale_threshold must be in"):
        plan_launch(batch=1, max_q=1, q_per_kv=1, num_kv_heads=1, head_dim=64,
                    table_width=4, rescale_threshold=20.0)


@pytest.mark.parametrize("batch,num_kv_heads", [(4, 2), (64, 8)])
def test_few_query_split_boundaries_do_not_follow_the_table_width(batch, num_kv_heads):
    """The engine's table width follows the batch's longest row and differs
    between a plain step and a verify step at the same position."""
    widths = (16, 64, 1024, 4096)
    plans = [plan_launch(batch=batch, max_q=max_q, q_per_kv=4, num_kv_heads=num_kv_heads,
                         head_dim=128, table_width=width)
             for width in widths for max_q in (1, 8)]
    splits = {p.num_splits for p in plans}
    if batch * num_kv_heads < 2 * device_info().num_sms:
        assert {p.pages_per_split for p in plans} == {FEW_Q_SPLIT_PAGES}
        assert splits == {-(-width // FEW_Q_SPLIT_PAGES) for width in widths}
    else:
        assert splits == {1}  # one split per row: no boundary at all


def test_prefill_arithmetic_follows_neither_the_batch_nor_the_table_width():
    """Under a stream, who shares a prompt's prefill call (its rows) and the longest
    of them (the table width) follow arrival timing; the prompt's bits must not."""
    fields = set()
    for batch in (1, 3, 8, 64):
        for width in (16, 64, 1024, 4096):
            for max_q in (256, 512):
                plan = plan_launch(batch=batch, max_q=max_q, q_per_kv=4, num_kv_heads=8,
                                   head_dim=128, table_width=width)
                # the split count only covers the width: boundaries sit at the same pages
                assert plan.num_splits == -(-width // FEW_Q_SPLIT_PAGES)
                fields.add(arithmetic(plan._replace(num_splits=0)))
    assert len(fields) == 1
