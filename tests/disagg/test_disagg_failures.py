"""Disaggregated serving in one process, loud and contained on every failure: mismatched
KV formats and pairs refused by name, a corrupted buffer, a lost request, no room on the
generation side, a request ended while its KV is made, a source that refuses a fetch or
drops what was asked for; each fails its own request alone, pages conserved on both
sides."""

import dataclasses
import threading
import time

import pytest

from disagg.control import PeerClosed
from disagg.http import failure_status
from disagg.kv_format import KVFormat, KVFormatMismatch, check_kv_formats
from disagg.loop import Event
from disagg.sources import ContextWorker, InProcessSource, disaggregated_engine
from drafter.request import SamplingParams
from unified_kv import AdmissionError
from tests.disagg import disagg_pair
from tests.disagg.disagg_pair import (MAX_NEW, PROMPTS, Tampered, assert_pair_free,
                                      split_engine)

pair, aggregated = disagg_pair.pair, disagg_pair.aggregated  # this module's own (fixtures)


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
    assert bad.retryable   # damaged on the way: sent again, it may be served
    assert not any(r.retryable for r in results.values())
    assert "from context worker 0" in bad.error
    for i, r in enumerate(requests):
        if r.request_id in results:
            assert results[r.request_id].tokens == agg[i].tokens
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
    assert results["lost"].retryable and not results["kept"].retryable
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


@pytest.mark.parametrize("threaded", [False, True])
def test_an_id_ended_while_its_kv_is_made_is_refused_until_the_source_answers(threaded, pair,
                                                                            aggregated):
    """The source still works on a cancelled request: its id is refused by name (its late
    KV must never land in a new request of that id), the refusal changes nothing, and
    once the source has answered the id serves a new prompt exactly as aggregated."""
    params, cfg = pair
    engine = disaggregated_engine(params, cfg, threaded=threaded)
    held = threading.Event()   # a thread's worker waits: the KV may not come back early
    if threaded:
        ctx = engine.kv_source.contexts[0]
        pump = ctx.pump
        ctx.pump = lambda: (held.wait(30), pump())[1]
    engine.add_request("a", PROMPTS[2], MAX_NEW)
    engine.step()   # admitted: its KV is being made
    assert "cancelled" in engine.cancel("a").error
    with pytest.raises(AdmissionError, match="'a' is still in flight at the KV source"):
        engine.add_request("a", PROMPTS[3], MAX_NEW)
    held.set()
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

    error = RuntimeError("no room for it over there")

    def fetch(self, request):
        if request.request_id == self.refused:
            raise self.error
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
    assert not results["refused"].retryable   # a failure that does not say it passes
    assert results["kept"].tokens == aggregated[1].tokens
    assert not engine.arrivals.at_source("refused")
    assert_pair_free(engine)
    # A peer that cannot be reached (a TransferError) passes: retryable, HTTP 503.
    engine.kv_source.error = PeerClosed("the context worker cannot be reached")
    engine.add_request("refused", PROMPTS[0], MAX_NEW)
    [result] = engine.run()
    assert result.retryable and "PeerClosed" in result.error
    event = Event("refused", [], "", "error", result=result, error=result.error)
    assert failure_status(event) == 503
    assert failure_status(dataclasses.replace(event, result=results["refused"])) == 500
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
