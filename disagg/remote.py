"""Context and generation workers in separate OS processes.

    context process                                    generation process
    ContextServer (ContextWorker: export Engine)       Engine + RemoteSource (KV source)
      listener  <---- hello {layout, transfer address} ----  connect (reconnects after a drop)
      check     ----- hello {layout, transfer address} --->  check
                <---- prefill {request} (as admitted) -----  fetch: room already reserved here
      batched, chunked prefill; export_step;
      await_pull(uuid, shards)
                ----- handoff {lengths, first token, ----->  reader thread: pull(uuid) ->
                       logical pages, checksums, uuid}        KVPayload -> poll() -> import_step
                ===== KV shards: jax.experimental.transfer =>
                ----- refused {request, error} ----------->  that request fails, alone

The control channel (disagg.control) carries metadata only. Requests from
the stream are pipelined: the generation side sends each admitted request at
once, the context batches whatever is waiting into its prefill steps, and the
reader thread pulls each handoff while the generation engine keeps decoding.
The context frees a request's pages as soon as its export is dispatched (the
offered buffers are copies), so no page is held across the wire; an offer
nobody pulls expires after `timeout`. Every wait has a timeout. A dropped
channel fails the requests in flight on it, by name; the next request
reconnects.
"""

from __future__ import annotations

import datetime
import logging
import queue
import secrets
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from disagg.control import ControlChannel, Listener, PeerClosed
from disagg.layout import Layout, LayoutMismatch, check_layouts
from disagg.sources import ContextWorker
from disagg.transfer import TransferError, TransferTimeout, move_payload
from disagg.wire import (assemble, corrupt, hello, layout_from_wire, layout_to_wire, peer_layout,
                         request_from_wire, request_to_wire, split_shards, start_transfer_server)
from drafter.kv_io import KVPayload
from drafter.request import Request, RequestError
from unified_kv import AdmissionError

log = logging.getLogger("disagg.remote")


# --------------------------------------------------------------- context side

class ContextServer:
    """Serves one generation peer at a time: handshake, then a stream of
    prefill requests answered by handoffs (or refusals) as their prefills end."""

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
        """Compile prefill and export with a request handed to nobody."""
        engine = self.worker.engine
        self.worker.submit(engine.make_request("warm-up", [0] * num_tokens, max_new_tokens=1))
        handoffs = []
        while not handoffs:
            handoffs += self.worker.pump()[0]
        jax.block_until_ready(handoffs[0].payload.buffers)
        engine.run()

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
        try:
            while True:
                busy = self.worker.busy
                if channel.poll(0.0 if busy else self.idle_timeout):
                    try:
                        message = channel.recv(self.timeout)
                    except PeerClosed:
                        return  # the peer is done
                    if not self._handle(channel, message):
                        return
                elif not busy:
                    self._note(f"peer {channel.peer}: no request within "
                               f"{self.idle_timeout:.0f}s; dropped")
                    return
                if self.worker.busy:
                    handoffs, failed = self.worker.pump()
                    for result in failed:
                        self._refuse(channel, result.request_id, TransferError(result.error))
                    for handoff in handoffs:
                        self._offer(channel, handoff)
        finally:
            self._drop_requests(channel.peer)

    def _handle(self, channel: ControlChannel, message: dict) -> bool:
        """Act on one message; False when the peer said goodbye."""
        op = message.get("op")
        if op == "prefill":
            engine = self.worker.engine
            try:
                self.worker.submit(request_from_wire(
                    message, vocab_size=engine.cfg.target.vocab_size,
                    reserved_ids=engine.reserved_ids))
            except (RequestError, AdmissionError, TypeError) as e:
                self._refuse(channel, str(message.get("request_id")), e)
            return True
        if op in ("stats", "close"):
            channel.send(self.stats(), self.timeout)
            return op != "close"
        raise TransferError(f"unknown control message op={op!r}")

    def _refuse(self, channel: ControlChannel, request_id: str, error: BaseException) -> None:
        self._note(f"request {request_id!r} refused: {type(error).__name__}: {error}")
        channel.send({"op": "refused", "request_id": request_id,
                      "error_type": type(error).__name__, "error": str(error)}, self.timeout)

    def _offer(self, channel: ControlChannel, handoff) -> None:
        payload, request_id = handoff.payload, handoff.request_id
        sums, first = jax.device_get((payload.checksums, payload.first_token))
        uuid = secrets.randbits(62)   # single use: a fresh one per handoff
        pieces, pools = [], []
        for k, pool_id in enumerate(payload.pool_ids):
            shards, boxes = split_shards(payload.buffers[k])
            pieces += shards
            pools.append({"pool_id": pool_id,
                          "logical_pages": payload.logical_pages[k].tolist(),
                          "checksum": int(sums[k]), "shape": list(payload.buffers[k].shape),
                          "dtype": str(payload.buffers[k].dtype), "shards": boxes})
        if request_id in self.corrupt_request_ids:
            pieces[0] = corrupt(pieces[0])
        # The offer expires, so a vanished peer leaves nothing behind.
        expiry = datetime.datetime.now() + datetime.timedelta(seconds=self.timeout)
        self.transfer.await_pull(uuid, pieces, timeout=expiry)
        channel.send({"op": "handoff", "request_id": request_id,
                      "target_len": payload.target_len, "draft_ctx_len": payload.draft_ctx_len,
                      "first_token": int(first), "mode": payload.mode, "uuid": uuid,
                      "pools": pools, "layout": layout_to_wire(handoff.layout)}, self.timeout)
        self.num_completed += 1

    def _drop_requests(self, peer: str) -> None:
        """The peer is gone: end whatever it asked for, and free the pages."""
        engine = self.worker.engine
        dropped = list(engine.scheduler.active) + [s.request_id for s in engine.scheduler.waiting]
        for request_id in dropped:
            engine.cancel(request_id)
            self._note(f"request {request_id!r}: peer {peer} left before its handoff")
        engine.run()
        engine.take_exports()

    def stats(self) -> dict:
        engine = self.worker.engine
        if not engine.num_active:
            engine.run()  # let pending slot resets land
        return {"op": "stats", "num_active": engine.num_active,
                "free_pages": np.asarray(engine.state.kv.num_free).tolist(),
                "usable_pages": [p.num_usable_pages for p in engine.spec.pools],
                "reserved_pages": list(engine.admission.reserved_pages),
                "num_completed": self.num_completed, "errors": self.errors[-20:]}

    def _note(self, error: str) -> None:
        self.errors.append(error)
        log.warning(error)


# ------------------------------------------------------------ generation side

class RemoteSource:
    """A generation engine's KV source: a context worker in another process.

    Args:
      address: the context server's control address.
      layout: this generation worker's layout (checked at every handshake).
      mesh: the generation engine's mesh; KV is pulled onto its first device
        and resharded onto it.
      timeout: seconds any single wait (connect, send, a pull) may take.
    """

    def __init__(self, address: str, layout: Layout, *, mesh=None,
                 transfer_host: str = "127.0.0.1", timeout: float = 30.0):
        self.address, self.layout, self.mesh, self.timeout = address, layout, mesh, timeout
        self.pull_device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
        self.transfer = start_transfer_server(transfer_host)
        self.bytes_pulled, self.pull_seconds = 0, 0.0
        self._arrivals: queue.Queue = queue.Queue()
        self._replies: queue.Queue = queue.Queue()
        self._outstanding: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.channel = None
        self._connect()
        self._reader = threading.Thread(target=self._read_loop, name="remote-source",
                                        daemon=True)
        self._reader.start()

    def _connect(self) -> None:
        channel = ControlChannel.connect(self.address, self.timeout)
        try:
            channel.send(hello("generation", self.layout, self.transfer.address()),
                         self.timeout)
            reply = channel.recv(self.timeout)
            check_layouts(peer_layout(reply, "context"), self.layout)
        except BaseException:
            channel.close()
            raise
        self.peer_transfer_address = reply["transfer_address"]
        self._pulls = self.transfer.connect(self.peer_transfer_address)
        self.channel = channel

    # ------------------------------------------------------------ KVSource

    def fetch(self, request: Request) -> None:
        try:
            if self.channel is None or self.channel.broken:
                self._connect()  # the peer may have restarted
            with self._lock:
                self._outstanding.add(request.request_id)
            self.channel.send({"op": "prefill", **request_to_wire(request)}, self.timeout)
        except (TransferError, LayoutMismatch) as e:
            self._fail(request.request_id, e)

    def poll(self, timeout: float) -> list:
        out = []
        try:
            out.append(self._arrivals.get(timeout=timeout) if timeout > 0
                       else self._arrivals.get_nowait())
            while True:
                out.append(self._arrivals.get_nowait())
        except queue.Empty:
            return out

    # ------------------------------------------------------------ control

    def stats(self) -> dict:
        """The context worker's page counts and failures."""
        self.channel.send({"op": "stats"}, self.timeout)
        return self._reply()

    def close(self) -> dict | None:
        """Say goodbye; returns the context worker's final stats (None if gone)."""
        try:
            if self.channel is not None and not self.channel.broken:
                self.channel.send({"op": "close"}, self.timeout)
                return self._reply()
        except TransferError:
            return None
        finally:
            self._stop.set()
            self._reader.join(self.timeout)
            if self.channel is not None:
                self.channel.close()

    def _reply(self) -> dict:
        try:
            return self._replies.get(timeout=self.timeout)
        except queue.Empty:
            raise TransferTimeout(f"no reply from the context worker at {self.address} "
                                  f"within {self.timeout:.1f}s") from None

    # ------------------------------------------------------------ reader

    def _fail(self, request_id: str, error: BaseException) -> None:
        with self._lock:
            self._outstanding.discard(request_id)
        self._arrivals.put((request_id, error))

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            channel = self.channel
            try:
                if channel is None or channel.broken or not channel.poll(0.05):
                    time.sleep(0.01 if channel is None or channel.broken else 0)
                    continue
                message = channel.recv(self.timeout)
            except TransferError as e:
                with self._lock:
                    lost, self._outstanding = self._outstanding, set()
                for request_id in lost:
                    self._arrivals.put((request_id, PeerClosed(
                        f"the context worker at {self.address} was lost: {e}")))
                continue
            op, request_id = message.get("op"), message.get("request_id")
            if op == "handoff":
                try:
                    payload = self._pull(message)
                except Exception as e:  # noqa: BLE001 - any failure is this request's alone
                    self._fail(request_id, e)
                    continue
                with self._lock:
                    self._outstanding.discard(request_id)
                self._arrivals.put((request_id, payload))
            elif op == "refused":
                error = {"AdmissionError": AdmissionError,
                         "RequestError": RequestError}.get(message.get("error_type"),
                                                           TransferError)
                self._fail(request_id, error(f"the context worker refused request "
                                             f"{request_id!r}: {message.get('error')}"))
            elif op == "stats":
                self._replies.put(message)

    def _pull(self, message: dict) -> KVPayload:
        """Pull a handoff's KV shards onto `pull_device`, then onto the mesh."""
        request_id = message["request_id"]
        check_layouts(layout_from_wire(message["layout"]), self.layout)
        local = jax.sharding.SingleDeviceSharding(self.pull_device)
        avals = [jax.ShapeDtypeStruct([b - a for a, b in box], jnp.dtype(pool["dtype"]),
                                      sharding=local)
                 for pool in message["pools"] for box in pool["shards"]]
        start = time.perf_counter()
        pieces = self._pulls.pull(message["uuid"], avals)
        self._await(pieces, request_id)
        self.pull_seconds += time.perf_counter() - start
        self.bytes_pulled += sum(p.nbytes for p in pieces)
        buffers = []
        for pool in message["pools"]:
            mine, pieces = pieces[:len(pool["shards"])], pieces[len(pool["shards"]):]
            buffers.append(assemble(pool["shape"], pool["dtype"], pool["shards"], mine))
        payload = KVPayload(
            target_len=message["target_len"], draft_ctx_len=message["draft_ctx_len"],
            first_token=np.int32(message["first_token"]),
            pool_ids=tuple(p["pool_id"] for p in message["pools"]),
            logical_pages=tuple(np.asarray(p["logical_pages"], np.int32)
                                for p in message["pools"]),
            buffers=tuple(buffers),
            checksums=np.asarray([p["checksum"] for p in message["pools"]], np.uint32),
            mode=message["mode"])
        return move_payload(payload, self.mesh)

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
