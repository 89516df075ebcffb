"""Context and generation workers in separate OS processes: the generation side.

    context process                                    generation process
    ContextServer (disagg.context_server)              Engine + RemoteSource (KV source)
      listener  <-- hello {kv_format, weights, --------  connect (reconnects after a drop)
                         transfer address, keepalive_s,
                         transfer_timeout_s}
      check     --- hello {kv_format, weights, ...} -->  check (disagg.handshake)
                <---- prefill {request} (as admitted) -----  fetch: room already reserved here
      batched, chunked prefill; export_step;
      await_pull(uuid, shards)
                ----- progress {request ids} --------->  heartbeat: the listed ids wait on
                ----- handoff {lengths, first token, ----->  pull thread: pull(uuid) ->
                       logical pages, checksums, uuid}        KVPayload -> poll() -> import_step
                ===== KV shards: jax.experimental.transfer =>
                ----- refused {request, error} ----------->  that request fails, alone

The control channel (disagg.control) carries metadata only. Requests from
the stream are pipelined: the generation side sends each admitted request at
once, the context batches whatever is waiting into its prefill steps; a
reader thread reads the channel and a pull thread pulls each handoff in turn,
while the generation engine keeps decoding.
The context frees a request's pages as soon as its export is dispatched (the
offered buffers are copies), so no page is held across the wire; an offer
nobody pulls expires (see Deadlines).

Deadlines (every wait has one):
  - the context sends each peer a heartbeat every timeout / 4 seconds listing
    that peer's requests it holds (queued or prefilling), so a long prefill
    never times out. A channel silent for `timeout` while a request waits on it
    (counted from the later of its last message and the request's send; pulls
    included) means the context is stopped or hung: the channel is dropped,
    every request on it fails naming the peer, and the next request reconnects.
  - a request the heartbeats listed and then stopped listing, with neither a
    handoff nor a refusal within `timeout`, fails naming the peer.
  - a pull not finished `transfer_timeout` after its handoff arrived while the
    peer keeps sending heartbeats (a stuck transfer) fails naming the transfer
    server. The context keeps each offer that long plus `timeout` (the hello
    tells it), so pulls queued behind others still find their offers.
  - a dropped channel (the peer died or closed) fails the requests on it whose
    KV is not all here, by name; the next request reconnects (off the engine's
    thread: requests fetched meanwhile wait for it), and one that cannot within
    `timeout` fails naming the address to restart.
  - a message that is not the protocol's (not a JSON object, a field of the wrong
    type) drops the channel like a lost peer, naming what could not be read.
The engine's own deadline (`engine_timeout_s`, given to `Engine.kv_timeout_s`)
lies past these, a backstop: the source names every fault first.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

import jax

from disagg.control import ControlChannel, PeerClosed
from disagg.handshake import Weights, check_eos_ids, check_pair, eos_ids_of, hello, read_hello
from disagg.kv_format import KVFormat, PairMismatch, check_kv_formats
from disagg.sources import received
from disagg.transfer import TransferError, TransferTimeout, move_payload
from disagg.wire import (Pulls, kv_format_from_wire, payload_from_wire, request_to_wire,
                         start_transfer_server)
from drafter.kv_io import KVPayload
from drafter.request import Request, RequestError
from unified_kv import AdmissionError

log = logging.getLogger("disagg.remote")


class PeerHung(TransferTimeout):
    """The context worker sent nothing for `timeout` while requests waited on it."""


@dataclasses.dataclass
class _Wait:
    """A request sent to the context and not yet answered."""

    sent: float                   # when it was sent
    listed: float | None = None   # when a heartbeat last listed it
    pulling: bool = False         # its handoff arrived


class RemoteSource:
    """A generation engine's KV source: a context worker in another process.

    Args:
      address: the context server's control address.
      kv_format: this generation worker's KV format (checked at every handshake).
      weights: fingerprints of this worker's weights (`Weights.of(params, cfg)`); the
        context's must match as the KV format's mode needs (disagg.handshake).
      eos_token_ids: this worker's end-of-sequence ids; the context's must be the same.
      mesh: the generation engine's mesh; KV is pulled onto its first device
        and resharded onto it.
      timeout: seconds any single wait (connect, send, a reply, the peer's
        silence) may take; the context sends a heartbeat every timeout / 4 seconds.
      transfer_timeout: seconds from a handoff to the end of its pull while the
        peer stays alive (default 4 * timeout).
    """

    def __init__(self, address: str, kv_format: KVFormat, *, weights: Weights, mesh=None,
                 transfer_host: str = "127.0.0.1", timeout: float = 30.0,
                 transfer_timeout: float | None = None, eos_token_ids=()):
        for name, value in (("timeout", timeout), ("transfer_timeout", transfer_timeout)):
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"RemoteSource {name}={value!r}: give a finite number of "
                                 f"seconds above 0")
        self.address, self.kv_format, self.mesh, self.timeout = address, kv_format, mesh, timeout
        self.transfer_timeout = transfer_timeout or 4 * timeout
        self.weights, self.eos_token_ids = weights, tuple(eos_token_ids)
        self.pull_device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
        self.transfer = start_transfer_server(transfer_host)
        self.bytes_pulled, self.pull_seconds = 0, 0.0
        self._arrivals: queue.Queue = queue.Queue()
        self._replies: queue.Queue = queue.Queue()
        self._handoffs: queue.Queue = queue.Queue()   # (channel, message, deadline)
        self._outstanding: dict[str, _Wait] = {}
        self._unsent: list[tuple[str, dict]] = []   # (request id, prefill) awaiting a channel
        self._reconnecting = False
        self._heard = time.monotonic()   # when the channel last carried a message
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.channel = None
        self._connect()
        self._threads = [threading.Thread(target=loop, name=name, daemon=True) for loop, name
                         in ((self._read_loop, "remote-reader"), (self._pull_loop, "remote-pulls"))]
        for thread in self._threads:
            thread.start()

    def _connect(self) -> None:
        # A first connection waits for a peer still starting; a reconnection fails at
        # once on a refusal (the peer is gone).
        channel = ControlChannel.connect(self.address, self.timeout,
                                         retry_refused=self.channel is None)
        try:
            channel.send(hello("generation", self.kv_format, self.weights,
                               self.transfer.address(), keepalive_s=self.timeout / 4,
                               transfer_timeout_s=self.transfer_timeout,
                               eos_token_ids=self.eos_token_ids),
                         self.timeout)
            reply = channel.recv(self.timeout)
            check_pair(read_hello(reply, "context"), (self.kv_format, self.weights))
            check_eos_ids(eos_ids_of(reply), self.eos_token_ids)
        except BaseException:
            channel.close()
            raise
        self.peer_transfer_address = reply["transfer_address"]
        self._pulls = Pulls(self.transfer, self.peer_transfer_address,
                            f"the context worker at {self.address}")
        self._heard = time.monotonic()
        self.channel = channel

    @property
    def engine_timeout_s(self) -> float:
        """The deadline to give the engine (`Engine.kv_timeout_s`): a backstop past
        this source's own, so the source's errors (naming the peer) come first."""
        return 2 * self.timeout + 1.0

    # ------------------------------------------------------------ KVSource

    def fetch(self, request: Request) -> None:
        rid, prefill = request.request_id, {"op": "prefill", **request_to_wire(request)}
        with self._lock:   # waiting from here on: `_fail` ends only waiting requests
            self._outstanding[rid] = _Wait(time.monotonic())
            channel = self.channel
            if channel is None or channel.broken:
                # The peer may have restarted. Reconnecting waits up to `timeout` on a
                # hung peer, so it runs off the engine's thread (whose batch keeps
                # decoding); requests fetched meanwhile go once it is done.
                self._unsent.append((rid, prefill))
                if self._reconnecting:
                    return
                self._reconnecting, channel = True, None
        if channel is None:
            threading.Thread(target=self._reconnect, name="remote-reconnect",
                             daemon=True).start()
        else:
            self._send_prefill(channel, rid, prefill)

    def _send_prefill(self, channel, request_id: str, prefill: dict) -> None:
        try:
            channel.send(prefill, self.timeout)
        except TransferError as e:
            self._fail(request_id, self._unreachable(e))

    def _reconnect(self) -> None:
        error = None
        try:
            self._connect()
        except PairMismatch as e:
            error = e
        except TransferError as e:
            error = self._unreachable(e)
        except Exception as e:  # noqa: BLE001 - a malformed reply: fail what waits, by name
            error = TransferError(f"the context worker at {self.address} answered the "
                                  f"reconnection with something unreadable ({e!r}): not a "
                                  f"worker of this project?")
        with self._lock:
            unsent, self._unsent, self._reconnecting = self._unsent, [], False
        for request_id, prefill in unsent:
            if error is not None:
                self._fail(request_id, error)
            else:
                self._send_prefill(self.channel, request_id, prefill)

    def _unreachable(self, e: TransferError) -> TransferError:
        if isinstance(e, TransferTimeout):
            return TransferTimeout(
                f"the context worker at {self.address} did not answer ({e}): it is stopped "
                f"or hung, or the address is unreachable; check or restart that process: "
                f"each later request reconnects")
        return type(e)(f"the context worker at {self.address} cannot be reached ({e}); "
                       f"start it there again: each later request reconnects")

    def poll(self, timeout: float) -> list:
        out = []
        try:
            out.append(self._arrivals.get(timeout=timeout) if timeout > 0
                       else self._arrivals.get_nowait())
            while True:
                out.append(self._arrivals.get_nowait())
        except queue.Empty:
            return out

    def unavailable(self) -> str | None:
        """Why a request sent now would fail, or None: the channel to the context worker
        is down (reconnected from here, off the caller's thread, so a worker that comes
        back is found without a request), or no heartbeat came within `timeout` (it is
        stopped or hung). A server's health check reports it."""
        with self._lock:
            if self.channel is None or self.channel.broken:
                if not self._reconnecting:
                    self._reconnecting = True
                    threading.Thread(target=self._reconnect, name="remote-reconnect",
                                     daemon=True).start()
                return f"the context worker at {self.address} cannot be reached (reconnecting)"
        if time.monotonic() - self._heard > self.timeout:
            return (f"the context worker at {self.address} sent nothing within "
                    f"{self.timeout:.1f}s (no heartbeat): it is stopped or hung")
        return None

    # ------------------------------------------------------------ control

    def stats(self) -> dict:
        """The context worker's page counts and failures (reconnecting if the channel
        was dropped)."""
        if self.channel is None or self.channel.broken:
            self._connect()
        while not self._replies.empty():   # a late answer to an earlier call
            self._replies.get_nowait()
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
            for thread in self._threads:
                thread.join(self.timeout)
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
        """End one waiting request with `error`; the first fault found is the one told
        (a request that already ended, or was claimed, is left alone)."""
        with self._lock:
            waiting = self._outstanding.pop(request_id, None) is not None
        if waiting:
            self._arrivals.put((request_id, error))

    def _claim(self, request_id: str) -> bool:
        """Its KV is all here: no fault of the peer can end it now (False: it ended)."""
        with self._lock:
            return self._outstanding.pop(request_id, None) is not None

    def _lose_channel(self, channel, error: BaseException) -> None:
        """Drop `channel` (the peer sees EOF and cancels what it holds of ours) and
        fail every request waiting on it."""
        with self._lock:   # before the close: the pull thread then sees them ended
            lost, self._outstanding = list(self._outstanding), {}
        channel.close()
        for request_id in lost:
            self._arrivals.put((request_id, error))

    def _check_silence(self, channel) -> None:
        """Fail what the peer has left waiting for `timeout` (see Deadlines)."""
        now = time.monotonic()
        with self._lock:
            waiting = list(self._outstanding.items())
        if any(now - max(self._heard, w.sent) > self.timeout for _, w in waiting):
            self._lose_channel(channel, PeerHung(
                f"the context worker at {self.address} sent nothing within "
                f"{self.timeout:.1f}s (no heartbeat): it is stopped or hung; check or "
                f"restart that process (the connection is dropped, the next request "
                f"reconnects)"))
            return
        for request_id, wait in waiting:
            if not wait.pulling and wait.listed is not None and now - wait.listed > self.timeout:
                self._fail(request_id, TransferTimeout(
                    f"the context worker at {self.address} stopped listing it as in "
                    f"progress and sent neither its handoff nor a refusal within "
                    f"{self.timeout:.1f}s: it dropped the request (see that worker's log)"))

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            channel = self.channel
            if channel is None or channel.broken:
                time.sleep(0.01)
                continue
            try:
                if not channel.poll(0.05):
                    self._check_silence(channel)
                    continue
                message = channel.recv(self.timeout)
            except TransferError as e:
                self._lose_channel(channel, PeerClosed(
                    f"the context worker at {self.address} was lost ({e}); if it died, "
                    f"start it again: the next request reconnects"))
                continue
            now = self._heard = time.monotonic()
            try:
                self._on_message(channel, message, now)
            except Exception as e:  # noqa: BLE001 - a malformed message: not this protocol
                self._lose_channel(channel, TransferError(
                    f"the context worker at {self.address} sent a message this worker "
                    f"cannot read ({e!r}): not a worker of this project, or another "
                    f"version? The connection is dropped; the next request reconnects"))

    def _on_message(self, channel, message: dict, now: float) -> None:
        op, request_id = message.get("op"), message.get("request_id")
        if op == "progress":   # a heartbeat: every request it does not end waits on
            ids = set(message.get("request_ids", ()))
            with self._lock:
                alive = [r for r, w in self._outstanding.items()
                         if r in ids or w.pulling or w.listed is None]  # None: unread
                for request_id in ids.intersection(alive):
                    self._outstanding[request_id].listed = now
            for request_id in alive:
                self._arrivals.put((request_id, None))
        elif op == "handoff":
            with self._lock:
                if request_id not in self._outstanding:
                    return   # failed meanwhile: its offer expires over there
                self._outstanding[request_id].pulling = True
            self._arrivals.put((request_id, None))
            self._handoffs.put((channel, message, now + self.transfer_timeout))
        elif op == "refused":
            error = {"AdmissionError": AdmissionError,
                     "RequestError": RequestError}.get(message.get("error_type"),
                                                       TransferError)
            self._fail(request_id, error(f"the context worker refused request "
                                         f"{request_id!r}: {message.get('error')}"))
        elif op == "stats":
            self._replies.put(message)

    def _pull_loop(self) -> None:
        while not self._stop.is_set():
            try:
                channel, message, deadline = self._handoffs.get(timeout=0.05)
            except queue.Empty:
                continue
            request_id = message["request_id"]
            with self._lock:
                if request_id not in self._outstanding:
                    continue   # its peer was lost meanwhile
            try:
                payload = self._pull(message, channel, deadline)
            except TransferError as e:
                self._fail(request_id, e)
                continue
            except Exception as e:  # noqa: BLE001 - any failure is this request's alone
                self._fail(request_id, TransferError(
                    f"request {request_id!r}: its handoff from the context worker at "
                    f"{self.address} could not be received: {e!r}"))
                continue
            if payload is not None:
                self._arrivals.put((request_id, payload))

    def _pull(self, message: dict, channel, deadline: float) -> KVPayload | None:
        """Pull a handoff's KV shards onto `pull_device`, then onto the mesh (None:
        the request ended meanwhile)."""
        request_id = message["request_id"]
        check_kv_formats(kv_format_from_wire(message["kv_format"]), self.kv_format)
        start = time.perf_counter()
        pieces = self._pulls.pull(message, self.pull_device)
        self._pulls.wait(pieces, abandoned=lambda: channel.broken, deadline=deadline,
                         timeout_s=self.transfer_timeout)
        seconds, nbytes = time.perf_counter() - start, sum(p.nbytes for p in pieces)
        payload = payload_from_wire(message, pieces, f"the context worker at {self.address}")
        payload = move_payload(received(payload, self.kv_format.mode), self.mesh)
        # Claimed only once built: a handoff that cannot be read fails its request (`_fail`
        # ends only requests still waiting), by name, instead of vanishing.
        if not self._claim(request_id):
            return None
        self.pull_seconds += seconds
        self.bytes_pulled += nbytes
        return payload
