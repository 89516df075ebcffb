"""The two-process handshake and peer faults, with the context server in a thread of
this process (same sockets, transfer servers and messages as two processes; the
compiled steps are shared): weights fingerprints, a context without a drafter,
progress against the KV deadline, a silent peer, several peers on one context."""

import contextlib
import threading
import time

import jax
import numpy as np
import pytest

from disagg.context_server import ContextServer
from disagg.control import Listener
from disagg.handshake import (ModelMismatch, Weights, check_pair, check_weights, eos_ids_of,
                              hello, read_hello)
from disagg.kv_format import KVFormat, KVFormatMismatch, PairMismatch
from disagg.remote import RemoteSource
from disagg.sources import ContextWorker
from disagg.transfer import TransferError
from disagg.wire import start_transfer_server
from drafter.default import default_step_config
from drafter.engine import Engine
from models.checkpoint import fingerprint
from tests.disagg.disagg_pair import assert_all_free
from tests.disagg.test_remote import SOURCE, assert_context_all_free, serve
from tests.drafter.test_context import periodic_prompts

pytestmark = pytest.mark.timeout(240)
PROMPTS = periodic_prompts(n=3, length=40, seed=11)
MAX_NEW = 8


@pytest.fixture(scope="module")
def pair():
    params, cfg = SOURCE.load()
    return params, cfg, Weights.of(params, cfg)


@pytest.fixture(scope="module")
def meshes():
    """(generation mesh, context mesh): one device each."""
    devices = jax.devices()
    return tuple(jax.sharding.Mesh(np.array([d]), ("tp",)) for d in (devices[0], devices[-1]))


@pytest.fixture(scope="module")
def expected(pair, meshes):
    """Aggregated greedy output of PROMPTS."""
    params, cfg, _ = pair
    return [r.tokens for r in Engine(params, cfg, mesh=meshes[0]).generate(PROMPTS, MAX_NEW)]


@contextlib.contextmanager
def context_server(worker, **kwargs):
    """A ContextServer serving from a thread; stopped (every peer dropped) at exit."""
    server = ContextServer(worker, **kwargs)
    thread = threading.Thread(target=server.serve, name="test-context", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(30)
        server.listener.close()
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def shared_context(pair, meshes):
    params, cfg, _ = pair
    with context_server(ContextWorker(params, cfg, mesh=meshes[1]), timeout=30.0) as server:
        yield server


def generation(address, pair, mesh, *, mode="shared", timeout=30.0, weights=None):
    params, cfg, mine = pair
    source = RemoteSource(address, KVFormat.of(cfg.spec, mode), weights=weights or mine,
                          mesh=mesh, timeout=timeout)
    return Engine(params, cfg, mesh=mesh, kv_source=source, mode=mode,
                  kv_timeout_s=source.engine_timeout_s)


def perturbed(tree):
    """The same shapes, one value changed."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [leaves[0] + 1e-3] + leaves[1:])


def test_different_weights_are_refused_at_connect_naming_both_fingerprints(pair, meshes):
    params, cfg, mine = pair
    other_draft = {"target": params["target"], "draft": perturbed(params["draft"])}
    theirs = Weights.of(other_draft, cfg)
    assert theirs.target == mine.target and theirs.draft != mine.draft
    with context_server(ContextWorker(other_draft, cfg, mesh=meshes[1]), timeout=10.0) as server:
        start = time.monotonic()
        with pytest.raises(ModelMismatch, match=f"draft weights with fingerprint "
                                                f"{theirs.draft}, the generation worker "
                                                f"{mine.draft}.*same drafter"):
            generation(server.address, pair, meshes[0], timeout=10.0)
        assert time.monotonic() - start < 1.0
        deadline = time.monotonic() + 1.0   # the context refused it too, naming both
        while not any("ModelMismatch" in e for e in server.errors):
            assert time.monotonic() < deadline, server.errors
            time.sleep(0.01)
    private = KVFormat.of(cfg.spec, "private")   # the context's drafter is unused: accepted
    check_pair((private, theirs), (private, mine))
    other_target = Weights(fingerprint(perturbed(params["target"])), mine.draft)
    for mode in ("shared", "private"):
        with pytest.raises(ModelMismatch, match=f"target weights with fingerprint "
                                                f"{mine.target}, the generation worker "
                                                f"{other_target.target}.*same target"):
            check_weights(mine, other_target, mode)


def test_different_eos_ids_are_refused_at_connect_naming_both(pair, meshes):
    """The context draws each first token, which min_tokens keeps off the EOS ids: two
    workers that know different ones are refused on both sides, naming both."""
    params, cfg, mine = pair
    worker = ContextWorker(params, cfg, mesh=meshes[1], eos_token_ids=(5, 3))
    with context_server(worker, timeout=10.0) as server:
        with pytest.raises(PairMismatch, match=r"the context worker's ids are \[3, 5\], the "
                                               r"generation worker's \[\].*same tokenizer"):
            generation(server.address, pair, meshes[0], timeout=10.0)
        deadline = time.monotonic() + 1.0
        while not any("end-of-sequence mismatch" in e for e in server.errors):
            assert time.monotonic() < deadline, server.errors
            time.sleep(0.01)
    assert eos_ids_of({}) == () and eos_ids_of({"eos_token_ids": [7, 2]}) == (2, 7)
    for bad in (0, "", [1.0], {"a": 1}):   # not read as "none"
        with pytest.raises(TransferError, match="must be a list of token ids"):
            eos_ids_of({"eos_token_ids": bad})


def test_target_only_context_serves_private_generation_and_refuses_shared(pair, meshes,
                                                                          expected):
    """The no-drafter context: private mode equals aggregated greedy output (acceptance
    may be lower); shared mode is refused at connect, naming the fix."""
    params, cfg, mine = pair
    target_cfg = default_step_config(cfg.target, None, num_slots=SOURCE.num_slots,
                                     max_seq_len=SOURCE.max_seq_len,
                                     memory_budget_bytes=SOURCE.kv_memory_mib << 20)
    worker = ContextWorker({"target": params["target"]}, target_cfg, mesh=meshes[1],
                           mode="private")
    assert worker.weights.draft is None
    with context_server(worker, timeout=30.0) as server:
        start = time.monotonic()
        with pytest.raises(KVFormatMismatch, match="has no drafter.*--draft-kv private"):
            generation(server.address, pair, meshes[0], mode="shared")
        assert time.monotonic() - start < 1.0
        engine = generation(server.address, pair, meshes[0], mode="private")
        results = engine.generate(PROMPTS, MAX_NEW)
        assert [r.tokens for r in results] == expected
        assert all(r.ok for r in results)
        assert_all_free(engine)
        assert_context_all_free(engine.kv_source.close())


class SlowPrefill:
    """A context worker whose next step takes `seconds` (a long prefill or compile)."""

    def __init__(self, worker, seconds):
        self.worker, self.seconds = worker, seconds

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def pump(self):
        if self.seconds:
            time.sleep(self.seconds)
            self.seconds = 0
        return self.worker.pump()


def test_progress_keeps_a_slow_prefill_alive_and_a_silent_peer_is_found(pair, meshes,
                                                                        expected):
    params, cfg, mine = pair
    # A prefill step 3x longer than the timeout (compiles included): keep-alives carry it.
    slow = SlowPrefill(ContextWorker(params, cfg, mesh=meshes[1]), 3.0)
    with context_server(slow, timeout=1.0) as server:
        engine = generation(server.address, pair, meshes[0], timeout=1.0)
        start = time.monotonic()
        results = serve(engine, [("slow", PROMPTS[0])], MAX_NEW)
        assert time.monotonic() - start > 3.0
        assert results["slow"].ok, results["slow"].error
        assert results["slow"].tokens == expected[0]
        assert_all_free(engine)
        assert_context_all_free(engine.kv_source.close())

    # A peer that answers the handshake, then says nothing: found within the timeout.
    listener, transfer = Listener("127.0.0.1:0"), start_transfer_server("127.0.0.1")
    def silent():
        channel = listener.accept(10.0)
        kv_format, weights = read_hello(channel.recv(10.0), "generation")
        channel.send(hello("context", kv_format, weights, transfer.address()), 10.0)
        time.sleep(4.0)   # reads nothing, sends nothing
        channel.close()
    thread = threading.Thread(target=silent, daemon=True)
    thread.start()
    engine = generation(listener.address, pair, meshes[0], timeout=1.0)
    start = time.monotonic()
    results = serve(engine, [("lost", PROMPTS[0])], MAX_NEW)
    assert "'lost'" in results["lost"].error and "within 1.0s" in results["lost"].error
    assert 1.0 <= time.monotonic() - start < 2.0
    assert_all_free(engine)
    assert engine.kv_source.close() is None   # nobody answers: no stats, no hang
    thread.join(10)
    listener.close()


def test_several_generation_peers_share_one_context(pair, meshes, expected, shared_context):
    """Two generation workers connected at once, their requests (same ids) interleaved."""
    engines = [generation(shared_context.address, pair, meshes[0]) for _ in range(2)]
    for k, engine in enumerate(engines):
        for i in range(k, len(PROMPTS)):
            engine.submit(engine.make_request(f"r{i}", PROMPTS[i], max_new_tokens=MAX_NEW))
    done = [{}, {}]
    deadline = time.monotonic() + 120
    while any(e.has_work for e in engines) and time.monotonic() < deadline:
        for engine, out in zip(engines, done):
            out.update({r.request_id: r for r in engine.step()})
    for k, out in enumerate(done):
        assert {rid: r.tokens for rid, r in out.items()} == {
            f"r{i}": expected[i] for i in range(k, len(PROMPTS))}
    stats = [e.kv_source.stats() for e in engines]
    assert stats[0]["num_peers"] == 2
    for engine in engines:
        assert_all_free(engine)
        assert_context_all_free(engine.kv_source.close())


def test_a_peer_over_the_limit_is_refused_by_name(pair, meshes):
    params, cfg, mine = pair
    with context_server(ContextWorker(params, cfg, mesh=meshes[1]), max_peers=1,
                        timeout=5.0) as server:
        first = RemoteSource(server.address, KVFormat.of(cfg.spec, "shared"), weights=mine,
                             timeout=5.0)
        start = time.monotonic()
        with pytest.raises(TransferError, match="serves at most 1 generation peers"):
            RemoteSource(server.address, KVFormat.of(cfg.spec, "shared"), weights=mine,
                         timeout=5.0)
        assert time.monotonic() - start < 1.0
        first.close()
