"""`serve`'s JSON-lines loop and the ServingLoop under it, in-process on the tiny copy pair:
one answer per line, whatever goes wrong (a repeated id, a stop while a line is being
read, an engine failure), and a compilation cache that cannot be written is named."""

from __future__ import annotations

import io
import json
import os
import threading
import time

import pytest

from disagg.compile_cache import enable_compile_cache
from disagg.frontend import load_pair, make_engine
from disagg.serving import serve_json_lines
from tests.disagg.test_frontend import copy_pair_with_text


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = copy_pair_with_text(tmp_path_factory.mktemp("pair") / "pair")
    pair = load_pair(str(root / "target"), str(root / "draft"), num_slots=2,
                     max_seq_len=512, kv_memory_mib=16)
    return make_engine("aggregated", pair), pair.tokenizer


@pytest.fixture
def engine(served):
    return served[0]


@pytest.fixture
def tokenizer(served):
    return served[1]


def line(rid, n, prompt=(1, 2, 3, 4)):
    return json.dumps({"id": rid, "tokens": list(prompt), "max_new_tokens": n,
                       "ignore_eos": True}) + "\n"


def answers(out: io.StringIO) -> list[dict]:
    return [json.loads(x) for x in out.getvalue().splitlines()]


def test_a_repeated_id_is_refused_and_the_first_answer_keeps_all_its_text(tmp_path, engine,
                                                                         tokenizer):
    fifo = tmp_path / "in"
    os.mkfifo(fifo)

    def feed():
        with open(fifo, "w") as f:
            f.write(line("a", 400))
            f.flush()
            deadline = time.monotonic() + 60   # "a" has streamed some text: then the repeat
            while time.monotonic() < deadline:
                seq = engine.scheduler.active.get("a")
                if seq is not None and len(seq.tokens) >= 8:
                    break
                time.sleep(0.005)
            time.sleep(0.1)
            f.write(line("a", 4))
    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    out = io.StringIO()
    assert serve_json_lines(engine, str(fifo), tokenizer, out=out) == 1
    writer.join(10)
    first, = [a for a in answers(out) if "tokens" in a]
    refused, = [a for a in answers(out) if "tokens" not in a]
    assert "already in flight" in refused["error"]
    assert len(first["tokens"]) == 400
    assert first["text"] == tokenizer.decode(first["tokens"])


def test_a_line_read_as_the_server_stops_is_answered_before_it_returns(tmp_path, engine,
                                                                       tokenizer, monkeypatch):
    """SIGTERM lands while the reader holds a line it has read but not submitted: the
    loop closes, the line is refused as ServingClosed, and `serve_json_lines` waits for
    that answer before it returns (the process would otherwise exit without it)."""
    import signal

    from disagg import serving
    reading, proceed = threading.Event(), threading.Event()
    real_parse = serving.parse_line

    def paused_parse(*args, **kwargs):
        reading.set()
        proceed.wait(30)
        return real_parse(*args, **kwargs)
    monkeypatch.setattr(serving, "parse_line", paused_parse)

    def stop_mid_read():
        assert reading.wait(60)
        os.kill(os.getpid(), signal.SIGTERM)   # serve's drain handler closes the loop
        time.sleep(0.5)   # the loop has stopped; the reader still holds its line
        proceed.set()
    stopper = threading.Thread(target=stop_mid_read, daemon=True)
    stopper.start()
    requests = tmp_path / "requests.jsonl"
    requests.write_text(line("late", 4))
    out = io.StringIO()
    assert serve_json_lines(engine, str(requests), tokenizer, out=out) == 1
    answer, = answers(out)
    assert answer["id"] == "late" and answer["error"].startswith("ServingClosed"), answer
    stopper.join(10)
    assert engine.admission.reserved_pages == (0,) * len(engine.spec.pools)


def test_logprobs_come_with_the_tokens_kept_even_when_a_stop_string_cuts_them(tmp_path,
                                                                          engine, tokenizer):
    """A JSON line's `logprobs` answers one entry per token (the token, its log-probability,
    that many [id, log-probability] alternatives), its `prompt_logprobs` one per prompt
    token (null for the first); a stop string that cuts the output cuts the former with
    the tokens."""
    first = tmp_path / "first.jsonl"
    first.write_text(json.dumps({"id": "a", "tokens": [1, 2, 3, 4], "max_new_tokens": 8,
                                 "ignore_eos": True, "logprobs": 2,
                                 "prompt_logprobs": 1}) + "\n")
    out = io.StringIO()
    serve_json_lines(engine, str(first), tokenizer, out=out)
    whole, = answers(out)
    assert [e["token"] for e in whole["logprobs"]] == whole["tokens"]
    # the prompt's: null for its first token, then one entry per token as above
    assert whole["prompt_logprobs"][0] is None
    assert [e["token"] for e in whole["prompt_logprobs"][1:]] == [2, 3, 4]
    assert all(len(e["top_logprobs"]) == 1 for e in whole["prompt_logprobs"][1:])
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0][1] >= e["logprob"] - 1e-6
               for e in whole["logprobs"])
    # greedy: each kept token is the most likely, rank 1; a prompt token's rank counts
    # the tokens more likely than it
    assert all(e["rank"] == 1 for e in whole["logprobs"])
    assert all(e["rank"] >= 1 and (e["rank"] == 1) == (e["top_logprobs"][0][0] == e["token"])
               for e in whole["prompt_logprobs"][1:])
    stop = tokenizer.decode(whole["tokens"][3:5])
    cut_at = whole["text"].index(stop)
    assert stop and cut_at > 0
    second = tmp_path / "second.jsonl"
    second.write_text(json.dumps({"id": "b", "tokens": [1, 2, 3, 4], "max_new_tokens": 8,
                                  "ignore_eos": True, "logprobs": 1, "stop": stop}) + "\n")
    out = io.StringIO()
    serve_json_lines(engine, str(second), tokenizer, out=out)
    cut, = answers(out)
    assert cut["finish_reason"] == "stop" and cut["text"] == whole["text"][:cut_at]
    assert len(cut["tokens"]) < len(whole["tokens"])
    assert [e["token"] for e in cut["logprobs"]] == cut["tokens"]
    assert [e["logprob"] for e in cut["logprobs"]] == \
        [e["logprob"] for e in whole["logprobs"][:len(cut["tokens"])]]
    assert engine.admission.reserved_pages == (0,) * len(engine.spec.pools)


def test_an_engine_failure_answers_every_request_in_flight_and_queued(tmp_path, engine,
                                                                      tokenizer, monkeypatch):
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("device lost")
        return real_step()
    monkeypatch.setattr(engine, "step", failing_step)
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(line(f"r{i}", 200) for i in range(4)))
    out = io.StringIO()
    with pytest.raises(RuntimeError, match="device lost"):
        serve_json_lines(engine, str(requests), tokenizer, out=out)
    got = answers(out)
    assert sorted(a["id"] for a in got) == ["r0", "r1", "r2", "r3"]
    assert all("the engine failed (RuntimeError: device lost)" in a["error"] for a in got)
    monkeypatch.undo()
    engine.run()   # what the failed step left: the engine is reusable, its pages free
    for rid in list(engine.scheduler.active):
        engine.cancel(rid)
    engine.run()
    assert engine.admission.reserved_pages == (0,) * len(engine.spec.pools)


def test_an_unwritable_cache_directory_is_named(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(blocker / "jax"))
    with pytest.raises(SystemExit, match="cannot write to .*JAX_COMPILATION_CACHE_DIR"):
        enable_compile_cache()


def test_a_second_signal_stops_at_once():
    import signal
    from disagg.serving import install_drain_handlers
    stops = []
    handlers = install_drain_handlers("test", lambda: stops.append(1))
    try:
        handler = signal.getsignal(signal.SIGINT)
        handler(signal.SIGINT, None)
        assert stops == [1]   # the first drains
        with pytest.raises(SystemExit) as e:
            handler(signal.SIGTERM, None)
        assert e.value.code == 130 and stops == [1]
    finally:
        for sig, previous in handlers.items():
            signal.signal(sig, previous)
