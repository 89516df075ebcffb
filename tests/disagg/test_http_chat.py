"""The OpenAI-compatible HTTP server's chat completions, tokenize and detokenize, and
prompt options (echo, prompt log-probabilities, truncate_prompt_tokens), driven by the
official `openai` client and raw HTTP. The server: tests/disagg/http_server.py."""

import json
import urllib.request

import numpy as np
import pytest

openai = pytest.importorskip("openai")

from disagg.http import CompletionsApp  # noqa: E402
from disagg.http_thread import HTTPServer  # noqa: E402
from disagg.loop import ServingLoop  # noqa: E402
from disagg.metrics import ServingMetrics  # noqa: E402
from drafter.corpus import BOS, ByteTokenizer  # noqa: E402
from tests.disagg import http_server  # noqa: E402
from tests.disagg.http_server import (  # noqa: E402
    CHATS, MAX_TOKENS, PROMPTS, assert_refused, post)



def test_echo_returns_the_prompt_and_its_logprobs_before_the_completion(server):
    """OpenAI's echo: the prompt's text before the completion's, whole and streamed; with
    logprobs, the prompt's tokens first (the first one's null, the rest the engine's
    prompt log-probabilities), text offsets running on into the completion; with
    max_tokens 0 the prompt alone (what lm-eval's loglikelihood asks), no completion
    tokens counted."""
    c, name, tok = server["client"], server["name"], server["tok"]
    ids = tok.encode(PROMPTS[0])
    prompt_text, greedy = tok.decode(ids), server["greedy"][PROMPTS[0]]
    ask = dict(model=name, prompt=PROMPTS[0], temperature=0, echo=True)
    out = c.completions.create(**ask, max_tokens=MAX_TOKENS)
    assert out.choices[0].text == prompt_text + tok.decode(greedy)
    assert out.choices[0].token_ids == greedy and out.usage.completion_tokens == MAX_TOKENS
    streamed = list(c.completions.create(**ask, max_tokens=MAX_TOKENS, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == out.choices[0].text
    want = server["prompt_logprobs"]
    for stream in (False, True):
        got = c.completions.create(**ask, max_tokens=0, logprobs=2, stream=stream)
        chunks = [ch for ch in got if ch.choices] if stream else [got]
        assert "".join(ch.choices[0].text for ch in chunks) == prompt_text
        assert chunks[-1].choices[0].finish_reason == "length"
        lp = chunks[0].choices[0].logprobs
        assert lp.tokens == [tok.decode([t]) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:], [x.logprob for x in want[1:]],
                                   atol=1e-5)
        assert [list(d) for d in lp.top_logprobs[1:]] == [   # and the prompt token's own
            list(dict.fromkeys([*(tok.decode([u]) for u, _ in x.top), tok.decode([t])]))
            for t, x in zip(ids[1:], want[1:])]
        assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(prompt_text) - len(
            lp.tokens[-1])
        if not stream:
            assert got.usage.completion_tokens == 0 and got.choices[0].token_ids == []
    both = c.completions.create(**ask, max_tokens=MAX_TOKENS, logprobs=1)
    lp = both.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + MAX_TOKENS and lp.token_logprobs[0] is None
    assert lp.text_offset[len(ids)] == len(prompt_text)


def test_vllm_prompt_logprobs_score_every_prompt_token_with_its_rank(server):
    """vLLM's prompt_logprobs: a choice (a stream's first chunk) carries null, then per
    prompt token its own log-probability and rank and those of the k most likely tokens
    (ranks 1..k), the engine's prompt log-probabilities; beside echo, each form keeps its
    own count; out of range, refused by name."""
    c, name, tok, url = server["client"], server["name"], server["tok"], server["url"]
    ids, want = tok.encode(PROMPTS[0]), server["prompt_logprobs"]
    ask = dict(model=name, prompt=PROMPTS[0], temperature=0, max_tokens=MAX_TOKENS)
    whole = json.loads(post(f"{url}/v1/completions", dict(ask, prompt_logprobs=2))[1])
    lines = post(f"{url}/v1/completions",
                 dict(ask, prompt_logprobs=2, stream=True))[1].splitlines()
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    scored = [ch["choices"][0].get("prompt_logprobs") for ch in chunks if ch["choices"]]
    assert scored[0] is not None and not any(scored[1:])
    for got in (whole["choices"][0]["prompt_logprobs"], scored[0]):
        assert got[0] is None and len(got) == len(ids)
        for token, entries, lp in zip(ids[1:], got[1:], want[1:]):
            own = entries[str(token)]
            assert own["rank"] == lp.rank >= 1 and own["decoded_token"] == tok.decode([token])
            np.testing.assert_allclose(own["logprob"], lp.logprob, atol=1e-5)
            for rank, (t, x) in enumerate(lp.top[:2], start=1):
                assert entries[str(t)]["rank"] == rank
                np.testing.assert_allclose(entries[str(t)]["logprob"], x, atol=1e-5)
            assert set(entries) == {str(token), *(str(t) for t, _ in lp.top[:2])}
            if token in [t for t, _ in lp.top[:2]]:   # its own rank is where it stands
                assert own["rank"] == 1 + [t for t, _ in lp.top].index(token)
    assert whole["choices"][0]["token_ids"] == server["greedy"][PROMPTS[0]]
    both = c.completions.create(**ask, echo=True, logprobs=1,
                                extra_body={"prompt_logprobs": 2})
    assert all(1 <= len(d) <= 2 and tok.decode([t]) in d for t, d in zip(
        ids[1:], both.choices[0].logprobs.top_logprobs[1:len(ids)]))
    assert len(both.choices[0].model_extra["prompt_logprobs"][1]) >= 2
    status, body = post(f"{url}/v1/completions", dict(ask, prompt_logprobs=21))
    assert status == 400 and "prompt_logprobs" in json.loads(body)["error"]["message"]


def test_truncate_prompt_tokens_keeps_the_prompts_end(server):
    """vLLM's truncate_prompt_tokens: a completion of a prompt cut to its last k tokens
    equals one of those k tokens sent as the prompt; usage counts k."""
    c, name, tok = server["client"], server["name"], server["tok"]
    ids = tok.encode(PROMPTS[1])
    k = len(ids) // 2
    cut = c.completions.create(model=name, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                               temperature=0, extra_body={"truncate_prompt_tokens": k})
    tail = c.completions.create(model=name, prompt=ids[-k:], max_tokens=MAX_TOKENS,
                                temperature=0)
    assert cut.choices[0].token_ids == tail.choices[0].token_ids
    assert cut.usage.prompt_tokens == k
    assert cut.choices[0].token_ids != server["greedy"][PROMPTS[1]]   # the cut mattered


def test_chat_equals_the_engines_greedy_output_for_the_rendered_prompt(server):
    c, tok = server["client"], server["tok"]
    messages, _ = CHATS["add"]
    out = c.chat.completions.create(model=server["name"], messages=messages,
                                    max_tokens=MAX_TOKENS, temperature=0)
    want = server["greedy"]["add"]
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert choice.message.content == tok.decode(want)
    assert choice.token_ids == want
    assert choice.finish_reason == ("length" if len(want) == MAX_TOKENS else "stop")
    assert out.usage.prompt_tokens == len(server["chat_ids"]["add"])
    assert out.usage.completion_tokens == len(want)
    assert 1.0 <= out.acceptance_length <= server["block"]
    # OpenAI's content parts: the texts joined, the same prompt and answer
    parts = [{**m, "content": [{"type": "text", "text": m["content"][:3]},
                               {"type": "text", "text": m["content"][3:]}]} for m in messages]
    out = c.chat.completions.create(model=server["name"], messages=parts,
                                    max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].token_ids == want


def test_streamed_chat_sends_the_role_then_deltas_then_the_finish(server):
    c, tok = server["client"], server["tok"]
    messages, _ = CHATS["loop"]
    chunks = list(c.chat.completions.create(
        model=server["name"], messages=messages, max_completion_tokens=MAX_TOKENS,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    want = server["greedy"]["loop"]
    assert {ch.object for ch in chunks} == {"chat.completion.chunk"}
    assert len({ch.id for ch in chunks}) == 1
    first, *middle, last, usage = chunks
    assert first.choices[0].delta.role == "assistant" and not first.choices[0].delta.content
    assert len(middle) >= 2, "content arrives in several deltas as decode steps commit it"
    assert all(ch.choices[0].finish_reason is None for ch in [first, *middle])
    assert "".join(ch.choices[0].delta.content for ch in middle) == tok.decode(want)
    assert [t for ch in middle for t in ch.choices[0].token_ids] == want
    assert last.choices[0].finish_reason in ("length", "stop")
    assert last.choices[0].delta.content is None
    assert 1.0 <= last.acceptance_length <= server["block"]
    assert usage.choices == [] and usage.usage.completion_tokens == len(want)
    assert usage.usage.prompt_tokens == len(server["chat_ids"]["loop"])


BAD_CHATS = [
    ({"max_tokens": 3}, "messages", "missing"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": "hi"}, "messages", "non-empty list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "use one of"),
    ({"messages": [{"role": "developer", "content": "hi"}]}, "messages[0].role", "system"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 7}]},
     "messages[1].content", "must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]", "only text parts"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content",
     "a string or a list of text parts"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs",
     "true or false"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing"),
    ({"messages": [{"role": "user", "content": "hi", "name": "x"}]}, "messages[0].name",
     "unknown fields"),
    ({"messages": ["hi"]}, "messages[0]", "must be an object"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages",
     "a conversation opens with a system or user message"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
      "max_completion_tokens": 2}, "max_completion_tokens", "not both"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens", "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6},
     "max_completion_tokens", "max_completion_tokens=1000000"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "tools", "not implemented"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt": "x"}, "prompt",
     "unknown fields"),
    ({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
     "continue_final_message", "\"add_generation_prompt\": false"),
    ({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": "no"},
     "add_generation_prompt", "true or false"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": ["x"]},
     "chat_template_kwargs", "an object"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": []},
     "chat_template_kwargs", "an object"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs", "may not set"),
]


def test_bad_chats_get_400_naming_the_problem_while_a_good_one_completes(server):
    url = f"{server['url']}/v1/chat/completions"
    messages, _ = CHATS["add"]
    body = json.dumps({"model": server["name"], "messages": messages, "temperature": 0,
                       "max_tokens": MAX_TOKENS, "stream": True}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        head = json.loads(r.readline().decode()[len("data: "):])  # in flight from here
        assert head["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        for bad, param, words in BAD_CHATS:
            assert_refused(url, bad, param, words)
        lines = [line.decode().strip() for line in r if line.strip()]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == \
        server["greedy"]["add"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_model_without_a_chat_template_refuses_chat_naming_the_way_in(server):
    """The embedded pair's byte tokenizer has no chat template: /v1/chat/completions says
    so (never an invented template); the loop is never run, nothing reaches the engine."""
    metrics = ServingMetrics(server["engine"].spec, server["block"])
    app = CompletionsApp(ServingLoop(server["engine"], ByteTokenizer(), metrics), metrics,
                         server["name"])
    http = HTTPServer(app.app, "127.0.0.1", 0).start()
    try:
        client = openai.OpenAI(base_url=f"{http.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server["name"], messages=CHATS["add"][0],
                                           max_tokens=4)
        message = e.value.body["message"]
        assert "has no chat template" in message and "/v1/completions" in message
        assert e.value.status_code == 400
    finally:
        http.stop()


def test_chat_options_render_the_prompt_as_vllm_does(server):
    """vLLM's chat options: "continue_final_message" (with "add_generation_prompt":
    false) leaves the final assistant message open for the model to continue, in
    /tokenize and in a chat completion alike, whose tokens are a completion's of that
    prompt; "chat_template_kwargs" reach the template."""
    c, name, url = server["client"], server["name"], server["url"]
    chat = CHATS["add"][0] + [{"role": "assistant", "content": "  return a"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    status, text = post(f"{url}/tokenize", {"messages": chat, **options})
    assert status == 200, text
    ids = json.loads(text)["tokens"]
    assert ids == [BOS, *(CHATS["add"][1].removesuffix("<assistant>")
                          + "<assistant>  return a").encode()]
    got = c.chat.completions.create(model=name, messages=chat, temperature=0,
                                    max_tokens=MAX_TOKENS, extra_body=options)
    want = c.completions.create(model=name, prompt=ids, temperature=0, max_tokens=MAX_TOKENS)
    assert got.choices[0].token_ids == want.choices[0].token_ids
    status, text = post(f"{url}/tokenize", {"messages": CHATS["add"][0],
                                             "chat_template_kwargs": {"unused": 1}})
    assert status == 200 and json.loads(text)["tokens"] == server["chat_ids"]["add"]


def test_tokenize_and_detokenize_use_the_served_tokenizer(server):
    """/tokenize gives a prompt's ids as a completion encodes them, and a chat's as the
    chat template renders it; /detokenize gives the text back; bad bodies get 400 naming
    the field, another model's name 404."""
    url, tok = server["url"], server["tok"]
    status, text = post(f"{url}/tokenize", {"model": server["name"], "prompt": PROMPTS[1]})
    assert status == 200, text
    out = json.loads(text)
    assert out["tokens"] == tok.encode(PROMPTS[1]) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == server["engine"].spec.max_seq_len
    status, text = post(f"{url}/tokenize", {"messages": CHATS["loop"][0]})
    assert status == 200 and json.loads(text)["tokens"] == server["chat_ids"]["loop"]
    assert json.loads(post(f"{url}/tokenize", {"prompt": ""})[1])["tokens"] == []
    status, text = post(f"{url}/detokenize", {"tokens": tok.encode(PROMPTS[2])})
    assert status == 200 and json.loads(text)["prompt"] == PROMPTS[2]
    for route, body, param in [
            ("tokenize", {}, "prompt"), ("tokenize", {"prompt": "a", "messages": []}, "prompt"),
            ("tokenize", {"prompt": [1, 2]}, "prompt"),
            ("tokenize", {"messages": [{"role": "robot", "content": "x"}]},
             "messages[0].role"),
            ("tokenize", {"prompt": "a", "colour": 1}, "colour"),
            ("detokenize", {"tokens": "abc"}, "tokens"),
            ("detokenize", {"tokens": [1, 10**6]}, "tokens"),
            ("detokenize", {"tokens": [True]}, "tokens")]:
        status, text = post(f"{url}/{route}", body)
        assert status == 400 and json.loads(text)["error"]["param"] == param, (body, text)
    status, text = post(f"{url}/tokenize", {"model": "other", "prompt": "a"})
    assert status == 404 and json.loads(text)["error"]["param"] == "model"
    assert post(f"{url}/detokenize", b"{nope")[0] == 400


def test_unknown_paths_methods_and_malformed_fields_get_openai_error_bodies(server):
    """No path answers in plain text: an unknown path is a 404 naming the paths there are,
    a method a path does not take a 405 naming the one it does, both in OpenAI's error
    shape; a model that is not a string and stream_options without streaming are 400s
    naming the field."""
    from disagg.http import PATHS
    url, app = server["url"], server["app"]
    assert {f"{m} {r.path}" for r in app.app.routes for m in r.methods - {"HEAD"}} == set(PATHS)
    status, text = http_server.get(f"{url}/v1/complete")
    err = json.loads(text)["error"]
    assert status == 404 and err["type"] == "not_found_error"
    assert "POST /v1/completions" in err["message"]
    status, text = http_server.get(f"{url}/v1/completions")
    assert status == 405 and "use POST" in json.loads(text)["error"]["message"]
    for body, param, words in (
            ({"model": 5, "prompt": "x"}, "model", "must be a string"),
            ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
             "is for streamed answers")):
        assert_refused(f"{url}/v1/completions", body, param, words)


def test_health_is_503_while_the_kv_source_could_not_serve(server, monkeypatch):
    """The loop asks the engine about its KV source once a second (a peer in another
    process down or silent: `RemoteSource.unavailable`, tests/disagg/test_faults.py);
    /health then answers 503 with the reason, and 200 again once it clears."""
    import time
    url, engine = server["url"], server["engine"]
    reason = "the context worker at 127.0.0.1:9 cannot be reached (reconnecting)"

    def health_within(status, seconds=5.0):
        deadline = time.monotonic() + seconds
        while (got := http_server.get(f"{url}/health"))[0] != status:
            assert time.monotonic() < deadline, got
            time.sleep(0.1)
        return json.loads(got[1])

    assert engine.kv_source_unavailable() is None   # aggregated: no source to lose
    monkeypatch.setattr(engine, "kv_source_unavailable", lambda: reason)
    assert health_within(503) == {"status": "unavailable", "reason": reason}
    monkeypatch.undo()
    assert health_within(200)["status"] == "ready"
