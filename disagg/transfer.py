"""Moving one request's KV between caches: gather, move, verify, scatter.

    context cache                              generation cache
    pool p: row of slot s  --gather (1 op)-->  buffer [H, n, L, 2, ps, D]
            (live pages only: a windowed       --move-->  checksum check
             pool sends its in-window tail)    --scatter (1 op)--> its own pages

The receiver allocates its own pages for the same logical page range (the
same lengths and windows give the same live tail) and checks the logical
page lists match. Each buffer carries a position-weighted byte checksum; a
mismatch fails the request loudly and frees its pages.

Move paths: "coalesced" (one device-to-device put per pool buffer), "host"
(through host memory) and "fragments" (one put per page: the slow fallback,
kept to measure against).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from unified_kv import (BAD_PAGE_INDEX, NULL_PAGE, CacheSpec, KVState, grow,
                        retire_window_pages)

MOVE_PATHS = ("coalesced", "host", "fragments")


class TransferError(RuntimeError):
    """A request's KV could not be moved intact; its pages were freed."""


@dataclasses.dataclass
class PoolPayload:
    logical_pages: np.ndarray   # i32[n]: logical page indices of the row's live pages
    buffer: jax.Array           # [H, n padded to a power of two, L, 2, page_size, D]
    checksum: int


@dataclasses.dataclass
class Handoff:
    """Everything a generation worker needs to continue a request."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    first_token: int
    target_len: int
    draft_ctx_len: int
    pools: dict[int, PoolPayload]
    layout: object                # disagg.layout.Layout
    submitted: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(p.buffer.nbytes for p in self.pools.values())


@jax.jit
def checksum(buffer: jax.Array) -> jax.Array:
    """Position-weighted sum of the buffer's bytes (u32): catches flips and swaps."""
    raw = jax.lax.bitcast_convert_type(buffer, jnp.uint8).reshape(-1).astype(jnp.uint32)
    weights = jnp.arange(raw.shape[0], dtype=jnp.uint32) % jnp.uint32(251) + jnp.uint32(1)
    return jnp.sum(raw * weights, dtype=jnp.uint32)


def _bucket(n: int) -> int:
    """Page counts are padded to powers of two so gather/scatter compile a few times."""
    return 1 << max(n - 1, 0).bit_length()


@jax.jit
def _gather(pool, pages):
    return jnp.take(pool, pages, axis=1)


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(pool, pages, buffer):
    # Padding entries point past the pool and are dropped.
    return pool.at[:, pages].set(buffer.astype(pool.dtype), mode="drop")


def _padded(pages: np.ndarray, fill: int) -> jax.Array:
    out = np.full(_bucket(len(pages)), fill, np.int32)
    out[:len(pages)] = pages
    return jnp.asarray(out)


@functools.partial(jax.jit, static_argnums=2, donate_argnums=0)
def _zero_layers(pool, pages, layer_offsets: tuple[int, ...]):
    for offset in layer_offsets:
        pool = pool.at[:, pages, offset].set(0, mode="drop")
    return pool


def live_pages(kv: KVState, pool_id: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
    """(logical page indices, physical pages) of a slot's valid entries in a pool."""
    row = np.asarray(kv.page_tables[pool_id][slot])
    logical = np.flatnonzero(row != BAD_PAGE_INDEX).astype(np.int32)
    return logical, row[logical]


def export_kv(spec: CacheSpec, kv: KVState, slot: int, *, mode: str) -> dict[int, PoolPayload]:
    """Gather a slot's live pages of every pool it sends (private mode keeps
    draft-only pools home) into one contiguous buffer per pool."""
    out = {}
    for pool in spec.pools:
        if mode == "private" and pool.roles == {"draft"}:
            continue
        logical, pages = live_pages(kv, pool.pool_id, slot)
        # Padding rows gather the all-zero null page; the receiver drops them.
        buffer = _gather(kv.pools[pool.pool_id], _padded(pages, NULL_PAGE))
        out[pool.pool_id] = PoolPayload(logical, buffer, int(checksum(buffer)))
    return out


def move(payloads: dict[int, PoolPayload], mesh, *, path: str = "coalesced",
         kv_head_axis: str | None = None) -> dict[int, PoolPayload]:
    """Put every buffer on the receiver's mesh, split along kv heads."""
    if path not in MOVE_PATHS:
        raise ValueError(f"move path {path!r} is unknown; use one of {MOVE_PATHS}")
    if mesh is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    else:
        sharding = NamedSharding(mesh, P(kv_head_axis or mesh.axis_names[0]))
    out = {}
    for pool_id, payload in payloads.items():
        buf = payload.buffer
        if path == "coalesced":
            moved = jax.device_put(buf, sharding)
        elif path == "host":
            moved = jax.device_put(np.asarray(buf), sharding)
        else:  # one transfer per page, stacked on the receiver
            pages = [jax.device_put(buf[:, j], sharding) for j in range(buf.shape[1])]
            moved = (jnp.stack(pages, axis=1) if pages
                     else jax.device_put(buf, sharding))
        out[pool_id] = dataclasses.replace(payload, buffer=moved)
    return out


_grow = jax.jit(grow, static_argnums=0)
_retire = jax.jit(retire_window_pages, static_argnums=0)


def import_kv(spec: CacheSpec, kv: KVState, slot: int, handoff: Handoff, *,
              mode: str) -> KVState:
    """Allocate the slot's pages for the handoff's lengths and scatter the data in.

    Raises TransferError (checksum, page ranges); the caller frees the slot.
    In private mode the draft layers' prompt context is left empty (zeros):
    the drafter starts without it, the baseline that shows the loss.
    """
    ids = jnp.array([slot], jnp.int32)
    kv, ok = _grow(spec, kv, ids, jnp.array([handoff.target_len], jnp.int32),
                   jnp.array([handoff.draft_ctx_len], jnp.int32))
    if not bool(ok[0]):
        raise TransferError(f"request {handoff.request_id!r}: no pages for "
                            f"{handoff.target_len} tokens (admission should have refused it)")
    kv = _retire(spec, kv, ids)
    pools = list(kv.pools)
    for pool in spec.pools:
        logical, pages = live_pages(kv, pool.pool_id, slot)
        payload = handoff.pools.get(pool.pool_id)
        draft_offsets = tuple(i for i, name in enumerate(pool.layer_names)
                              if spec.layer(name).role == "draft")
        if payload is None:
            if mode != "private" or pool.roles != {"draft"}:
                raise TransferError(f"request {handoff.request_id!r}: pool {pool.pool_id} "
                                    f"missing from the transfer")
        else:
            if not np.array_equal(logical, payload.logical_pages):
                raise TransferError(
                    f"request {handoff.request_id!r}: pool {pool.pool_id} live pages "
                    f"{logical.tolist()} on the receiver != {payload.logical_pages.tolist()} "
                    f"sent (the two caches disagree on windows or page size)")
            got = int(checksum(payload.buffer))
            if got != payload.checksum:
                raise TransferError(f"request {handoff.request_id!r}: pool {pool.pool_id} "
                                    f"buffer checksum {got:#010x} != {payload.checksum:#010x} "
                                    f"sent: the KV was corrupted in transit")
            pools[pool.pool_id] = _scatter(pools[pool.pool_id],
                                           _padded(pages, pool.num_pages), payload.buffer)
        if mode == "private" and draft_offsets:
            pools[pool.pool_id] = _zero_layers(pools[pool.pool_id],
                                               _padded(pages, pool.num_pages), draft_offsets)
    return kv.replace(pools=tuple(pools))
