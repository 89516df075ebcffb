r"""Moving one request's KV between workers: the handoff, its move paths, head slices.

    context Engine (export)                        generation Engine (KV source)
    export_step: live pages per pool -> buffers    import_step: allocate, verify checksums
      + u32 checksums (drafter.kv_io)                and page ranges, scatter, redraft
                  \                                /
                   Handoff --move (device puts)--> KVPayload on the receiver's mesh

Move paths: "coalesced" (one device-to-device put per pool buffer),
"pinned_host" (staged in the sender's pinned host memory, then put on the
receiver: what a transfer that must leave the device does) and "host" (through
pageable host memory, numpy).

Head slices (fan-in): a context worker on a TP mesh holds each buffer as
per-device shards along kv heads; `split_heads` sends each shard as its own
handoff (what separate context ranks do) and `assemble_heads` puts them back
together on the receiver. The checksum is additive over head slices, so the
assembled buffer is verified against the sum of the slices' checksums.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from drafter.kv_io import KVPayload, checksum, receiver_shardings
from drafter.request import Request

MOVE_PATHS = ("coalesced", "pinned_host", "host")


class TransferError(RuntimeError):
    """A request's KV could not be moved intact; its pages were freed. Passing: the same
    request sent again may be served (`drafter.arrivals.passing`)."""

    retryable = True


class TransferTimeout(TransferError):
    """A peer did not answer in time; the request's pages were freed."""


class MovePathUnavailable(ValueError):
    """The chosen move path needs a memory kind these devices do not offer."""


@dataclasses.dataclass
class Handoff:
    """A request leaving a context worker: its KV payload and the sender's KV format.

    Attributes:
      heads: per sent pool, the kv heads [start, stop) this handoff carries
        (None: all); slice_index / num_slices: this head slice among the request's.
    """

    request: Request
    payload: KVPayload
    kv_format: object             # disagg.kv_format.KVFormat
    submitted: float = 0.0
    heads: tuple | None = None
    slice_index: int = 0
    num_slices: int = 1

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes


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
    raise ValueError(f"move path {path!r} is unknown; use one of {MOVE_PATHS}")


def move_payload(payload: KVPayload, mesh, *, path: str = "coalesced",
                 kv_head_axis: str | None = None) -> KVPayload:
    """Put every buffer (and the small scalars) on the receiver's mesh, split
    along kv heads. Asynchronous: nothing waits for the data."""
    if path not in MOVE_PATHS:
        raise ValueError(f"move path {path!r} is unknown; use one of {MOVE_PATHS}")
    if path == "coalesced":
        return move_payloads([payload], mesh, kv_head_axis=kv_head_axis)[0]
    sharding, replicated = receiver_shardings(mesh, kv_head_axis)
    return dataclasses.replace(
        payload, buffers=tuple(move_buffer(b, sharding, path) for b in payload.buffers),
        first_token=jax.device_put(payload.first_token, replicated),
        drafts=jax.device_put(payload.drafts, replicated),
        checksums=jax.device_put(payload.checksums, replicated))


def move_payloads(payloads: list[KVPayload], mesh, *, path: str = "coalesced",
                  kv_head_axis: str | None = None) -> list[KVPayload]:
    """`move_payload` for several payloads; "coalesced" moves them all in one device_put.
    Arrays already placed as the receiver wants them (a context worker on the same
    device) are handed over as they are: they are the export's own copies, never views
    of a cache, so the receiver may keep them."""
    if path != "coalesced":
        return [move_payload(p, mesh, path=path, kv_head_axis=kv_head_axis) for p in payloads]
    sharding, replicated = receiver_shardings(mesh, kv_head_axis)
    tree = [(p.buffers, p.first_token, p.drafts, p.checksums) for p in payloads]
    where = [(tuple(sharding for _ in p.buffers), replicated, replicated, replicated)
             for p in payloads]
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(where)
    moving = [k for k, (x, s) in enumerate(zip(leaves, targets)) if not _placed(x, s)]
    if moving:
        for k, x in zip(moving, jax.device_put([leaves[k] for k in moving],
                                               [targets[k] for k in moving])):
            leaves[k] = x
    moved = jax.tree.unflatten(treedef, leaves)
    return [dataclasses.replace(p, buffers=tuple(b), first_token=f, drafts=d, checksums=c)
            for p, (b, f, d, c) in zip(payloads, moved)]


def _placed(x, sharding) -> bool:
    """`x` is a device array already laid out as `sharding`."""
    return isinstance(x, jax.Array) and x.sharding == sharding


def split_heads(handoff: Handoff) -> list[Handoff]:
    """One handoff per kv-head slice of the sender's buffers (one per device of a
    TP mesh), each with its slice's own checksums: what separate ranks send."""
    per_pool = []
    for buffer in handoff.payload.buffers:
        shards = {}
        for shard in buffer.addressable_shards:  # replicas repeat a range: keep one
            heads = shard.index[0].indices(buffer.shape[0])[:2]
            shards.setdefault(heads, shard.data)
        per_pool.append(sorted(shards.items()))
    counts = {len(s) for s in per_pool}
    if len(counts) != 1:
        raise TransferError(f"request {handoff.request_id!r}: pools are split into "
                            f"{sorted(counts)} head slices; every pool must be sharded over "
                            f"the same mesh axis")
    num = counts.pop()
    out = []
    for i in range(num):
        parts = [slices[i] for slices in per_pool]
        sums = jnp.stack([checksum(data, heads[0]) for heads, data in parts])
        payload = dataclasses.replace(handoff.payload, buffers=tuple(d for _, d in parts),
                                      checksums=sums)
        out.append(dataclasses.replace(handoff, payload=payload, slice_index=i, num_slices=num,
                                       heads=tuple(h for h, _ in parts)))
    return out


def assemble_heads(slices: list[Handoff], device, *, path: str = "coalesced") -> Handoff:
    """Move every head slice of one request onto `device` and join them along kv
    heads. The joined buffers' checksums are the sums of the slices' (verified on
    import). Raises TransferError naming a missing, repeated or inconsistent slice."""
    first = slices[0]
    rid = first.request_id
    got = sorted(s.slice_index for s in slices)
    if got != list(range(first.num_slices)) or any(
            s.request_id != rid or s.num_slices != first.num_slices for s in slices):
        raise TransferError(f"request {rid!r}: head slices {got} arrived, expected "
                            f"0..{first.num_slices - 1} once each")
    slices = sorted(slices, key=lambda s: s.heads[0])
    target = jax.sharding.SingleDeviceSharding(device)
    buffers = []
    for k, pool_id in enumerate(first.payload.pool_ids):
        covered = 0
        for s in slices:
            if s.heads[k][0] != covered:
                raise TransferError(f"request {rid!r}: pool {pool_id} kv heads "
                                    f"{covered}..{s.heads[k][0] - 1} are missing or repeated "
                                    f"(slices cover {[x.heads[k] for x in slices]})")
            covered = s.heads[k][1]
        buffers.append(jnp.concatenate([move_buffer(s.payload.buffers[k], target, path)
                                        for s in slices], axis=0))
    sums = sum(jax.device_put(s.payload.checksums, device) for s in slices)
    payload = dataclasses.replace(first.payload, buffers=tuple(buffers),
                                  checksums=sums.astype(jnp.uint32),
                                  first_token=jax.device_put(first.payload.first_token, device),
                                  drafts=jax.device_put(first.payload.drafts, device))
    return dataclasses.replace(first, payload=payload, heads=None, slice_index=0, num_slices=1)
