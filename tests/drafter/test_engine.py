"""The engine's request lifecycle: bad input, queueing, stop ids, mixed arrivals, pages."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from drafter.engine import Engine
from drafter.request import RequestError, SamplingParams
from tests.compile_log import compiled_in
from tests.drafter.tiny import tiny_pair
from unified_kv import AdmissionError


@pytest.fixture(scope="module")
def pair():
    """The module's one reference pair, its params committed to a device as checkpoints
    load: every test serving on it shares its compiled steps (tests/models/test_checkpoint.py
    serves the same config, so its steps come from the run's compilation cache)."""
    params, speculative_cfg, plain_cfg = tiny_pair(num_slots=2)
    return jax.device_put(params, jax.devices()[0]), speculative_cfg, plain_cfg


def snapshot(engine):
    return jax.tree.map(np.asarray, engine.state)


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def assert_all_free(engine):
    spec = engine.spec
    assert np.asarray(engine.state.kv.num_free).tolist() == [p.num_usable_pages
                                                             for p in spec.pools]
    assert engine.admission.reserved_pages == (0,) * len(spec.pools)
    assert engine.admission.num_free_slots == spec.num_slots
    assert not np.asarray(engine.state.running).any()


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


def test_sampled_requests_draw_the_same_whatever_shares_their_batch(pair):
    params, speculative_cfg, _ = pair
    sampling = SamplingParams(10, temperature=0.8, seed=11)
    alone = Engine(params, speculative_cfg).generate([[1, 2, 3, 4]], params=sampling)[0]
    engine = Engine(params, speculative_cfg)
    engine.submit(engine.make_request("greedy", [9, 8, 7, 6, 5], max_new_tokens=10))
    engine.submit(engine.make_request("sampled", [1, 2, 3, 4], sampling))
    got = {r.request_id: r for r in engine.run()}
    assert got["sampled"].tokens == alone.tokens
    other = Engine(params, speculative_cfg).generate(
        [[1, 2, 3, 4]], params=SamplingParams(10, temperature=0.8, seed=12))[0]
    assert other.tokens != alone.tokens  # the seed matters


@pytest.mark.parametrize("truncation", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_sampling_truncated_to_the_most_likely_token_is_greedy(pair, truncation):
    """At a high temperature, a truncation that keeps one token gives greedy's tokens and
    acceptance, speculative and plain, beside an untruncated sampled row that draws what
    it draws alone."""
    params, speculative_cfg, plain_cfg = pair
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6, 5]]
    free = SamplingParams(10, temperature=0.9, seed=5)
    for speculative, cfg in ((True, speculative_cfg), (False, plain_cfg)):
        make = functools.partial(Engine, params, cfg, speculative=speculative)
        greedy = make().generate(prompts[:1], 10)[0]
        free_alone = make().generate(prompts[1:], params=free)[0]
        engine = make()
        engine.submit(engine.make_request(
            "one", prompts[0], SamplingParams(10, temperature=3.0, seed=1, **truncation)))
        engine.submit(engine.make_request("free", prompts[1], free))
        got = {r.request_id: r for r in engine.run()}
        assert got["one"].tokens == greedy.tokens
        assert got["one"].acceptance == greedy.acceptance
        assert got["free"].tokens == free_alone.tokens
        assert_all_free(engine)


def test_logprobs_are_the_targets_own_for_every_kept_token(pair):
    """Each generated token's log-probability, and the most likely tokens at its position
    with theirs, are the target's (a dense forward over prompt + output, f32), speculative
    and plain, for kept tokens only; asking for them changes no token; a request that does
    not ask beside one that does gets None."""
    from models.qwen3 import dense_forward
    params, speculative_cfg, plain_cfg = pair
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6, 5]]
    for speculative, cfg in ((True, speculative_cfg), (False, plain_cfg)):
        engine = Engine(params, cfg, speculative=speculative)
        alone = engine.generate(prompts, 9)
        engine.submit(engine.make_request("asks", prompts[0], SamplingParams(9, logprobs=3)))
        engine.submit(engine.make_request("not", prompts[1], SamplingParams(9)))
        got = {r.request_id: r for r in engine.run()}
        assert got["asks"].tokens == alone[0].tokens and got["not"].tokens == alone[1].tokens
        assert got["not"].logprobs is None
        tokens, logprobs = got["asks"].tokens, got["asks"].logprobs
        assert len(logprobs) == len(tokens) == 9
        with jax.default_matmul_precision("highest"):   # an f32 reference on GPUs too
            logits, _ = dense_forward(params["target"], cfg.target,
                                      np.asarray([prompts[0] + tokens], np.int32))
        reference = np.asarray(jax.nn.log_softmax(logits[0].astype(np.float32), axis=-1))
        for i, (token, lp) in enumerate(zip(tokens, logprobs)):
            row = reference[len(prompts[0]) - 1 + i]   # the position that predicts token i
            most_likely = np.argsort(-row, kind="stable")[:3]
            np.testing.assert_allclose(lp.logprob, row[token], atol=2e-4)
            assert [t for t, _ in lp.top] == most_likely.tolist()
            np.testing.assert_allclose([x for _, x in lp.top], row[most_likely], atol=2e-4)
        assert_all_free(engine)
    with pytest.raises(RequestError, match="logprobs must be an integer in \\[0, 20\\]"):
        engine.make_request("bad", prompts[0], SamplingParams(4, logprobs=21))


def assert_prompt_logprobs(params, target_cfg, prompt, got, top):
    """`got` (Result.prompt_logprobs) is None for the first prompt token, then each prompt
    token's log-probability and the `top` most likely tokens at the position before it,
    from a dense f32 forward over the prompt."""
    from models.qwen3 import dense_forward
    with jax.default_matmul_precision("highest"):   # an f32 reference on GPUs too
        logits, _ = dense_forward(params["target"], target_cfg, np.asarray([prompt], np.int32))
    reference = np.asarray(jax.nn.log_softmax(logits[0].astype(np.float32), axis=-1))
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        row = reference[i - 1]
        most_likely = np.argsort(-row, kind="stable")[:top]
        np.testing.assert_allclose(got[i].logprob, row[prompt[i]], atol=2e-4)
        assert [t for t, _ in got[i].top] == most_likely.tolist(), i
        np.testing.assert_allclose([x for _, x in got[i].top], row[most_likely], atol=2e-4)


def test_prompt_logprobs_are_the_targets_own_across_chunks(pair):
    """A prompt's log-probabilities (vLLM's prompt_logprobs) are the target's at every
    position, across prefill chunks (8 tokens here) and a one-token prompt's none,
    speculative and plain, beside token log-probabilities; asking changes no token; a
    request that does not ask gets None."""
    params, speculative_cfg, plain_cfg = pair
    prompts = [list(range(1, 21)), [7], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    asked = [SamplingParams(6, prompt_logprobs=2), SamplingParams(6, prompt_logprobs=0),
             SamplingParams(6, prompt_logprobs=3, logprobs=1)]
    for speculative, cfg in ((True, speculative_cfg), (False, plain_cfg)):
        engine = Engine(params, cfg, speculative=speculative)
        alone = engine.generate(prompts, 6)
        for i, (prompt, p) in enumerate(zip(prompts, asked)):
            engine.submit(engine.make_request(f"r{i}", prompt, p))
        engine.submit(engine.make_request("not", prompts[0], SamplingParams(6)))
        got = {r.request_id: r for r in engine.run()}
        assert [got[f"r{i}"].tokens for i in range(3)] == [r.tokens for r in alone]
        assert got["not"].prompt_logprobs is None and got["r0"].logprobs is None
        assert got["r1"].prompt_logprobs == [None]
        assert len(got["r2"].logprobs) == 6
        for i in (0, 2):
            assert_prompt_logprobs(params, cfg.target, prompts[i], got[f"r{i}"].prompt_logprobs,
                                   asked[i].prompt_logprobs)
        assert_all_free(engine)
    with pytest.raises(RequestError, match="prompt_logprobs must be an integer") as e:
        engine.make_request("bad", prompts[0], SamplingParams(4, prompt_logprobs=-1))
    assert e.value.field == "prompt_logprobs"


def test_penalties_score_each_token_against_the_tokens_generated_before_it(pair):
    """Presence and frequency penalties, with a logit bias and a repetition penalty: every
    generated token is the most likely one of the target's logits (a dense f32 forward
    over prompt + output) plus its bias, its repetition penalty applied for the prompt's
    tokens and those generated before it, less its other penalties for the latter; a request without them beside gets what it gets
    alone; they change what the pair generates. (Speculative equals plain under them,
    with drafts accepted: tests/drafter/test_default_pair.py.)"""
    from models.qwen3 import dense_forward
    params, cfg, _ = pair
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6, 5]]
    asked = [SamplingParams(14, presence_penalty=1.5, frequency_penalty=0.5),
             SamplingParams(14, frequency_penalty=-0.4, presence_penalty=0.3,
                            logit_bias={41: -0.8, 5: 0.6, 0: 0.2}, repetition_penalty=1.4)]
    engine = Engine(params, cfg)
    alone = engine.generate(prompts[:1], 14)[0]
    for i, (prompt, p) in enumerate(zip(prompts, asked)):
        engine.submit(engine.make_request(f"pen{i}", prompt, p))
    engine.submit(engine.make_request("plain", prompts[0], SamplingParams(14)))
    out = {r.request_id: r for r in engine.run()}
    assert out["plain"].tokens == alone.tokens
    assert out["pen0"].tokens != alone.tokens   # a presence penalty of 1.5 changes the output
    assert_all_free(engine)
    for i, (prompt, p) in enumerate(zip(prompts, asked)):
        tokens = out[f"pen{i}"].tokens
        with jax.default_matmul_precision("highest"):   # an f32 reference on GPUs too
            logits, _ = dense_forward(params["target"], cfg.target,
                                      np.asarray([prompt + tokens], np.int32))
        logits = np.asarray(logits[0], np.float64)
        for j, token in enumerate(tokens):
            seen = np.bincount(tokens[:j], minlength=logits.shape[-1])
            score = logits[len(prompt) - 1 + j].copy()
            for token_id, bias in p.logit_bias:
                score[token_id] += bias
            hit = (seen > 0) | np.isin(np.arange(len(seen)), prompt)
            r = p.repetition_penalty
            score = np.where(hit, np.where(score > 0, score / r, score * r), score)
            score -= p.frequency_penalty * seen + p.presence_penalty * (seen > 0)
            assert score[token] >= score.max() - 1e-4, (j, token, int(score.argmax()))


def test_logit_bias_forces_and_bans_tokens_from_the_first_one_on(pair):
    """A bias of 100 makes every token (the prefill's first included) that one; -100 keeps
    a token out; a request without a bias beside them gets what it gets alone."""
    params, cfg, _ = pair
    engine = Engine(params, cfg)
    prompt = [1, 2, 3, 4]
    alone = engine.generate([prompt], 10)[0].tokens
    banned = alone[0]
    engine.submit(engine.make_request("forced", prompt, SamplingParams(10, logit_bias={7: 100})))
    engine.submit(engine.make_request("banned", prompt,
                                      SamplingParams(10, logit_bias={banned: -100.0})))
    engine.submit(engine.make_request("plain", prompt, SamplingParams(10)))
    got = {r.request_id: r.tokens for r in engine.run()}
    assert got["forced"] == [7] * 10
    assert banned not in got["banned"] and len(got["banned"]) == 10
    assert got["plain"] == alone
    assert_all_free(engine)


def test_min_tokens_bans_stop_and_eos_ids_from_the_first_tokens_only(pair):
    """With min_tokens, none of a request's first min_tokens tokens is a stop id or an
    EOS id (each is the most likely token of the target's logits, a dense f32 forward,
    less those ids), and the first such id after them ends it; ignore_eos leaves EOS
    unbanned; speculative equals plain; a request without it beside gets what it gets
    alone; its pages come back."""
    from models.qwen3 import dense_forward
    params, cfg, plain_cfg = pair
    prompt = [1, 2, 3, 4]
    alone = Engine(params, cfg).generate([prompt], 16)[0].tokens
    stop, eos = alone[0], alone[2]   # unbanned, the first token would end it
    asked = {"min": SamplingParams(16, stop_token_ids=(stop,), min_tokens=6),
             "min-ignoring-eos": SamplingParams(16, stop_token_ids=(stop,), min_tokens=3,
                                                ignore_eos=True),
             "min-all": SamplingParams(16, stop_token_ids=(stop,), min_tokens=16)}
    got = {}
    for name, step_cfg in (("spec", cfg), ("plain", plain_cfg)):
        engine = Engine(params, step_cfg, speculative=step_cfg is cfg, eos_token_ids=(eos,))
        for rid, p in asked.items():
            engine.submit(engine.make_request(rid, prompt, p))
        engine.submit(engine.make_request("plain", prompt, SamplingParams(16, ignore_eos=True)))
        got[name] = {r.request_id: r for r in engine.run()}
        assert_all_free(engine)
    assert {k: r.tokens for k, r in got["spec"].items()} == {
        k: r.tokens for k, r in got["plain"].items()}
    out = got["spec"]
    assert out["plain"].tokens == alone
    assert len(out["min-all"].tokens) == 16 and out["min-all"].finish_reason == "length"
    for rid, p in asked.items():
        tokens, banned = out[rid].tokens, {stop} | (set() if p.ignore_eos else {eos})
        with jax.default_matmul_precision("highest"):   # an f32 reference on GPUs too
            logits, _ = dense_forward(params["target"], cfg.target,
                                      np.asarray([prompt + tokens], np.int32))
        logits = np.asarray(logits[0], np.float64)
        for j, token in enumerate(tokens):
            score = logits[len(prompt) - 1 + j].copy()
            if j < p.min_tokens:
                score[list(banned)] = -np.inf
            assert score[token] >= score.max() - 1e-4, (rid, j, token, int(score.argmax()))
        ends = [j for j, t in enumerate(tokens) if t in banned | {stop}]
        assert all(j >= p.min_tokens for j in ends), (rid, tokens)
        if out[rid].finish_reason == "stop":
            assert ends == [len(tokens) - 1]
    assert out["min"].tokens[0] != stop   # the ban changed the first token


def test_min_tokens_is_checked(pair):
    """min_tokens beyond max_new_tokens, and bans that with the logit bias overflow its
    entries, are refused naming the field."""
    params, cfg, _ = pair
    engine = Engine(params, cfg, eos_token_ids=(0,))
    with pytest.raises(RequestError, match=r"min_tokens must be an integer in \[0, "
                                           r"max_new_tokens=4\]") as e:
        engine.make_request("big", [1, 2], SamplingParams(4, min_tokens=5))
    assert e.value.field == "min_tokens"
    crowded = SamplingParams(4, min_tokens=2, stop_token_ids=tuple(range(1, 10)),
                             logit_bias={i: 0.5 for i in (0, *range(10, 64))})
    with pytest.raises(RequestError, match="min_tokens bans its 10 stop ids .* at most 64"):
        engine.submit(engine.make_request("crowded", [1, 2], crowded))
    engine.submit(engine.make_request("fits", [1, 2], dataclasses.replace(
        crowded, ignore_eos=True)))   # 9 bans + 55 entries
    assert len(engine.run()[0].tokens) == 4
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
            if not kwargs["decode"] and kwargs["num_prefill"]:
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
