"""Disaggregated serving in one process: identical to aggregated in shared mode,
loud and contained on every failure, pages conserved on both sides."""

import dataclasses
import time

import jax
import numpy as np
import pytest

from disagg.kv_format import KVFormat, KVFormatMismatch, check_kv_formats
from disagg.sources import ContextWorker, InProcessSource, disaggregated_engine
from disagg.transfer import MOVE_PATHS
from drafter.engine import Engine
from drafter.request import SamplingParams
from tests.drafter.test_context import PAIR, periodic_prompts
from tests.drafter.tiny import tiny_pair
from unified_kv import AdmissionError


# One tiny pair for the module (4 kv heads, so the TP tests can split them 4 ways): every
# engine here, aggregated or either side of a pair, on a device or a mesh, runs the same
# configuration and so compiles each of its steps once for the whole module.
@pytest.fixture(scope="module")
def pair():
    params, cfg, _ = tiny_pair(num_slots=2, num_kv_heads=4)
    return params, cfg


_rng = np.random.default_rng(1)
PROMPTS = [_rng.integers(0, 63, n).tolist() for n in (5, 17, 33, 40, 9)]  # > draft window 16
MAX_NEW = 16


@pytest.fixture(scope="module")
def aggregated(pair):
    """The aggregated engine's results for PROMPTS: what every serving split must equal."""
    params, cfg = pair
    return Engine(params, cfg).generate(PROMPTS, MAX_NEW)


def meshes():
    devices = np.array(jax.devices())
    if len(devices) < 4:
        pytest.skip("needs 4 (host) devices")
    return (jax.sharding.Mesh(devices[:2], ("tp",)), jax.sharding.Mesh(devices[2:4], ("tp",)))


def split_engine(params, cfg, **kwargs):
    """A pair on the equality test's meshes (context TP2, generation TP2: their compiled
    steps are shared) where there are 4 devices, else on the default device."""
    if len(jax.devices()) >= 4:
        mesh_a, mesh_b = meshes()
        kwargs = dict(context_meshes=(mesh_a,), mesh=mesh_b, **kwargs)
    return disaggregated_engine(params, cfg, **kwargs)


def assert_all_free(engine):
    spec = engine.spec
    assert np.asarray(engine.state.kv.num_free).tolist() == [p.num_usable_pages
                                                             for p in spec.pools]
    assert engine.admission.reserved_pages == (0,) * len(spec.pools)
    assert engine.num_active == 0 and not np.asarray(engine.state.running).any()


def assert_pair_free(engine):
    assert_all_free(engine)
    for ctx in engine.kv_source.contexts:
        ctx.engine.run()
        assert_all_free(ctx.engine)


class Tampered:
    """A KV source whose arrived payloads pass through `change(request_id, payload)` (a
    bad wire); progress and failures pass as they are."""

    def __init__(self, inner, change):
        self.inner, self.change = inner, change
        self.contexts = inner.contexts

    def fetch(self, request):
        self.inner.fetch(request)

    def poll(self, timeout):
        return [(rid, item if item is None or isinstance(item, BaseException)
                 else self.change(rid, item)) for rid, item in self.inner.poll(timeout)]


# Two paths here: device to device, and through host memory. Every path's bytes are
# checked in test_transfer.py; what happens after the move does not depend on the path.
@pytest.mark.parametrize("path", ["coalesced", "host"])
def test_shared_mode_equals_aggregated_token_for_token_and_step_for_step(path, pair,
                                                                         aggregated):
    assert path in MOVE_PATHS
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if path == "pinned_host" and "pinned_host" not in kinds:
        pytest.skip(f"this platform's devices offer no pinned host memory ({sorted(kinds)})")
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


def variant(cfg, **layer_changes):
    layers = tuple(dataclasses.replace(l, **layer_changes) if l.role == "draft" else l
                   for l in cfg.spec.layers)
    return dataclasses.replace(cfg, spec=dataclasses.replace(cfg.spec, layers=layers))


@pytest.mark.parametrize("change,match", [
    (dict(mode="private"), "mode: context worker has 'shared', generation worker has 'private'"),
    (dict(page_size=16), "page_size: context worker has 8, generation worker has 16"),
    (dict(drop_draft=True), "num_draft_layers: context worker has 2, generation worker has 1"),
    (dict(kv_dtype="bf16"), "layers: context worker has .*'f32'.*generation worker has .*'bf16'"),
    (dict(sliding_window=32), "layers: .*16.*32"),
])
def test_kv_format_gate_fails_fast_naming_both_sides(change, match, pair):
    _, cfg = pair
    mode = change.pop("mode", "shared")
    other = cfg
    if change.pop("drop_draft", False):
        layers = tuple(l for l in cfg.spec.layers if l.name != "draft.1")
        other = dataclasses.replace(cfg, spec=dataclasses.replace(cfg.spec, layers=layers))
    elif "page_size" in change:
        other = dataclasses.replace(cfg, spec=dataclasses.replace(cfg.spec, **change))
    elif change:
        other = variant(cfg, **change)
    start = time.monotonic()
    with pytest.raises(KVFormatMismatch, match=match):
        check_kv_formats(KVFormat.of(cfg.spec, "shared"), KVFormat.of(other.spec, mode))
    assert time.monotonic() - start < 1.0


def test_a_mismatched_pair_is_refused_when_built(pair):
    params, cfg = pair
    context = ContextWorker(params, cfg, mode="shared")
    start = time.monotonic()
    with pytest.raises(KVFormatMismatch, match="mode"):
        InProcessSource([context], kv_format=KVFormat.of(cfg.spec, "private"))
    assert time.monotonic() - start < 1.0


# the last pool's corruption with several decode steps in the import's call (the GPU's)
@pytest.mark.parametrize("which, steps", [(0, 1), (-1, 3)])
def test_a_corrupted_buffer_fails_that_request_alone(which, steps, pair, aggregated):
    """Any pool's corruption (the last one too) fails its request inside the
    import step; the others are served exactly, and no page leaks anywhere."""
    params, cfg = pair
    prompts, agg = PROMPTS, aggregated
    engine = split_engine(params, cfg, decode_steps_per_call=steps)
    victim = {}

    def corrupt(request_id, payload):
        if not victim:
            victim["id"] = request_id
            bufs = list(payload.buffers)
            bufs[which] = bufs[which].at[0, 0, 0, 0, 0, 0].add(1.0)  # one value off
            payload = dataclasses.replace(payload, buffers=tuple(bufs))
        return payload

    engine.kv_source = Tampered(engine.kv_source, corrupt)
    requests = [engine.make_request(f"r{i}", p, max_new_tokens=MAX_NEW)
                for i, p in enumerate(prompts)]
    for r in requests:
        engine.submit(r)
    results = {r.request_id: r for r in engine.run()}
    assert len(results) == len(prompts)
    bad = results.pop(victim["id"])
    assert bad.finish_reason == "error" and "checksum" in bad.error and victim["id"] in bad.error
    assert "from context worker 0" in bad.error
    for i, r in enumerate(requests):
        if r.request_id in results:
            assert results[r.request_id].tokens == agg[i].tokens
    assert_pair_free(engine)


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


def test_a_lost_request_times_out_alone_and_frees_its_pages(pair):
    params, cfg = pair
    engine = split_engine(params, cfg, kv_timeout_s=0.5)
    engine.generate([[1, 2, 3, 4, 5]], 4)  # compile outside the timed wait
    engine.kv_source = Tampered(engine.kv_source, lambda rid, item: item)
    real_poll = engine.kv_source.poll
    engine.kv_source.poll = lambda t: [x for x in real_poll(t) if x[0] != "lost"]
    engine.submit(engine.make_request("lost", [1, 2, 3, 4, 5], max_new_tokens=4))
    engine.submit(engine.make_request("kept", [6, 7, 8, 9], max_new_tokens=4))
    start = time.monotonic()
    results = {r.request_id: r for r in engine.run()}
    assert time.monotonic() - start < 5.0
    assert results["kept"].ok and len(results["kept"].tokens) == 4
    assert not results["lost"].ok and "did not arrive within 0.5s" in results["lost"].error
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


def test_room_is_checked_on_the_generation_side_before_any_prefill(pair):
    """6 prompts into 3 generation slots cost exactly 6 prefills."""
    params, cfg = pair
    assert cfg.spec.num_slots < 6
    engine = split_engine(params, cfg)
    prompts = [[i + 1, i + 2, i + 3] for i in range(6)]
    engine.generate(prompts, 6)
    assert engine.kv_source.contexts[0].num_prefilled == 6
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


@pytest.mark.parametrize("threaded", [False, True])
def test_an_id_ended_while_its_kv_is_made_is_refused_until_the_source_answers(threaded, pair,
                                                                            aggregated):
    """The source still works on a cancelled request: its id is refused by name (its late
    KV must never land in a new request of that id), the refusal changes nothing, and
    once the source has answered the id serves a new prompt exactly as aggregated."""
    params, cfg = pair
    engine = disaggregated_engine(params, cfg, threaded=threaded)
    engine.add_request("a", PROMPTS[2], MAX_NEW)
    engine.step()   # admitted: its KV is being made
    assert "cancelled" in engine.cancel("a").error
    with pytest.raises(AdmissionError, match="'a' is still in flight at the KV source"):
        engine.add_request("a", PROMPTS[3], MAX_NEW)
    engine.add_request("b", PROMPTS[1], MAX_NEW)
    results = {r.request_id: r for r in engine.run()}
    assert list(results) == ["b"] and results["b"].tokens == aggregated[1].tokens
    deadline = time.monotonic() + 10.0
    while engine.arrivals.at_source("a") and time.monotonic() < deadline:
        engine.step()   # polls the source
    assert not engine.arrivals.at_source("a")
    engine.add_request("a", PROMPTS[3], MAX_NEW)
    (result,) = engine.run()
    assert result.request_id == "a" and result.tokens == aggregated[3].tokens
    if threaded:
        engine.kv_source.close()
    assert_pair_free(engine)


class RefusingSource:
    """A KV source whose `fetch` raises for one request id (a sender that refuses it)."""

    def __init__(self, inner, refused: str):
        self.inner, self.refused = inner, refused

    def fetch(self, request):
        if request.request_id == self.refused:
            raise RuntimeError("no room for it over there")
        self.inner.fetch(request)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_source_that_refuses_a_fetch_fails_that_request_alone(pair, aggregated):
    params, cfg = pair
    engine = disaggregated_engine(params, cfg)
    engine.kv_source = RefusingSource(engine.kv_source, "refused")
    engine.add_request("refused", PROMPTS[0], MAX_NEW)
    engine.add_request("kept", PROMPTS[1], MAX_NEW)
    results = {r.request_id: r for r in engine.run()}
    assert "its KV source refused it: RuntimeError: no room for it over there" in (
        results["refused"].error)
    assert results["kept"].tokens == aggregated[1].tokens
    assert not engine.arrivals.at_source("refused")
    assert_pair_free(engine)


class DroppingLogprobsSource(RefusingSource):
    """A KV source whose payloads come without the first token's log-probabilities, or
    without the prompt's first chunk's (a sender that does not send them)."""

    def poll(self, timeout):
        return [(rid, dataclasses.replace(item, first_logprobs=None,
                                          prompt_logprobs=item.prompt_logprobs[1:])
                 if hasattr(item, "first_logprobs") else item)
                for rid, item in self.inner.poll(timeout)]


def test_kv_without_the_logprobs_asked_for_fails_that_request_alone(pair, aggregated):
    """A request that asked for log-probabilities (its tokens', its prompt's) whose KV
    arrives without them ends with an error naming what is missing; the request beside
    it is served; no page leaks."""
    params, cfg = pair
    engine = split_engine(params, cfg)
    engine.kv_source = DroppingLogprobsSource(engine.kv_source, "")
    engine.submit(engine.make_request("asks", PROMPTS[0], SamplingParams(MAX_NEW, logprobs=1)))
    engine.submit(engine.make_request("prompt", PROMPTS[2],
                                      SamplingParams(MAX_NEW, prompt_logprobs=1)))
    engine.add_request("kept", PROMPTS[1], MAX_NEW)
    results = {r.request_id: r for r in engine.run()}
    assert "arrived without the first token's log-probabilities" in results["asks"].error
    assert "arrived without the prompt's log-probabilities" in results["prompt"].error
    assert results["kept"].tokens == aggregated[1].tokens
    assert_pair_free(engine)
