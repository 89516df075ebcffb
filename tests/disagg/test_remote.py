"""Context and generation in separate OS processes over loopback: KV through
jax.experimental.transfer, metadata through the control channel, a timeout on
every wait, every failure scoped to its request, pages conserved on both sides."""

import dataclasses
import json
import queue
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from disagg.__main__ import main
from disagg.control import ControlChannel, Listener, PeerClosed
from disagg.handshake import Weights
from disagg.kv_format import KVFormat, KVFormatMismatch
from disagg.processes import ContextProcess, PairSource
from disagg.remote import PeerHung, RemoteSource, _Wait
from disagg.transfer import TransferTimeout
from disagg.wire import assemble, kv_format_from_wire, kv_format_to_wire, split_shards
from drafter.engine import Engine
from drafter.request import SamplingParams
from tests.disagg.disagg_pair import assert_all_free
from tests.drafter.test_context import PAIR, periodic_prompts

# The shipped tiny copy pair with the default cache (fp8 target KV, bf16 draft KV).
SOURCE = PairSource(str(PAIR), num_slots=3, max_seq_len=256, kv_memory_mib=16)
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def pair():
    return SOURCE.load()


@pytest.fixture(scope="module")
def weights(pair):
    return Weights.of(*pair)


@pytest.fixture(scope="module")
def child_env(tmp_path_factory):
    """Context processes share a compilation cache: a later child skips the compiles."""
    cache = tmp_path_factory.mktemp("jax_cache")
    return {"JAX_COMPILATION_CACHE_DIR": str(cache),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.2"}


@pytest.fixture(scope="module")
def context(tmp_path_factory, child_env):
    """A healthy TP2 context worker process."""
    log = tmp_path_factory.mktemp("remote") / "context.log"
    with ContextProcess(SOURCE, log, tp=2, extra_args=["--warmup"],
                        extra_env=child_env) as proc:
        yield proc


@pytest.fixture(scope="module")
def mesh():
    """The generation side's mesh; aggregated runs on it too, so both share compiles."""
    return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))


def remote_engine(address, cfg, params, mesh, *, mode="shared", timeout=30.0):
    source = RemoteSource(address, KVFormat.of(cfg.spec, mode), weights=Weights.of(params, cfg),
                          mesh=mesh, timeout=timeout)
    return Engine(params, cfg, mesh=mesh, kv_source=source, mode=mode,
                  kv_timeout_s=source.engine_timeout_s)


def assert_context_all_free(stats):
    assert stats["num_active"] == 0
    assert stats["free_pages"] == stats["usable_pages"]
    assert stats["reserved_pages"] == [0] * len(stats["usable_pages"])


def serve(engine, named_prompts, max_new):
    for rid, prompt in named_prompts:
        engine.submit(engine.make_request(rid, prompt, max_new_tokens=max_new))
    return {r.request_id: r for r in engine.run()}


def test_two_processes_equal_aggregated_token_for_token_and_step_for_step(context, pair, mesh):
    params, cfg = pair
    rng = np.random.default_rng(5)
    # All longer than the draft window (16); similar lengths keep the compiles few.
    prompts = (periodic_prompts(n=3, length=40, seed=11)
               + [rng.integers(0, 31, n).tolist() for n in (36, 48)])
    # with log-probabilities: the first token's and the prompt's travel in the handoff
    # message
    asks = SamplingParams(16, logprobs=1, prompt_logprobs=2)
    agg = Engine(params, cfg, mesh=mesh).generate(prompts, params=asks)
    engine = remote_engine(context.address, cfg, params, mesh)
    before = engine.kv_source.stats()
    dis = engine.generate(prompts, params=asks, arrival_steps=[0, 0, 0, 2, 5])
    assert [r.tokens for r in dis] == [r.tokens for r in agg]
    assert [r.acceptance for r in dis] == [r.acceptance for r in agg]
    np.testing.assert_allclose([x.logprob for r in dis for x in r.logprobs],
                               [x.logprob for r in agg for x in r.logprobs], atol=1e-5)
    assert [len(r.prompt_logprobs) for r in dis] == [len(p) for p in prompts]
    np.testing.assert_allclose([x.logprob for r in dis for x in r.prompt_logprobs[1:]],
                               [x.logprob for r in agg for x in r.prompt_logprobs[1:]],
                               atol=1e-5)
    assert np.mean([a for r in dis for a in r.acceptance]) > 2.0  # the draft context arrived
    assert engine.kv_source.bytes_pulled > 0
    assert_all_free(engine)
    after = engine.kv_source.close()
    assert_context_all_free(after)
    assert after["num_completed"] - before["num_completed"] == len(prompts)


def test_generation_cli_serves_json_lines_through_a_context_process(context, pair, mesh,
                                                                   tmp_path, capsys,
                                                                   monkeypatch, caplog):
    """Token lines equal aggregated greedy output ended by a stop id; a line whose
    reading raises unexpectedly (a bug) and a request whose submit does are answered by
    id and logged, and the lines after them are served. A generation worker whose
    tokenizer names end-of-sequence ids the context does not know (the context draws
    each first token, which min_tokens keeps off them) exits at connect naming both."""
    import disagg.frontend
    import disagg.serving
    from drafter.corpus import ByteTokenizer
    params, cfg = pair
    prompts = periodic_prompts(n=2, length=28, seed=4)
    agg = Engine(params, cfg, mesh=mesh).generate(prompts, 8)
    eos = agg[0].tokens[3]   # generation must stop there, on this prompt at least
    tokenizer = ByteTokenizer()
    tokenizer.eos_token_ids = (eos,)
    asked = []   # the pair has no tokenizer.json (no `tokenizers` needed): a stand-in
    monkeypatch.setattr(disagg.frontend, "load_tokenizer",
                        lambda path, **kw: asked.append(path) or tokenizer)

    def parse_line(obj, *args):   # a bug on the line with id "boom"
        if obj.get("id") == "boom":
            raise ZeroDivisionError("boom on purpose")
        return real_parse(obj, *args)
    real_parse = disagg.serving.parse_line
    monkeypatch.setattr(disagg.serving, "parse_line", parse_line)
    real_submit = Engine.submit
    monkeypatch.setattr(Engine, "submit", lambda self, request: (
        real_submit(self, request) if request.request_id != "bang" else 1 / 0))
    lines = [{"id": "q0", "tokens": prompts[0], "max_new_tokens": 8, "stop_token_ids": [eos]},
             {"id": "boom"}, {"id": "bang", "tokens": prompts[0], "max_new_tokens": 8},
             {"id": "q1", "tokens": prompts[1], "max_new_tokens": 8, "stop_token_ids": [eos]}]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(map(json.dumps, lines)) + "\nnot json\n")
    args = ["serve-remote", "--role", "generation", "--address", context.address,
            *SOURCE.cli_args(), str(requests)]
    with pytest.raises(SystemExit, match=r"end-of-sequence mismatch: the context worker's "
                                         r"ids are \[\], the generation worker's \[%d\]" % eos):
        main(args)
    tokenizer.eos_token_ids = ()   # the context's: none
    capsys.readouterr()
    main(args)
    out = {o["id"]: o for o in (json.loads(l) for l in
                                capsys.readouterr().out.strip().splitlines()[-5:])}
    assert asked == [Path(SOURCE.pair_dir) / "target"] * 2
    expected = [r.tokens[:r.tokens.index(eos) + 1] if eos in r.tokens else r.tokens
                for r in agg]   # the engine keeps the stop id and ends there
    assert [out[f"q{i}"]["tokens"] for i in range(2)] == expected
    assert len(out["q0"]["tokens"]) <= 4 and out["q0"]["finish_reason"] == "stop"
    assert "internal error: ZeroDivisionError: boom on purpose" in out["boom"]["error"]
    assert "internal error: ZeroDivisionError" in out["bang"]["error"]
    assert "not JSON" in out["line-5"]["error"]
    logged = [r.getMessage() for r in caplog.records if r.exc_info]
    assert any("'boom'" in m for m in logged) and any("'bang'" in m for m in logged)


def test_kv_format_is_checked_again_on_every_handoff(context, pair, mesh, monkeypatch):
    import disagg.remote
    params, cfg = pair
    engine = remote_engine(context.address, cfg, params, mesh)
    monkeypatch.setattr(disagg.remote, "kv_format_from_wire",   # a handoff in another KV format
                        lambda fields: KVFormat.of(cfg.spec, "private"))
    results = serve(engine, [("r0", list(range(1, 12)))], 4)
    assert "KVFormatMismatch" in results["r0"].error or "mode" in results["r0"].error
    assert_all_free(engine)
    assert_context_all_free(engine.kv_source.close())


def test_kv_format_mismatch_fails_within_a_second_on_both_sides(tmp_path, pair, weights):
    _, cfg = pair
    with ContextProcess(SOURCE, tmp_path / "context.log", draft_kv="private",
                        extra_args=["--max-connections", "1"]) as ctx:
        start = time.monotonic()
        with pytest.raises(KVFormatMismatch, match="mode: context worker has 'private', "
                                                   "generation worker has 'shared'"):
            RemoteSource(ctx.address, KVFormat.of(cfg.spec, "shared"), weights=weights,
                         timeout=10.0)
        assert time.monotonic() - start < 1.0
        assert ctx.proc.wait(timeout=10) == 0   # served its one peer and exited
        assert ("KVFormatMismatch: KV format mismatch in mode: context worker has 'private', "
                "generation worker has 'shared'") in ctx.log_text()


def test_no_drafter_context_process_serves_private_and_refuses_shared(tmp_path, pair, weights,
                                                                       mesh, child_env):
    """`serve-remote --role context --no-drafter`: a private-mode generation worker's
    tokens equal aggregated greedy output; a shared-mode one is refused within a
    second, on both sides, naming the two fixes."""
    params, cfg = pair
    with ContextProcess(dataclasses.replace(SOURCE, drafter=False), tmp_path / "context.log",
                        extra_env=child_env) as ctx:
        start = time.monotonic()
        with pytest.raises(KVFormatMismatch, match="no drafter.*--draft-kv private.*--no-drafter"):
            RemoteSource(ctx.address, KVFormat.of(cfg.spec, "shared"), weights=weights,
                         timeout=10.0)
        assert time.monotonic() - start < 1.0
        prompts = periodic_prompts(n=3, length=40, seed=11)
        engine = remote_engine(ctx.address, cfg, params, mesh, mode="private")
        results = engine.generate(prompts, 16)
        agg = Engine(params, cfg, mesh=mesh).generate(prompts, 16)
        assert [r.tokens for r in results] == [r.tokens for r in agg]
        assert_all_free(engine)
        assert_context_all_free(engine.kv_source.close())
        assert "KVFormatMismatch: the context worker has no drafter" in ctx.log_text()


def test_no_drafter_flag_is_refused_where_it_cannot_work():
    for argv, match in ((["--role", "generation", "--no-drafter"], "--role context only"),
                        (["--role", "context", "--no-drafter", "--draft-kv", "shared"],
                         "no draft KV to share")):
        with pytest.raises(SystemExit, match=match):
            main(["serve-remote", *argv])


def test_serve_remote_refuses_bad_addresses_pairs_and_the_other_roles_flags(tmp_path):
    """Each in one line and before any model loads: an address that is not HOST:PORT,
    a --pair without its checkpoints, and a flag only the other role takes (which would
    be ignored)."""
    for argv, match in (
            (["--role", "context", "--address", "foo"], "--address: 'foo': give HOST:PORT"),
            (["--role", "generation", "--address", "foo"], "give HOST:PORT"),
            (["--role", "context", "--pair", str(tmp_path)], "no target/config.json there"),
            (["--role", "context", "requests.jsonl"], "does not take a requests file"),
            (["--role", "context", "--http", "127.0.0.1:0", "--default-max-tokens", "9"],
             "does not take --http, --default-max-tokens .the generation worker's.; leave "
             "them out"),
            (["--role", "generation", "--warmup"], "does not take --warmup"),
            (["--role", "generation", "--idle-timeout", "5", "--max-connections", "1"],
             "does not take --idle-timeout, --max-connections .the context worker's.")):
        with pytest.raises(SystemExit, match=match):
            main(["serve-remote", *argv])


def test_serve_remote_names_a_port_in_use_and_a_context_that_is_not_there():
    import socket
    busy = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{busy.getsockname()[1]}"
    with pytest.raises(SystemExit, match=f"cannot listen on {address}"):
        main(["serve-remote", "--role", "context", "--address", address])
    busy.close()   # nobody listens there now
    with pytest.raises(SystemExit, match=f"--role generation: could not connect to {address}"):
        main(["serve-remote", "--role", "generation", "--address", address, "--timeout", "0.5"])


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
    start = time.monotonic()   # a reconnection to a peer that is gone: refused at once
    with pytest.raises(PeerClosed, match="could not connect"):
        ControlChannel.connect(listener.address, timeout=5.0, retry_refused=False)
    assert time.monotonic() - start < 0.5


def test_kv_format_and_shards_survive_the_wire(pair):
    _, cfg = pair
    kv_format = KVFormat.of(cfg.spec, "private")
    assert kv_format_from_wire(kv_format_to_wire(kv_format)) == kv_format
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


def test_a_lost_peer_is_told_once_per_request_by_the_first_fault_found():
    """The reader drops a hung peer's channel while the pull thread watches it: the pull
    thread sees the channel broken at once, but the request's error stays the reader's."""
    source = RemoteSource.__new__(RemoteSource)
    source._lock, source._arrivals = threading.Lock(), queue.Queue()
    source._outstanding = {"p0": _Wait(0.0, pulling=True), "p1": _Wait(0.0)}

    class Channel:   # its close is where the pull thread wakes up and fails its request
        def close(self):
            source._fail("p0", PeerClosed("the KV pull was abandoned"))

    source._lose_channel(Channel(), PeerHung("it is stopped or hung"))
    source._fail("p1", TransferTimeout("late"))   # already ended: not told twice
    told = [source._arrivals.get_nowait() for _ in range(source._arrivals.qsize())]
    assert [(r, type(e).__name__) for r, e in told] == [("p0", "PeerHung"), ("p1", "PeerHung")]
    assert source._outstanding == {}
