"""A fuzz of the request schema through `python -m disagg serve` (a real process): 500
lines, hostile ones interleaved with good ones. Every line gets exactly one answer by
id (its line number when it has none); good ones equal greedy output (the target's
plain greedy decoding, which speculative serving must equal token for token); bad ones
name the field at fault; the process exits 0 with every page back on both workers."""

import concurrent.futures
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from disagg.processes import child_env
from drafter.corpus import ByteTokenizer
from drafter.default import default_step_config, load_default
from drafter.engine import Engine

NUM_LINES, NUM_GOOD, MAX_NEW = 500, 40, 3
TEXTS = ["def add(a, b):", "naïve ☃ = 1", "for i in range(", "x"]
TOKEN_PROMPTS = [[100, 101, 102], [35, 36, 37, 38, 39], [10]]
PROMPTS = [ByteTokenizer().encode(t) for t in TEXTS] + TOKEN_PROMPTS


def good_line(rng, i: int):
    """(JSON object, id, index into PROMPTS, max_new_tokens)."""
    k = int(rng.integers(len(PROMPTS)))
    n = int(rng.integers(1, MAX_NEW + 1))
    rid = f"g{i}" if i % 3 else 70000 + i   # ids as strings and as ints
    obj = {"id": rid, "max_new_tokens": n}
    obj.update({"prompt": TEXTS[k]} if k < len(TEXTS) else {"tokens": PROMPTS[k]})
    if i % 4 == 1:
        obj.update(temperature=0, seed=int(rng.integers(2**32)), stop_token_ids=[],
                   ignore_eos=bool(i % 8 == 1), logprobs=2)
    return obj, str(rid), k, n


def bad_lines(mask: int) -> list[tuple[bytes | dict, str]]:
    """Hostile lines: (a line's bytes, or an object given an id; what its error names)."""
    huge = "z" * 12000
    return [
        (b"not json {", "not JSON"), (b"[1, 2]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"), (b"3.5", "must be a JSON object"),
        (b"null", "must be a JSON object"), (b"\xff\xfe{}", "not UTF-8"),
        (b"[" * 50000, "not JSON"), (b'{"id": "x", "prompt": "a"', "not JSON"),
        ({"prompt": "a", "max_new_tokens": None}, "max_new_tokens"),
        ({"prompt": "a", "max_new_tokens": "3"}, "max_new_tokens"),
        ({"prompt": "a", "max_new_tokens": 2.9}, "max_new_tokens"),
        ({"prompt": "a", "max_new_tokens": True}, "max_new_tokens"),
        ({"prompt": "a", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "a", "max_new_tokens": 10**9}, "max_new_tokens"),
        ({"prompt": "a", "temperature": -1}, "temperature"),
        ({"prompt": "a", "temperature": "0"}, "temperature"),
        ({"prompt": "a", "temperature": float("nan")}, "temperature"),
        ({"prompt": "a", "temperature": None}, "temperature"),
        ({"prompt": "a", "seed": -1}, "seed"), ({"prompt": "a", "seed": 2**32}, "seed"),
        ({"prompt": "a", "seed": 1.5}, "seed"), ({"prompt": "a", "seed": "7"}, "seed"),
        ({"prompt": "a", "stop_token_ids": "5"}, "stop_token_ids"),
        ({"prompt": "a", "stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"prompt": "a", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": "a", "stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"prompt": "a", "ignore_eos": "yes"}, "ignore_eos"),
        ({"prompt": "a", "ignore_eos": 1}, "ignore_eos"),
        ({"prompt": "a", "ignore_eos": None}, "ignore_eos"),
        ({"prompt": 7}, "prompt"), ({"prompt": ["a"]}, "prompt"), ({"prompt": {}}, "prompt"),
        ({"prompt": ""}, "empty prompt"), ({"prompt": "\ud800"}, "not valid Unicode"),
        ({"prompt": huge}, "exceeds max_seq_len"),
        ({"tokens": []}, "empty prompt"), ({"tokens": "abc"}, "tokens"),
        ({"tokens": [[1, 2]]}, "non-integer"), ({"tokens": [True]}, "non-integer"),
        ({"tokens": [1e300]}, "non-integer"), ({"tokens": [-1]}, "outside the vocabulary"),
        ({"tokens": [10**30]}, "outside the vocabulary"), ({"tokens": [mask]}, "reserved"),
        ({"tokens": [1] * 12000}, "exceeds max_seq_len"),
        ({"prompt": "a", "tokens": [1]}, "exactly one"), ({"max_new_tokens": 2}, "exactly one"),
        ({"prompt": "a", "colour": "red"}, "unknown fields"),
        ({"prompt": "a", "stop": ""}, "stop"), ({"prompt": "a", "stop": [1]}, "stop"),
        ({"prompt": "a", "logprobs": 21}, "logprobs"), ({"prompt": "a", "logprobs": "1"},
                                                         "logprobs"),
    ]


def corpus(mask: int, seed: int = 26):
    """(lines, expected answers by id: ("tokens", prompt index, n) or ("error", text))."""
    rng = np.random.default_rng(seed)
    kinds = bad_lines(mask)
    slots = ["good"] * NUM_GOOD + ["bad"] * (NUM_LINES - NUM_GOOD)
    rng.shuffle(slots)
    lines, expect = [], {}
    for line_no, slot in enumerate(slots, 1):
        i = line_no
        if slot == "good":
            obj, rid, k, n = good_line(rng, i)
            lines.append(json.dumps(obj).encode())
            expect[rid] = ("tokens", k, n, "logprobs" in obj)
            continue
        raw, names = kinds[int(rng.integers(len(kinds)))]
        if isinstance(raw, dict):
            ids = [f"b{i}", None, True, [i]]   # a usable id, or none the server can use
            rid = ids[int(rng.integers(len(ids))) if i % 5 == 0 else 0]
            raw = json.dumps({"id": rid, **raw} if rid is not None else raw).encode()
            answer_id = rid if isinstance(rid, str) else f"line-{line_no}"
        else:
            answer_id = f"line-{line_no}"
        lines.append(raw)
        expect[answer_id] = ("error", names)
    return lines, expect


@pytest.fixture(scope="module")
def pair():
    return load_default()


@pytest.fixture(scope="module")
def jsonl_server(pair, tmp_path_factory):
    """The JSON-line server's process, started first: it compiles while the test
    process computes the reference output."""
    lines, expect = corpus(pair[2].mask_token_id)
    path = tmp_path_factory.mktemp("fuzz") / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    # --batch-invariant: one shape a call kind, so the stream compiles nothing new (the
    # schema, not the rows, is the subject here)
    proc = subprocess.Popen(
        [sys.executable, "-m", "disagg", "serve", "--draft-kv", "shared", "--batch-invariant",
         str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2], env=child_env(2))
    yield proc, lines, expect
    if proc.poll() is None:
        proc.kill()
        proc.communicate(timeout=30)


@pytest.fixture(scope="module")
def engine(pair, jsonl_server):
    """The target alone, plain greedy decoding (what speculative serving must equal)."""
    params, tcfg, _ = pair
    cfg = default_step_config(tcfg, None, num_slots=len(PROMPTS), max_seq_len=64,
                              memory_budget_bytes=8 << 20)
    return Engine({"target": params["target"]}, cfg, speculative=False)


@pytest.fixture(scope="module")
def greedy(engine):
    return [r.tokens for r in engine.generate(PROMPTS, MAX_NEW)]


@pytest.mark.timeout(600)
def test_500_hostile_and_good_lines_through_serve(jsonl_server, greedy):
    proc, lines, expect = jsonl_server
    assert len(lines) == NUM_LINES == len(expect)
    out, err = proc.communicate(timeout=500)
    err = err.decode()
    assert proc.returncode == 0, err[-3000:]
    answers = [json.loads(l) for l in out.decode().splitlines()]
    ids = [a["id"] for a in answers]
    assert len(ids) == len(set(ids)) == NUM_LINES and set(ids) == set(expect)
    for answer in answers:
        kind, *what = expect[answer["id"]]
        if kind == "tokens":
            k, n, asked = what
            assert "error" not in answer, answer
            assert answer["tokens"] == greedy[k][:n], answer
            assert ("logprobs" in answer) == asked, answer
            if asked:   # served disaggregated: the first token's travel with the KV
                assert [e["token"] for e in answer["logprobs"]] == answer["tokens"], answer
                assert all(len(e["top_logprobs"]) == 2 for e in answer["logprobs"]), answer
        else:
            assert what[0] in answer["error"], (answer, what)
            assert "tokens" not in answer
    report = json.loads(err.split("serve: pages at exit: ")[1].splitlines()[0])
    assert report["conserved"] and len(report["contexts"]) == 1, report


HTTP_REQUESTS, HTTP_GOOD = 500, 20
HTTP_BAD = [
    (b"not json {", "not JSON"), (b"[1, 2]", "must be a JSON object"), (b"null", "JSON object"),
    (b"\xff\xfe{}", "not JSON"), (b"[" * 50000, "not JSON"),
    ({"prompt": "a", "max_tokens": None}, "max_tokens"),
    ({"prompt": "a", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 2.9}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "seed": 2**32}, "seed"), ({"prompt": "a", "stop": [1]}, "stop"),
    ({"prompt": "a", "n": 0}, "n"), ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_k": 1.5}, "top_k"), ({"prompt": "a", "min_p": 2}, "min_p"),
    ({"prompt": "a", "stream": "yes"}, "stream"), ({"prompt": "a", "colour": 1}, "colour"),
    ({"prompt": "a", "user": 5}, "user"),
    ({"prompt": 7}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": "\ud800"}, "prompt"),
    ({"prompt": [-1]}, "prompt"), ({"prompt": [[1], "a", 3]}, "prompt"), ({}, "prompt"),
    ({"prompt": [1] * 100}, "prompt"),   # no max_tokens: the prompt alone leaves no room
]


@pytest.fixture(scope="module")
def http_server(engine, greedy):
    """The OpenAI-compatible server (disagg.http) over the module's engine, on a thread."""
    pytest.importorskip("starlette")
    from disagg.http import CompletionsApp
    from disagg.http_thread import HTTPServer
    from disagg.loop import ServingLoop
    from disagg.metrics import ServingMetrics
    metrics = ServingMetrics(engine.spec, engine.cfg.block_size)
    loop = ServingLoop(engine, ByteTokenizer(), metrics)
    app = CompletionsApp(loop, metrics, "fuzz", request_timeout_s=120)
    http = HTTPServer(app.app, "127.0.0.1", 0).start()
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    app.ready.set()
    yield http.url
    loop.close()
    thread.join(60)
    http.stop()
    assert not thread.is_alive()


def post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.timeout(300)
def test_hostile_and_good_requests_through_http(http_server, engine, greedy):
    """Every request one answer: good ones equal greedy (some sampled hot with top_k = 1),
    sampled ones (top_p, min_p, n = 2) answer both choices, hostile ones a 400 naming the
    field; sent 8 at a time; afterwards no page is held."""
    rng = np.random.default_rng(25)
    jobs = []
    for i in range(HTTP_REQUESTS):
        if i < HTTP_GOOD:
            k, n = int(rng.integers(len(PROMPTS))), int(rng.integers(1, MAX_NEW + 1))
            body = {"prompt": TEXTS[k] if k < len(TEXTS) else PROMPTS[k], "max_tokens": n,
                    "temperature": 0}
            if i % 4 == 1:    # hot, truncated to the most likely token: greedy's tokens
                body.update(temperature=1.5, top_k=1, seed=i)
            if i % 4 == 2:    # sampled, truncated, two choices: only their shape is known
                body.update(temperature=1.0, top_p=0.9, min_p=0.05, n=2, seed=i)
                jobs.append((json.dumps(body).encode(), ("sampled", n)))
                continue
            jobs.append((json.dumps(body).encode(), ("tokens", greedy[k][:n])))
        else:
            raw, names = HTTP_BAD[int(rng.integers(len(HTTP_BAD)))]
            raw = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
            jobs.append((raw, ("error", names)))
    order = rng.permutation(len(jobs))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda j: post(http_server, jobs[j][0]), order))
    for j, (status, body) in zip(order, answers):
        kind, want = jobs[j][1]
        if kind == "tokens":
            assert status == 200 and body["choices"][0]["token_ids"] == want, body
        elif kind == "sampled":
            assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1], body
            assert all(1 <= len(c["token_ids"]) <= want for c in body["choices"]), body
        else:
            assert status == 400, (status, body, jobs[j][0][:80])
            err = body["error"]
            assert want in err["message"] or want == err["param"], (err, want)
    deadline = time.monotonic() + 10   # the loop's last slot resets land on its next steps
    while not conserved(engine):
        assert time.monotonic() < deadline, "pages leaked"
        time.sleep(0.1)


def conserved(engine) -> bool:
    """Read-only (the loop's thread owns the engine): every page free, none reserved. A
    read that meets the state as a step donates it is no answer (False: read again)."""
    try:
        free = np.asarray(engine.state.kv.num_free).tolist()
    except RuntimeError:   # "Array has been deleted": the loop's step took the state
        return False
    return (free == [p.num_usable_pages for p in engine.spec.pools] and engine.num_active == 0
            and engine.admission.reserved_pages == (0,) * len(engine.spec.pools))
