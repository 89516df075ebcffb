"""The engine's sampled requests, log-probabilities, penalties, logit bias and
min_tokens, each against the target's own distribution."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from drafter.engine import Engine
from drafter.request import RequestError, SamplingParams
from tests.drafter import engine_pair
from tests.drafter.engine_pair import assert_all_free

pair = engine_pair.pair  # this module's own pair (a module-scoped fixture)


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


def test_a_prefill_runs_the_head_over_a_whole_chunk_only_for_prompt_logprobs(pair,
                                                                             monkeypatch):
    """A prefill's first tokens need the head at each row's last position alone ([B, 1,
    H]); the head over every chunk position, a matmul of vocab columns a token and an
    f32 [B, T, vocab] buffer, runs only in the log-probabilities variant."""
    import drafter.steps as steps
    from drafter.sampling import Sampler
    from drafter.steps import init_step_state
    from unified_kv import init_state
    params, cfg, _ = pair
    heads, real_head = [], steps.lm_head
    monkeypatch.setattr(steps, "lm_head", lambda p, c, x: heads.append(x.shape) or
                        real_head(p, c, x))
    rows, chunk = 2, cfg.spec.max_step_tokens
    state = init_step_state(cfg, init_state(cfg.spec))
    args = (params, state, np.arange(rows, dtype=np.int32), np.ones((rows, chunk), np.int32),
            np.full(rows, chunk, np.int32), np.ones(rows, bool),
            Sampler.uniform(rows, 0.0, jax.random.key(0)))
    hidden = cfg.target.hidden_size
    for logprobs, expected in ((False, [(rows, 1, hidden)]),
                               (True, [(rows, 1, hidden), (rows, chunk, hidden)])):
        heads.clear()
        jax.eval_shape(functools.partial(steps.prefill_rows, cfg=cfg, table_width=8,
                                         logprobs=logprobs,
                                         next_tokens=np.zeros(rows, np.int32)), *args)
        assert heads == expected, logprobs
