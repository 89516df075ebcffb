"""The unified target/draft paged KV cache: specs, pools, functional state."""

from unified_kv.admission import (AdmissionController, AdmissionError, Capacity, Reservation,
                                  budget_for, bytes_per_pool, bytes_per_request, capacity,
                                  check_fits, pages_per_request)
from unified_kv.spec import (BAD_PAGE_INDEX, KV_DTYPES, NULL_PAGE, SUPPORTED_PAGE_SIZES, CacheSpec,
                             CacheSpecError, LayerSpec, PoolSpec, bucket_width, layer_name,
                             max_live_pages, pow2_at_least)
from unified_kv.state import (KVState, admit_slots, allocate_pages, grow, init_state,
                              live_logical_pages,
                              release_slots, retire_window_pages, row_extent,
                              state_shardings, validate_slot_ids)

__all__ = [
    "AdmissionController", "AdmissionError", "Capacity", "Reservation", "budget_for",
    "bytes_per_pool", "bytes_per_request", "capacity", "check_fits",
    "pages_per_request", "BAD_PAGE_INDEX", "KV_DTYPES", "NULL_PAGE", "SUPPORTED_PAGE_SIZES",
    "CacheSpec", "CacheSpecError", "LayerSpec", "PoolSpec", "bucket_width", "layer_name",
    "max_live_pages",
    "pow2_at_least",
    "KVState", "admit_slots", "allocate_pages", "grow", "init_state", "live_logical_pages", "release_slots",
    "retire_window_pages", "row_extent", "state_shardings", "validate_slot_ids",
]
