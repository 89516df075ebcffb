"""Host-side admission: slots and worst-case page reservations per pool.

The jitted steps allocate pages themselves (accepted-token counts never come
back to the host first), so the host must guarantee they cannot run out: a
request is admitted only if its worst-case page count fits in every pool next
to the worst cases already reserved. A refused request raises
`AdmissionError` and changes nothing.

    reserve(request of max_len) per pool:
      full pool      ceil((max_len + max_step_tokens) / page_size)
      windowed pool  min(full, ceil((W - 1 + max_step_tokens) / page_size) + 1)
"""

from __future__ import annotations

import dataclasses

from unified_kv.spec import CacheSpec, max_live_pages


class AdmissionError(RuntimeError):
    """A request the cache cannot take now; nothing was changed."""


@dataclasses.dataclass(frozen=True)
class Reservation:
    """What one admitted request holds: its slot and reserved pages per pool."""

    request_id: str
    slot: int
    max_len: int
    pages_per_pool: tuple[int, ...]


def pages_per_request(spec: CacheSpec, max_len: int) -> tuple[int, ...]:
    """Worst-case pages a request of `max_len` tokens holds in each pool."""
    return tuple(max_live_pages(spec.page_size, p.sliding_window, max_len,
                                spec.max_step_tokens) for p in spec.pools)


def check_fits(spec: CacheSpec, request_id: str, max_len: int) -> tuple[int, ...]:
    """The worst-case pages per pool of a request of `max_len` tokens; AdmissionError if
    it could not run even in an empty cache (past max_seq_len, or more pages than a pool
    has)."""
    if not isinstance(max_len, int) or max_len <= 0:
        raise AdmissionError(f"request {request_id!r}: max_len must be a positive "
                             f"int, got {max_len!r}")
    if max_len > spec.max_seq_len:
        raise AdmissionError(
            f"request {request_id!r}: max_len={max_len} exceeds the cache's "
            f"max_seq_len={spec.max_seq_len}; shorten the prompt or max_new_tokens, "
            f"or build the cache with a larger max_seq_len")
    need = pages_per_request(spec, max_len)
    for pool, n in zip(spec.pools, need):
        if n > pool.num_usable_pages:
            raise AdmissionError(
                f"request {request_id!r}: needs {n} pages of pool {pool.pool_id} but it "
                f"has {pool.num_usable_pages}; raise memory_budget_bytes")
    return need


def bytes_per_request(spec: CacheSpec, max_len: int) -> dict[int, int]:
    """Worst-case KV bytes of one request, per pool id."""
    return {p.pool_id: n * p.bytes_per_page
            for p, n in zip(spec.pools, pages_per_request(spec, max_len))}


def bytes_per_pool(spec: CacheSpec) -> dict[int, int]:
    """Device bytes of each pool."""
    return {p.pool_id: p.nbytes for p in spec.pools}


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What a cache holds at once: requests of `max_len` tokens, each at its worst
    case in every pool (what admission reserves), and no more than the slots."""

    requests: int
    max_len: int
    num_slots: int
    limited_by: str          # "slots" or "memory"
    kv_bytes: int            # every pool, null pages included

    def describe(self) -> str:
        fix = ("more KV memory holds more" if self.limited_by == "memory"
               else "more slots would hold more")
        return (f"KV cache {self.kv_bytes / 2**30:.2f} GiB holds {self.requests} request(s) "
                f"of {self.max_len:,} tokens at once ({self.num_slots} slots; "
                f"{self.limited_by} limit it: {fix})")


def capacity(spec: CacheSpec, max_len: int | None = None) -> Capacity:
    """How many requests of `max_len` tokens (default max_seq_len) admission takes at
    once into an empty cache of `spec`."""
    max_len = spec.max_seq_len if max_len is None else max_len
    need = pages_per_request(spec, max_len)
    by_memory = min(p.num_usable_pages // n for p, n in zip(spec.pools, need))
    return Capacity(min(spec.num_slots, by_memory), max_len, spec.num_slots,
                    "slots" if spec.num_slots <= by_memory else "memory",
                    sum(p.nbytes for p in spec.pools))


def budget_for(spec: CacheSpec, requests: int) -> int:
    """The least memory_budget_bytes with which a cache of `spec`'s layers, slots and
    max_seq_len holds `requests` requests of max_seq_len tokens at once."""
    need = pages_per_request(spec, spec.max_seq_len)
    return sum((requests * n + 1) * p.bytes_per_page for p, n in zip(spec.pools, need))


class AdmissionController:
    """Hands out slots and reserves pages; holds host ints only, never arrays."""

    def __init__(self, spec: CacheSpec):
        self.spec = spec
        self._free_slots = list(range(spec.num_slots))
        self._reserved = [0] * len(spec.pools)
        self._by_request: dict[str, Reservation] = {}

    @property
    def reserved_pages(self) -> tuple[int, ...]:
        return tuple(self._reserved)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def reservation(self, request_id: str) -> Reservation:
        return self._by_request[request_id]

    def admit(self, request_id: str, max_len: int) -> Reservation:
        """Reserve a slot and worst-case pages, or raise AdmissionError."""
        spec = self.spec
        if request_id in self._by_request:
            raise AdmissionError(f"request {request_id!r} is already admitted "
                                 f"(slot {self._by_request[request_id].slot})")
        need = check_fits(spec, request_id, max_len)
        if not self._free_slots:
            raise AdmissionError(
                f"request {request_id!r}: all {spec.num_slots} slots are busy; retry "
                f"after a request finishes or raise num_slots")
        for pool, n, held in zip(spec.pools, need, self._reserved):
            if held + n > pool.num_usable_pages:
                raise AdmissionError(
                    f"request {request_id!r}: pool {pool.pool_id} "
                    f"({pool.kv_dtype}, window={pool.sliding_window}) needs {n} pages "
                    f"but only {pool.num_usable_pages - held} of {pool.num_usable_pages} are "
                    f"unreserved; retry later, shorten the request, or raise "
                    f"memory_budget_bytes")
        slot = self._free_slots.pop(0)
        self._reserved = [r + n for r, n in zip(self._reserved, need)]
        res = Reservation(request_id, slot, max_len, need)
        self._by_request[request_id] = res
        return res

    def release(self, request_id: str) -> Reservation:
        """Return a finished request's slot and reservation."""
        try:
            res = self._by_request.pop(request_id)
        except KeyError:
            raise KeyError(f"request {request_id!r} is not admitted") from None
        self._reserved = [r - n for r, n in zip(self._reserved, res.pages_per_pool)]
        self._free_slots.append(res.slot)
        self._free_slots.sort()
        return res
