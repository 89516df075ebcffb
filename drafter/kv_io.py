"""A request's KV out of one cache and into another: jitted export and import steps.

    sender (context)                               receiver (generation)
    export_step(state, slot, logical pages)        import_step(state, slot, lengths, first token,
      gather the row's live pages of every pool      logical pages, buffers, checksums)
      -> one buffer per pool [H, n, L, 2, ps, D]     allocate pages for the lengths, check the
      -> u32 checksum per buffer                     page ranges and checksums, scatter, zero the
                                                     draft layers in private mode, redraft
                                                     -> (state, ok)

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
from drafter.steps import StepState, StepConfig, _at_precision, redraft_rows
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
def export_step(state: StepState, slot, logical_pages, tokens=None, token_index=0, *,
                pool_ids: tuple[int, ...]):
    """Gather one slot's live pages of each pool in `pool_ids` into contiguous buffers.

    Args:
      slot: i32[]; logical_pages: per sent pool, i32[n_bucket] (BAD pads).
      tokens, token_index: the request's first token is tokens[token_index] (a
        step's output vector, read here rather than by a separate device op).
    Returns:
      (buffers: per sent pool [H, n_bucket, L, 2, page_size, D] (padding gathers
       the all-zero null page), checksums: u32[len(pool_ids)], first token i32[]).
    """
    kv = state.kv
    buffers = tuple(jnp.take(kv.pools[i], _physical(kv.page_tables[i][slot], logical), axis=1)
                    for i, logical in zip(pool_ids, logical_pages))
    first = jnp.int32(0) if tokens is None else tokens[token_index]
    return buffers, jnp.stack([checksum_of(b) for b in buffers]), first


def _pages_match(row, logical, num_pages: int):
    """The receiver's valid entries are exactly the sender's logical pages."""
    # BAD (-1) pads would wrap to the last entry: send them out of range instead.
    sent = jnp.zeros((num_pages,), bool).at[jnp.where(logical >= 0, logical, num_pages)].set(
        True, mode="drop")
    return jnp.all((row != BAD_PAGE_INDEX) == sent)


@_at_precision
def import_step(params, state: StepState, slot, target_len, draft_ctx_len, first_token,
                logical_pages, buffers, checksums, *, cfg: StepConfig, pool_ids: tuple[int, ...],
                mode: str, table_width: int) -> tuple[StepState, jax.Array]:
    """Receive one request into an empty slot: allocate, verify, scatter, redraft.

    Args:
      slot, target_len, draft_ctx_len, first_token: i32[] each.
      logical_pages, buffers: per pool in `pool_ids`, as `export_step` made them
        (BAD-padded logical pages pad with entries that are dropped).
      checksums: u32[len(pool_ids)], the sender's.
    Returns:
      (state, ok bool[]). With ok, the slot holds the request's KV, its anchor is
      `first_token` with a fresh draft block, and it runs. Without, the slot is
      empty (pages returned) and nothing else changed.
    """
    spec, kv = cfg.spec, state.kv
    ids = slot[None]
    # Lengths first, so a windowed pool allocates only its in-window tail.
    kv = kv.replace(target_lens=kv.target_lens.at[ids].set(target_len),
                    draft_ctx_lens=kv.draft_ctx_lens.at[ids].set(draft_ctx_len))
    kv, ok = allocate_pages(spec, kv, ids, target_len[None], draft_ctx_len[None])
    ok = ok[0]
    for i, logical, buf, sent in zip(pool_ids, logical_pages, buffers, checksums):
        ok &= _pages_match(kv.page_tables[i][slot], logical, spec.pools[i].max_pages_per_seq)
        ok &= checksum_of(buf) == sent
    pools = list(kv.pools)
    for pool in spec.pools:
        i = pool.pool_id
        row = kv.page_tables[i][slot]
        if i in pool_ids:
            logical = logical_pages[pool_ids.index(i)]
            pages = jnp.where((logical >= 0) & ok, _physical(row, logical), pool.num_pages)
            buf = buffers[pool_ids.index(i)]
            pools[i] = pools[i].at[:, pages].set(buf.astype(pools[i].dtype), mode="drop")
        draft_offsets = [o for o, name in enumerate(pool.layer_names)
                         if spec.layer(name).role == "draft"]
        if mode == "private" and draft_offsets:  # the drafter starts without the prompt
            pages = jnp.where((row != BAD_PAGE_INDEX) & ok, row, pool.num_pages)
            for o in draft_offsets:
                pools[i] = pools[i].at[:, pages, o].set(0, mode="drop")
    kv = release_slots(spec, kv.replace(pools=tuple(pools)),
                       jnp.where(ok, spec.dummy_slot, slot)[None])
    state = state.replace(kv=kv, anchors=state.anchors.at[slot].set(
                              jnp.where(ok, first_token, state.anchors[slot])),
                          running=state.running.at[slot].set(ok))
    if cfg.draft is not None:
        state = redraft_rows(params, state, ids, cfg=cfg, table_width=table_width,
                             active=ok[None])
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
    """

    target_len: int
    draft_ctx_len: int
    first_token: object
    pool_ids: tuple[int, ...]
    logical_pages: tuple[np.ndarray, ...]
    buffers: tuple[jax.Array, ...]
    checksums: object
    mode: str

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


def export_payload(spec: CacheSpec, state: StepState, slot: int, target_len: int,
                   draft_ctx_len: int, tokens, token_index: int, *, mode: str) -> KVPayload:
    """Dispatch `export_step` for one prefilled slot whose first token is
    tokens[token_index] (no host sync)."""
    pool_ids = sent_pool_ids(spec, mode)
    logical = tuple(padded_pages(live_logical_pages(spec, spec.pools[i], target_len,
                                                    draft_ctx_len)) for i in pool_ids)
    buffers, sums, first = export_step(state, np.int32(slot), logical, tokens,
                                       np.int32(token_index), pool_ids=pool_ids)
    return KVPayload(target_len, draft_ctx_len, first, pool_ids, logical, buffers, sums, mode)


# ---------------------------------------------------------------- between engines

class KVSource(Protocol):
    """Where a generation engine's admitted requests get their KV."""

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
