"""Fan-in: several context workers (threads, own meshes) into one generation worker."""

import time

import jax
import numpy as np
import pytest

from disagg.fanin import FanIn
from disagg.transfer import TransferError
from disagg.workers import ContextWorker, GenerationWorker, TransferTimeout
from drafter.engine import Engine
from tests.drafter.tiny import tiny_pair


def mesh_of(*device_ids):
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 (host) devices")
    return jax.sharding.Mesh(np.array([devices[i] for i in device_ids]), ("tp",))


def free_pages(worker):
    return np.asarray(worker.engine.state.kv.num_free).tolist()


def assert_all_free(fan):
    for worker in [*fan.contexts, fan.generation]:
        assert free_pages(worker) == [p.num_usable_pages for p in worker.engine.spec.pools]
        assert worker.engine.admission.reserved_pages == (0,) * len(worker.engine.spec.pools)
        assert worker.engine.num_active == 0
    assert all(ctx.num_held == 0 for ctx in fan.contexts)


@pytest.fixture(scope="module")
def setup():
    """Three 1-device context workers (devices 0, 1, 2) into a generation worker on 3.
    The first sits on the default device unmeshed, as the aggregated engine does,
    so the two share compilations (the suite runs on CPU)."""
    params, cfg, _ = tiny_pair(num_slots=3)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 63, n).tolist() for n in (5, 17, 33, 40, 9, 26, 12)]
    agg = Engine(params, cfg).generate(prompts, 16)
    contexts = [ContextWorker(params, cfg, mesh=None if i == 0 else mesh_of(i))
                for i in range(3)]
    assert {next(iter(c.engine.state.kv.pools[0].devices())).id for c in contexts} == {0, 1, 2}
    fan = FanIn(contexts,
                GenerationWorker(params, cfg, mesh=mesh_of(3)), timeout=300.0)
    return params, cfg, prompts, agg, fan


def test_three_contexts_into_one_generation_equal_aggregated(setup):
    _, _, prompts, agg, fan = setup
    fan.prefills = [0, 0, 0]
    dis = fan.generate(prompts, 16)
    assert [r.tokens for r in dis] == [r.tokens for r in agg]
    assert [r.acceptance for r in dis] == [r.acceptance for r in agg]
    assert sum(fan.prefills) == len(prompts)
    assert fan.generation.bytes_received > 0
    assert_all_free(fan)


def test_concurrent_prefills_interleave_on_the_channel(setup):
    """More contexts than the generation has slots: its admission refuses some
    handoffs until requests finish, and every context still drains."""
    _, _, prompts, agg, fan = setup
    many = prompts * 2  # 14 requests, 3 generation slots, 3 x 3 context slots
    dis = fan.generate(many, 16)
    assert [r.tokens for r in dis] == [r.tokens for r in agg] * 2
    assert [r.acceptance for r in dis] == [r.acceptance for r in agg] * 2
    assert_all_free(fan)


def test_corrupted_handoff_fails_loudly_and_frees_every_worker(setup, monkeypatch):
    _, _, prompts, _, fan = setup
    ctx = fan.contexts[1]
    real_prefill = ctx.prefill

    def corrupt(*args, **kw):
        handoff = real_prefill(*args, **kw)
        payload = next(iter(handoff.pools.values()))
        payload.buffer = payload.buffer.at[0, 0, 0, 0, 0, 0].add(1.0)
        return handoff

    monkeypatch.setattr(ctx, "prefill", corrupt)
    with pytest.raises(TransferError, match="corrupted in transit"):
        fan.generate(prompts, 16)
    assert_all_free(fan)
    monkeypatch.undo()
    assert len(fan.generate(prompts[:2], 4)) == 2  # the workers still serve


def test_silent_contexts_time_out_and_free_their_pages(setup, monkeypatch):
    _, _, prompts, _, fan = setup
    monkeypatch.setattr(fan, "timeout", 0.3)
    monkeypatch.setattr(fan.channel, "send", lambda item: None)  # a wire that drops everything
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match="no context worker of 3 made progress"):
        fan.generate(prompts[:3], 4)
    assert time.monotonic() - start < 5.0
    assert_all_free(fan)


def test_stuck_receiver_makes_waiting_contexts_time_out(setup, monkeypatch):
    """A receiver stuck in one handoff: the contexts waiting for acks give up
    within the timeout and the error reaches the caller; nothing leaks."""
    _, _, prompts, _, fan = setup
    real_receive = fan.generation.receive

    def stuck(*args, **kw):
        time.sleep(1.5)
        return real_receive(*args, **kw)

    monkeypatch.setattr(fan, "timeout", 0.3)
    monkeypatch.setattr(fan.generation, "receive", stuck)
    with pytest.raises(TransferTimeout, match="generation worker made no progress"):
        fan.generate(prompts[:4], 4)
    assert_all_free(fan)


def test_head_slices_from_a_tp2_and_a_tp1_context_are_joined(setup, monkeypatch):
    """A TP2 context sends one handoff per kv-head shard (as two ranks would),
    interleaved with a TP1 context's whole handoffs; the receiver joins them."""
    params, cfg, prompts, agg, _ = setup
    fan = FanIn([ContextWorker(params, cfg, mesh=mesh_of(0, 1)),
                 ContextWorker(params, cfg, mesh=mesh_of(2))],
                GenerationWorker(params, cfg, mesh=mesh_of(3)), timeout=300.0,
                head_slices=True)
    joined = []
    real_assemble = fan.generation.assemble

    def counting(slices):
        joined.append(sorted(s.pools[0].heads for s in slices))
        return real_assemble(slices)

    monkeypatch.setattr(fan.generation, "assemble", counting)
    dis = fan.generate(prompts, 16)
    assert fan.prefills[0] > 0 and fan.prefills[1] > 0
    assert joined and all(heads == [(0, 1), (1, 2)] for heads in joined)
    assert len(joined) == fan.prefills[0]
    assert [r.tokens for r in dis] == [r.tokens for r in agg]
    assert [r.acceptance for r in dis] == [r.acceptance for r in agg]
    assert_all_free(fan)


def test_fan_in_needs_a_context():
    params, cfg, _ = tiny_pair(num_slots=2)
    with pytest.raises(ValueError, match="at least one context worker"):
        FanIn([], GenerationWorker(params, cfg))
