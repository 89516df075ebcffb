"""How a step's KV transfers group into export and import calls, and what a call takes.

Requests of one page bucket (`kv_io.page_bucket`, per sent pool) share a call, up to
`call_rows` of them, padded to a power of two (`scheduler.padded_rows`), so a stream
runs a few call shapes, all compiled by the warm-up. A call's host inputs travel packed
in one i32 array (`pack_export_index`, `pack_import_index`): on a GPU every host array
a call takes is a transfer of its own.
"""

from __future__ import annotations

import numpy as np

from drafter.scheduler import padded_rows

# A transfer call's rows hold at most this many pages of their largest pool (2,048 tokens
# at 16-token pages). Requests that end their prefill in one step are mostly short ones (a
# long prompt spans several steps), so a long bucket's calls take one row, and the
# warm-up compiles one shape for each long bucket rather than one per row count.
CALL_PAGES = 128


def call_rows(key, most: int) -> int:
    """The most rows a transfer call of page bucket `key` (pages per sent pool) takes:
    `most`, or fewer (a power of two, at least 1) so that its rows hold at most
    CALL_PAGES pages of the largest pool."""
    fit = CALL_PAGES // max(*key, 1)
    return min(most, 1 << (fit.bit_length() - 1)) if fit >= 1 else 1


def call_groups(keys, most: int):
    """(key, indices, rows) per transfer call: items of one key (page bucket) together,
    at most `call_rows(key, most)` a call, which runs `rows` rows (`padded_rows`: a
    power of two; `row_shapes(call_rows(key, most))` a bucket)."""
    by_key: dict = {}
    for i, key in enumerate(keys):
        by_key.setdefault(key, []).append(i)
    for key, idx in by_key.items():
        limit = call_rows(key, most)
        for j in range(0, len(idx), limit):
            group = idx[j:j + limit]
            yield key, group, padded_rows(len(group), limit)


def pack_export_index(rows) -> np.ndarray:
    """An export call's host inputs as one i32[rows, 1 + sum(buckets)] array (one
    transfer a call): per row its slot, then its logical pages of each sent pool.
    rows: (slot, logical_pages: per pool i32[n_bucket]) per request."""
    return np.stack([np.concatenate([np.int32([slot]), *logical]).astype(np.int32)
                     for slot, logical in rows])


def pack_import_index(reset_slots, rows) -> np.ndarray:
    """An import call's host inputs as one i32 vector (one transfer a call): the
    slots to empty first (i32[num_slots], dummy pads), then per row its slot,
    target_len, draft_ctx_len and logical pages of each sent pool.
    rows: (slot, target_len, draft_ctx_len, logical_pages) per request."""
    parts = [np.asarray(reset_slots, np.int32)]
    for slot, target_len, draft_ctx_len, logical in rows:
        parts += [np.int32([slot, target_len, draft_ctx_len]), *logical]
    return np.concatenate(parts).astype(np.int32)
