"""KVState: the unified cache as a pytree of arrays, changed by pure functions.

Every function here takes the static `CacheSpec` first (a jit static argument)
and a `KVState`, and returns a new `KVState`; all of them run inside
`jax.jit` with the state donated. Failure inside jit is data: `allocate_pages`
returns an `ok` mask and leaves rows that do not fit untouched.

One row's page table in a windowed pool (page_size 4, window 6, len 13):

    logical page   0    1    2    3    4
    positions     0-3  4-7  8-11 12-15 16-19
    entry         BAD  BAD   17    5   BAD
                  `retired`  `-live-`  `unallocated`
    live keys start at len - W + 1 = 8; extent = last valid entry + 1 = 4

Conventions:
  * `slot_ids: i32[B]` are the batch's rows; padding rows use the dummy slot
    (`spec.dummy_slot`), which owns no pages and whose lengths are 0 after
    every function here.
  * PRECONDITION: a real slot appears at most once in `slot_ids`
    (`validate_slot_ids` checks this on the host).
  * `target_lens[s]`: positions with target KV in the cache; `draft_ctx_lens[s]`:
    positions with draft context KV. Lengths only grow between admit and release.
  * A free list is a stack: `free_pages[p][:num_free[p]]` are the free pages.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from unified_kv.spec import BAD_PAGE_INDEX, NULL_PAGE, CacheSpec, PoolSpec


@flax.struct.dataclass
class KVState:
    """Attributes:
      pools: per pool, [num_kv_heads, num_pages, num_layers, 2, page_size, head_dim].
      page_tables: per pool, i32[num_slots + 1, max_pages_per_seq]; BAD = -1.
      free_pages: per pool, i32[num_pages]; a stack, entries [:num_free] are free
        (NULL_PAGE is never among them).
      num_free: i32[num_pools], free pages per pool.
      target_lens: i32[num_slots + 1], committed target KV positions per slot.
      draft_ctx_lens: i32[num_slots + 1], draft context KV positions per slot.
    """

    pools: tuple[jax.Array, ...]
    page_tables: tuple[jax.Array, ...]
    free_pages: tuple[jax.Array, ...]
    num_free: jax.Array
    target_lens: jax.Array
    draft_ctx_lens: jax.Array


def init_state(spec: CacheSpec, *, mesh: Mesh | None = None,
               kv_head_axis: str | None = None) -> KVState:
    """An empty cache: every page free, every table entry BAD, lengths 0.

    With `mesh`, pools are sharded along kv heads over `kv_head_axis` (default:
    the mesh's first axis) and everything else is replicated.
    """
    pools, tables, free = [], [], []
    for pool in spec.pools:
        pools.append(jnp.zeros(pool.shape, pool.dtype))
        tables.append(jnp.full((spec.num_slots + 1, pool.max_pages_per_seq),
                               BAD_PAGE_INDEX, jnp.int32))
        # Every page but NULL_PAGE (0), reversed so pops hand out 1, 2, 3, ...
        free.append(jnp.concatenate([jnp.arange(pool.num_pages - 1, 0, -1, dtype=jnp.int32),
                                     jnp.full((1,), NULL_PAGE, jnp.int32)]))
    def lens():  # distinct buffers: both are donated
        return jnp.zeros((spec.num_slots + 1,), jnp.int32)

    state = KVState(
        pools=tuple(pools), page_tables=tuple(tables), free_pages=tuple(free),
        num_free=jnp.asarray([p.num_usable_pages for p in spec.pools], jnp.int32),
        target_lens=lens(), draft_ctx_lens=lens())
    if mesh is not None:
        state = jax.device_put(state, state_shardings(spec, mesh, kv_head_axis))
    return state


def state_shardings(spec: CacheSpec, mesh: Mesh, kv_head_axis: str | None = None):
    """A KVState-shaped pytree of shardings: pools split along kv heads."""
    axis = kv_head_axis or mesh.axis_names[0]
    size = mesh.shape[axis]
    for pool in spec.pools:
        if pool.num_kv_heads % size:
            raise ValueError(
                f"pool {pool.pool_id} has num_kv_heads={pool.num_kv_heads}, not "
                f"divisible by mesh axis {axis!r} of size {size}; use a mesh whose "
                f"{axis!r} axis divides every layer's kv heads")
    replicated = NamedSharding(mesh, P())
    n = len(spec.pools)
    return KVState(
        pools=tuple(NamedSharding(mesh, P(axis)) for _ in range(n)),
        page_tables=(replicated,) * n, free_pages=(replicated,) * n,
        num_free=replicated, target_lens=replicated, draft_ctx_lens=replicated)


# ---------------------------------------------------------------- row helpers

def row_extent(table_rows: jax.Array) -> jax.Array:
    """Allocated extent of each row: last valid entry + 1 (0 if none).

    Not the count of valid entries: a windowed row has BAD entries in front
    of its live tail.

    Args:
      table_rows: i32[..., max_pages_per_seq].
    Returns:
      i32[...].
    """
    cols = jnp.arange(1, table_rows.shape[-1] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(table_rows != BAD_PAGE_INDEX, cols, 0), axis=-1)


def _pool_len(pool: PoolSpec, target_lens, draft_lens, combine):
    """The length that governs a pool: its roles' lengths, combined."""
    lens = [l for role, l in (("target", target_lens), ("draft", draft_lens))
            if role in pool.roles]
    return functools.reduce(combine, lens)


def _window_start(pool: PoolSpec, lens: jax.Array) -> jax.Array:
    """First position a query at `lens` (or later) can still see."""
    if pool.sliding_window is None:
        return jnp.zeros_like(lens)
    return jnp.maximum(lens - pool.sliding_window + 1, 0)


def _plan_allocation(pool: PoolSpec, rows, num_free, first_page, end_page, active):
    """Which entries of `rows` get a new page, and whether each row fits.

    A row fits if it needs no page, or if the pages of it and of every row before
    it fit in the free list (first-come order keeps the result deterministic).
    """
    cols = jnp.arange(rows.shape[-1], dtype=jnp.int32)[None, :]
    start = jnp.maximum(first_page, row_extent(rows))[:, None]
    want = (cols >= start) & (cols < end_page[:, None]) & active[:, None]
    need = want.sum(axis=1, dtype=jnp.int32)
    fits = (jnp.cumsum(need) <= num_free) | (need == 0)
    return want, fits


def _pop_pages(rows, free, num_free, want):
    """Fill `want` entries of `rows` with pages popped from the free stack."""
    need = want.sum(axis=1, dtype=jnp.int32)
    rank = (jnp.cumsum(need) - need)[:, None] + jnp.cumsum(want, axis=1) - 1
    pages = free[jnp.clip(num_free - 1 - rank, 0, free.shape[0] - 1)]
    return jnp.where(want, pages, rows), num_free - need.sum()


def _push_pages(rows, free, num_free, give_back):
    """Return the `give_back` entries of `rows` to the free stack; they become BAD."""
    flat = give_back.reshape(-1)
    rank = jnp.cumsum(flat) - 1
    dst = jnp.where(flat, num_free + rank, free.shape[0])  # out of range: dropped
    free = free.at[dst].set(rows.reshape(-1), mode="drop")
    rows = jnp.where(give_back, BAD_PAGE_INDEX, rows)
    return rows, free, num_free + flat.sum(dtype=jnp.int32)


def _clear_dummy(spec: CacheSpec, state: KVState) -> KVState:
    d = spec.dummy_slot
    return state.replace(target_lens=state.target_lens.at[d].set(0),
                         draft_ctx_lens=state.draft_ctx_lens.at[d].set(0))


# ----------------------------------------------------------- state -> state

def allocate_pages(spec: CacheSpec, state: KVState, slot_ids, target_ends,
                   draft_ends) -> tuple[KVState, jax.Array]:
    """Back positions [.., end) of each row with pages, from the free lists.

    A windowed pool only backs positions a query at the row's current length
    or later can see (from len - W + 1), so pages behind the window are never
    allocated. The step calls this before writing K/V at positions
    [len, end); `end` may run past the committed length (verify tokens).

    Args:
      slot_ids: i32[B]; target_ends, draft_ends: i32[B] exclusive end positions.
    Returns:
      (state, ok: bool[B]). A row with ok False got nothing in any pool (it
      would have overflowed some pool); admission makes this impossible for
      admitted requests, so False means a bug or over-admission.
    """
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    active = slot_ids != spec.dummy_slot
    cur_t, cur_d = state.target_lens[slot_ids], state.draft_ctx_lens[slot_ids]
    plans, ok = [], jnp.ones_like(active)
    for pool, table in zip(spec.pools, state.page_tables):
        rows = table[slot_ids]
        cur = _pool_len(pool, cur_t, cur_d, jnp.minimum)
        end = _pool_len(pool, jnp.asarray(target_ends, jnp.int32),
                        jnp.asarray(draft_ends, jnp.int32), jnp.maximum)
        first_page = _window_start(pool, cur) // spec.page_size
        end_page = -(-end // spec.page_size)
        want, fits = _plan_allocation(pool, rows, state.num_free[pool.pool_id],
                                      first_page, end_page, active)
        plans.append((rows, want))
        ok = ok & fits
    tables, num_free = list(state.page_tables), state.num_free
    for pool, (rows, want) in zip(spec.pools, plans):
        i = pool.pool_id
        rows, n = _pop_pages(rows, state.free_pages[i], num_free[i], want & ok[:, None])
        tables[i] = tables[i].at[slot_ids].set(rows)
        num_free = num_free.at[i].set(n)
    state = state.replace(page_tables=tuple(tables), num_free=num_free)
    return _clear_dummy(spec, state), ok


def grow(spec: CacheSpec, state: KVState, slot_ids, new_target_lens,
         new_draft_ctx_lens) -> tuple[KVState, jax.Array]:
    """Allocate pages for, then commit, new lengths (>= the current ones).

    Returns (state, ok: bool[B]); rows with ok False keep their lengths and pages.
    """
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    new_t = jnp.asarray(new_target_lens, jnp.int32)
    new_d = jnp.asarray(new_draft_ctx_lens, jnp.int32)
    state, ok = allocate_pages(spec, state, slot_ids, new_t, new_d)
    state = state.replace(
        target_lens=state.target_lens.at[slot_ids].set(
            jnp.where(ok, new_t, state.target_lens[slot_ids])),
        draft_ctx_lens=state.draft_ctx_lens.at[slot_ids].set(
            jnp.where(ok, new_d, state.draft_ctx_lens[slot_ids])))
    return _clear_dummy(spec, state), ok


def retire_window_pages(spec: CacheSpec, state: KVState, slot_ids) -> KVState:
    """Free pages that fell wholly behind each windowed pool's window.

    A page is retired when every position in it is < len - W + 1, where len is
    the pool's governing length (the smaller of its roles' lengths): no query
    at len or later can see it. Its entry becomes BAD; the page is reusable.
    """
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    active = slot_ids != spec.dummy_slot
    cur_t, cur_d = state.target_lens[slot_ids], state.draft_ctx_lens[slot_ids]
    tables, free, num_free = list(state.page_tables), list(state.free_pages), state.num_free
    for pool in spec.pools:
        if pool.sliding_window is None:
            continue
        i = pool.pool_id
        rows = tables[i][slot_ids]
        start = _window_start(pool, _pool_len(pool, cur_t, cur_d, jnp.minimum))
        page_end = (jnp.arange(rows.shape[1], dtype=jnp.int32)[None, :] + 1) * spec.page_size
        behind = (rows != BAD_PAGE_INDEX) & (page_end <= start[:, None]) & active[:, None]
        rows, free[i], n = _push_pages(rows, free[i], num_free[i], behind)
        tables[i] = tables[i].at[slot_ids].set(rows)
        num_free = num_free.at[i].set(n)
    state = state.replace(page_tables=tuple(tables), free_pages=tuple(free),
                          num_free=num_free)
    return _clear_dummy(spec, state)


def release_slots(spec: CacheSpec, state: KVState, slot_ids) -> KVState:
    """Return every page of the given slots to the free lists; lengths -> 0."""
    slot_ids = jnp.asarray(slot_ids, jnp.int32)
    active = slot_ids != spec.dummy_slot
    tables, free, num_free = list(state.page_tables), list(state.free_pages), state.num_free
    for pool in spec.pools:
        i = pool.pool_id
        rows = tables[i][slot_ids]
        owned = (rows != BAD_PAGE_INDEX) & active[:, None]
        rows, free[i], n = _push_pages(rows, free[i], num_free[i], owned)
        tables[i] = tables[i].at[slot_ids].set(rows)
        num_free = num_free.at[i].set(n)
    # The dummy slot's lengths are zeroed by _clear_dummy anyway.
    state = state.replace(
        page_tables=tuple(tables), free_pages=tuple(free), num_free=num_free,
        target_lens=state.target_lens.at[slot_ids].set(0),
        draft_ctx_lens=state.draft_ctx_lens.at[slot_ids].set(0))
    return _clear_dummy(spec, state)


def admit_slots(spec: CacheSpec, state: KVState, slot_ids) -> KVState:
    """Make slots fresh for new requests: no pages, lengths 0.

    A slot handed out by admission is already empty; releasing first means a
    host bookkeeping slip cannot leak the previous occupant's pages.
    """
    return release_slots(spec, state, slot_ids)


# ------------------------------------------------------------ host helpers

def validate_slot_ids(spec: CacheSpec, slot_ids) -> np.ndarray:
    """Host check of a batch's slot ids: in range, real slots unique."""
    ids = np.asarray(slot_ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"slot_ids must be a 1-D integer array, got shape={ids.shape} "
                         f"dtype={ids.dtype}")
    bad = ids[(ids < 0) | (ids > spec.dummy_slot)]
    if bad.size:
        raise ValueError(f"slot_ids {bad.tolist()} are outside [0, {spec.dummy_slot}] "
                         f"(num_slots={spec.num_slots}; {spec.dummy_slot} is the padding slot)")
    real = ids[ids != spec.dummy_slot]
    uniq, counts = np.unique(real, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"slot_ids repeat real slots {uniq[counts > 1].tolist()}; each "
                         f"request may appear once per batch (pad with {spec.dummy_slot})")
    return ids.astype(np.int32)


def live_logical_pages(spec: CacheSpec, pool: PoolSpec, target_len: int,
                       draft_ctx_len: int) -> np.ndarray:
    """i32[n]: the logical pages a row of these lengths holds in `pool` after
    `allocate_pages` and `retire_window_pages` (host ints, no table read): from
    the first page a query at the row's length can see to the last written one."""
    length = _pool_len(pool, target_len, draft_ctx_len, min)
    first = 0
    if pool.sliding_window is not None:
        first = max(length - pool.sliding_window + 1, 0) // spec.page_size
    return np.arange(first, -(-length // spec.page_size), dtype=np.int32)


def owned_pages(spec: CacheSpec, state: KVState) -> list[np.ndarray]:
    """Per pool, i32[num_slots + 1]: pages each slot holds (host, for accounting)."""
    return [np.asarray((t != BAD_PAGE_INDEX).sum(axis=1)) for t in state.page_tables]
