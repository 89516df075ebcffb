"""Moving one request's KV between caches: gather, move, verify, scatter.

    context cache                              generation cache
    pool p: row of slot s  --gather (1 op)-->  buffer [H, n, L, 2, ps, D]
            (live pages only: a windowed       --move-->  checksum check
             pool sends its in-window tail)    --scatter (1 op)--> its own pages

The receiver allocates its own pages for the same logical page range (the
same lengths and windows give the same live tail) and checks the logical
page lists match. Each buffer carries a position-weighted byte checksum; a
mismatch fails the request loudly and frees its pages.

Move paths: "coalesced" (one device-to-device put per pool buffer),
"pinned_host" (staged in the sender's pinned host memory, then put on the
receiver: what a transfer that must leave the device does), "host" (through
pageable host memory, numpy) and "fragments" (one put per page: the slow
fallback, kept to measure against).

Head slices (fan-in): a context worker on a TP mesh holds each buffer as
per-device shards along kv heads; `split_heads` sends each shard as its own
handoff (what separate context ranks do) and `assemble_heads` puts them back
together on the receiver. The checksum is additive over head slices, so the
assembled buffer is verified against the sum of the slices' checksums.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from unified_kv import (BAD_PAGE_INDEX, NULL_PAGE, CacheSpec, KVState, allocate_pages,
                        pow2_at_least)

MOVE_PATHS = ("coalesced", "pinned_host", "host", "fragments")


class TransferError(RuntimeError):
    """A request's KV could not be moved intact; its pages were freed."""


class MovePathUnavailable(ValueError):
    """The chosen move path needs a memory kind these devices do not offer."""


@dataclasses.dataclass
class PoolPayload:
    logical_pages: np.ndarray   # i32[n]: logical page indices of the row's live pages
    buffer: jax.Array           # [H, n padded to a bucket, L, 2, page_size, D]
    checksum: int
    heads: tuple[int, int] | None = None  # kv heads [start, stop) of a head slice; None: all


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
    slice_index: int = 0          # head slices: this one's index among num_slices
    num_slices: int = 1

    @property
    def nbytes(self) -> int:
        return sum(p.buffer.nbytes for p in self.pools.values())


@jax.jit
def _checksum(buffer: jax.Array, first_head: jax.Array) -> jax.Array:
    heads = buffer.shape[0]
    raw = jax.lax.bitcast_convert_type(buffer, jnp.uint8).reshape(heads, -1).astype(jnp.uint32)
    m = jnp.uint32(251)
    # Byte j of global head h sits at flat position h * S + j of the whole
    # buffer (S bytes per head); its weight is that position mod 251, plus 1.
    head_w = ((jnp.arange(heads, dtype=jnp.uint32) + first_head) % m
              * jnp.uint32(raw.shape[1] % 251)) % m
    byte_w = jnp.arange(raw.shape[1], dtype=jnp.uint32) % m
    weights = (head_w[:, None] + byte_w[None, :]) % m + jnp.uint32(1)
    return jnp.sum(raw * weights, dtype=jnp.uint32)


def checksum(buffer: jax.Array, first_head: int = 0) -> jax.Array:
    """Position-weighted sum of the buffer's bytes (u32): catches flips and swaps.

    A slice of kv heads [first_head, ...) sums to its share of the whole
    buffer's checksum, so the slices' checksums add up (mod 2**32) to the whole's.
    """
    return _checksum(buffer, np.uint32(first_head))


def _bucket(n: int) -> int:
    """Page counts are padded to a few sizes so gather/scatter compile a few times:
    powers of two up to 16 pages, then 8 sizes per octave (padding <= 1/8)."""
    if n <= 16:
        return pow2_at_least(n)
    step = 1 << ((n - 1).bit_length() - 4)
    return -(-n // step) * step


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


def _split_row(row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    logical = np.flatnonzero(row != BAD_PAGE_INDEX).astype(np.int32)
    return logical, row[logical]


def live_pages(kv: KVState, pool_id: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
    """(logical page indices, physical pages) of a slot's valid entries in a pool."""
    return _split_row(np.asarray(kv.page_tables[pool_id][slot]))


@jax.jit
def _slot_rows(tables, slot):
    return [t[slot] for t in tables]


def _rows(kv: KVState, pool_ids, slot: int, *extra):
    """The slot's table row of each pool (and `extra` arrays): one dispatch, one sync."""
    return jax.device_get((_slot_rows([kv.page_tables[i] for i in pool_ids], np.int32(slot)),
                           *extra))


def export_kv(spec: CacheSpec, kv: KVState, slot: int, *, mode: str) -> dict[int, PoolPayload]:
    """Gather a slot's live pages of every pool it sends (private mode keeps
    draft-only pools home) into one contiguous buffer per pool."""
    ids = [p.pool_id for p in spec.pools if not (mode == "private" and p.roles == {"draft"})]
    rows, = _rows(kv, ids, slot)
    live = [_split_row(row) for row in rows]
    # Padding rows gather the all-zero null page; the receiver drops them.
    bufs = [_gather(kv.pools[i], _padded(pages, NULL_PAGE)) for i, (_, pages) in zip(ids, live)]
    sums = jax.device_get([checksum(b) for b in bufs])  # one sync for every pool
    return {i: PoolPayload(logical, buf, int(total))
            for i, (logical, _), buf, total in zip(ids, live, bufs, sums)}


def pinned_host_sharding(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """`sharding` in pinned host memory; MovePathUnavailable if a device lacks it."""
    for device in sharding.device_set:
        kinds = sorted(m.kind for m in device.addressable_memories())
        if "pinned_host" not in kinds:
            raise MovePathUnavailable(
                f"move path 'pinned_host' needs pinned host memory, but {device} offers "
                f"memory kinds {kinds}; use move path 'host' (pageable host memory) or "
                f"'coalesced' (device to device)")
    return sharding.with_memory_kind("pinned_host")


def move_buffer(buf: jax.Array, sharding: jax.sharding.Sharding, path: str) -> jax.Array:
    """Put one buffer onto `sharding` by the given path (see the module docstring)."""
    if path == "coalesced":
        return jax.device_put(buf, sharding)
    if path == "pinned_host":
        staged = jax.device_put(buf, pinned_host_sharding(buf.sharding))
        return jax.device_put(staged, sharding)
    if path == "host":
        return jax.device_put(np.asarray(buf), sharding)
    if path == "fragments":  # one transfer per page, stacked on the receiver
        pages = [jax.device_put(buf[:, j], sharding) for j in range(buf.shape[1])]
        return jnp.stack(pages, axis=1) if pages else jax.device_put(buf, sharding)
    raise ValueError(f"move path {path!r} is unknown; use one of {MOVE_PATHS}")


def move(payloads: dict[int, PoolPayload], mesh, *, path: str = "coalesced",
         kv_head_axis: str | None = None) -> dict[int, PoolPayload]:
    """Put every buffer on the receiver's mesh, split along kv heads."""
    if path not in MOVE_PATHS:
        raise ValueError(f"move path {path!r} is unknown; use one of {MOVE_PATHS}")
    if mesh is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    else:
        sharding = NamedSharding(mesh, P(kv_head_axis or mesh.axis_names[0]))
    return {pool_id: dataclasses.replace(payload,
                                         buffer=move_buffer(payload.buffer, sharding, path))
            for pool_id, payload in payloads.items()}


def split_heads(handoff: Handoff) -> list[Handoff]:
    """One handoff per kv-head slice of the sender's buffers (one per device of a
    TP mesh), each with its slice's own checksum: what separate ranks send."""
    per_pool = {}
    for pool_id, payload in handoff.pools.items():
        shards = {}
        for shard in payload.buffer.addressable_shards:  # replicas repeat a range: keep one
            heads = shard.index[0].indices(payload.buffer.shape[0])[:2]
            shards.setdefault(heads, shard.data)
        per_pool[pool_id] = sorted(shards.items())
    counts = {len(s) for s in per_pool.values()}
    if len(counts) != 1:
        raise TransferError(f"request {handoff.request_id!r}: pools are split into "
                            f"{sorted(counts)} head slices; every pool must be sharded over "
                            f"the same mesh axis")
    num = counts.pop()
    return [dataclasses.replace(
        handoff, slice_index=i, num_slices=num,
        pools={pool_id: PoolPayload(handoff.pools[pool_id].logical_pages, data,
                                    int(checksum(data, heads[0])), heads=heads)
               for pool_id, slices in per_pool.items()
               for heads, data in (slices[i],)})
        for i in range(num)]


def assemble_heads(slices: list[Handoff], device, *, path: str = "coalesced") -> Handoff:
    """Move every head slice of one request onto `device` and join them along kv
    heads. The joined buffer's checksum is the sum of the slices' (verified on import).
    Raises TransferError naming a missing, repeated or inconsistent slice."""
    first = slices[0]
    rid = first.request_id
    got = sorted(s.slice_index for s in slices)
    if got != list(range(first.num_slices)) or any(
            s.request_id != rid or s.num_slices != first.num_slices for s in slices):
        raise TransferError(f"request {rid!r}: head slices {got} arrived, expected "
                            f"0..{first.num_slices - 1} once each")
    target = jax.sharding.SingleDeviceSharding(device)
    pools = {}
    for pool_id in first.pools:
        parts = sorted((s.pools[pool_id] for s in slices if pool_id in s.pools),
                       key=lambda p: p.heads)
        covered = 0
        for part in parts:
            if part.heads[0] != covered:
                raise TransferError(f"request {rid!r}: pool {pool_id} kv heads "
                                    f"{covered}..{part.heads[0] - 1} are missing or repeated "
                                    f"(slices cover {[p.heads for p in parts]})")
            if not np.array_equal(part.logical_pages, parts[0].logical_pages):
                raise TransferError(f"request {rid!r}: pool {pool_id} head slices disagree "
                                    f"on the live pages")
            covered = part.heads[1]
        buffer = jnp.concatenate([move_buffer(p.buffer, target, path) for p in parts], axis=0)
        pools[pool_id] = PoolPayload(parts[0].logical_pages, buffer,
                                     sum(p.checksum for p in parts) & 0xFFFFFFFF)
    return dataclasses.replace(first, pools=pools, slice_index=0, num_slices=1)


@functools.partial(jax.jit, static_argnums=0)
def _allocate_at_lengths(spec: CacheSpec, kv: KVState, ids, target_lens, draft_lens):
    """Back a fresh slot's pages for these lengths. The lengths are set first, so a
    windowed pool allocates only its in-window tail (growing from 0 at once
    would take every page of the prompt, more than admission reserved).
    Runs on the state without its pools: jitted without donation, passing them
    through would copy the whole cache."""
    kv = kv.replace(target_lens=kv.target_lens.at[ids].set(target_lens),
                    draft_ctx_lens=kv.draft_ctx_lens.at[ids].set(draft_lens))
    return allocate_pages(spec, kv, ids, target_lens, draft_lens)


def import_kv(spec: CacheSpec, kv: KVState, slot: int, handoff: Handoff, *,
              mode: str) -> KVState:
    """Allocate the slot's pages for the handoff's lengths and scatter the data in.

    Raises TransferError (checksum, page ranges); the caller frees the slot.
    In private mode the draft layers' prompt context is left empty (zeros):
    the drafter starts without it, the baseline that shows the loss.
    """
    pools = list(kv.pools)
    kv, ok = _allocate_at_lengths(spec, kv.replace(pools=()), jnp.array([slot], jnp.int32),
                                  jnp.array([handoff.target_len], jnp.int32),
                                  jnp.array([handoff.draft_ctx_len], jnp.int32))
    rows, ok = _rows(kv, [p.pool_id for p in spec.pools], slot, ok)
    if not ok[0]:
        raise TransferError(f"request {handoff.request_id!r}: no pages for "
                            f"{handoff.target_len} tokens (admission should have refused it)")
    live = [_split_row(row) for row in rows]
    for pool, (logical, _) in zip(spec.pools, live):
        payload = handoff.pools.get(pool.pool_id)
        if payload is None:
            if mode != "private" or pool.roles != {"draft"}:
                raise TransferError(f"request {handoff.request_id!r}: pool {pool.pool_id} "
                                    f"missing from the transfer")
        elif not np.array_equal(logical, payload.logical_pages):
            raise TransferError(
                f"request {handoff.request_id!r}: pool {pool.pool_id} live pages "
                f"{logical.tolist()} on the receiver != {payload.logical_pages.tolist()} "
                f"sent (the two caches disagree on windows or page size)")
    # Verify every pool before scattering any: the scatter donates the
    # caller's pools, which must stay intact when the request fails.
    sums = jax.device_get({i: checksum(p.buffer) for i, p in handoff.pools.items()})
    for i, payload in handoff.pools.items():
        if int(sums[i]) != payload.checksum:
            raise TransferError(f"request {handoff.request_id!r}: pool {i} buffer checksum "
                                f"{int(sums[i]):#010x} != {payload.checksum:#010x} sent: the "
                                f"KV was corrupted in transit")
    for pool, (_, pages) in zip(spec.pools, live):
        pages = _padded(pages, pool.num_pages)
        payload = handoff.pools.get(pool.pool_id)
        if payload is not None:
            pools[pool.pool_id] = _scatter(pools[pool.pool_id], pages, payload.buffer)
        draft_offsets = tuple(i for i, name in enumerate(pool.layer_names)
                              if spec.layer(name).role == "draft")
        if mode == "private" and draft_offsets:
            pools[pool.pool_id] = _zero_layers(pools[pool.pool_id], pages, draft_offsets)
    return kv.replace(pools=tuple(pools))
