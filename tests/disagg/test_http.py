"""The OpenAI-compatible HTTP server's completions, driven by the official `openai`
client and raw HTTP: answers equal to the engine's, greedy, sampled and penalized;
streaming, stops and concurrent clients; n choices and batched prompts; health and
metrics (refusals and failures: test_http_failures.py). The server:
tests/disagg/http_server.py."""

import concurrent.futures
import json

import pytest

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from disagg.schema import parse_completion  # noqa: E402
from unified_kv import AdmissionError  # noqa: E402
from tests.disagg.http_server import (  # noqa: E402
    CHATS, DEFAULT_MAX_TOKENS, MAX_TOKENS, PENALTIES, PROMPTS, get, post)



def test_completion_equals_the_engines_greedy_output(server):
    c, tok = server["client"], server["tok"]
    prompt = PROMPTS[0]
    out = c.completions.create(model=server["name"], prompt=prompt, max_tokens=MAX_TOKENS,
                               temperature=0)
    want = server["greedy"][prompt]
    choice = out.choices[0]
    assert choice.token_ids == want
    assert choice.text == tok.decode(want)
    assert choice.finish_reason == ("length" if len(want) == MAX_TOKENS else "stop")
    assert out.usage.prompt_tokens == len(tok.encode(prompt))
    assert out.usage.completion_tokens == len(want)
    assert 1.0 <= out.acceptance_length <= server["block"]
    # token ids in, same tokens out
    ids = c.completions.create(model=server["name"], prompt=tok.encode(prompt),
                               max_tokens=MAX_TOKENS, temperature=0)
    assert ids.choices[0].token_ids == want


def test_logprobs_of_completions_and_chats_are_the_engines(server):
    """`logprobs` (completions: OpenAI's legacy form; chat: logprobs + top_logprobs) gives
    the engine's log-probabilities for each token, whole and streamed alike; values out
    of range or top_logprobs without logprobs are refused naming the field."""
    import numpy as np
    c, name, tok = server["client"], server["name"], server["tok"]
    want = server["logprobs"]["prompt"]
    out = c.completions.create(model=name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                               temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert out.choices[0].token_ids == want.tokens
    assert lp.tokens == [tok.decode([t]) for t in want.tokens]
    np.testing.assert_allclose(lp.token_logprobs, [x.logprob for x in want.logprobs],
                               atol=1e-5)
    for top, x, t in zip(lp.top_logprobs, want.logprobs, want.tokens):
        assert len(x.top) == 3 and tok.decode([t]) in top   # the chosen token's, always
        expected = {}
        for t, v in x.top:   # tokens whose texts collide keep the first (most likely)
            expected.setdefault(tok.decode([t]), v)
        np.testing.assert_allclose([top[k] for k in expected], list(expected.values()),
                                   atol=1e-5)
    assert lp.text_offset == np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]).tolist()
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in c.completions.create(model=name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                      temperature=0, logprobs=3, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key, values in streamed.items():
                values += getattr(chunk.choices[0].logprobs, key)
    assert streamed == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs,
                        "text_offset": lp.text_offset}
    want = server["logprobs"]["chat"]
    chat = c.chat.completions.create(model=name, messages=CHATS["add"][0], temperature=0,
                                     max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [e.token for e in content] == [tok.decode([t]) for t in want.tokens]
    np.testing.assert_allclose([e.logprob for e in content], [x.logprob for x in want.logprobs],
                               atol=1e-5)
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(tok.token_bytes(t))
               for e, t in zip(content, want.tokens))   # a byte of a character: that byte
    plain = c.chat.completions.create(model=name, messages=CHATS["add"][0], temperature=0,
                                      max_tokens=4)
    assert plain.choices[0].logprobs is None
    url = server["url"]
    for path, body, field in (
            ("completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
            ("completions", {"prompt": "x", "logprobs": True}, "logprobs"),
            ("chat/completions", {"messages": CHATS["add"][0], "top_logprobs": 2},
             "top_logprobs"),
            ("chat/completions", {"messages": CHATS["add"][0], "logprobs": True,
                                  "top_logprobs": 21}, "top_logprobs")):
        status, text = post(f"{url}/v1/{path}", {"model": name, "max_tokens": 2, **body})
        assert status == 400 and json.loads(text)["error"]["param"] == field, text


def test_sampling_truncated_to_one_token_gives_greedy_output_through_the_client(server):
    """top_p (OpenAI's own field) and top_k / min_p (extensions, as vLLM takes them)
    reach the engine: each cut to the most likely token, a hot sampled request returns
    the greedy tokens, completion and chat alike."""
    c, name = server["client"], server["name"]
    prompt = PROMPTS[0]
    for kw in (dict(top_p=1e-6), dict(extra_body={"top_k": 1}),
               dict(extra_body={"min_p": 1.0, "top_p": None})):
        out = c.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS,
                                   temperature=5.0, seed=3, **kw)
        assert out.choices[0].token_ids == server["greedy"][prompt], kw
    chat = c.chat.completions.create(model=name, messages=CHATS["add"][0], temperature=5.0,
                                     max_tokens=MAX_TOKENS, extra_body={"top_k": 1})
    assert chat.choices[0].token_ids == server["greedy"]["add"]


def test_penalties_reach_the_engine_through_the_client(server):
    """presence_penalty and frequency_penalty (OpenAI's fields) give the engine's penalized
    tokens, completion and chat, whole and streamed."""
    c, name = server["client"], server["name"]
    want = server["penalized"]
    assert want["prompt"] != server["greedy"][PROMPTS[0]]   # the penalties change the output
    out = c.completions.create(model=name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                               temperature=0, **PENALTIES)
    assert out.choices[0].token_ids == want["prompt"]
    streamed = c.completions.create(model=name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                    temperature=0, stream=True, **PENALTIES)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == \
        out.choices[0].text
    chat = c.chat.completions.create(model=name, messages=CHATS["add"][0], temperature=0,
                                     max_tokens=MAX_TOKENS, **PENALTIES)
    assert chat.choices[0].token_ids == want["chat"]


def test_logit_bias_reaches_the_engine_through_the_client(server):
    """OpenAI's logit_bias ({"token id": bias}): 100 forces a token from the first one on,
    completion and chat; -100 keeps the greedy output's first token out."""
    c, name = server["client"], server["name"]
    forced = ord("x")   # the embedded pair's byte-level ids
    out = c.completions.create(model=name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                               temperature=0, logit_bias={str(forced): 100})
    assert out.choices[0].token_ids == [forced] * MAX_TOKENS
    chat = c.chat.completions.create(model=name, messages=CHATS["add"][0], temperature=0,
                                     max_tokens=MAX_TOKENS, logit_bias={str(forced): 100})
    assert chat.choices[0].token_ids == [forced] * MAX_TOKENS
    banned = server["greedy"][PROMPTS[0]][0]
    out = c.completions.create(model=name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                               temperature=0, logit_bias={str(banned): -100})
    assert banned not in out.choices[0].token_ids


def test_streamed_pieces_make_the_same_text(server):
    c, tok = server["client"], server["tok"]
    prompt = PROMPTS[1]
    chunks = list(c.completions.create(model=server["name"], prompt=prompt,
                                       max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    text_chunks = [ch for ch in chunks if ch.choices]
    assert len(text_chunks) >= 2, "tokens arrive in several pieces as decode steps commit them"
    want = server["greedy"][prompt]
    assert "".join(ch.choices[0].text for ch in text_chunks) == tok.decode(want)
    assert [t for ch in text_chunks for t in ch.choices[0].token_ids] == want
    assert [ch.choices[0].finish_reason for ch in text_chunks][:-1] == \
        [None] * (len(text_chunks) - 1)
    assert text_chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert chunks[-1].usage.completion_tokens == len(want)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences_cut_the_text(server, stream):
    c, tok = server["client"], server["tok"]
    prompt = PROMPTS[2]
    full = tok.decode(server["greedy"][prompt])
    stop = full[5:8]  # a stop string inside the greedy output, not at its start
    cut = full[:full.index(stop)]
    res = c.completions.create(model=server["name"], prompt=prompt, max_tokens=MAX_TOKENS,
                               temperature=0, stop=[stop, "\x00never"], stream=stream)
    if stream:
        chunks = [ch for ch in res if ch.choices]
        text = "".join(ch.choices[0].text for ch in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        text, reason = res.choices[0].text, res.choices[0].finish_reason
        assert tok.decode(res.choices[0].token_ids).startswith(cut + stop)
    assert (text, reason) == (cut, "stop")


def test_concurrent_clients_each_get_their_greedy_output(server):
    c = server["client"]

    def one(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            chunks = c.completions.create(model=server["name"], prompt=prompt, temperature=0,
                                          max_tokens=MAX_TOKENS, stream=True)
            return prompt, [t for ch in chunks for t in ch.choices[0].token_ids]
        out = c.completions.create(model=server["name"], prompt=prompt, temperature=0,
                                   max_tokens=MAX_TOKENS)
        return prompt, out.choices[0].token_ids

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(one, range(6), timeout=300))
    for prompt, tokens in got:
        assert tokens == server["greedy"][prompt], prompt


def test_min_tokens_bans_stop_ids_and_delays_stop_strings_through_the_client(server):
    """vLLM's min_tokens (extra_body): a stop string within the first min_tokens tokens'
    text does not end the completion, one after it does, whole and streamed; a stop id
    is kept out of the first min_tokens tokens."""
    c, name, tok = server["client"], server["name"], server["tok"]
    greedy = server["greedy"][PROMPTS[0]]
    text = tok.decode(greedy)
    # byte-level, ASCII: token k ends at character k; a character that comes twice
    stop = next(ch for ch in text if text.count(ch) > 1)
    first = text.index(stop)
    ask = dict(model=name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
               stop=[stop])
    assert c.completions.create(**ask).choices[0].text == text[:first]
    want = text[:text.index(stop, first + 1)]   # min_tokens first + 1 passes the first
    late = c.completions.create(**ask, extra_body={"min_tokens": first + 1})
    assert late.choices[0].text == want
    streamed = c.completions.create(**ask, stream=True,
                                    extra_body={"min_tokens": first + 1})
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == want
    kept = c.completions.create(**ask, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:first + 1]   # vLLM's: the stop string kept
    banned = c.completions.create(model=name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                  temperature=0, extra_body={"min_tokens": MAX_TOKENS,
                                                             "stop_token_ids": [greedy[0]]})
    tokens = banned.choices[0].token_ids
    assert len(tokens) == MAX_TOKENS and greedy[0] not in tokens
    assert banned.choices[0].finish_reason == "length"


def test_health_models_and_metrics(server):
    url = server["url"]
    status, text = get(f"{url}/health")
    assert status == 200 and json.loads(text)["status"] == "ready"
    models = server["client"].models.list()
    assert [m.id for m in models.data] == [server["name"]]
    assert models.data[0].max_model_len == server["engine"].spec.max_seq_len   # as vLLM
    server["client"].completions.create(model=server["name"], prompt=PROMPTS[0], max_tokens=4,
                                        temperature=0)
    status, text = get(f"{url}/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("dflash_time_to_first_token_seconds", "dflash_inter_token_latency_seconds",
                 "dflash_request_acceptance_length", "dflash_requests_running",
                 "dflash_requests_waiting", "dflash_kv_pages_reserved",
                 "dflash_kv_pages_capacity", "dflash_kv_bytes_moved",
                 "dflash_kv_moved_gigabytes_per_second", "dflash_generation_tokens"):
        assert name in families, (name, sorted(families))

    def value(family, sample_name, **labels):
        return next(s.value for s in families[family].samples
                    if s.name == sample_name and all(s.labels.get(k) == v
                                                     for k, v in labels.items()))

    assert value("dflash_time_to_first_token_seconds",
                 "dflash_time_to_first_token_seconds_count") >= 1
    assert value("dflash_generation_tokens", "dflash_generation_tokens_total") >= 4
    pools = {s.labels["pool"] for s in families["dflash_kv_pages_capacity"].samples}
    assert pools == {str(p.pool_id) for p in server["engine"].spec.pools}
    assert value("dflash_kv_pages_capacity", "dflash_kv_pages_capacity", pool="0") > 0


def test_a_request_without_max_tokens_gets_the_servers_default(server):
    """Completions and chat that give no max_tokens stop at the server's default (usage
    counts it); a max_tokens given wins over the default."""
    c, name = server["client"], server["name"]
    no_eos = {"ignore_eos": True}   # runs to the cap: the default is what stops it
    out = c.completions.create(model=name, prompt=PROMPTS[0], temperature=0,
                               extra_body=no_eos)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == len(out.choices[0].token_ids) == DEFAULT_MAX_TOKENS
    chunks = list(c.chat.completions.create(
        model=name, messages=CHATS["add"][0], temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=no_eos))
    assert chunks[-1].usage.completion_tokens == DEFAULT_MAX_TOKENS
    assert chunks[-2].choices[0].finish_reason == "length"
    chat = c.chat.completions.create(model=name, messages=CHATS["loop"][0], temperature=0,
                                     max_tokens=DEFAULT_MAX_TOKENS + 8, extra_body=no_eos)
    assert chat.usage.completion_tokens == DEFAULT_MAX_TOKENS + 8


def test_the_default_max_tokens_is_cut_to_the_room_a_long_prompt_leaves(server):
    """A default never makes a request that fits fail: next to a long prompt it is the
    most that fits (check_fits, the admission rule, passes; one more does not)."""
    engine, scheduler = server["engine"], server["engine"].scheduler
    prompt = [ord("a")] * (engine.spec.max_seq_len - DEFAULT_MAX_TOKENS)
    [(req, _)] = parse_completion({"prompt": prompt}, "long", engine, server["tok"],
                                  default_max_tokens=DEFAULT_MAX_TOKENS)
    room = req.params.max_new_tokens
    assert 1 <= room < DEFAULT_MAX_TOKENS
    scheduler.check_fits(req)
    with pytest.raises(AdmissionError, match="exceeds max_seq_len"):
        scheduler.check_fits(engine.make_request("long", prompt, max_new_tokens=room + 1))


def test_n_choices_and_batched_prompts_are_each_served_as_alone(server):
    """n samples of a prompt draw with seeds seed, seed + 1, ... (each what the engine
    draws alone with that seed); a batch of prompts answers each prompt's choices in
    order; usage counts each prompt once; streamed choices carry their index."""
    c, name, tok, engine = server["client"], server["name"], server["tok"], server["engine"]
    ids = tok.encode(PROMPTS[1])
    # top_p: the truncated programs the test above compiled (no sampled set of its own)
    hot = dict(temperature=2.0, top_p=0.999, max_tokens=8)
    out = c.completions.create(model=name, prompt=PROMPTS[1], n=2, seed=7, **hot)
    alone = [c.completions.create(model=name, prompt=PROMPTS[1], seed=seed, **hot)
             .choices[0].token_ids for seed in (7, 8)]
    assert alone[0] != alone[1]   # the seeds differ, so do the draws
    assert [ch.index for ch in out.choices] == [0, 1]
    assert [ch.token_ids for ch in out.choices] == alone
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == sum(map(len, alone))
    batch = [PROMPTS[0], PROMPTS[2]]
    out = c.completions.create(model=name, prompt=batch, max_tokens=MAX_TOKENS, n=2,
                               temperature=0)
    want = [server["greedy"][p] for p in batch for _ in range(2)]
    assert [ch.token_ids for ch in out.choices] == want
    assert out.usage.prompt_tokens == sum(len(tok.encode(p)) for p in batch)
    stream = c.completions.create(model=name, prompt=batch, max_tokens=MAX_TOKENS,
                                  temperature=0, stream=True,
                                  stream_options={"include_usage": True})
    got = {0: [], 1: []}
    usage = None
    for chunk in stream:
        for ch in chunk.choices:
            got[ch.index] += ch.token_ids
        usage = chunk.usage or usage
    assert [got[0], got[1]] == [server["greedy"][p] for p in batch]
    assert usage.completion_tokens == sum(len(server["greedy"][p]) for p in batch)
    chat = c.chat.completions.create(model=name, messages=CHATS["add"][0], n=2, temperature=0,
                                     max_tokens=MAX_TOKENS)
    assert [ch.token_ids for ch in chat.choices] == [server["greedy"]["add"]] * 2
    assert engine.num_active == 0
