"""The baselines the benchmarks time compute exactly what the unified cache does."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.cache_baselines import (TwoCacheState, full_rebuild, kv_memory_bytes, per_layer,
                                        split_config, split_state, two_cache_decode_step)
from drafter.engine import Engine
from drafter.uniform_steps import decode_step
from tests.drafter.tiny import tiny_pair

PROMPTS = [list(np.random.default_rng(3).integers(0, 63, n)) for n in (5, 23, 41)]


def test_per_layer_pools_and_full_capacity_tables_give_identical_tokens():
    params, cfg, _ = tiny_pair(num_slots=2)   # the third prompt waits for a slot
    # batch-invariant engines: one shape a call kind, fewer compiles (rows are not the
    # subject here)
    want = Engine(params, cfg, batch_invariant=True).generate(PROMPTS, 12)
    per_layer_cfg = per_layer(cfg)
    assert len(per_layer_cfg.spec.pools) == len(cfg.spec.layers) > len(cfg.spec.pools)
    for variant in (per_layer_cfg, full_rebuild(cfg)):
        got = Engine(params, variant, batch_invariant=True).generate(PROMPTS, 12)
        assert [r.tokens for r in got] == [r.tokens for r in want]
        assert [r.acceptance for r in got] == [r.acceptance for r in want]


def test_two_caches_decode_like_the_unified_cache():
    params, cfg, _ = tiny_pair(num_slots=3, target_kv_dtype="f32", kv_dtype="bf16")
    engine = Engine(params, cfg)
    for i, prompt in enumerate(PROMPTS):  # prefill through the unified engine
        engine.add_request(f"r{i}", prompt, 40)
    engine.prefill_submitted()
    cfgs = split_config(cfg)
    target_kv, draft_kv = split_state(cfg, engine.state.kv, cfgs)
    assert {l.role for l in cfgs[0].spec.layers} == {"target"}
    assert {l.role for l in cfgs[1].spec.layers} == {"draft"}
    two = TwoCacheState(target_kv, draft_kv, engine.state.anchors + 0, engine.state.drafts + 0)
    one = engine.state
    slots = jnp.arange(3, dtype=jnp.int32)
    key = jax.random.key(0)
    step_one = jax.jit(decode_step, static_argnames=("cfg", "table_width"))
    step_two = jax.jit(two_cache_decode_step, static_argnames=("cfgs", "table_width"))
    accepted = []
    for _ in range(6):
        one, tok1, n1, ok1 = step_one(params, one, slots, key, cfg=cfg, table_width=16)
        two, tok2, n2, ok2 = step_two(params, two, slots, key, cfgs=cfgs, table_width=16)
        np.testing.assert_array_equal(tok1, tok2)
        np.testing.assert_array_equal(n1, n2)
        assert bool(ok1.all()) and bool(ok2.all())
        accepted.append(np.asarray(n1))
    assert np.concatenate(accepted).min() >= 1
    np.testing.assert_array_equal(two.target_kv.target_lens, one.kv.target_lens)
    np.testing.assert_array_equal(two.draft_kv.page_tables[0],
                                  one.kv.page_tables[len(cfgs[0].spec.pools)])
    # Same pools, so the same bytes: the unified cache saves nothing but also costs nothing.
    split_bytes = sum(kv_memory_bytes(c.spec)["pools"] for c in cfgs)
    assert split_bytes == kv_memory_bytes(cfg.spec)["pools"]


def test_split_refuses_mixed_pools_and_sizes_pools_alike_under_a_binding_budget():
    params, cfg, _ = tiny_pair(num_slots=3)
    with pytest.raises(ValueError, match="holds target and draft layers"):
        split_state(cfg, Engine(params, cfg).state.kv, split_config(cfg))
    params, cfg, _ = tiny_pair(num_slots=3, target_kv_dtype="f32", kv_dtype="bf16")
    need = sum(p.nbytes for p in cfg.spec.pools) // 2  # buys fewer than num_slots requests
    small = dataclasses.replace(cfg, spec=dataclasses.replace(cfg.spec,
                                                              memory_budget_bytes=need))
    assert sum(p.nbytes for p in small.spec.pools) < sum(p.nbytes for p in cfg.spec.pools)
    cfgs = split_config(small)
    target_kv, draft_kv = split_state(small, Engine(params, small).state.kv, cfgs)
    shapes = sorted(p.shape for c in cfgs for p in c.spec.pools)
    assert shapes == sorted(p.shape for p in small.spec.pools)
    assert [k.shape for k in target_kv.pools + draft_kv.pools] == [
        p.shape for c in cfgs for p in c.spec.pools]
