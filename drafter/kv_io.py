"""A request's KV out of one cache and into another: jitted export and import steps.

    sender (context)                               receiver (generation)
    export_step(state, slots, logical pages)       import_step(state, slots, lengths, first
      gather each row's live pages of every pool     tokens, logical pages, buffers, checksums)
      -> per row, one buffer per pool                allocate pages for the lengths, check the
         [H, n, L, 2, ps, D] + u32 checksums         page ranges and checksums, scatter, zero the
                                                     draft layers in private mode, redraft
                                                     -> (state, ok per row)

Each is one call for every request a step sends or receives (rows padded to a
power of two, one call per buffer shape), so a burst costs the host one launch
a side, not one per request.

Both run on the device with no host sync: the live logical pages of a row
follow from its lengths and the pool's window (`live_logical_pages`), so the
host computes them without reading the page tables. A receiver whose cache
disagrees (windows, page size) or a buffer corrupted in transit comes back
as `ok` False; the slot is then empty again and nothing else changed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from drafter.request import Request
from drafter.steps import (StepConfig, StepState, _at_precision, empty_slots,
                           redraft_rows)
from unified_kv import (BAD_PAGE_INDEX, NULL_PAGE, CacheSpec, allocate_pages,
                        live_logical_pages, pow2_at_least, release_slots)


def page_bucket(n: int) -> int:
    """Page counts are padded to a few sizes so export/import compile a few times:
    powers of two up to 16 pages, then 8 sizes per octave (padding <= 1/8)."""
    if n <= 16:
        return pow2_at_least(n)
    step = 1 << ((n - 1).bit_length() - 4)
    return -(-n // step) * step


def padded_pages(logical: np.ndarray) -> np.ndarray:
    """`logical` padded with BAD entries to its bucket size."""
    out = np.full(page_bucket(len(logical)), BAD_PAGE_INDEX, np.int32)
    out[:len(logical)] = logical
    return out


def sent_pool_ids(spec: CacheSpec, mode: str) -> tuple[int, ...]:
    """Pools whose pages travel: all in shared mode; private mode keeps draft-only pools home."""
    return tuple(p.pool_id for p in spec.pools if not (mode == "private" and p.roles == {"draft"}))


def checksum_of(buffer: jax.Array, first_head=0) -> jax.Array:
    """Position-weighted sum of the buffer's bytes (u32): catches flips and swaps.

    A slice of kv heads [first_head, ...) sums to its share of the whole
    buffer's checksum, so the slices' checksums add up (mod 2**32) to the whole's.
    """
    heads = buffer.shape[0]
    raw = jax.lax.bitcast_convert_type(buffer, jnp.uint8).reshape(heads, -1).astype(jnp.uint32)
    m = jnp.uint32(251)
    # Byte j of global head h sits at flat position h * S + j of the whole
    # buffer (S bytes per head); its weight is that position mod 251, plus 1.
    head_w = ((jnp.arange(heads, dtype=jnp.uint32) + jnp.uint32(first_head)) % m
              * jnp.uint32(raw.shape[1] % 251)) % m
    byte_w = jnp.arange(raw.shape[1], dtype=jnp.uint32) % m
    weights = (head_w[:, None] + byte_w[None, :]) % m + jnp.uint32(1)
    return jnp.sum(raw * weights, dtype=jnp.uint32)


checksum = jax.jit(checksum_of)


def _physical(row, logical):
    """Physical pages of `logical` entries of a table row; padding -> NULL_PAGE."""
    pages = row[jnp.clip(logical, 0, row.shape[0] - 1)]
    return jnp.where(logical >= 0, pages, NULL_PAGE)


@functools.partial(jax.jit, static_argnames=("pool_ids",))
def export_step(state: StepState, slots, logical_pages, tokens=None, token_indices=None, *,
                pool_ids: tuple[int, ...]):
    """Gather the live pages of each pool in `pool_ids` of R slots into contiguous buffers.

    Args:
      slots: i32[R] (the dummy slot pads: its row gathers the null page);
      logical_pages: per sent pool, i32[R, n_bucket] (BAD pads).
      tokens, token_indices: row r's first token is tokens[token_indices[r]] (a
        step's output vector, read here rather than by a separate device op).
    Returns:
      per row: (buffers: per sent pool [H, n_bucket, L, 2, page_size, D] (padding
      gathers the all-zero null page), checksums: u32[len(pool_ids)], first token i32[]).
    """
    kv, rows = state.kv, []
    for r in range(slots.shape[0]):
        buffers = tuple(jnp.take(kv.pools[i], _physical(kv.page_tables[i][slots[r]], logical[r]),
                                 axis=1) for i, logical in zip(pool_ids, logical_pages))
        first = jnp.int32(0) if tokens is None else tokens[token_indices[r]]
        rows.append((buffers, jnp.stack([checksum_of(b) for b in buffers]), first))
    return tuple(rows)


def _pages_match(row, logical, num_pages: int):
    """The receiver's valid entries are exactly the sender's logical pages."""
    # BAD (-1) pads would wrap to the last entry: send them out of range instead.
    sent = jnp.zeros((num_pages,), bool).at[jnp.where(logical >= 0, logical, num_pages)].set(
        True, mode="drop")
    return jnp.all((row != BAD_PAGE_INDEX) == sent)


@_at_precision
def import_step(params, state: StepState, slots, target_lens, draft_ctx_lens, first_tokens,
                logical_pages, buffers, checksums, reset_slots=None, *, cfg: StepConfig,
                pool_ids: tuple[int, ...], mode: str,
                table_width: int) -> tuple[StepState, jax.Array]:
    """Receive R requests into empty slots: allocate, verify, scatter, redraft.

    Args:
      slots, target_lens, draft_ctx_lens: i32[R] (the dummy slot pads a row);
      first_tokens: per row i32[] (a sender's device scalar or an int).
      logical_pages: per pool in `pool_ids`, i32[R, n_bucket] (BAD pads are dropped);
      buffers: per row, per pool, as `export_step` made them (one shape for all rows);
      checksums: per row u32[len(pool_ids)], the sender's.
      reset_slots: i32[num_slots] slots emptied first (dummy pads), as a step's resets:
        the import carries a step's resets when it is the step's first call.
    Returns:
      (state, ok bool[R]). With ok, the row's slot holds its request's KV, its anchor
      is its first token with a fresh draft block, and it runs. Without (and for a
      padding row), the slot is empty (pages returned); no other row is affected.
    """
    if reset_slots is not None:
        state = empty_slots(cfg, state, reset_slots)
    spec, kv = cfg.spec, state.kv
    ids = slots
    real = ids != spec.dummy_slot
    firsts = jnp.stack([jnp.asarray(t, jnp.int32) for t in first_tokens])
    # Lengths first, so a windowed pool allocates only its in-window tail.
    kv = kv.replace(target_lens=kv.target_lens.at[ids].set(target_lens),
                    draft_ctx_lens=kv.draft_ctx_lens.at[ids].set(draft_ctx_lens))
    kv, ok = allocate_pages(spec, kv, ids, target_lens, draft_ctx_lens)
    ok &= real
    for k, (i, logical) in enumerate(zip(pool_ids, logical_pages)):
        rows = kv.page_tables[i][ids]
        ok &= jax.vmap(_pages_match, (0, 0, None))(rows, logical,
                                                   spec.pools[i].max_pages_per_seq)
        ok &= jnp.stack([checksum_of(bufs[k]) == sums[k]
                         for bufs, sums in zip(buffers, checksums)])
    pools = list(kv.pools)
    for pool in spec.pools:
        i = pool.pool_id
        rows = kv.page_tables[i][ids]                                  # [R, max_pages]
        if i in pool_ids:
            k = pool_ids.index(i)
            logical = logical_pages[k]
            pages = jnp.where((logical >= 0) & ok[:, None],
                              jax.vmap(_physical)(rows, logical), pool.num_pages)
            buf = jnp.concatenate([bufs[k] for bufs in buffers], axis=1)  # [H, R*n, ...]
            pools[i] = pools[i].at[:, pages.reshape(-1)].set(buf.astype(pools[i].dtype),
                                                             mode="drop")
        draft_offsets = [o for o, name in enumerate(pool.layer_names)
                         if spec.layer(name).role == "draft"]
        if mode == "private" and draft_offsets:  # the drafter starts without the prompt
            pages = jnp.where((rows != BAD_PAGE_INDEX) & ok[:, None], rows, pool.num_pages)
            for o in draft_offsets:
                pools[i] = pools[i].at[:, pages.reshape(-1), o].set(0, mode="drop")
    kv = release_slots(spec, kv.replace(pools=tuple(pools)), jnp.where(ok, spec.dummy_slot, ids))
    state = state.replace(kv=kv, anchors=state.anchors.at[ids].set(
                              jnp.where(ok, firsts, state.anchors[ids])),
                          running=state.running.at[ids].set(ok | state.running[ids] & ~real))
    if cfg.draft is not None:
        state = redraft_rows(params, state, ids, cfg=cfg, table_width=table_width, active=ok)
    return state, ok


@dataclasses.dataclass
class KVPayload:
    """One request's KV as it travels: what `import_step` takes.

    Attributes:
      target_len, draft_ctx_len: the sender's lengths (the prompt's).
      first_token: the token after the prompt (i32[] on a device, or an int).
      pool_ids: the pools sent (`sent_pool_ids`); logical_pages: per pool,
        i32[n_bucket] BAD-padded; buffers: per pool [H, n_bucket, L, 2, ps, D];
        checksums: u32[len(pool_ids)] (a device array or numpy).
      mode: "shared" or "private".
      origin: who sent it, as errors about it name the sender ("" : unnamed).
    """

    target_len: int
    draft_ctx_len: int
    first_token: object
    pool_ids: tuple[int, ...]
    logical_pages: tuple[np.ndarray, ...]
    buffers: tuple[jax.Array, ...]
    checksums: object
    mode: str
    origin: str = ""

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


def pow2_rows(n: int) -> int:
    """Rows of an export or import call for n requests: a power of two (few shapes)."""
    return pow2_at_least(max(n, 1))


def export_payloads(spec: CacheSpec, state: StepState, rows, tokens, *,
                    mode: str) -> list[KVPayload]:
    """Dispatch `export_step` for prefilled slots, one call per page bucket (no host sync).

    rows: (slot, target_len, draft_ctx_len, token_index) per request, whose first
    token is tokens[token_index]. Returns their payloads in order.
    """
    pool_ids = sent_pool_ids(spec, mode)
    logical = [tuple(padded_pages(live_logical_pages(spec, spec.pools[i], t, d))
                     for i in pool_ids) for _, t, d, _ in rows]
    groups: dict[tuple, list[int]] = {}
    for r, pages in enumerate(logical):
        groups.setdefault(tuple(len(p) for p in pages), []).append(r)
    out: list[KVPayload | None] = [None] * len(rows)
    for members in groups.values():
        n = pow2_rows(len(members))
        pad = n - len(members)
        slots = np.array([rows[r][0] for r in members] + [spec.dummy_slot] * pad, np.int32)
        index = np.array([rows[r][3] for r in members] + [0] * pad, np.int32)
        stacked = tuple(np.stack([logical[r][k] for r in members]
                                 + [np.full_like(logical[members[0]][k], BAD_PAGE_INDEX)] * pad)
                        for k in range(len(pool_ids)))
        exported = export_step(state, slots, stacked, tokens, index, pool_ids=pool_ids)
        for r, (buffers, sums, first) in zip(members, exported):
            slot, t, d, _ = rows[r]
            out[r] = KVPayload(t, d, first, pool_ids, logical[r], buffers, sums, mode)
    return out


# ---------------------------------------------------------------- between engines

class KVSource(Protocol):
    """Where a generation engine's admitted requests get their KV. A source whose
    senders' steps run in this process may also have `warmup(max_len, min_len, *,
    sampled)`, which `Engine.warmup` calls to compile those steps too."""

    def fetch(self, request: Request) -> None:
        """Start producing `request`'s KV (it is admitted here: room is reserved)."""

    def poll(self, timeout: float) -> list[tuple[str, KVPayload | BaseException | None]]:
        """Arrived payloads (on this engine's devices) or failures, by request id;
        waits up to `timeout` seconds for the first one. None: the request's KV
        is still being made (its `kv_timeout_s` starts again)."""


@dataclasses.dataclass
class Export:
    """A context engine's prefilled request, leaving with its KV."""

    request: Request
    payload: KVPayload
    submitted: float


def import_failure(request_id: str, origin: str = "") -> str:
    """The error of a request whose import step said not ok."""
    sender = f" from {origin}" if origin else ""
    return (f"request {request_id!r}: KV import{sender} failed: a buffer's checksum or its "
            f"page ranges did not match (corrupted in transit, or the two caches disagree "
            f"on windows or page size); retry the request, and if it recurs check that "
            f"link and both workers' cache settings")


def import_refusal(payload: KVPayload, spec: CacheSpec, mode: str,
                   prompt_len: int) -> str | None:
    """Why a worker of `spec` in draft-KV `mode` cannot import `payload` for a prompt of
    `prompt_len` tokens (None: it can). Checked on the host before the import step."""
    want = sent_pool_ids(spec, mode)
    if payload.mode != mode or tuple(payload.pool_ids) != want:
        return (f"the sender's draft KV mode {payload.mode!r} (pools "
                f"{list(payload.pool_ids)}) differs from this worker's {mode!r} "
                f"(pools {list(want)}); start both with the same mode")
    if payload.target_len != prompt_len:
        return f"the sender prefilled {payload.target_len} tokens, the prompt has {prompt_len}"
    return None
