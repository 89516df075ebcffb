"""The OpenAI-compatible HTTP server, driven by the official `openai` client and raw HTTP.

One server for the module: the embedded pair, aggregated, on a free local port;
its ServingLoop runs on a thread of the test process. The engine's own greedy
output for the test prompts is computed first (it is also the warm-up).
"""

import concurrent.futures
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from disagg.frontend import load_pair, make_engine, warm_up  # noqa: E402
from disagg.http import CompletionsApp, HTTPServer  # noqa: E402
from disagg.loop import ServingLoop  # noqa: E402
from disagg.metrics import ServingMetrics  # noqa: E402

PROMPTS = ["def add(a, b):\n    return", "import os\n\ndef main():\n", "class Point:\n    def",
           "for i in range(10):\n    "]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server():
    pair = load_pair(num_slots=4)
    engine = make_engine("aggregated", pair)
    tok = pair.tokenizer
    warm_up(engine, tok)
    greedy = engine.generate([tok.encode(p) for p in PROMPTS], MAX_TOKENS)
    metrics = ServingMetrics(pair.step_config.spec, pair.step_config.block_size)
    loop = ServingLoop(engine, tok, metrics)
    app = CompletionsApp(loop, metrics, pair.name, request_timeout_s=120)
    http = HTTPServer(app.app, "127.0.0.1", 0).start()
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    app.ready.set()
    client = openai.OpenAI(base_url=f"{http.url}/v1", api_key="unused", timeout=120,
                           max_retries=0)
    yield {"url": http.url, "client": client, "name": pair.name, "tok": tok,
           "greedy": {p: r.tokens for p, r in zip(PROMPTS, greedy)}, "engine": engine,
           "block": pair.step_config.block_size}
    loop.close()
    thread.join(60)
    http.stop()
    assert not thread.is_alive(), "the serving loop did not stop after close()"


def post(url, body, timeout=120):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def get(url, timeout=30):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


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


BAD = [
    (b"{not json", None, "not JSON"),
    ({"prompt": "x", "max_tokens": "3"}, "max_tokens", "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature", "temperature"),
    ({"prompt": "x", "colour": "red"}, "colour", "unknown fields"),
    ({"prompt": "x", "n": 2}, "n", "one request per completion"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt"),
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
        status, text = post(url, body)
        err = json.loads(text)["error"]
        assert status == 400, (body, text)
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
        assert words in err["message"], (body, err)
    status, text = post(url, {"model": "other", "prompt": "x"})
    assert status == 404 and json.loads(text)["error"]["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        server["client"].completions.create(model=server["name"], prompt="x", max_tokens=-1)
    status, text = post(url, {"prompt": PROMPTS[3], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200
    assert json.loads(text)["choices"][0]["token_ids"] == server["greedy"][PROMPTS[3]]


def test_a_client_that_goes_away_frees_its_request(server):
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0,
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


def test_health_models_and_metrics(server):
    url = server["url"]
    status, text = get(f"{url}/health")
    assert status == 200 and json.loads(text)["status"] == "ready"
    models = server["client"].models.list()
    assert [m.id for m in models.data] == [server["name"]]
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
