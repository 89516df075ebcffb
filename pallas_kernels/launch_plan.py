"""How a paged-attention call is cut into Pallas programs, and the default launch
options (the evidence for each: docs/decisions.md).

One job: from the call's shapes and the caller's explicit choices, decide
query blocks, key splits, warps, pipeline stages, page-id prefetch and the
rescale threshold (over fp8 KV, its own for the last three). Greedy speculative
decoding must reproduce plain decoding token for token, so a row's 1-query decode
pass and its K+1-query verify pass must do the same arithmetic; `arithmetic(plan)`
names the fields that decide it, and tests check that decode and verify plans agree
on them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jax.experimental import pallas as pl

from pallas_kernels.device import device_info
from pallas_kernels.pool_layout import pow2_at_least

MIN_ROWS = 16    # Triton's dot needs at least 16 rows
FEW_Q_MAX = 16   # "few-query" calls have up to this many query tokens per row: decode, verify, draft block
FEW_Q_ROWS = 32  # at most this many query rows per block for those (2 warps)
# Key pages per split: for few-query calls when rows x kv heads cannot fill the GPU
# (measured on the H200 against 32-page splits: docs/decisions.md), and for prefill always.
FEW_Q_SPLIT_PAGES = 128
# Key splits of the Gluon kernel's few-query calls at small batch: keys per split for up
# to 16 (row, kv head) programs, doubling with every doubling past that, so a batch-1
# step's attention runs on 4 x as many programs at a 1K context while the partial
# results of a long context stay a bounded size (docs/decisions.md).
SMALL_BATCH_SPLIT_KEYS = 256


class LaunchOptions(NamedTuple):
    """A Pallas attention call's launch choices, passed as one static argument. A field
    left None takes the default `plan_launch` picks for the call's shapes."""
    rows_per_block: int | None = None      # query rows per program
    pages_per_block: int = 4               # pages per key block (a power of two)
    num_splits: int | None = None          # key splits per (row, kv head, query block)
    num_warps: int | None = None
    num_stages: int | None = None          # pipeline stages of the key loop
    compute_dtype: Any = None              # the dots' dtype (None: q's; f16 over fp8 KV)
    prefetch_page_ids: bool | None = None  # load a block's page ids one block ahead
    rescale_threshold: float | None = None  # lazy rescale: move a row's max by > 2**T only


class LaunchPlan(NamedTuple):
    tokens_per_block: int  # query tokens per program
    num_q_blocks: int      # programs per (row, kv head, split)
    rows: int              # query rows per program: tokens x q_per_kv, padded to 2^k >= 16
    pages_per_block: int   # pages per key block (one loop iteration)
    num_splits: int        # key splits per (row, kv head, query block)
    pages_per_split: int
    num_warps: int
    num_stages: int
    prefetch_page_ids: bool
    rescale_threshold: float
    warps_split_rows: bool  # Triton's layout for the dots: rows >= head_dim (see below)


def small_batch_split_keys(batch: int, num_kv_heads: int, num_sms: int | None = None) -> int:
    """Keys per key split of the Gluon kernel's few-query calls (decode, verify, draft
    block), or 0 for none: split when batch x kv heads is at most half the SM count
    (one program per (row, kv head) then leaves most of the GPU idle). The split size
    follows the batch only, never the table width or the query count, so a row's decode
    and verify passes in one engine split its keys alike; engines of equal slot counts
    agree bit for bit."""
    programs = batch * num_kv_heads
    if 2 * programs > (num_sms or device_info().num_sms):
        return 0
    return SMALL_BATCH_SPLIT_KEYS * pow2_at_least(-(-programs // 16))


def arithmetic(plan: LaunchPlan) -> tuple:
    """The fields that decide a query row's result bits. Stages and prefetch
    only schedule loads; rows and query blocks change no row's arithmetic up
    to FEW_Q_ROWS rows per block over 2 warps while the dots' warp layout stays
    the same (test_gpu_compiled)."""
    return (plan.pages_per_block, plan.num_splits, plan.pages_per_split, plan.num_warps,
            plan.rescale_threshold, plan.warps_split_rows)


def plan_launch(*, batch: int, max_q: int, q_per_kv: int, num_kv_heads: int,
                head_dim: int, table_width: int, rows_per_block: int | None = None,
                pages_per_block: int = 4, num_splits: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None,
                prefetch_page_ids: bool | None = None,
                rescale_threshold: float | None = None, kv_fp8: bool = False,
                num_sms: int | None = None) -> LaunchPlan:
    """The caller's explicit options, and the defaults for those left None.

    Up to FEW_Q_MAX query tokens per row (decode, verify, draft block) every
    arithmetic field is the same whatever max_q and table width: blocks of at
    most FEW_Q_ROWS rows over 2 warps, and, when rows x kv heads cannot fill
    the GPU twice, key splits of FEW_Q_SPLIT_PAGES pages (else none). Whether
    a call splits follows its batch, which in the engine is its slot count:
    two engines (plain and speculative, or an aggregated server and a
    disaggregated generation server) split a row's keys alike, and so agree
    bit for bit, when both have slots x kv heads below 2 x num_sms or both
    at or above it (8 kv heads, 132 SMs: both under 33 slots, or both 33 or
    more). Splitting always would drop that condition at some large-batch
    decode time (docs/decisions.md). num_sms: the device's
    (`device.device_info`) unless given.

    A verify with more rows than FEW_Q_ROWS takes several query blocks per row
    (never one larger block, nor more warps, nor a split count that follows the
    number of query blocks: under Pallas Triton's own layouts each changes bits
    against decode), launched side by side so their reads of the row's keys meet in
    L2. The Gluon kernel, whose layouts are explicit, asks for one block of up to 64
    rows instead (`rows_per_block`; paged_attention_gluon.FEW_Q_WIDE_ROWS). Triton
    lays the two dots out over 2 warps by splitting head_dim when rows < head_dim
    and the rows otherwise, and the two add in different orders; so few-query blocks
    hold fewer rows than head_dim (16 at head dim 32) unless q heads per kv head
    alone reach it (docs/decisions.md, "Exactness").

    Prefill (more than FEW_Q_MAX query tokens) always splits keys in
    FEW_Q_SPLIT_PAGES-page pieces, whatever its rows and table width, so a
    prompt's KV and logits do not depend on which other prompts share its call
    or how long they are.

    `kv_fp8` (the call reads fp8 KV) sets the fp8 defaults up to FEW_Q_MAX
    query tokens: decode prefetches the page ids one block ahead, verify takes
    5 stages, and both rescale lazily (rescale_threshold=8); docs/decisions.md
    says why bf16 KV and prefill keep the plain ones.
    """
    few_q = max_q <= FEW_Q_MAX
    fast = kv_fp8 and few_q  # prefill keeps its options (the lazy rescale slows it)
    if rows_per_block is None:
        rows_per_block = max(MIN_ROWS, min(FEW_Q_ROWS, head_dim // 2)) if few_q else 128
    tokens_per_block = min(max_q, max(1, rows_per_block // q_per_kv))
    num_q_blocks = pl.cdiv(max_q, tokens_per_block)
    rows = max(MIN_ROWS, pow2_at_least(tokens_per_block * q_per_kv))
    pages_per_block = min(pages_per_block, pow2_at_least(table_width))
    programs = batch * num_kv_heads * (1 if few_q else num_q_blocks)
    num_sms = num_sms or device_info().num_sms
    if num_splits is None and few_q and programs >= 2 * num_sms:
        num_splits = 1  # the rows alone fill the GPU: no split, so no boundary at all
    if num_splits is None:
        # Splits of a fixed size: a row's split boundaries, and so its bits, must not
        # follow the table width (which follows the batch's longest row and differs
        # between a plain decode step and a verify step at the same position) nor,
        # for prefill, the batch (which follows who shares the call). Splits past a
        # row's keys add exact zeros.
        pages_per_split = pl.cdiv(FEW_Q_SPLIT_PAGES, pages_per_block) * pages_per_block
        num_splits = pl.cdiv(table_width, pages_per_split)
    else:
        pages_per_split = (pl.cdiv(pl.cdiv(table_width, num_splits), pages_per_block)
                           * pages_per_block)
    if rescale_threshold is not None and not 0 <= rescale_threshold <= 16:
        raise ValueError(f"rescale_threshold must be in [0, 16] (p < 2**threshold must fit "
                         f"the dots' f16/bf16), got {rescale_threshold}")
    return LaunchPlan(
        tokens_per_block=tokens_per_block, num_q_blocks=num_q_blocks, rows=rows,
        pages_per_block=pages_per_block, num_splits=num_splits,
        pages_per_split=pages_per_split,
        num_warps=num_warps or (2 if few_q or rows <= 32 else 4),
        num_stages=num_stages or (5 if fast and rows > 16 else 3),
        prefetch_page_ids=(fast and rows <= 16) if prefetch_page_ids is None
        else prefetch_page_ids,
        rescale_threshold=(8.0 if fast else 0.0) if rescale_threshold is None
        else rescale_threshold,
        warps_split_rows=rows >= head_dim)
