"""A peer that does not speak the control protocol, on either side of the two-process pair:
its fault is named and stays its own (the other peers and the reader threads keep going),
and no wait on it blocks the generation engine's thread. Fake peers, no model."""

from __future__ import annotations

import datetime
import secrets
import socket
import struct
import threading
import time
import types

import jax.numpy as jnp
import numpy as np
import pytest

from disagg.context_server import ContextServer
from disagg.control import ControlChannel, Listener, PeerClosed
from disagg.handshake import Weights, hello, read_hello
from disagg.kv_format import KVFormat
from disagg.remote import RemoteSource
from disagg.transfer import TransferError, TransferTimeout
from disagg.wire import kv_format_to_wire, start_transfer_server
from drafter.request import SamplingParams
from drafter.sampling import LOGPROB_WIDTH

FORMAT = KVFormat(page_size=16, num_target_layers=1, num_draft_layers=0,
                  layers=(("t0", "target", 1, 8, "bfloat16", None, 1.0, 1.0),),
                  mode="private", pools=(("t0",),))
WEIGHTS = Weights("abc", None)


def request(rid: str):
    return types.SimpleNamespace(request_id=rid, prompt=[1, 2, 3, 4], params=SamplingParams())


def raw_frame(channel: ControlChannel, body: bytes) -> None:
    channel._sock.sendall(struct.pack("!I", len(body)) + body)


class FakeContext:
    """Greets each generation peer as a context worker would, then runs `behave(self, ch)`."""

    def __init__(self, behave, connections: int = 1):
        self.listener = Listener("127.0.0.1:0")
        self.transfer = start_transfer_server("127.0.0.1")
        self.address = self.listener.address

        def run():
            for _ in range(connections):
                channel = self.listener.accept(30.0)
                read_hello(channel.recv(10.0), "generation")
                channel.send(hello("context", FORMAT, WEIGHTS, self.transfer.address()), 10.0)
                threading.Thread(target=behave, args=(self, channel), daemon=True).start()
        threading.Thread(target=run, daemon=True).start()


def heartbeats(channel, ids=()):
    while True:
        time.sleep(0.2)
        try:
            channel.send({"op": "progress", "request_ids": list(ids)}, 1.0)
        except TransferError:
            return


def errors_within(source: RemoteSource, seconds: float, expect: set | None = None) -> dict:
    """Errors the source's polls give within `seconds`: until the first (or, given
    `expect`, until every expected request's) has come."""
    out, end = {}, time.monotonic() + seconds
    while time.monotonic() < end and (not out if expect is None else not expect <= set(out)):
        for rid, item in source.poll(0.05):
            if isinstance(item, BaseException):
                out[rid] = item
    return out


@pytest.mark.parametrize("body, problem", [(b"[]", "is a JSON list, not an object"),
                                           (b"{not json", "is not JSON")])
def test_a_frame_that_is_not_a_json_object_is_refused_by_name_and_drops_the_channel(body, problem):
    listener = Listener("127.0.0.1:0")
    client = ControlChannel.connect(listener.address, timeout=1.0)
    server = listener.accept(timeout=1.0)
    raw_frame(client, body)
    with pytest.raises(TransferError, match=f"sent a control message that {problem}"):
        server.recv(timeout=1.0)
    assert server.broken
    with pytest.raises(PeerClosed):   # the peer sees EOF
        client.recv(timeout=1.0)
    listener.close()


def test_a_malformed_message_fails_its_requests_by_name_and_the_reader_goes_on():
    def behave(fake, channel):
        channel.recv(10.0)                     # r0's prefill
        raw_frame(channel, b'{"op": "progress", "request_ids": 7}')   # not a list
        heartbeats(channel, ["r0"])
    source = RemoteSource(FakeContext(behave).address, FORMAT, weights=WEIGHTS, timeout=1.0)
    try:
        source.fetch(request("r0"))
        errors = errors_within(source, 3.0)
        assert list(errors) == ["r0"]
        assert "sent a message this worker cannot read" in str(errors["r0"])
        assert source._threads[0].is_alive() and not source._outstanding
    finally:
        source.close()


@pytest.mark.parametrize("bad", [{"drafts": ["x"]},
                                 {"drafts": [1, 2, 3], "first_logprobs": [0.5, "x"]},
                                 {"drafts": [1, 2, 3], "prompt_logprobs": "AAAAAA=="},
                                 {"drafts": [1, 2, 3], "prompt_logprobs": "not base64!"}],
                         ids=["drafts", "first_logprobs", "prompt_logprobs", "not_base64"])
def test_a_handoff_that_cannot_be_read_after_its_pull_fails_its_request_by_name(bad):
    def behave(fake, channel):
        prefill = channel.recv(10.0)
        uuid = secrets.randbits(62)
        fake.transfer.await_pull(uuid, [jnp.arange(4, dtype=jnp.float32)],
                                 timeout=datetime.datetime.now() + datetime.timedelta(seconds=30))
        channel.send({"op": "handoff", "request_id": prefill["request_id"], "target_len": 4,
                      "draft_ctx_len": 4, "first_token": 1, **bad, "mode": "private",
                      "uuid": uuid, "kv_format": kv_format_to_wire(FORMAT),
                      "pools": [{"pool_id": 0, "logical_pages": [0], "checksum": 0,
                                 "shape": [4], "dtype": "float32", "shards": [[[0, 4]]]}]}, 5.0)
        heartbeats(channel)
    source = RemoteSource(FakeContext(behave).address, FORMAT, weights=WEIGHTS, timeout=1.0)
    try:
        source.fetch(request("r0"))
        errors = errors_within(source, 5.0)
        assert "r0" in errors, "the unreadable handoff vanished"
        assert "its handoff from the context worker" in str(errors["r0"])
        assert "could not be received" in str(errors["r0"]) and not source._outstanding
        if "first_logprobs" in bad:
            assert (f"first_logprobs must be {LOGPROB_WIDTH} i32 bit patterns"
                    in str(errors["r0"]))
        if bad.get("prompt_logprobs") == "AAAAAA==":   # one i32, for a 4-token prompt's rows
            assert (f"prompt_logprobs hold 1 i32 values; a 4-token prompt's are "
                    f"3 x {LOGPROB_WIDTH}") in str(errors["r0"])
        elif "prompt_logprobs" in bad:
            assert "prompt_logprobs are not base64 i32 bits" in str(errors["r0"])
    finally:
        source.close()


def test_reconnecting_to_a_hung_context_does_not_block_the_engine_and_names_the_hang():
    def behave(fake, channel):
        time.sleep(0.2)
        channel.close()                         # the context dies ...
    fake = FakeContext(behave)
    source = RemoteSource(fake.address, FORMAT, weights=WEIGHTS, timeout=1.0)
    try:
        deadline = time.monotonic() + 3.0
        while not source.channel.broken and time.monotonic() < deadline:
            time.sleep(0.02)
        assert source.channel.broken
        fake.listener.close()                   # ... and a hung one takes its address:
        port = int(fake.address.rsplit(":", 1)[1])   # connects complete, nothing answers
        hung = socket.create_server(("127.0.0.1", port))
        start = time.monotonic()
        source.fetch(request("r1"))
        source.fetch(request("r2"))
        assert time.monotonic() - start < 0.3   # the engine's thread went on decoding
        errors = errors_within(source, 3.0, expect={"r1", "r2"})
        assert set(errors) == {"r1", "r2"}
        for error in errors.values():
            assert isinstance(error, TransferTimeout)
            assert f"the context worker at {fake.address} did not answer" in str(error)
            assert "stopped or hung" in str(error)
        hung.close()
    finally:
        source.close()


def test_a_bad_timeout_is_refused_before_connecting():
    with pytest.raises(ValueError, match=r"transfer_timeout=nan: give a finite number"):
        RemoteSource("127.0.0.1:1", FORMAT, weights=WEIGHTS, transfer_timeout=float("nan"))


class OneHandoff:
    """A context worker stand-in: one handoff for `request_id` once `go` is set."""
    weights, kv_format, busy, eos_token_ids = WEIGHTS, FORMAT, False, ()

    def __init__(self, request_id: str):
        self.request_id = request_id

    def pump(self):
        self.busy = False
        payload = types.SimpleNamespace(
            checksums=jnp.zeros(1, jnp.uint32), first_token=jnp.int32(1),
            drafts=jnp.zeros(2, jnp.int32), pool_ids=(0,),
            logical_pages=(np.zeros(1, np.int32),), buffers=(jnp.zeros(4),), target_len=4,
            draft_ctx_len=4, mode="private")
        return [types.SimpleNamespace(request_id=self.request_id, payload=payload,
                                      kv_format=FORMAT)], []


@pytest.mark.parametrize("stray", ["frame", "nan_hello"])
def test_a_stray_peer_is_dropped_alone_and_the_context_serves_on(stray):
    worker = OneHandoff("p2/r0")   # a handoff for the stray peer, once it is greeted
    server = ContextServer(worker, timeout=2.0)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    healthy = RemoteSource(server.address, FORMAT, weights=WEIGHTS, timeout=2.0)   # p1
    try:
        bad = ControlChannel.connect(server.address, 2.0)                          # p2
        if stray == "frame":
            raw_frame(bad, b"[]")
        else:
            bad.send(hello("generation", FORMAT, WEIGHTS, "127.0.0.1:1",
                           transfer_timeout_s=float("nan")), 2.0)
            worker.busy = True
        deadline = time.monotonic() + 3.0
        while "p2" not in server._peers and time.monotonic() < deadline:
            time.sleep(0.01)
        while "p2" in server._peers and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)   # the stray's handoff, if any, was pumped meanwhile
        assert "p2" not in server._peers, "the stray peer was kept"
        assert thread.is_alive(), "one stray peer stopped the context server"
        assert "p1" in server._peers and not healthy.channel.broken
        bad.close()
    finally:
        healthy.close()
        server.stop()
        thread.join(10)
        server.listener.close()


def test_every_sampling_field_crosses_the_wire_and_a_bad_one_is_refused_by_name():
    """A request's parameters reach the other process as JSON and come back equal
    (penalties, logit bias pairs, truncation, stops, log-probabilities); a peer's bad
    value is refused naming the field, as the front ends refuse it."""
    import json

    from disagg.wire import request_from_wire, request_to_wire
    from drafter.request import Request, RequestError
    params = SamplingParams(9, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1,
                            presence_penalty=-0.5, frequency_penalty=1.25,
                            repetition_penalty=1.3, seed=3,
                            stop_token_ids=(4, 6), ignore_eos=True, min_tokens=2, logprobs=2,
                            prompt_logprobs=3, include_stop_str_in_output=True,
                            logit_bias={7: -100, 0: 2.5})
    request = Request.make("r", [1, 2, 3], params, vocab_size=64)
    message = json.loads(json.dumps(request_to_wire(request)))
    assert request_from_wire(message, vocab_size=64) == request
    message["params"]["logit_bias"] = [[7, 1.0], [7, 2.0]]
    with pytest.raises(RequestError, match="twice") as e:
        request_from_wire(message, vocab_size=64)
    assert e.value.field == "logit_bias"
