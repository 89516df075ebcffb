"""Context and generation workers in separate OS processes: the generation side.

    context process                                    generation process
    ContextServer (disagg.context_server)              Engine + RemoteSource (KV source)
      listener  <-- hello {layout, weights, transfer --  connect (reconnects after a drop)
                         address, keepalive_s}
      check     --- hello {layout, weights, ...} ----->  check (disagg.handshake)
                <---- prefill {request} (as admitted) -----  fetch: room already reserved here
      batched, chunked prefill; export_step;
      await_pull(uuid, shards)
                ----- progress {request ids} --------->  each id's wait starts again
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
nobody pulls expires after `timeout`.

Deadlines: the engine fails a request whose KV shows no progress for
`timeout` seconds (`Engine.kv_timeout_s`). The context sends progress for
each request it holds every `timeout / 4` seconds, so a long prefill never
times out while a stopped context does; a pull has its own `timeout` from
its handoff. A dropped channel fails the requests in flight on it, by name;
the next request reconnects.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from disagg.control import ControlChannel, PeerClosed
from disagg.handshake import Weights, check_pair, hello, read_hello
from disagg.layout import Layout, LayoutMismatch, check_layouts
from disagg.sources import received
from disagg.transfer import TransferError, TransferTimeout, move_payload
from disagg.wire import (assemble, layout_from_wire, request_to_wire, start_transfer_server)
from drafter.kv_io import KVPayload
from drafter.request import Request, RequestError
from unified_kv import AdmissionError

log = logging.getLogger("disagg.remote")


class RemoteSource:
    """A generation engine's KV source: a context worker in another process.

    Args:
      address: the context server's control address.
      layout: this generation worker's layout (checked at every handshake).
      weights: fingerprints of this worker's weights (`Weights.of(params)`); the
        context's must match as the layout's mode needs (disagg.handshake).
      mesh: the generation engine's mesh; KV is pulled onto its first device
        and resharded onto it.
      timeout: seconds any single wait (connect, send, a pull) may take; the
        context reports progress every timeout / 4 seconds.
    """

    def __init__(self, address: str, layout: Layout, *, weights: Weights, mesh=None,
                 transfer_host: str = "127.0.0.1", timeout: float = 30.0):
        self.address, self.layout, self.mesh, self.timeout = address, layout, mesh, timeout
        self.weights = weights
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
            channel.send(hello("generation", self.layout, self.weights,
                               self.transfer.address(), keepalive_s=self.timeout / 4),
                         self.timeout)
            reply = channel.recv(self.timeout)
            check_pair(read_hello(reply, "context"), (self.layout, self.weights))
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
            if op == "progress":
                with self._lock:
                    held = [r for r in message.get("request_ids", ()) if r in self._outstanding]
                for request_id in held:
                    self._arrivals.put((request_id, None))
            elif op == "handoff":
                self._arrivals.put((request_id, None))  # the pull's own deadline starts
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
        return move_payload(received(payload, self.layout.mode), self.mesh)

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
