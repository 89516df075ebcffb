"""The wire format between worker processes: KV formats, requests, handoffs, shards.

Only JSON-able metadata goes over the control channel; the KV buffers travel
as shards through `jax.experimental.transfer` and are put back together on
the receiver (`split_shards` / `assemble`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import transfer as jax_transfer

from disagg.kv_format import KVFormat
from drafter.request import Request, RequestError, SamplingParams


def kv_format_to_wire(kv_format: KVFormat) -> dict:
    return dataclasses.asdict(kv_format)


def kv_format_from_wire(fields: dict) -> KVFormat:
    return KVFormat(**{**fields, "layers": tuple(tuple(l) for l in fields["layers"]),
                     "pools": tuple(tuple(p) for p in fields.get("pools", ()))})


def split_shards(buffer: jax.Array) -> tuple[list[jax.Array], list[list[list[int]]]]:
    """A buffer's distinct shards (a replica once) and the box each covers,
    [[start, stop] per dim]: pulled as they lie, reassembled on the receiver."""
    pieces, boxes = [], []
    for shard in buffer.addressable_shards:
        box = [list(s.indices(n)[:2]) for s, n in zip(shard.index, buffer.shape)]
        if box not in boxes:
            pieces.append(shard.data)
            boxes.append(box)
    return pieces, boxes


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _assemble(shape, dtype, boxes, *pieces):
    out = jnp.zeros(shape, dtype)
    for box, piece in zip(boxes, pieces):
        out = out.at[tuple(slice(a, b) for a, b in box)].set(piece)
    return out


def assemble(shape, dtype, boxes, pieces) -> jax.Array:
    if len(pieces) == 1 and list(pieces[0].shape) == list(shape):
        return pieces[0]
    boxes = tuple(tuple(tuple(b) for b in box) for box in boxes)
    return _assemble(tuple(shape), jnp.dtype(dtype), boxes, *pieces)


def start_transfer_server(host: str):
    """A transfer server on `host` with an explicit transport address (DESIGN: Transfers)."""
    return jax_transfer.start_transfer_server(jax.devices()[0].client, f"{host}:0",
                                              [f"{host}:0"])


def request_to_wire(request: Request) -> dict:
    return {"request_id": request.request_id, "prompt": list(request.prompt),
            "params": dataclasses.asdict(request.params)}


def request_from_wire(message: dict, *, vocab_size: int, reserved_ids=()) -> Request:
    """A checked Request from a peer's message (RequestError names what is wrong)."""
    fields = dict(message.get("params") or {})
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(SamplingParams)})
    if unknown:
        raise RequestError(f"request {message.get('request_id')!r}: unknown sampling "
                           f"fields {unknown}")
    fields["stop_token_ids"] = tuple(fields.get("stop_token_ids") or ())
    return Request.make(message.get("request_id"), message.get("prompt"),
                        SamplingParams(**fields), vocab_size=vocab_size,
                        reserved_ids=reserved_ids)
