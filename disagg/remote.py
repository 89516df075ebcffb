"""Context and generation workers in separate OS processes.

    context process                                       generation process
    ContextServer (ContextWorker)                         RemoteContext + GenerationWorker
      control listener  <------ hello {layout, transfer address} ------  connect
      check_layouts     ------- hello {layout, transfer address} ----->  check_layouts
                        <------ prefill {id, prompt, max_new_tokens} ---
      prefill, gather live pages,
      await_pull(uuid, shards) - handoff {lengths, logical pages,
                                 checksums, shapes, uuid, layout} --->  pull(uuid)
                        ======= KV shards: jax.experimental.transfer ==>  receive: gate, reserve,
                                                                         checksum, scatter, redraft
      complete (free)   <------ ack | abort {error} -------------------

The control channel (disagg.control) carries metadata only; the bulk KV moves
through the two processes' transfer servers. Every wait has a timeout: the
context frees a request's pages on ack, abort, timeout or a closed peer; the
generation side frees its own in `GenerationWorker.receive` and aborts. A
layout mismatch raises LayoutMismatch on both sides at the handshake, and
`receive` checks the layout sent with every handoff again.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import secrets
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import transfer as jax_transfer

from disagg.control import ControlChannel, Listener, PeerClosed
from disagg.layout import Layout, LayoutMismatch, check_layouts
from disagg.transfer import Handoff, PoolPayload, TransferError
from disagg.workers import (ContextWorker, DisaggregatedPair, GenerationWorker,
                            TransferTimeout)
from unified_kv import AdmissionError, pages_per_request

log = logging.getLogger("disagg.remote")


@dataclasses.dataclass(frozen=True)
class PairSource:
    """Which model pair and cache a worker process builds (both sides must agree;
    the layout handshake says so when they do not)."""

    pair_dir: str | None = None   # target/ and draft/ HF checkpoints; None: the embedded pair
    num_slots: int = 4
    max_seq_len: int = 9216
    kv_memory_mib: int = 1024

    def load(self):
        """(params, StepConfig) with the default cache (fp8 target KV, bf16 draft KV)."""
        from drafter.default import default_step_config, load_default
        from models.checkpoint import load_dflash, load_qwen3
        if self.pair_dir is None:
            params, tcfg, dcfg = load_default()
        else:
            tcfg, target = load_qwen3(Path(self.pair_dir) / "target")
            dcfg, draft = load_dflash(Path(self.pair_dir) / "draft")
            params = {"target": target, "draft": draft}
        return params, default_step_config(tcfg, dcfg, num_slots=self.num_slots,
                                           max_seq_len=self.max_seq_len,
                                           memory_budget_bytes=self.kv_memory_mib << 20)

    def cli_args(self) -> list[str]:
        args = ["--num-slots", str(self.num_slots), "--max-seq-len", str(self.max_seq_len),
                "--kv-memory-mib", str(self.kv_memory_mib)]
        return args + (["--pair", str(self.pair_dir)] if self.pair_dir else [])


# ------------------------------------------------------------------ wire format

def layout_to_wire(layout: Layout) -> dict:
    return dataclasses.asdict(layout)


def layout_from_wire(fields: dict) -> Layout:
    return Layout(**{**fields, "layers": tuple(tuple(l) for l in fields["layers"])})


def hello(role: str, layout: Layout, transfer_address: str) -> dict:
    return {"op": "hello", "role": role, "layout": layout_to_wire(layout),
            "transfer_address": transfer_address}


def peer_layout(message: dict, role: str) -> Layout:
    if message.get("op") != "hello" or message.get("role") != role:
        raise TransferError(f"expected a hello from a {role} worker, got "
                            f"{ {k: message.get(k) for k in ('op', 'role')} }")
    return layout_from_wire(message["layout"])


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


def corrupt(piece: jax.Array) -> jax.Array:
    """Fault injection: change one value (to 1 if it was 0, else 0), checksum untouched."""
    first = (0,) * piece.ndim
    return piece.at[first].set(jnp.where(piece[first] == 0, 1, 0).astype(piece.dtype))


def start_transfer_server(host: str):
    """A transfer server on `host` with an explicit transport address (DESIGN: Transfers)."""
    return jax_transfer.start_transfer_server(jax.devices()[0].client, f"{host}:0",
                                              [f"{host}:0"])


# --------------------------------------------------------------- context side

class ContextServer:
    """Serves one generation peer at a time: handshake, then prefill -> offer -> ack."""

    def __init__(self, worker: ContextWorker, *, address: str = "127.0.0.1:0",
                 transfer_host: str = "127.0.0.1", timeout: float = 30.0,
                 idle_timeout: float = 3600.0, corrupt_request_ids=()):
        self.worker, self.timeout, self.idle_timeout = worker, timeout, idle_timeout
        self.corrupt_request_ids = frozenset(corrupt_request_ids)  # tests: a bad wire
        self.transfer = start_transfer_server(transfer_host)
        self.listener = Listener(address)
        self.num_completed, self.errors = 0, []

    @property
    def address(self) -> str:
        return self.listener.address

    def warm_up(self, num_tokens: int = 64) -> None:
        """Compile prefill and export by handing off a dummy request to nobody."""
        self.worker.prefill("warm-up", [0] * num_tokens, 1)
        self.worker.complete("warm-up")

    def serve(self, max_connections: int | None = None) -> None:
        """Accept peers until `max_connections` have been served (None: forever)."""
        served = 0
        while max_connections is None or served < max_connections:
            channel = self.listener.accept(None)  # a server idles until a peer comes
            served += 1
            try:
                self.serve_peer(channel)
            # A failed, silent or misbehaving peer is dropped; the server keeps serving.
            except (TransferError, LayoutMismatch, KeyError, TypeError, ValueError) as e:
                self._note(f"peer {channel.peer}: {type(e).__name__}: {e}")
            finally:
                channel.close()

    def serve_peer(self, channel: ControlChannel) -> None:
        theirs = peer_layout(channel.recv(self.timeout), "generation")
        channel.send(hello("context", self.worker.layout, self.transfer.address()),
                     self.timeout)
        check_layouts(self.worker.layout, theirs)
        log.info("generation peer %s connected", channel.peer)
        while True:
            try:
                message = channel.recv(self.idle_timeout)
            except PeerClosed:
                return  # the peer is done
            op = message.get("op")
            if op == "prefill":
                self.hand_off(channel, message)
            elif op in ("stats", "close"):
                channel.send(self.stats(), self.timeout)
                if op == "close":
                    return
            else:
                raise TransferError(f"unknown control message op={op!r}")

    def hand_off(self, channel: ControlChannel, message: dict) -> None:
        request_id = message["request_id"]
        try:
            try:
                handoff = self.worker.prefill(request_id, message["prompt"],
                                              message["max_new_tokens"])
            except (AdmissionError, ValueError) as e:
                self._note(f"request {request_id!r} refused: {type(e).__name__}: {e}")
                channel.send({"op": "refused", "request_id": request_id,
                              "error_type": type(e).__name__, "error": str(e)}, self.timeout)
                return
            uuid = secrets.randbits(62)   # single use: a fresh one per handoff
            pieces, pools = [], []
            for pool_id, payload in handoff.pools.items():
                shards, boxes = split_shards(payload.buffer)
                pieces += shards
                pools.append({"pool_id": pool_id, "logical_pages": payload.logical_pages.tolist(),
                              "checksum": payload.checksum, "shape": list(payload.buffer.shape),
                              "dtype": str(payload.buffer.dtype), "shards": boxes})
            if request_id in self.corrupt_request_ids:
                pieces[0] = corrupt(pieces[0])
            # The offer expires with the ack wait, so a vanished peer leaves nothing behind.
            expiry = datetime.datetime.now() + datetime.timedelta(seconds=self.timeout)
            self.transfer.await_pull(uuid, pieces, timeout=expiry)
            channel.send({"op": "handoff", "request_id": request_id, "prompt": handoff.prompt,
                          "max_new_tokens": handoff.max_new_tokens,
                          "first_token": handoff.first_token, "target_len": handoff.target_len,
                          "draft_ctx_len": handoff.draft_ctx_len, "uuid": uuid, "pools": pools,
                          "layout": layout_to_wire(handoff.layout)}, self.timeout)
            reply = channel.recv(self.timeout)
            if reply.get("op") == "ack" and reply.get("request_id") == request_id:
                self.num_completed += 1
            else:
                self._note(f"request {request_id!r} aborted by the generation worker: "
                           f"{reply.get('error')}")
        except TransferError as e:
            self._note(f"request {request_id!r}: {type(e).__name__}: {e}")
            raise  # the channel is unusable: drop the peer
        finally:
            self.worker.complete(request_id)  # pages freed on ack, abort, timeout, error

    def stats(self) -> dict:
        engine = self.worker.engine
        return {"op": "stats", "num_held": self.worker.num_held,
                "free_pages": np.asarray(engine.state.kv.num_free).tolist(),
                "usable_pages": [p.num_usable_pages for p in engine.spec.pools],
                "reserved_pages": list(engine.admission.reserved_pages),
                "num_completed": self.num_completed, "errors": self.errors[-20:]}

    def _note(self, error: str) -> None:
        self.errors.append(error)
        log.warning(error)


# ------------------------------------------------------------ generation side

class RemoteContext:
    """The generation process's handle on a context worker process."""

    def __init__(self, address: str, layout: Layout, *, pull_device=None,
                 transfer_host: str = "127.0.0.1", timeout: float = 30.0):
        self.address, self.layout, self.timeout = address, layout, timeout
        self.pull_device = pull_device or jax.devices()[0]
        self.transfer = start_transfer_server(transfer_host)
        self.channel = ControlChannel.connect(address, timeout)
        try:
            self.channel.send(hello("generation", layout, self.transfer.address()), timeout)
            reply = self.channel.recv(timeout)
            check_layouts(peer_layout(reply, "context"), layout)
        except BaseException:
            self.channel.close()
            raise
        self.peer_transfer_address = reply["transfer_address"]
        self._pulls = self.transfer.connect(self.peer_transfer_address)
        self.bytes_pulled, self.pull_seconds = 0, 0.0

    def prefill(self, request_id: str, prompt, max_new_tokens: int) -> dict:
        """Ask the context worker to prefill; returns its handoff message."""
        self.channel.send({"op": "prefill", "request_id": request_id,
                           "prompt": [int(t) for t in prompt],
                           "max_new_tokens": int(max_new_tokens)}, self.timeout)
        reply = self.channel.recv(self.timeout)
        if reply.get("op") == "refused":
            error = AdmissionError if reply["error_type"] == "AdmissionError" else TransferError
            raise error(f"context worker refused request {request_id!r}: {reply['error']}")
        if reply.get("op") != "handoff" or reply.get("request_id") != request_id:
            self.channel.close()
            raise TransferError(f"expected the handoff of {request_id!r}, got "
                                f"op={reply.get('op')!r} for {reply.get('request_id')!r}")
        return reply

    def pull(self, message: dict, *, submitted: float) -> Handoff:
        """Pull a handoff's KV shards onto `pull_device` and rebuild the Handoff."""
        request_id = message["request_id"]
        local = jax.sharding.SingleDeviceSharding(self.pull_device)
        avals = [jax.ShapeDtypeStruct([b - a for a, b in box], jnp.dtype(pool["dtype"]),
                                      sharding=local)
                 for pool in message["pools"] for box in pool["shards"]]
        start = time.perf_counter()
        pieces = self._pulls.pull(message["uuid"], avals)
        self._await(pieces, request_id)
        self.pull_seconds += time.perf_counter() - start
        self.bytes_pulled += sum(p.nbytes for p in pieces)
        pools = {}
        for pool in message["pools"]:
            mine, pieces = pieces[:len(pool["shards"])], pieces[len(pool["shards"]):]
            pools[pool["pool_id"]] = PoolPayload(
                np.asarray(pool["logical_pages"], np.int32),
                assemble(pool["shape"], pool["dtype"], pool["shards"], mine), pool["checksum"])
        return Handoff(request_id=request_id, prompt=message["prompt"],
                       max_new_tokens=message["max_new_tokens"],
                       first_token=message["first_token"], target_len=message["target_len"],
                       draft_ctx_len=message["draft_ctx_len"], pools=pools,
                       layout=layout_from_wire(message["layout"]), submitted=submitted)

    def _await(self, pieces, request_id: str) -> None:
        # The pull's own `timeout` argument is not honoured on CPU in jax 0.11.2 (a pull of
        # an unoffered uuid waits until the peer dies), so poll readiness against a deadline.
        deadline, delay = time.monotonic() + self.timeout, 1e-4
        while not all(p.is_ready() for p in pieces):
            if time.monotonic() > deadline:
                self._reset_pulls()
                raise TransferTimeout(f"request {request_id!r}: the KV pull from "
                                      f"{self.peer_transfer_address} did not finish within "
                                      f"{self.timeout:.1f}s")
            time.sleep(delay)
            delay = min(2 * delay, 0.01)
        try:
            jax.block_until_ready(pieces)
        except jax.errors.JaxRuntimeError as e:
            self._reset_pulls()
            raise TransferError(f"request {request_id!r}: the KV pull from "
                                f"{self.peer_transfer_address} failed: {e}") from None

    def _reset_pulls(self) -> None:
        # Poisoning fails the connection's pending pulls (else they wait on a dead
        # uuid forever); later requests use a fresh connection.
        poison = getattr(self._pulls, "_poison_connection", None)
        if poison is not None:
            poison()
        self._pulls = self.transfer.connect(self.peer_transfer_address)

    def finish(self, request_id: str, error: BaseException | None = None) -> None:
        """Ack a received handoff, or abort it: either way the context frees its pages.
        Best effort: a context that cannot hear it times out (or sees EOF) and frees
        them itself, and an unheard ack loses nothing here (the KV has arrived)."""
        message = {"op": "ack" if error is None else "abort", "request_id": request_id,
                   "error": None if error is None else f"{type(error).__name__}: {error}"}
        try:
            self.channel.send(message, self.timeout)
        except TransferError as e:
            log.warning("request %r: could not %s to the context worker: %s",
                        request_id, message["op"], e)

    def stats(self) -> dict:
        """The context worker's page counts and failures."""
        self.channel.send({"op": "stats"}, self.timeout)
        return self.channel.recv(self.timeout)

    def close(self) -> dict:
        """Say goodbye; returns the context worker's final stats."""
        try:
            self.channel.send({"op": "close"}, self.timeout)
            return self.channel.recv(self.timeout)
        finally:
            self.channel.close()


def check_room(engine, request_id: str, prompt, max_new_tokens: int) -> None:
    """AdmissionError now (ValueError for a bad prompt) rather than after the context
    worker has prefilled a request this worker cannot admit yet."""
    prompt = engine.validate_prompt(prompt, max_new_tokens)
    admission = engine.admission
    if admission.num_free_slots == 0:
        raise AdmissionError(f"request {request_id!r}: all {engine.spec.num_slots} "
                             f"generation slots are busy")
    need = pages_per_request(engine.spec, len(prompt) + max_new_tokens + engine.cfg.block_size)
    for pool, n, held in zip(engine.spec.pools, need, admission.reserved_pages):
        if held + n > pool.num_usable_pages:
            raise AdmissionError(f"request {request_id!r}: generation pool {pool.pool_id} "
                                 f"has {pool.num_usable_pages - held} unreserved pages, needs {n}")


class RemotePair(DisaggregatedPair):
    """DisaggregatedPair's serving loop with the context worker in another process."""

    def __init__(self, remote: RemoteContext, generation: GenerationWorker):
        # No in-process ContextWorker: the handshake already ran in RemoteContext.
        check_layouts(remote.layout, generation.layout)
        self.remote, self.generation, self.context = remote, generation, None
        self.timeout = remote.timeout

    def transfer_one(self, request_id: str, prompt, max_new_tokens: int) -> None:
        check_room(self.generation.engine, request_id, prompt, max_new_tokens)
        submitted = time.perf_counter()
        message = self.remote.prefill(request_id, prompt, max_new_tokens)
        try:
            self.generation.receive(self.remote.pull(message, submitted=submitted))
        except BaseException as e:
            self.remote.finish(request_id, error=e)
            raise
        self.remote.finish(request_id)
