"""Disaggregated serving in one process: identical to aggregated in shared mode (tokens,
acceptance, sampled draws, log-probabilities, adjusted logits, min_tokens, any TP split,
windowed pools, batch invariance); private mode loses acceptance, not output; decode
keeps running while a transfer is pending. Failures: test_disagg_failures.py."""

import jax
import numpy as np
import pytest

from disagg.sources import disaggregated_engine
from disagg.transfer import MOVE_PATHS
from drafter.engine import Engine
from drafter.request import SamplingParams
from tests.drafter.test_context import PAIR, periodic_prompts
from tests.disagg import disagg_pair
from tests.disagg.disagg_pair import (MAX_NEW, PROMPTS, Tampered, assert_pair_free, meshes,
                                      split_engine)

pair, aggregated = disagg_pair.pair, disagg_pair.aggregated  # this module's own (fixtures)


# Two paths here: device to device, and through host memory. Every path's bytes are
# checked in test_transfer.py; what happens after the move does not depend on the path.
@pytest.mark.parametrize("path", ["coalesced", "host"])
def test_shared_mode_equals_aggregated_token_for_token_and_step_for_step(path, pair,
                                                                         aggregated):
    assert path in MOVE_PATHS
    params, cfg = pair
    agg = aggregated
    mesh_a, mesh_b = meshes()
    engine = disaggregated_engine(params, cfg, context_meshes=(mesh_a,), mesh=mesh_b,
                                  move_path=path)
    dis = engine.generate(PROMPTS, MAX_NEW, arrival_steps=[0, 0, 1, 4, 6])
    assert [r.tokens for r in dis] == [r.tokens for r in agg]
    assert [r.acceptance for r in dis] == [r.acceptance for r in agg]
    assert engine.bytes_imported > 0
    assert_pair_free(engine)


def test_imported_rows_decode_several_steps_in_their_import_call(pair, aggregated):
    """With several decode steps a call, a step that imports the last arrivals (nothing
    waiting, no KV still in flight) runs them all, as a step after a prefill does: the
    imported rows decode from their first call; tokens and acceptance equal aggregated
    serving's."""
    params, cfg = pair
    engine = split_engine(params, cfg, decode_steps_per_call=3)
    steps_with_imports, run = [], engine.executor.run

    def spy(plan, **kwargs):
        if (plan.imports and not engine.scheduler.waiting
                and len(plan.decode) == engine.num_active):
            steps_with_imports.append(kwargs["decode_steps"])
        return run(plan, **kwargs)

    engine.executor.run = spy
    dis = engine.generate(PROMPTS[:3], MAX_NEW)
    assert [r.tokens for r in dis] == [r.tokens for r in aggregated[:3]]
    assert [r.acceptance for r in dis] == [r.acceptance for r in aggregated[:3]]
    assert steps_with_imports and set(steps_with_imports) == {3}, steps_with_imports
    assert_pair_free(engine)


SAMPLED = [SamplingParams(MAX_NEW, temperature=0.8, seed=1),
           SamplingParams(MAX_NEW, temperature=1.2, seed=2, top_p=0.7),
           SamplingParams(MAX_NEW),
           SamplingParams(MAX_NEW, temperature=1.0, seed=4, top_k=3, min_p=0.05),
           SamplingParams(MAX_NEW, temperature=0.5, seed=5)]


def serve_each(engine, params_per_prompt):
    for i, (prompt, params) in enumerate(zip(PROMPTS, params_per_prompt)):
        engine.submit(engine.make_request(f"r{i}", prompt, params))
    return {r.request_id: r for r in engine.run()}


def test_sampled_requests_draw_in_shared_mode_what_they_draw_aggregated(pair):
    """A sampled request's draws are keyed by its seed and positions, whichever engine
    makes them: the context's first token and the generation side's decode steps give
    the aggregated tokens, truncated or not, beside greedy ones."""
    params, cfg = pair
    agg = serve_each(Engine(params, cfg), SAMPLED)
    engine = split_engine(params, cfg)
    dis = serve_each(engine, SAMPLED)
    assert {k: r.tokens for k, r in dis.items()} == {k: r.tokens for k, r in agg.items()}
    assert_pair_free(engine)


def test_private_mode_loses_acceptance_not_output():
    from drafter.checkpoint import load_dflash
    from drafter.steps import StepConfig
    from models.checkpoint import load_qwen3
    from unified_kv import CacheSpec
    tcfg, target = load_qwen3(PAIR / "target")
    dcfg, draft = load_dflash(PAIR / "draft")
    spec = CacheSpec(8, tuple(tcfg.layer_specs("f32") + dcfg.layer_specs("f32")), 4, 128,
                     1 << 26, 8)
    cfg, params = StepConfig(tcfg, spec, dcfg, "reference"), {"target": target, "draft": draft}
    prompts = periodic_prompts(n=4)
    runs = {mode: disaggregated_engine(params, cfg, mode=mode).generate(prompts, 32)
            for mode in ("shared", "private")}
    al = {m: np.mean([a for r in rs for a in r.acceptance]) for m, rs in runs.items()}
    assert [r.tokens for r in runs["shared"]] == [r.tokens for r in runs["private"]]
    assert al["private"] < al["shared"] - 0.5, al


def test_the_first_token_is_booked_on_arrival_before_any_import(pair, aggregated):
    """The first token is the context's: booked as soon as it is computed, while the KV
    still waits to be imported; the rest of the output is unchanged."""
    params, cfg = pair
    engine = split_engine(params, cfg)
    arrived = {}

    def ready(request_id, item):
        if hasattr(item, "first_token"):
            arrived[request_id] = int(jax.block_until_ready(item.first_token))
        return item

    engine.kv_source = Tampered(engine.kv_source, ready)
    engine.submit(engine.make_request("r0", PROMPTS[0], max_new_tokens=MAX_NEW))
    results = []
    while "r0" not in arrived:
        results += engine.step()
    # the step that received the KV has not read an import (at most dispatched one)
    assert engine.scheduler.active["r0"].tokens == [arrived["r0"]] == aggregated[0].tokens[:1]
    results += engine.run()
    assert [r.tokens for r in results] == [aggregated[0].tokens]
    assert_pair_free(engine)


def test_decode_steps_keep_running_while_a_transfer_is_pending(pair):
    """A slow transport: one request's KV is held back for many steps; the
    running request keeps decoding meanwhile and both equal aggregated."""
    params, cfg = pair
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 10, 11, 12, 13]]
    agg = Engine(params, cfg).generate(prompts, 20)
    engine = split_engine(params, cfg)
    held, steps_while_held = [], []

    def slow(request_id, item):
        if request_id == "slow":
            held.append(item)
        return item

    engine.kv_source = Tampered(engine.kv_source, slow)
    real_poll = engine.kv_source.poll

    def poll(timeout):
        got = [x for x in real_poll(timeout) if x[0] != "slow"]
        if held and len(steps_while_held) < 12:
            steps_while_held.append(engine.scheduler.active["fast"].tokens[:])
        elif held:
            got.append(("slow", held.pop()))
        return got

    engine.kv_source.poll = poll
    engine.submit(engine.make_request("fast", prompts[0], max_new_tokens=20))
    engine.submit(engine.make_request("slow", prompts[1], max_new_tokens=20))
    results = {r.request_id: r for r in engine.run()}
    assert len(steps_while_held) == 12
    grew = [len(t) for t in steps_while_held]
    assert grew[-1] > grew[0], grew  # decode steps ran while the KV was in flight
    assert results["fast"].tokens == agg[0].tokens and results["slow"].tokens == agg[1].tokens
    assert_pair_free(engine)


def test_logprobs_travel_with_the_kv_and_equal_aggregated(pair):
    """A disaggregated request's first token is the context's: its log-probabilities
    (the context's prefill computed them) travel with the KV, as do the prompt's (every
    prefill chunk's), so every token's and every prompt token's equal aggregated
    serving's (shared mode here; private mode moves them alike, and the two-process pair
    too: test_remote.py); a request that does not ask gets None."""
    params, cfg = pair
    asks = SamplingParams(MAX_NEW, logprobs=2, prompt_logprobs=1)
    want = Engine(params, cfg).generate(PROMPTS[:3], params=asks)
    engine = split_engine(params, cfg)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.submit(engine.make_request(f"asks-{i}", prompt, asks))
    engine.submit(engine.make_request("not", PROMPTS[3], SamplingParams(MAX_NEW)))
    got = {r.request_id: r for r in engine.run()}
    assert got["not"].logprobs is None and got["not"].prompt_logprobs is None
    for i, w in enumerate(want):
        g = got[f"asks-{i}"]
        assert g.tokens == w.tokens and len(g.logprobs) == len(w.logprobs) == MAX_NEW
        assert len(g.prompt_logprobs) == len(PROMPTS[i]) and g.prompt_logprobs[0] is None
        np.testing.assert_allclose([x.logprob for x in g.prompt_logprobs[1:]],
                                   [x.logprob for x in w.prompt_logprobs[1:]], atol=1e-5)
        assert [[t for t, _ in x.top] for x in g.prompt_logprobs[1:]] == \
            [[t for t, _ in x.top] for x in w.prompt_logprobs[1:]]
        np.testing.assert_allclose([x.logprob for x in g.logprobs],
                                   [x.logprob for x in w.logprobs], atol=1e-5)
        assert [[t for t, _ in x.top] for x in g.logprobs] == \
            [[t for t, _ in x.top] for x in w.logprobs]
    assert_pair_free(engine)


def test_adjusted_logits_equal_aggregated(pair):
    """The context's prefill biases the first token, the import counts it as generated,
    and both workers mark a repetition penalty's prompt, so penalized and biased requests
    give the aggregated tokens (shared mode; the same import serves private mode and the
    two-process pair)."""
    params, cfg = pair
    asked = [SamplingParams(MAX_NEW, presence_penalty=1.5, frequency_penalty=0.5),
             SamplingParams(MAX_NEW, logit_bias={7: 100}),
             SamplingParams(MAX_NEW, repetition_penalty=1.5)]
    want = serve_each(Engine(params, cfg), asked)
    engine = split_engine(params, cfg)
    got = serve_each(engine, asked)
    assert {k: r.tokens for k, r in got.items()} == {k: r.tokens for k, r in want.items()}
    # drafted as the adjusted target chooses, on both sides alike: acceptance equal too
    assert {k: r.acceptance for k, r in got.items()} == \
        {k: r.acceptance for k, r in want.items()}
    assert got["r1"].tokens == [7] * MAX_NEW
    assert_pair_free(engine)


def test_min_tokens_equal_aggregated(pair):
    """The context draws the first token with the generation side's EOS ids and the
    request's stop ids banned (min_tokens), the generation side the rest: tokens and
    acceptance equal aggregated serving's, EOS as a stop after min_tokens included."""
    params, cfg = pair
    firsts = [r.tokens[0] for r in Engine(params, cfg).generate(PROMPTS[:3], 1)]
    eos = (firsts[0],)   # unbanned, request 0 would end at its first token
    asked = [SamplingParams(MAX_NEW, min_tokens=3),
             SamplingParams(MAX_NEW, min_tokens=MAX_NEW, stop_token_ids=(firsts[1],)),
             SamplingParams(MAX_NEW, min_tokens=2, stop_token_ids=(firsts[2],),
                            presence_penalty=0.5)]
    want = serve_each(Engine(params, cfg, eos_token_ids=eos), asked)
    engine = split_engine(params, cfg, eos_token_ids=eos)
    got = serve_each(engine, asked)
    assert {k: r.tokens for k, r in got.items()} == {k: r.tokens for k, r in want.items()}
    assert {k: r.acceptance for k, r in got.items()} == \
        {k: r.acceptance for k, r in want.items()}
    assert [got[f"r{i}"].tokens[0] != firsts[i] for i in range(3)] == [True] * 3
    assert_pair_free(engine)


@pytest.mark.parametrize("gen_tp", [2, 1])
def test_context_tp4_into_generation_tp2_and_tp1(gen_tp, pair, aggregated):
    """kv heads split 4 ways on the context side are resharded on receipt."""
    devices = np.array(jax.devices())
    if len(devices) < 4:
        pytest.skip("needs 4 (host) devices")
    params, cfg = pair
    assert cfg.target.num_kv_heads == 4
    agg = aggregated
    ctx_mesh = jax.sharding.Mesh(devices[:4], ("tp",))
    gen_mesh = jax.sharding.Mesh(devices[4 - gen_tp:], ("tp",))
    engine = disaggregated_engine(params, cfg, context_meshes=(ctx_mesh,), mesh=gen_mesh)
    dis = engine.generate(PROMPTS, MAX_NEW, arrival_steps=[0, 0, 1, 4, 6])
    assert len(engine.state.kv.pools[0].sharding.device_set) == gen_tp
    assert [r.tokens for r in dis] == [r.tokens for r in agg]
    assert [r.acceptance for r in dis] == [r.acceptance for r in agg]
    assert_pair_free(engine)


def test_long_prompt_into_windowed_pools_takes_only_the_window_tail(pair):
    """The receiver backs a windowed pool's in-window tail only: a prompt whose
    whole page range is larger than the windowed pools still moves."""
    params, cfg = pair
    prompt = np.random.default_rng(5).integers(0, 63, 130).tolist()
    windowed = [p for p in cfg.spec.pools if p.sliding_window]
    assert windowed and all(p.num_usable_pages < -(-len(prompt) // cfg.spec.page_size)
                            for p in windowed)
    agg = Engine(params, cfg).generate([prompt], 8)
    engine = split_engine(params, cfg)
    dis = engine.generate([prompt], 8)
    assert [r.tokens for r in dis] == [r.tokens for r in agg]
    assert [r.acceptance for r in dis] == [r.acceptance for r in agg]
    assert_pair_free(engine)


def test_a_batch_invariant_pair_pads_every_prefill_and_equals_aggregated(pair):
    """`batch_invariant` reaches the context workers, whose prefill calls make the KV:
    every engine of the pair runs it, and the tokens equal the aggregated engine's."""
    params, cfg = pair
    agg = Engine(params, cfg, batch_invariant=True).generate(PROMPTS, MAX_NEW,
                                                             arrival_steps=[0, 0, 1, 4, 6])
    engine = split_engine(params, cfg, batch_invariant=True)
    assert engine.batch_invariant and all(c.engine.batch_invariant
                                          for c in engine.kv_source.contexts)
    dis = engine.generate(PROMPTS, MAX_NEW, arrival_steps=[0, 0, 1, 4, 6])
    assert [r.tokens for r in dis] == [r.tokens for r in agg]
    assert_pair_free(engine)
