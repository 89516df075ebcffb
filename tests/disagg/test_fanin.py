"""Fan-in: several context workers (threads, own meshes) into one generation engine."""

import jax
import numpy as np
import pytest

from disagg.kv_format import KVFormat
from disagg.sources import ContextWorker, InProcessSource
from disagg.transfer import split_heads
from drafter.engine import Engine
from tests.disagg.disagg_pair import assert_all_free
from tests.drafter.tiny import tiny_pair


def mesh_of(*device_ids):
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 (host) devices")
    return jax.sharding.Mesh(np.array([devices[i] for i in device_ids]), ("tp",))


@pytest.fixture(scope="module")
def setup():
    params, cfg, _ = tiny_pair(num_slots=3)
    rng = np.random.default_rng(1)
    # Below a page, below the window (16) and past it; their live pages fall in four
    # page buckets, so each context device compiles four export shapes, not five.
    prompts = [rng.integers(0, 63, n).tolist() for n in (5, 17, 33, 36, 9, 26, 12)]
    agg = Engine(params, cfg).generate(prompts, 16)
    return params, cfg, prompts, agg


def fan_in(params, cfg, context_meshes, gen_mesh, **kw):
    contexts = [ContextWorker(params, cfg, mesh=m) for m in context_meshes]
    source = InProcessSource(contexts, mesh=gen_mesh, kv_format=KVFormat.of(cfg.spec, "shared"),
                             threaded=True, **kw)
    return Engine(params, cfg, mesh=gen_mesh, kv_source=source)


def assert_fan_free(engine):
    engine.kv_source.close()
    assert_all_free(engine)
    for ctx in engine.kv_source.contexts:
        ctx.engine.run()
        assert_all_free(ctx.engine)


def test_three_contexts_into_one_generation_equal_aggregated(setup):
    params, cfg, prompts, agg = setup
    engine = fan_in(params, cfg, [None, mesh_of(1), mesh_of(2)], mesh_of(3))
    many = prompts * 2  # 14 requests, 3 generation slots, 3 x 3 context slots
    dis = engine.generate(many, 16)
    assert [r.tokens for r in dis] == [r.tokens for r in agg] * 2
    assert [r.acceptance for r in dis] == [r.acceptance for r in agg] * 2
    assert sum(c.num_prefilled for c in engine.kv_source.contexts) == len(many)
    assert engine.bytes_imported > 0
    assert_fan_free(engine)


def test_head_slices_from_a_tp2_and_a_tp1_context_are_joined(setup, monkeypatch):
    """A TP2 context sends one handoff per kv-head shard (as two ranks would),
    interleaved with a TP1 context's whole handoffs; the receiver joins them."""
    params, cfg, prompts, agg = setup
    engine = fan_in(params, cfg, [mesh_of(0, 1), mesh_of(2)], mesh_of(3), head_slices=True)
    sliced = []
    import disagg.sources as sources

    def counting(handoff):
        parts = split_heads(handoff)
        sliced.append([p.heads[0] for p in parts])
        return parts

    monkeypatch.setattr(sources, "split_heads", counting)
    dis = engine.generate(prompts, 16)
    assert [c.num_prefilled > 0 for c in engine.kv_source.contexts] == [True, True]
    assert sorted(map(tuple, sliced)).count(((0, 1), (1, 2))) == \
        engine.kv_source.contexts[0].num_prefilled
    assert [r.tokens for r in dis] == [r.tokens for r in agg]
    assert [r.acceptance for r in dis] == [r.acceptance for r in agg]
    assert_fan_free(engine)


def test_a_failing_context_fails_its_requests_by_name_and_others_serve(setup, monkeypatch):
    params, cfg, prompts, agg = setup
    engine = fan_in(params, cfg, [None, mesh_of(1)], mesh_of(3))
    broken = engine.kv_source.contexts[1]

    def boom():
        raise RuntimeError("context device lost")

    monkeypatch.setattr(broken, "pump", boom)
    requests = [engine.make_request(f"r{i}", p, max_new_tokens=8) for i, p in enumerate(prompts)]
    for r in requests:
        engine.submit(r)
    results = {r.request_id: r for r in engine.run()}
    assert len(results) == len(prompts)
    failed = [r for r in results.values() if not r.ok]
    assert failed and all("context device lost" in r.error for r in failed)
    served = [r for r in results.values() if r.ok]
    assert served
    for i, r in enumerate(requests):
        if results[r.request_id].ok:
            assert results[r.request_id].tokens == agg[i].tokens[:8]
    engine.kv_source.close()
    assert_all_free(engine)


def test_fan_in_needs_a_context():
    params, cfg, _ = tiny_pair(num_slots=2)
    with pytest.raises(ValueError, match="at least one context worker"):
        InProcessSource([], kv_format=KVFormat.of(cfg.spec, "shared"))


def test_a_threaded_context_on_the_generation_device_equals_aggregated(setup):
    """bench_serving's threaded variant: one context thread, both workers on one device."""
    from disagg.sources import disaggregated_engine
    params, cfg, prompts, agg = setup
    engine = disaggregated_engine(params, cfg, threaded=True)
    dis = engine.generate(prompts, 16)
    assert [r.tokens for r in dis] == [r.tokens for r in agg]
    assert [r.acceptance for r in dis] == [r.acceptance for r in agg]
    assert_fan_free(engine)
