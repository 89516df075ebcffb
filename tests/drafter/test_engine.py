"""The engine's request lifecycle: bad input, queueing, stop ids, mixed arrivals, pages,
kernel paths, warm-up and step variants (sampling and log-probabilities:
test_engine_sampling.py)."""

import jax
import numpy as np
import pytest

from drafter.engine import Engine
from drafter.request import RequestError, SamplingParams
from tests.compile_log import compiled_in
from tests.drafter import engine_pair
from tests.drafter.engine_pair import assert_all_free, assert_same, pool_addresses, snapshot
from tests.drafter.tiny import tiny_pair
from unified_kv import AdmissionError

pair = engine_pair.pair  # this module's own pair (a module-scoped fixture)


@pytest.mark.parametrize("prompt,max_new,err,match", [
    ([], 4, RequestError, "empty prompt"),
    ([1, 2, 64], 4, RequestError, r"token ids \[64\] are outside the vocabulary \[0, 64\)"),
    ([1, -1], 4, RequestError, r"token ids \[-1\]"),
    ([1, 63], 4, RequestError, r"\[63\] are reserved"),
    ([1, "2"], 4, RequestError, "non-integer"),
    ([1] * 150, 4, AdmissionError, "exceeds max_seq_len=160"),
    ([1, 2], 0, RequestError, "max_new_tokens must be an integer >= 1"),
])
def test_bad_requests_are_refused_and_leave_others_intact(pair, prompt, max_new, err, match):
    params, speculative_cfg, _ = pair
    engine = Engine(params, speculative_cfg)
    engine.add_request("ok", [5, 6, 7, 8, 9, 10, 11, 12, 13], 6)
    engine.step()
    before = snapshot(engine)
    with pytest.raises(err, match=match):
        engine.add_request("bad", prompt, max_new)
    assert_same(before, snapshot(engine))
    done = engine.run()
    alone = Engine(params, speculative_cfg).generate([[5, 6, 7, 8, 9, 10, 11, 12, 13]], 6)[0]
    assert [r.request_id for r in done] == ["ok"] and done[0].tokens == alone.tokens
    assert_all_free(engine)


def test_duplicate_ids_and_bad_sampling_fields_are_named(pair):
    params, speculative_cfg, _ = pair
    engine = Engine(params, speculative_cfg)
    engine.add_request("a", [1, 2, 3], 4)
    with pytest.raises(AdmissionError, match="'a' is already in flight"):
        engine.add_request("a", [1, 2, 3], 4)
    for fields, match in [(dict(temperature=-1.0), "temperature"),
                          (dict(temperature=float("nan")), "temperature"),
                          (dict(seed=-3), "seed"), (dict(stop_token_ids=(99,)), "stop_token_ids"),
                          (dict(max_new_tokens=2.9), "max_new_tokens"),
                          (dict(max_new_tokens=True), "max_new_tokens"),
                          (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                          (dict(top_p=float("nan")), "top_p"), (dict(top_k=-2), "top_k"),
                          (dict(top_k=2.0), "top_k"), (dict(min_p=-0.1), "min_p"),
                          (dict(min_p=True), "min_p"),
                          (dict(presence_penalty=2.5), "presence_penalty"),
                          (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                          (dict(frequency_penalty=True), "frequency_penalty"),
                          (dict(repetition_penalty=0.0), "repetition_penalty"),
                          (dict(logit_bias={99: 1.0}), "logit_bias"),
                          (dict(logit_bias={3: 101}), "logit_bias"),
                          (dict(logit_bias=((3, 1.0), (3, 2.0))), "logit_bias"),
                          (dict(logit_bias={i: 1.0 for i in range(65)}), "logit_bias"),
                          (dict(logit_bias="3:1"), "logit_bias")]:
        with pytest.raises(RequestError, match=match):
            engine.make_request("b", [1, 2], **fields)


def test_more_requests_than_slots_wait_their_turn(pair):
    params, speculative_cfg, _ = pair
    engine = Engine(params, speculative_cfg)
    prompts = [[i + 1, i + 2] for i in range(5)]
    results = engine.generate(prompts, 5)
    assert [len(r.tokens) for r in results] == [5] * 5
    alone = [Engine(params, speculative_cfg).generate([p], 5)[0].tokens for p in prompts[:2]]
    assert [r.tokens for r in results[:2]] == alone
    assert_all_free(engine)


def test_stop_ids_end_a_request_and_free_its_pages(pair):
    params, speculative_cfg, _ = pair
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    full = Engine(params, speculative_cfg).generate([prompt], 12)[0]
    stop = full.tokens[4]
    cut = full.tokens.index(stop) + 1
    engine = Engine(params, speculative_cfg, eos_token_ids=(full.tokens[cut - 1],))
    by_stop = engine.generate([prompt], params=SamplingParams(12, stop_token_ids=(stop,)))[0]
    assert by_stop.tokens == full.tokens[:cut] and by_stop.finish_reason == "stop"
    # Acceptance counts only the kept tokens: the first token comes from prefill.
    assert sum(by_stop.acceptance) + 1 == len(by_stop.tokens)
    by_eos = engine.generate([prompt], 12)[0]
    assert by_eos.tokens == full.tokens[:cut] and by_eos.finish_reason == "stop"
    ignoring = engine.generate([prompt], params=SamplingParams(12, ignore_eos=True))[0]
    assert ignoring.tokens == full.tokens and ignoring.finish_reason == "length"
    assert_all_free(engine)


def test_acceptance_counts_no_token_past_max_new_tokens(pair):
    params, speculative_cfg, _ = pair
    for max_new in (1, 2, 5, 7):
        r = Engine(params, speculative_cfg).generate([[3, 4, 5, 6, 7, 8]], max_new)[0]
        assert len(r.tokens) == max_new
        assert sum(r.acceptance) + 1 == max_new


def test_prefill_mixed_with_decode_equals_each_request_alone():
    """Long prompts arriving while others decode: chunks of several prompts and
    running rows share steps, and every request's tokens and per-step
    acceptance equal serving it alone."""
    params, cfg, _ = tiny_pair(num_slots=4, max_seq_len=160)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 63, n).tolist() for n in (40, 5, 33, 17, 26, 9)]
    engine = Engine(params, cfg, max_num_batched_tokens=40)
    mixed = engine.generate(prompts, 12, arrival_steps=[0, 0, 2, 3, 3, 5])
    solo = Engine(params, cfg)
    for prompt, got in zip(prompts, mixed):
        want = solo.generate([prompt], 12)[0]
        assert got.tokens == want.tokens and got.acceptance == want.acceptance
    assert_all_free(engine)


def test_lookahead_off_gives_the_same_tokens(pair):
    params, speculative_cfg, _ = pair
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
    ahead = Engine(params, speculative_cfg).generate(prompts, 9)
    lockstep = Engine(params, speculative_cfg, lookahead=False).generate(prompts, 9)
    assert [r.tokens for r in ahead] == [r.tokens for r in lockstep]
    assert [r.acceptance for r in ahead] == [r.acceptance for r in lockstep]


def test_cancel_frees_the_slot_and_its_pages(pair):
    params, speculative_cfg, _ = pair
    engine = Engine(params, speculative_cfg)
    engine.add_request("a", [1, 2, 3, 4, 5], 30)
    engine.step()
    engine.step()
    result = engine.cancel("a")
    assert result.finish_reason == "error" and "cancelled" in result.error
    engine.run()
    assert_all_free(engine)


def test_engine_runs_the_pallas_kernel_path_in_interpret_mode(pair):
    """The GPU path (Pallas batch tables + attention) wired through the engine."""
    params, speculative_cfg, plain_cfg = tiny_pair(num_slots=2, impl="interpret")
    ref_params, ref_cfg, _ = pair  # the same pair on the reference path (its steps compiled)
    assert ref_cfg.impl == "reference" and ref_cfg.spec == speculative_cfg.spec
    prompt = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    got = Engine(params, speculative_cfg).generate(prompt, 5)[0]
    want = Engine(ref_params, ref_cfg).generate(prompt, 5)[0]
    assert got.tokens == want.tokens and got.acceptance == want.acceptance


def test_fp8_kernel_options_stay_lossless_in_interpret_mode():
    """Over fp8 target KV the kernels take their fp8 launch options and
    speculative output still equals plain greedy output (interpret mode)."""
    params, speculative_cfg, plain_cfg = tiny_pair(num_slots=2, target_kv_dtype="fp8_e4m3",
                                                   impl="interpret")
    prompt = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
    speculative = Engine(params, speculative_cfg).generate(prompt, 6)[0]
    plain = Engine(params, plain_cfg, speculative=False).generate(prompt, 6)[0]
    assert speculative.tokens == plain.tokens


def test_warmup_compiles_table_widths_and_changes_nothing(pair):
    params, cfg, _ = pair
    prompts = [[1, 2, 3, 4, 5], list(range(1, 30))]
    want = Engine(params, cfg).generate(prompts, 10)
    engine = Engine(params, cfg)
    engine.add_request("a", prompts[0], 10)
    engine.step()
    before = jax.tree.map(np.asarray, engine.state)
    assert engine.warmup() == 2  # max_seq_len 160 at page 8 spans widths 16 and 32
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, engine.state))
    engine.cancel("a")
    engine.run()
    got = engine.generate(prompts, 10)
    assert [r.tokens for r in got] == [r.tokens for r in want]


def test_a_warmed_up_engine_compiles_no_step_for_prompts_in_its_range(caplog):
    """warmup(max_len, sampled=True) compiles every call a step makes in that range:
    prompts of several lengths arriving alone and together, greedy, sampled and sampled
    with truncation, then compile no step. A config of its own (max_seq_len 152), so that no other test
    compiled its steps first."""
    params, cfg, _ = tiny_pair(num_slots=2, max_seq_len=152)
    engine = Engine(params, cfg)
    engine.warmup(60, sampled=True)
    prompts = [[(3 * i + j) % 60 + 1 for j in range(n)] for i, n in enumerate((5, 19, 33))]
    with compiled_in(caplog, "step") as compiled:
        engine.generate(prompts[:1], 8)
        engine.generate(prompts[1:], 8)
        engine.add_request("t", prompts[2], 8, temperature=0.7, seed=3)
        engine.run()
        engine.add_request("p", prompts[0], 8, temperature=0.7, top_p=0.9)
        engine.add_request("k", prompts[1], 8, temperature=0.7, top_k=5)
        engine.run()
    assert not compiled, compiled


def test_warmup_with_logprobs_compiles_the_steps_that_return_them(caplog):
    """warmup(logprobs=True) also compiles each call returning log-probabilities: a
    request asking for them, alone and beside one that does not, compiles no step. The
    previous test's config (max_seq_len 152): its warm-up compiled the steps without
    log-probabilities (this one's add only those with them), and no test compiles those."""
    params, cfg, _ = tiny_pair(num_slots=2, max_seq_len=152)
    engine = Engine(params, cfg)
    engine.warmup(20, logprobs=True)
    with compiled_in(caplog, "step") as compiled:
        engine.add_request("asks", [1, 2, 3], 6, logprobs=2)
        engine.run()
        engine.add_request("asks-too", [4, 5, 6, 7], 6, logprobs=0)
        engine.add_request("not", [8, 9], 6)
        got = {r.request_id: r for r in engine.run()}
    assert not compiled, compiled
    assert [len(x.top) for x in got["asks-too"].logprobs] == [0] * 6
    assert got["not"].logprobs is None


def test_warmup_adjusted_compiles_the_steps_that_adjust_logits(caplog):
    """warmup(adjusted=True) also compiles each call that adjusts logits and the prompt
    marks of a repetition penalty: penalized and biased requests, alone and beside one
    that is neither, compile no step (the previous tests' config)."""
    params, cfg, _ = tiny_pair(num_slots=2, max_seq_len=152)
    engine = Engine(params, cfg)
    engine.warmup(20, adjusted=True)
    with compiled_in(caplog, "step") as compiled:
        engine.add_request("pen", [1, 2, 3], 6, presence_penalty=0.5)
        engine.run()
        engine.add_request("pen-too", [4, 5, 6, 7], 6, frequency_penalty=-1.0)
        engine.add_request("biased", [2, 4], 6, logit_bias={3: 5.0})
        engine.add_request("repeats", [5, 6, 5] * 7, 6, repetition_penalty=1.2)
        engine.add_request("not", [8, 9], 6)
        engine.run()
    assert not compiled, compiled


def test_a_warm_engine_compiles_nothing_more(pair, caplog):
    params, cfg, _ = pair  # params committed, as checkpoints load
    engine = Engine(params, cfg)
    engine.generate([[1, 2, 3, 4, 5]], 6)  # compiles every step it needs once (if not yet)
    with compiled_in(caplog) as compiled:
        engine.generate([[6, 7, 8, 9, 10]], 6)
    assert not compiled, compiled


def test_several_decode_steps_per_call_give_the_same_tokens(pair):
    """Steady decoding runs k steps per call; stops and max_new_tokens that fall
    inside a call cut there, and acceptance counts only kept tokens; penalized requests
    too."""
    params, speculative_cfg, _ = pair
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
    one = Engine(params, speculative_cfg).generate(prompts, 13)
    engine = Engine(params, speculative_cfg, decode_steps_per_call=3)
    three = engine.generate(prompts, 13)
    assert [r.tokens for r in three] == [r.tokens for r in one]
    assert [r.acceptance for r in three] == [r.acceptance for r in one]
    stop = one[1].tokens[6]
    cut = engine.generate([prompts[1]], params=SamplingParams(13, stop_token_ids=(stop,)))[0]
    assert cut.tokens == one[1].tokens[:one[1].tokens.index(stop) + 1]
    assert sum(cut.acceptance) + 1 == len(cut.tokens)
    # penalties count every token of the call's earlier steps (the GPU runs 8 a call)
    penalized = SamplingParams(13, presence_penalty=1.5, frequency_penalty=0.5)
    assert [r.tokens for r in engine.generate(prompts, params=penalized)] == \
        [r.tokens for r in Engine(params, speculative_cfg).generate(prompts, params=penalized)]
    assert_all_free(engine)


def test_batch_invariant_engines_run_every_prefill_call_at_full_rows(pair):
    """A lone prompt's prefill call is padded to the step's full rows, so every prefill
    call has one shape whatever arrives with it; the tokens are those of the default."""
    params, speculative_cfg, _ = pair
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 60, n).tolist() for n in (11, 20)]
    seen = {}
    for invariant in (False, True):
        engine = Engine(params, speculative_cfg, batch_invariant=invariant)
        rows, step_fn = [], engine.executor._step_fn

        def spy(*args, rows=rows, step_fn=step_fn, **kwargs):
            if not kwargs["num_decode"] and kwargs["num_prefill"]:
                rows.append(kwargs["num_prefill"])
            return step_fn(*args, **kwargs)

        engine.executor._step_fn = spy
        results = engine.generate(prompts, 8, arrival_steps=[0, 4])   # each prefills alone
        seen[invariant] = (sorted(set(rows)), [r.tokens for r in results])
        assert_all_free(engine)
    full = engine.scheduler.max_prefill_rows
    assert full > 1 and seen[False][0] == [1] and seen[True][0] == [full]
    assert seen[True][1] == seen[False][1]


def test_prefill_calls_pad_their_rows_to_a_power_of_two():
    """Three prompts arriving together prefill in one call of 4 rows, two in one of 2
    (not the step's most), and each generates its tokens alone."""
    params, cfg, _ = tiny_pair(num_slots=4)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, 60, n).tolist() for n in (6, 7, 5, 8, 4)]
    engine = Engine(params, cfg)
    assert engine.scheduler.max_prefill_rows == 4
    rows, step_fn = [], engine.executor._step_fn

    def spy(*args, **kwargs):
        if kwargs["num_prefill"]:
            rows.append(kwargs["num_prefill"])
        return step_fn(*args, **kwargs)

    engine.executor._step_fn = spy
    got = engine.generate(prompts, 6, arrival_steps=[0, 0, 0, 8, 8])
    assert rows == [4, 2]
    alone = [Engine(params, cfg).generate([p], 6)[0].tokens for p in prompts]
    assert [r.tokens for r in got] == alone
    assert_all_free(engine)


def test_decode_calls_run_a_row_per_running_request_padded_to_a_power_of_two():
    """A decode call runs `padded_rows` of its requests, not a row per slot: staggered
    arrivals decode in calls of 1, 2 and 4 rows on a 4-slot engine, and each request's
    tokens are those it generates alone (and those of an engine decoding every slot)."""
    params, cfg, _ = tiny_pair(num_slots=4)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(1, 60, n).tolist() for n in (6, 9, 5)]
    engine = Engine(params, cfg)
    calls, run = [], engine.executor.run

    def spy(plan, **kwargs):
        if plan.decode:
            calls.append((len(plan.decode), kwargs["decode_rows"]))
        return run(plan, **kwargs)

    engine.executor.run = spy
    got = [r.tokens for r in engine.generate(prompts, 12, arrival_steps=[0, 3, 6])]
    assert all(rows == 1 << (n - 1).bit_length() for n, rows in calls)
    assert {rows for _, rows in calls} == {1, 2, 4}
    assert got == [Engine(params, cfg).generate([p], 12)[0].tokens for p in prompts]
    every_slot = Engine(params, cfg, batch_invariant=True)
    assert every_slot.scheduler.rows_for("decode", 1) == 4
    assert [r.tokens for r in every_slot.generate(prompts, 12, arrival_steps=[0, 3, 6])] == got
    assert_all_free(engine)


def test_alternated_step_copies_give_the_same_tokens_and_are_all_warmed(caplog):
    """StepConfig.graph_copies=2: each program variant's calls alternate between two
    copies of it, with the same tokens and acceptance as one program; warmup compiles
    every copy, so a warm engine compiles no step."""
    import dataclasses
    params, cfg, _ = tiny_pair(num_slots=2, max_seq_len=144)
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
    want = Engine(params, cfg).generate(prompts, 13)
    engine = Engine(params, dataclasses.replace(cfg, graph_copies=2))
    engine.warmup(40)
    used = []
    for steps in engine.executor._steps.values():
        steps.copies = tuple((lambda *a, k=k, fn=fn, **kw: (used.append(k), fn(*a, **kw))[1])
                             for k, fn in enumerate(steps.copies))
    with compiled_in(caplog, "step") as compiled:
        got = engine.generate(prompts, 13)
    assert not compiled, compiled
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.acceptance for r in got] == [r.acceptance for r in want]
    assert set(used) == {0, 1} and len(used) > 2
    assert_all_free(engine)
    with pytest.raises(ValueError, match="graph_copies is 0"):
        Engine(params, dataclasses.replace(cfg, graph_copies=0))


def test_every_step_call_writes_the_cache_in_place(pair):
    """Prefill chunks and decode calls update the pools in the buffers they were given
    (donated, aliased to the outputs): a call that copied a pool would hold two caches
    at once, and an engine sized to the device's memory would run out of it."""
    params, speculative_cfg, _ = pair
    engine = Engine(params, speculative_cfg)
    pointers = pool_addresses(engine)
    chunk = engine.spec.max_step_tokens
    engine.add_request("long", [5 + i % 50 for i in range(3 * chunk + 7)], 12)
    engine.add_request("short", [7, 8, 9], 12)
    while engine.has_work:
        engine.step()
        assert pool_addresses(engine) == pointers
    assert engine.executor.calls["prefill"] >= 3 and engine.executor.calls["decode"] >= 2


def test_a_cache_the_device_cannot_hold_fails_at_construction_naming_its_size(monkeypatch):
    """The cache is allocated when the engine is made (not at its first step's read), and
    a device out of memory for it raises CacheMemoryError naming the pools' total and
    largest size and what to change; other runtime errors pass as they are."""
    from drafter import executor
    params, cfg, _ = tiny_pair(num_slots=2, max_seq_len=64)

    def out_of_memory(spec, mesh=None):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying "
                                         "to allocate 23.20GiB")
    monkeypatch.setattr(executor, "init_state", out_of_memory)
    total = sum(pool.nbytes for pool in cfg.spec.pools) / 2**30
    with pytest.raises(executor.CacheMemoryError,
                       match=rf"pools take {total:.2f} GiB, the largest .* GiB in one piece.*"
                             r"--kv-memory-mib.*TF_GPU_ALLOCATOR=cuda_malloc_async.*23\.20GiB"):
        Engine(params, cfg)

    def other_failure(spec, mesh=None):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")
    monkeypatch.setattr(executor, "init_state", other_failure)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        Engine(params, cfg)
