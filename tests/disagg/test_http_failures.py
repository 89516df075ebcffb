"""The OpenAI-compatible HTTP server's refusals and failures: bad requests and hostile
shapes named by field, bodies over the bound, prompts that do not fit, clients that go
away (streamed or not) and a choice that fails, each freeing its pages while the server
goes on serving. The server: tests/disagg/http_server.py."""

import json
import threading
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from disagg.schema import MAX_CHOICES  # noqa: E402
from tests.disagg.http_server import (  # noqa: E402
    MAX_TOKENS, PROMPTS, assert_refused, get, post)



BAD = [
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ">= 1"),
    ({"prompt": "x", "echo": "yes"}, "echo", "true or false"),
    ({"prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 3}, "min_tokens",
     "must be 0 with \"max_tokens\": 0"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens", "min_tokens must be"),
    ({"prompt": "x", "max_tokens": 3, "min_tokens": 4}, "min_tokens", "max_tokens=3"),
    (b"{not json", None, "not JSON"),
    ({"prompt": "x", "max_tokens": "3"}, "max_tokens", "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature", "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "(0, 1]"),
    ({"prompt": "x", "top_k": "5"}, "top_k", "integer"),
    ({"prompt": "x", "min_p": -1}, "min_p", "[0, 1]"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"prompt": "x", "frequency_penalty": "1"}, "frequency_penalty", "[-2, 2]"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "decimal strings"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "(0, 100]"),
    ({"prompt": "x", "logit_bias": [[5, 1]]}, "logit_bias", "decimal strings"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias", "not token ids"),
    ({"prompt": "x", "colour": "red"}, "colour", "unknown fields"),
    ({"prompt": "x", "n": 0}, "n", "integer >= 1"),
    ({"prompt": ["a", "b"], "n": 40}, "n", "at most 64"),
    ({"prompt": ["a"] * 65}, "prompt", "at most 64"),
    ({"prompt": "x", "best_of": 2}, "best_of", "ask for n completions"),
    ({"prompt": [1, 258]}, "prompt", "reserved"),
    ({"prompt": ""}, "prompt", "empty prompt"),
    ({"max_tokens": 3}, "prompt", "missing"),
    ({"prompt": "x", "stop": [""]}, "stop", "stop"),
    ({"prompt": "x", "stream": "yes"}, "stream", "true or false"),
    ({"prompt": "x", "max_tokens": 10**6}, "max_tokens", "max_seq_len"),
]


def test_bad_requests_get_400_naming_the_field_and_the_server_keeps_serving(server):
    url = f"{server['url']}/v1/completions"
    for body, param, words in BAD:
        assert_refused(url, body, param, words)
    status, text = post(url, {"model": "other", "prompt": "x"})
    assert status == 404 and json.loads(text)["error"]["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        server["client"].completions.create(model=server["name"], prompt="x", max_tokens=-1)
    status, text = post(url, {"prompt": PROMPTS[3], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200
    assert json.loads(text)["choices"][0]["token_ids"] == server["greedy"][PROMPTS[3]]


@pytest.mark.parametrize("n", [1, 3])
def test_a_client_that_goes_away_frees_its_request(server, n):
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "n": n,
                       "stream": True, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{server['url']}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.readline().startswith(b"data: ")  # streaming has begun
    engine = server["engine"]
    deadline = time.monotonic() + 60
    while engine.num_active and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.num_active == 0, "the abandoned request still runs"


def test_a_whole_answers_client_that_goes_away_frees_its_request(server):
    """Not streamed: the server notices the disconnect while the request runs (no token
    would tell it) and cancels it."""
    import socket
    from urllib.parse import urlparse
    url = urlparse(server["url"])
    body = json.dumps({"prompt": PROMPTS[1], "max_tokens": 4000, "temperature": 0,
                       "ignore_eos": True}).encode()
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        engine, deadline = server["engine"], time.monotonic() + 60
        while not engine.num_active and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.num_active == 1   # running: then the client goes
    deadline = time.monotonic() + 30
    while engine.num_active and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.num_active == 0, "the abandoned request still runs"
    assert engine.admission.reserved_pages == (0,) * len(engine.spec.pools)
    families = {f.name: f for f in text_string_to_metric_families(
        get(f"{server['url']}/metrics")[1])}
    aborted = [s.value for s in families["dflash_requests_finished"].samples
               if s.name == "dflash_requests_finished_total"
               and s.labels["finish_reason"] == "abort"]
    assert aborted and aborted[0] >= 1   # counted as vLLM counts it, not as an error


def test_hostile_shapes_get_named_refusals_not_500s(server):
    url, engine = f"{server['url']}/v1/completions", server["engine"]
    status, text = post(url, b'{"prompt": "x", "max_tokens": 2, "\\ud800": 1}')
    assert status == 400 and json.loads(text)["error"]["param"] == "\ud800"
    status, text = post(url, b"x" * (server["app"].max_body_bytes + 1))
    assert status == 413 and "send fewer or shorter" in json.loads(text)["error"]["message"]
    status, text = post(url, {"prompt": "x", "max_tokens": 2, "temperature": 0, "stop": []})
    assert status == 200, text   # no stop strings, as OpenAI reads it
    status, text = post(url, {"prompt": "x", "max_tokens": 2, "stop": ["y" * 257]})
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == "stop" and "at most 256" in err["message"]
    status, text = post(url, {"prompt": "a" * engine.spec.max_seq_len})  # no max_tokens
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == "prompt" and "shorten the prompt" in err["message"]
    status, text = post(url, {"prompt": [PROMPTS[2]], "max_tokens": MAX_TOKENS,
                              "temperature": 0})   # OpenAI's list form, one prompt
    assert status == 200
    assert json.loads(text)["choices"][0]["token_ids"] == server["greedy"][PROMPTS[2]]


def test_a_body_too_large_gets_413_whole_or_chunked_and_a_batch_fits_the_bound(server):
    """Over the bound, a body with a declared length or sent in chunks (no length) gets
    413 naming the bound, and the server goes on serving. The bound holds a whole batch:
    MAX_CHOICES prompts of max_seq_len token ids each."""
    import http.client
    from urllib.parse import urlparse
    app, engine = server["app"], server["engine"]
    batch = [[engine.cfg.target.vocab_size - 1] * engine.spec.max_seq_len] * MAX_CHOICES
    assert len(json.dumps({"model": server["name"], "prompt": batch, "max_tokens": 1})
               ) <= app.max_body_bytes
    url = urlparse(server["url"])
    piece = b" " * 65536
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/v1/completions", body=iter([piece] * (app.max_body_bytes // 65536
                                                                  + 2)),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    answer = conn.getresponse()
    assert answer.status == 413 and "send fewer or shorter" in json.loads(answer.read())[
        "error"]["message"]
    conn.close()
    status, _ = post(f"{server['url']}/v1/completions",
                     {"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0})
    assert status == 200   # and the server goes on serving


def test_a_batch_with_one_prompt_that_does_not_fit_is_refused_whole(server):
    url, engine = server["url"], server["engine"]
    long = [ord("a")] * engine.spec.max_seq_len
    status, text = post(f"{url}/v1/completions", {"prompt": [PROMPTS[0], long],
                                                  "max_tokens": 4})
    assert status == 400 and json.loads(text)["error"]["param"] == "prompt"   # too long alone
    status, text = post(f"{url}/v1/completions", {"prompt": [PROMPTS[0], PROMPTS[1]],
                                                  "max_tokens": engine.spec.max_seq_len})
    assert status == 400 and json.loads(text)["error"]["param"] == "max_tokens"
    assert engine.num_active == 0 and not engine.scheduler.waiting


@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_that_fails_ends_its_whole_request_and_frees_the_rest(server, stream,
                                                                       monkeypatch):
    """One of three choices cancelled on the server (as a failure of its own would end
    it): the answer is an error, and the other two stop too."""
    import types
    import disagg.http
    monkeypatch.setattr(disagg.http.uuid, "uuid4",
                        lambda: types.SimpleNamespace(hex=f"fail{int(stream)}"))
    rid = f"cmpl-fail{int(stream)}"
    engine = server["engine"]
    body = {"prompt": PROMPTS[2], "max_tokens": 2000, "temperature": 0, "n": 3,
            "ignore_eos": True, "stream": stream}
    answer = {}
    thread = threading.Thread(target=lambda: answer.update(
        zip(("status", "text"), post(f"{server['url']}/v1/completions", body))))
    thread.start()
    deadline = time.monotonic() + 60
    while engine.num_active < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    server["app"].loop.cancel(f"{rid}-1")
    thread.join(120)
    assert not thread.is_alive()
    if stream:
        assert answer["status"] == 200 and "was cancelled" in answer["text"]
        assert answer["text"].rstrip().endswith("data: [DONE]")
    else:
        assert answer["status"] == 500 and "was cancelled" in answer["text"]
    deadline = time.monotonic() + 10   # 2,000 tokens take far longer
    while engine.num_active and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.num_active == 0, "the other choices still run"
