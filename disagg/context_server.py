"""The context side of a two-process pair: one context worker serving several generation peers.

    listener ── accept ──> handshake (disagg.handshake: KV format + weights, both sides check)
    peers p0, p1, ...  ── prefill {request} ──>  one ContextWorker (export Engine):
                                                 batched, chunked prefill of every
                                                 peer's requests; export_step
    p_k <── handoff {lengths, first token, pages, checksums, uuid} (KV offered for pull)
    p_k <── refused {request, error}       that request fails, alone
    p_k <── progress {request ids}         a heartbeat every keepalive_s: its requests here

One thread runs the engine and every peer's channel (select over all of
them; each ready channel is read until empty before the next step). A
keep-alive thread sends every greeted peer a heartbeat listing its requests
still queued or prefilling here, so a generation worker bounds its wait by
"nothing heard for `timeout`", never by the prefill's total time, and a
stopped or hung context (no heartbeats) is still found within `timeout`.
Requests of different peers may share ids: inside the engine each is named
"<peer>/<id>". A peer that closes, times out or misbehaves is dropped alone:
its requests are cancelled and their pages freed; the others keep running.
At most `max_peers` peers are served at once; one more is refused at its
handshake with an error naming the limit. Every wait has a timeout; an offer
nobody pulls expires after the peer's pull deadline (its hello's
`transfer_timeout_s`) plus `timeout`, so a peer whose pulls queue up still
finds each offer while its own deadline runs.
"""

from __future__ import annotations

import datetime
import logging
import math
import secrets
import select
import threading
import time

import jax
import numpy as np

from disagg.control import ControlChannel, Listener, PeerClosed
from disagg.handshake import check_eos_ids, check_pair, eos_ids_of, hello, read_hello
from disagg.kv_format import PairMismatch
from disagg.sources import ContextWorker
from disagg.transfer import TransferError
from disagg.wire import handoff_to_wire, request_from_wire, start_transfer_server
from drafter.request import RequestError
from unified_kv import AdmissionError

log = logging.getLogger("disagg.remote")

# A peer's failures that drop that peer alone (the server keeps serving the others).
PEER_FAULTS = (TransferError, PairMismatch, KeyError, TypeError, ValueError, AttributeError)


class _Peer:
    """One connected generation worker: its channel and the requests it has here."""

    def __init__(self, channel: ControlChannel, key: str, now: float):
        self.channel, self.key = channel, key
        self.lock = threading.Lock()   # the keep-alive thread sends too
        self.requests: set[str] = set()   # engine ids ("<key>/<id>") not yet answered
        self.greeted = False
        self.keepalive_s = 1.0
        self.offer_s = 1.0   # an offer's life: the peer's pull deadline plus `timeout`
        self.last_heard = now

    def send(self, message: dict, timeout: float) -> None:
        with self.lock:
            self.channel.send(message, timeout)


class ContextServer:
    """A ContextWorker behind a listener, serving several generation peers at once.

    Args:
      worker: the context worker (its engine is stepped by `serve`'s thread only).
      address: where to listen ("host:0" picks a port).
      timeout: seconds any single wait on a peer may take (a handshake, a send).
      idle_timeout: a peer with nothing here that sends nothing for this long
        is dropped.
      max_peers: peers served at once; one more is refused at its handshake.
    """

    def __init__(self, worker: ContextWorker, *, address: str = "127.0.0.1:0",
                 transfer_host: str = "127.0.0.1", timeout: float = 30.0,
                 idle_timeout: float = 3600.0, max_peers: int = 16):
        self.worker, self.timeout, self.idle_timeout = worker, timeout, idle_timeout
        self.max_peers = max_peers
        self.weights = worker.weights   # fingerprinted once, before anyone may connect
        self.transfer = start_transfer_server(transfer_host)
        self.listener = Listener(address)
        self.num_completed, self.errors = 0, []
        self._peers: dict[str, _Peer] = {}
        self._num_accepted = 0
        self._stop = threading.Event()

    @property
    def address(self) -> str:
        return self.listener.address

    def warm_up(self, num_tokens: int = 64) -> None:
        """Compile prefill and export of one prompt and of a burst of two (the shapes
        a first burst needs), with requests handed to nobody."""
        engine = self.worker.engine
        for burst in (1, 2):
            for k in range(burst):
                self.worker.submit(engine.make_request(f"warm-up-{burst}-{k}", [0] * num_tokens,
                                                       max_new_tokens=1))
            handoffs = []
            while len(handoffs) < burst:
                handoffs += self.worker.pump()[0]
            jax.block_until_ready([h.payload.buffers for h in handoffs])
            engine.run()

    def stop(self) -> None:
        """Ask `serve` to return (from another thread); it drops every peer first."""
        self._stop.set()

    # ------------------------------------------------------------ the loop

    def serve(self, max_connections: int | None = None) -> None:
        """Serve peers until `max_connections` have connected and left (None: until
        `stop`). The engine and every channel are touched by this thread only."""
        keepalive = threading.Thread(target=self._keepalive_loop, name="context-keepalive",
                                     daemon=True)
        keepalive.start()
        try:
            while not self._stop.is_set():
                accepting = max_connections is None or self._num_accepted < max_connections
                if not accepting and not self._peers:
                    return
                busy = self.worker.busy
                self._serve_channels(0.0 if busy else 0.05, accepting)
                if self.worker.busy:
                    self._pump()
                self._drop_idle_peers()
        finally:
            self._stop.set()
            for peer in list(self._peers.values()):
                self._drop_peer(peer, "the context server stopped")
            keepalive.join(self.timeout)

    def _serve_channels(self, wait: float, accepting: bool) -> None:
        for peer in list(self._peers.values()):
            if peer.channel.broken:   # a keep-alive send failed
                self._drop_peer(peer, "its channel broke")
        peers = {peer.channel.fileno(): peer for peer in self._peers.values()}
        waiting = list(peers) + ([self.listener.fileno()] if accepting else [])
        try:
            ready = select.select(waiting, [], [], wait)[0]
        except (OSError, ValueError):   # a channel closed meanwhile: dropped next round
            return
        for fd in ready:
            if fd not in peers:
                self._accept()
                continue
            self._read_peer(peers[fd])

    def _read_peer(self, peer: _Peer) -> None:
        """Act on every message waiting on the peer's channel."""
        try:
            while True:
                message = peer.channel.recv(self.timeout)
                peer.last_heard = time.monotonic()
                if not peer.greeted:
                    self._greet(peer, message)
                elif not self._handle(peer, message):
                    self._drop_peer(peer, None)
                    return
                if not peer.channel.poll(0):
                    return
        except PeerClosed:
            self._drop_peer(peer, None)   # the peer is done
        except PEER_FAULTS as e:
            self._drop_peer(peer, f"{type(e).__name__}: {e}")

    def _accept(self) -> None:
        channel = self.listener.accept(self.timeout)
        self._num_accepted += 1
        key = f"p{self._num_accepted}"
        if len(self._peers) >= self.max_peers:
            self._note(f"peer {channel.peer}: refused, {self.max_peers} peers are connected")
            try:
                channel.send({"op": "error", "error": f"the context worker at {self.address} "
                              f"serves at most {self.max_peers} generation peers at once and "
                              f"has {len(self._peers)}; retry later or start another context "
                              f"worker"}, self.timeout)
            except TransferError:
                pass
            channel.close()
            return
        self._peers[key] = _Peer(channel, key, time.monotonic())

    def _greet(self, peer: _Peer, message: dict) -> None:
        theirs = read_hello(message, "generation")
        mine = (self.worker.kv_format, self.weights)
        peer.send(hello("context", *mine, self.transfer.address(),
                        eos_token_ids=self.worker.eos_token_ids), self.timeout)
        check_pair(mine, theirs)
        check_eos_ids(self.worker.eos_token_ids, eos_ids_of(message))
        peer.keepalive_s = min(max(_seconds(message, "keepalive_s", self.timeout / 4), 0.05),
                               self.timeout)
        peer.offer_s = min(max(_seconds(message, "transfer_timeout_s", self.timeout), 0.0),
                           3600.0) + self.timeout
        peer.greeted = True
        log.info("generation peer %s connected (%s)", peer.channel.peer, peer.key)

    def _handle(self, peer: _Peer, message: dict) -> bool:
        """Act on one message; False when the peer said goodbye."""
        op = message.get("op")
        if op == "prefill":
            engine, wire_id = self.worker.engine, str(message.get("request_id"))
            try:
                request = request_from_wire({**message, "request_id": f"{peer.key}/{wire_id}"},
                                            vocab_size=engine.cfg.target.vocab_size,
                                            reserved_ids=engine.reserved_ids)
                self.worker.submit(request)
            except (RequestError, AdmissionError, TypeError) as e:
                self._refuse(peer, wire_id, e)
                return True
            with peer.lock:
                peer.requests.add(request.request_id)
            return True
        if op in ("stats", "close"):
            peer.send(self.stats(), self.timeout)
            return op != "close"
        raise TransferError(f"unknown control message op={op!r}")

    def _pump(self) -> None:
        """One engine step; each handoff and failure goes to the peer that asked."""
        handoffs, failed = self.worker.pump()
        for result in failed:
            peer, wire_id = self._owner(result.request_id)
            if peer is not None:
                self._safely(peer, self._refuse, wire_id, TransferError(result.error))
        for handoff in handoffs:
            peer, wire_id = self._owner(handoff.request_id)
            if peer is not None:   # else its peer left: the copies are dropped with it
                self._safely(peer, self._offer, wire_id, handoff)

    def _owner(self, engine_id: str) -> tuple[_Peer | None, str]:
        key, _, wire_id = engine_id.partition("/")
        peer = self._peers.get(key)
        if peer is not None:
            with peer.lock:
                peer.requests.discard(engine_id)
        return peer, wire_id

    def _safely(self, peer: _Peer, send, *args) -> None:
        try:
            send(peer, *args)
        except PEER_FAULTS as e:
            self._drop_peer(peer, f"{type(e).__name__}: {e}")

    def _refuse(self, peer: _Peer, request_id: str, error: BaseException) -> None:
        self._note(f"request {request_id!r} of peer {peer.channel.peer} refused: "
                   f"{type(error).__name__}: {error}")
        peer.send({"op": "refused", "request_id": request_id,
                   "error_type": type(error).__name__, "error": str(error)}, self.timeout)

    def _offer(self, peer: _Peer, request_id: str, handoff) -> None:
        payload = handoff.payload
        host = jax.device_get((payload.checksums, payload.first_token, payload.drafts,
                               payload.first_logprobs, payload.prompt_logprobs))
        uuid = secrets.randbits(62)   # single use: a fresh one per handoff
        pieces, message = handoff_to_wire(request_id, payload, host, uuid, handoff.kv_format)
        # The offer expires, so a vanished peer leaves nothing behind.
        expiry = datetime.datetime.now() + datetime.timedelta(seconds=peer.offer_s)
        self.transfer.await_pull(uuid, pieces, timeout=expiry)
        peer.send(message, self.timeout)
        self.num_completed += 1

    # ------------------------------------------------------------ peers

    def _drop_peer(self, peer: _Peer, error: str | None) -> None:
        """The peer is gone: end whatever it asked for (pages free on the next steps)."""
        if self._peers.pop(peer.key, None) is None:
            return
        if error:
            self._note(f"peer {peer.channel.peer}: {error}")
        with peer.lock:
            dropped, peer.requests = peer.requests, set()
            peer.channel.close()
        for engine_id in dropped:
            self.worker.engine.cancel(engine_id)
            self._note(f"request {engine_id.partition('/')[2]!r}: peer {peer.channel.peer} "
                       f"left before its handoff")

    def _drop_idle_peers(self) -> None:
        now = time.monotonic()
        for peer in list(self._peers.values()):
            limit = self.idle_timeout if peer.greeted else self.timeout
            if not peer.requests and now - peer.last_heard > limit:
                self._drop_peer(peer, "no hello within the timeout" if not peer.greeted else
                                f"no request within {self.idle_timeout:.0f}s; dropped")

    def _keepalive_loop(self) -> None:
        """A heartbeat to each greeted peer: which of its requests are still here
        (queued or prefilling), possibly none."""
        last: dict[str, float] = {}
        while not self._stop.wait(0.05):
            now = time.monotonic()
            for peer in list(self._peers.values()):
                if now - last.get(peer.key, 0.0) < peer.keepalive_s:
                    continue
                last[peer.key] = now
                with peer.lock:
                    ids = [i.partition("/")[2] for i in peer.requests]
                    if not peer.greeted or peer.channel.broken:
                        continue
                    try:
                        peer.channel.send({"op": "progress", "request_ids": ids},
                                          self.timeout)
                    except TransferError:
                        pass   # the serving thread finds the channel broken and drops it

    def stats(self) -> dict:
        engine = self.worker.engine
        while not engine.scheduler.num_unfinished and engine.has_work:
            self._pump()   # let pending slot resets land
        return {"op": "stats", "num_active": engine.num_active, "num_peers": len(self._peers),
                "free_pages": np.asarray(engine.state.kv.num_free).tolist(),
                "usable_pages": [p.num_usable_pages for p in engine.spec.pools],
                "reserved_pages": list(engine.admission.reserved_pages),
                "num_completed": self.num_completed, "errors": self.errors[-20:]}

    def _note(self, error: str) -> None:
        self.errors.append(error)
        log.warning(error)


def _seconds(message: dict, field: str, default: float) -> float:
    """A duration from a peer's hello: a finite number (ValueError naming it, else)."""
    value = message.get(field, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"the generation worker's hello has {field}={value!r}; it must be a "
                         f"finite number of seconds")
    return float(value)
