"""The wire format between worker processes: KV formats, requests, handoffs, shards.

Only JSON-able metadata goes over the control channel; the KV buffers travel
as shards through `jax.experimental.transfer` and are put back together on
the receiver (`split_shards` / `assemble`), pulled by `Pulls`.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import transfer as jax_transfer

from disagg.control import PeerClosed
from disagg.kv_format import KVFormat
from disagg.transfer import TransferError, TransferTimeout
from drafter.kv_io import KVPayload
from drafter.request import Request, RequestError, SamplingParams
from drafter.sampling import LOGPROB_WIDTH


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


def handoff_to_wire(request_id: str, payload: KVPayload, host: tuple, uuid: int,
                    kv_format: KVFormat) -> tuple[list[jax.Array], dict]:
    """(the shards to offer under `uuid`, the handoff message) of a payload whose
    checksums, first token, drafts, first-token log-probability bits (or None) and prompt
    log-probability parts were read to the host (`host`, in that order)."""
    sums, first, drafts, first_logprobs, prompt_logprobs = host
    pieces, pools = [], []
    for k, pool_id in enumerate(payload.pool_ids):
        shards, boxes = split_shards(payload.buffers[k])
        pieces += shards
        pools.append({"pool_id": pool_id, "logical_pages": payload.logical_pages[k].tolist(),
                      "checksum": int(sums[k]), "shape": list(payload.buffers[k].shape),
                      "dtype": str(payload.buffers[k].dtype), "shards": boxes})
    return pieces, {"op": "handoff", "request_id": request_id,
                    "target_len": payload.target_len, "draft_ctx_len": payload.draft_ctx_len,
                    "first_token": int(first), "drafts": np.asarray(drafts).tolist(),
                    "first_logprobs": (None if first_logprobs is None
                                       else np.asarray(first_logprobs).tolist()),
                    "prompt_logprobs": _prompt_logprobs_to_wire(prompt_logprobs),
                    "mode": payload.mode, "uuid": uuid, "pools": pools,
                    "kv_format": kv_format_to_wire(kv_format)}


def handoff_avals(message: dict, device) -> list[jax.ShapeDtypeStruct]:
    """The shards a handoff message offers, as they are pulled onto `device`."""
    local = jax.sharding.SingleDeviceSharding(device)
    return [jax.ShapeDtypeStruct([b - a for a, b in box], jnp.dtype(pool["dtype"]),
                                 sharding=local)
            for pool in message["pools"] for box in pool["shards"]]


def payload_from_wire(message: dict, pieces: list[jax.Array], origin: str) -> KVPayload:
    """The KVPayload of a handoff message and its pulled shards (in `handoff_avals` order)."""
    buffers = []
    for pool in message["pools"]:
        mine, pieces = pieces[:len(pool["shards"])], pieces[len(pool["shards"]):]
        buffers.append(assemble(pool["shape"], pool["dtype"], pool["shards"], mine))
    return KVPayload(
        target_len=message["target_len"], draft_ctx_len=message["draft_ctx_len"],
        first_token=np.int32(message["first_token"]),
        drafts=np.asarray(message["drafts"], np.int32),
        pool_ids=tuple(p["pool_id"] for p in message["pools"]),
        logical_pages=tuple(np.asarray(p["logical_pages"], np.int32) for p in message["pools"]),
        buffers=tuple(buffers),
        checksums=np.asarray([p["checksum"] for p in message["pools"]], np.uint32),
        mode=message["mode"], origin=origin,
        first_logprobs=_logprob_bits(message.get("first_logprobs")),
        prompt_logprobs=_prompt_logprobs_from_wire(message.get("prompt_logprobs"),
                                                   message["target_len"]))


def _prompt_logprobs_to_wire(parts) -> str | None:
    """Prompt log-probability parts as one base64 string of their rows' i32 bits (None:
    not asked for). Bits, not numbers: the receiver books exactly what the sender's
    prefill computed."""
    if not parts:
        return None
    rows = [np.asarray(bits, np.int32)[:n * LOGPROB_WIDTH] for bits, n in parts]
    return base64.b64encode(np.concatenate(rows).astype("<i4").tobytes()).decode()


def _prompt_logprobs_from_wire(text, target_len: int) -> tuple:
    """A handoff's prompt log-probabilities: () or one part of target_len - 1 rows."""
    if text is None:
        return ()
    try:
        bits = np.frombuffer(base64.b64decode(text, validate=True), "<i4").astype(np.int32)
    except (TypeError, ValueError) as e:
        raise ValueError(f"a handoff's prompt_logprobs are not base64 i32 bits ({e})") from None
    rows = target_len - 1
    if bits.size != rows * LOGPROB_WIDTH:
        raise ValueError(f"a handoff's prompt_logprobs hold {bits.size} i32 values; a "
                         f"{target_len}-token prompt's are {rows} x {LOGPROB_WIDTH}")
    return ((bits, rows),)


def _logprob_bits(bits) -> np.ndarray | None:
    """A handoff's first-token log-probabilities: None, or LOGPROB_WIDTH i32 bit patterns."""
    if bits is None:
        return None
    if not (isinstance(bits, list) and len(bits) == LOGPROB_WIDTH
            and all(type(b) is int and -2**31 <= b < 2**31 for b in bits)):
        raise ValueError(f"a handoff's first_logprobs must be {LOGPROB_WIDTH} i32 bit "
                         f"patterns, got {str(bits)[:80]}")
    return np.asarray(bits, np.int32)


class Pulls:
    """Pulls of offered shards from one peer's transfer server. A pull that fails, is
    abandoned or is stuck poisons the connection (else its other pending pulls wait on a
    dead uuid forever) and opens a fresh one: later pulls start afresh."""

    def __init__(self, transfer, peer_address: str, peer: str):
        self.transfer, self.peer_address, self.peer = transfer, peer_address, peer
        self._connection = transfer.connect(peer_address)

    def pull(self, message: dict, device) -> list[jax.Array]:
        """Start pulling a handoff message's shards onto `device` (asynchronous)."""
        return self._connection.pull(message["uuid"], handoff_avals(message, device))

    def wait(self, pieces, *, abandoned, deadline: float, timeout_s: float) -> None:
        """Until `pieces` are here; PeerClosed once `abandoned()` (the peer was lost),
        TransferTimeout past `deadline` (monotonic), TransferError if the pull failed."""
        # The pull's own `timeout` argument is not honoured on CPU in jax 0.11.2 (a pull of
        # an unoffered uuid waits until the peer dies), so poll readiness against a deadline.
        delay = 1e-4
        where = f"the KV pull from {self.peer} (transfer server {self.peer_address})"
        while not all(p.is_ready() for p in pieces):
            if abandoned():
                self._reset()
                raise PeerClosed(f"{where} was abandoned: the context worker was lost")
            if time.monotonic() > deadline:
                self._reset()
                raise TransferTimeout(f"{where} did not finish within {timeout_s:.1f}s of its "
                                      f"handoff while the context sent heartbeats: the "
                                      f"transfer is stuck; check that its transfer server is "
                                      f"reachable from here (later requests pull afresh)")
            time.sleep(delay)
            delay = min(2 * delay, 0.01)
        try:
            jax.block_until_ready(pieces)
        except jax.errors.JaxRuntimeError as e:
            self._reset()
            raise TransferError(f"{where} failed: the context died or dropped the offer; "
                                f"if it died, start it again (the next request "
                                f"reconnects): {e}") from None

    def _reset(self) -> None:
        poison = getattr(self._connection, "_poison_connection", None)
        if poison is not None:
            poison()
        self._connection = self.transfer.connect(self.peer_address)
