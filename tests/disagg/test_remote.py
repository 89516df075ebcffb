"""Context and generation in separate OS processes over loopback: KV through
jax.experimental.transfer, metadata through the control channel, a timeout on
every wait, pages freed on both sides whatever happens."""

import dataclasses
import json
import os
import signal
import time

import jax
import numpy as np
import pytest

from disagg.__main__ import main
from disagg.control import ControlChannel, Listener, PeerClosed
from disagg.layout import Layout, LayoutMismatch
from disagg.processes import ContextProcess
from disagg.remote import (PairSource, RemoteContext, RemotePair, assemble, layout_from_wire,
                           layout_to_wire, split_shards)
from disagg.transfer import TransferError
from disagg.workers import GenerationWorker, TransferTimeout
from drafter.engine import Engine
from tests.drafter.test_context import PAIR, periodic_prompts

# The shipped tiny copy pair with the default cache (fp8 target KV, bf16 draft KV).
SOURCE = PairSource(str(PAIR), num_slots=3, max_seq_len=256, kv_memory_mib=16)
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pair():
    return SOURCE.load()


@pytest.fixture(scope="module")
def child_env(tmp_path_factory):
    """Context processes share a compilation cache: a later child skips the compiles."""
    cache = tmp_path_factory.mktemp("jax_cache")
    return {"JAX_COMPILATION_CACHE_DIR": str(cache),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.2"}


@pytest.fixture(scope="module")
def context(tmp_path_factory, child_env):
    """A healthy TP2 context worker process (it corrupts requests named 'bad')."""
    log = tmp_path_factory.mktemp("remote") / "context.log"
    with ContextProcess(SOURCE, log, tp=2, extra_args=["--corrupt-request", "bad", "--warmup"],
                        extra_env=child_env) as proc:
        yield proc


@pytest.fixture(scope="module")
def mesh():
    """The generation side's mesh; aggregated runs on it too, so both share compiles."""
    return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))


def free_pages(worker):
    return np.asarray(worker.engine.state.kv.num_free).tolist()


def all_free(worker):
    return [p.num_usable_pages for p in worker.engine.spec.pools]


def assert_context_all_free(stats):
    assert stats["num_held"] == 0
    assert stats["free_pages"] == stats["usable_pages"]
    assert stats["reserved_pages"] == [0] * len(stats["usable_pages"])


def test_two_processes_equal_aggregated_token_for_token_and_step_for_step(context, pair, mesh):
    params, cfg = pair
    rng = np.random.default_rng(5)
    # All longer than the draft window (16); similar lengths keep the compiles few.
    prompts = (periodic_prompts(n=3, length=40, seed=11)
               + [rng.integers(0, 31, n).tolist() for n in (36, 48)])
    agg = Engine(params, cfg, mesh=mesh).generate(prompts, 16)
    gen = GenerationWorker(params, cfg, mesh=mesh)   # the context's TP2 shards reassembled
    remote = RemoteContext(context.address, gen.layout)
    before = remote.stats()
    dis = RemotePair(remote, gen).generate(prompts, 16)
    assert [r.tokens for r in dis] == [r.tokens for r in agg]
    assert [r.acceptance for r in dis] == [r.acceptance for r in agg]
    assert np.mean([a for r in dis for a in r.acceptance]) > 2.0  # the draft context arrived
    assert remote.bytes_pulled > 0
    print(f"pulled {remote.bytes_pulled} B in {remote.pull_seconds * 1e3:.1f} ms")
    assert free_pages(gen) == all_free(gen)
    assert gen.engine.admission.reserved_pages == (0,) * len(gen.engine.spec.pools)
    after = remote.close()
    assert_context_all_free(after)
    assert after["num_completed"] - before["num_completed"] == len(prompts)


def test_corrupted_buffer_fails_that_request_only(context, pair, mesh):
    params, cfg = pair
    prompt = periodic_prompts(n=1, length=30, seed=3)[0]
    gen = GenerationWorker(params, cfg, mesh=mesh)
    remote = RemoteContext(context.address, gen.layout)
    remote_pair = RemotePair(remote, gen)
    with pytest.raises(TransferError, match="checksum .* corrupted in transit"):
        remote_pair.transfer_one("bad", prompt, 8)
    assert free_pages(gen) == all_free(gen) and gen.engine.num_active == 0
    stats = remote.stats()
    assert_context_all_free(stats)
    assert "'bad' aborted by the generation worker" in stats["errors"][-1]
    # The next request over the same connection is fine.
    [result] = remote_pair.generate([prompt], 8)
    assert result.tokens == Engine(params, cfg, mesh=mesh).generate([prompt], 8)[0].tokens
    assert_context_all_free(remote.close())


def test_generation_cli_serves_json_lines_through_a_context_process(context, pair, mesh,
                                                                   tmp_path, capsys):
    params, cfg = pair
    prompts = periodic_prompts(n=2, length=28, seed=4)
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps({"id": f"q{i}", "tokens": p, "max_new_tokens": 8})
                                  for i, p in enumerate(prompts)) + "\nnot json\n")
    main(["serve-remote", "--role", "generation", "--address", context.address,
          *SOURCE.cli_args(), str(requests)])
    out = [json.loads(l) for l in capsys.readouterr().out.strip().splitlines()[-3:]]
    agg = Engine(params, cfg, mesh=mesh).generate(prompts, 8)
    assert [o["tokens"] for o in out[:2]] == [r.tokens for r in agg]
    assert [o["id"] for o in out[:2]] == ["q0", "q1"] and "error" in out[2]


def test_layout_is_checked_again_on_every_handoff(context, pair, mesh):
    params, cfg = pair
    gen = GenerationWorker(params, cfg, mesh=mesh)
    remote = RemoteContext(context.address, gen.layout)
    pull = remote.pull
    remote.pull = lambda message, **kw: dataclasses.replace(   # a handoff from another layout
        pull(message, **kw), layout=Layout.of(cfg.spec, "private"))
    with pytest.raises(LayoutMismatch, match="mode: context worker has 'private'"):
        RemotePair(remote, gen).transfer_one("r0", list(range(1, 12)), 4)
    assert free_pages(gen) == all_free(gen) and gen.engine.num_active == 0
    stats = remote.close()
    assert_context_all_free(stats)
    assert "'r0' aborted by the generation worker: LayoutMismatch" in stats["errors"][-1]


def test_layout_mismatch_fails_within_a_second_on_both_sides(tmp_path, pair):
    _, cfg = pair
    with ContextProcess(SOURCE, tmp_path / "context.log", draft_kv="private",
                        extra_args=["--max-connections", "1"]) as ctx:
        start = time.monotonic()
        with pytest.raises(LayoutMismatch, match="mode: context worker has 'private', "
                                                 "generation worker has 'shared'"):
            RemoteContext(ctx.address, Layout.of(cfg.spec, "shared"), timeout=10.0)
        assert time.monotonic() - start < 1.0
        assert ctx.proc.wait(timeout=10) == 0   # served its one peer and exited
        assert ("LayoutMismatch: layout mismatch in mode: context worker has 'private', "
                "generation worker has 'shared'") in ctx.log_text()


def test_silent_or_killed_peer_times_out_and_pages_are_freed(tmp_path, pair, child_env):
    params, cfg = pair
    prompt = list(range(1, 21))
    with ContextProcess(SOURCE, tmp_path / "context.log", tp=2, timeout=1.0,
                        extra_env=child_env) as ctx:
        gen = GenerationWorker(params, cfg)
        remote_pair = RemotePair(RemoteContext(ctx.address, gen.layout, timeout=1.0), gen)

        # Silent context: stopped (not dead), its socket stays open and answers nothing.
        os.kill(ctx.proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(TransferTimeout, match="within 1.0s"):
            remote_pair.transfer_one("r0", prompt, 8)
        assert time.monotonic() - start < 2.0
        assert free_pages(gen) == all_free(gen) and gen.engine.num_active == 0
        os.kill(ctx.proc.pid, signal.SIGCONT)
        # It wakes, prefills r0, finds its peer gone and frees r0's pages.
        stats = RemoteContext(ctx.address, gen.layout, timeout=60.0).stats()  # incl. compile
        assert_context_all_free(stats)
        assert any("'r0'" in e for e in stats["errors"]), stats["errors"]

        # Silent generation side: takes the handoff, never pulls, never acks.
        remote = RemoteContext(ctx.address, gen.layout, timeout=10.0)
        message = remote.prefill("r1", prompt, 8)
        time.sleep(1.5)   # past the context's 1 s ack wait
        remote.timeout = 0.5
        with pytest.raises(TransferError):   # its offer expired with the ack wait
            remote.pull(message, submitted=0.0)
        with pytest.raises(PeerClosed):       # and it dropped this peer
            remote.stats()
        stats = RemoteContext(ctx.address, gen.layout, timeout=10.0).close()
        assert_context_all_free(stats)
        assert any("'r1': TransferTimeout" in e for e in stats["errors"]), stats["errors"]

        # Killed context between its handoff message and our pull.
        remote = RemoteContext(ctx.address, gen.layout, timeout=1.0)
        message = remote.prefill("r2", prompt, 8)
        ctx.proc.kill()
        ctx.proc.wait(timeout=10)
        start = time.monotonic()
        with pytest.raises(TransferError):
            remote.pull(message, submitted=0.0)
        assert time.monotonic() - start < 2.0
        with pytest.raises(PeerClosed):
            remote.prefill("r3", prompt, 8)
        assert free_pages(gen) == all_free(gen)


def test_control_channel_every_wait_times_out():
    listener = Listener("127.0.0.1:0")
    with pytest.raises(TransferTimeout, match="no peer connected"):
        listener.accept(timeout=0.05)
    client = ControlChannel.connect(listener.address, timeout=1.0)
    server = listener.accept(timeout=1.0)
    client.send({"op": "hello", "n": [1, 2]}, timeout=1.0)
    assert server.recv(timeout=1.0) == {"op": "hello", "n": [1, 2]}
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match="within 0.1s"):
        server.recv(timeout=0.1)
    assert time.monotonic() - start < 0.5
    with pytest.raises(PeerClosed, match="dropped after an earlier failure"):
        server.recv(timeout=1.0)
    with pytest.raises(PeerClosed):   # the timed-out side closed: the peer sees EOF
        client.recv(timeout=1.0)
    listener.close()
    start = time.monotonic()   # nobody listens there now: refusals retried until the timeout
    with pytest.raises(PeerClosed, match="within 0.3s"):
        ControlChannel.connect(listener.address, timeout=0.3)
    assert 0.2 < time.monotonic() - start < 1.0


def test_layout_and_shards_survive_the_wire(pair):
    _, cfg = pair
    layout = Layout.of(cfg.spec, "private")
    assert layout_from_wire(layout_to_wire(layout)) == layout
    devices = np.array(jax.devices())
    if len(devices) < 4:
        pytest.skip("needs 4 (host) devices")
    mesh = jax.sharding.Mesh(devices[:4].reshape(2, 2), ("a", "b"))
    x = jax.device_put(np.arange(4 * 6 * 2, dtype=np.float32).reshape(4, 6, 2),
                       jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b")))
    pieces, boxes = split_shards(x)
    assert len(pieces) == 4 and [0, 2] in boxes[0]
    pieces = [jax.device_put(p, devices[3]) for p in pieces]
    np.testing.assert_array_equal(assemble(x.shape, x.dtype, boxes, pieces), np.asarray(x))
