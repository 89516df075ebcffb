"""Export / import steps: the host's live-page rule matches the device's tables, and
a payload that disagrees with the receiver fails inside the step, changing nothing."""

import dataclasses
import time

import jax
import numpy as np
import pytest

from drafter.engine import Engine
from drafter import kv_io
from drafter.kv_io import live_logical_pages, page_bucket
from tests.compile_log import compiled_in
from tests.drafter.tiny import tiny_pair
from unified_kv import BAD_PAGE_INDEX


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(num_slots=3, max_seq_len=160)


def test_live_pages_from_lengths_equal_the_tables_after_chunked_prefill(pair):
    """Windows of 16 over pages of 8, prompts across page, window and chunk edges."""
    params, cfg, _ = pair
    engine = Engine(params, cfg, export=True, speculative=False)
    for n in (1, 7, 8, 9, 16, 17, 24, 25, 33, 61, 130):
        engine.add_request(f"r{n}", [i % 60 + 1 for i in range(n)], 4)
        exports = []
        while not exports:
            engine.step()
            exports = engine.take_exports()
        (export,) = exports
        kv = engine.state.kv
        slot = int(np.flatnonzero(np.asarray(kv.target_lens) == n)[0])
        for pool_id, logical in zip(export.payload.pool_ids, export.payload.logical_pages):
            row = np.asarray(kv.page_tables[pool_id][slot])
            want = np.flatnonzero(row != BAD_PAGE_INDEX)
            got = live_logical_pages(cfg.spec, cfg.spec.pools[pool_id], n, n)
            assert got.tolist() == want.tolist(), (n, pool_id)
            assert logical[:len(got)].tolist() == got.tolist()
            assert len(logical) == page_bucket(len(got))
        engine.run()


class OneShot:
    """Delivers given payloads for the requests it was asked for (after admission), all
    in one poll."""

    def __init__(self, items):
        self.items, self.asked = dict(items), []

    def fetch(self, request):
        self.asked.append(request.request_id)

    def poll(self, timeout):
        ready = [(rid, self.items.pop(rid)) for rid in self.asked if rid in self.items]
        return ready


def _exports(sender, n):
    out = []
    while len(out) < n:
        sender.step()
        out += sender.take_exports()
    return out


def test_a_burst_moves_in_one_export_and_one_import_and_a_bad_row_fails_alone(pair,
                                                                               monkeypatch):
    """Three prompts of one page bucket leave in one export call and arrive in one
    import call; the row whose checksum is wrong fails, the others generate what
    aggregated serving does, and every page comes back."""
    params, cfg, _ = pair
    prompts = {f"r{i}": [(7 * i + j) % 60 + 1 for j in range(n)]
               for i, n in enumerate((17, 20, 22))}
    sender = Engine(params, cfg, export=True, speculative=False)
    calls = {"export": 0, "import": 0}

    real_export = kv_io.export_step
    monkeypatch.setattr(kv_io, "export_step", lambda *a, **k: (
        calls.__setitem__("export", calls["export"] + 1), real_export(*a, **k))[1])
    for rid, prompt in prompts.items():
        sender.add_request(rid, prompt, 4)
    exports = _exports(sender, 3)
    assert calls["export"] == 1 and len(exports) == 3
    payloads = {e.request.request_id: e.payload for e in exports}
    payloads["r1"] = dataclasses.replace(
        payloads["r1"], checksums=np.asarray(payloads["r1"].checksums) + np.uint32(1))
    receiver = Engine(params, cfg, kv_source=OneShot(payloads))
    real_import = receiver.executor._import
    receiver.executor._import = lambda *a, **k: (calls.__setitem__("import", calls["import"] + 1),
                                                 real_import(*a, **k))[1]
    for rid, prompt in prompts.items():
        receiver.add_request(rid, prompt, 6)
    results = {r.request_id: r for r in receiver.run()}
    assert calls["import"] == 1
    assert not results["r1"].ok and "checksum" in results["r1"].error
    alone = Engine(params, cfg).generate([prompts["r0"], prompts["r2"]], 6)
    assert [results["r0"].tokens, results["r2"].tokens] == [r.tokens for r in alone]
    assert np.asarray(receiver.state.kv.num_free).tolist() == [p.num_usable_pages
                                                               for p in cfg.spec.pools]
    assert not np.asarray(receiver.state.running).any()


class SlowPoll(OneShot):
    """Delivers its payloads only after a poll that takes `seconds` (as an in-process
    source does while it runs the sender's prefill inside the poll)."""

    def __init__(self, items, seconds):
        super().__init__(items)
        self.seconds = seconds

    def poll(self, timeout):
        if not self.asked or not self.items:
            return []
        time.sleep(self.seconds)
        return super().poll(timeout)


def test_time_to_first_token_counts_the_poll_that_brought_the_kv(pair):
    """A first token is dated after the poll that delivered it: a poll that takes
    0.3 s makes the time to first token at least 0.3 s."""
    params, cfg, _ = pair
    prompt = [(5 * j) % 60 + 1 for j in range(20)]
    sender = Engine(params, cfg, export=True, speculative=False)
    sender.add_request("r", prompt, 4)
    (export,) = _exports(sender, 1)
    jax.block_until_ready(export.payload.buffers)
    receiver = Engine(params, cfg, kv_source=SlowPoll({"r": export.payload}, 0.3))
    receiver.add_request("r", prompt, 3)
    (result,) = receiver.run()
    assert result.ok and result.time_to_first_token_s >= 0.3, result.time_to_first_token_s


def test_warm_imports_compile_every_row_count_and_change_nothing(pair, caplog):
    """Warmed from one arrived payload, a receiver whose three requests then arrive
    together (a 4-row import call) compiles no import; the warm-up changed nothing,
    so they generate what aggregated serving does and every page comes back."""
    params, cfg, _ = pair
    prompts = {f"r{i}": [(3 * i + j) % 60 + 1 for j in range(n)]
               for i, n in enumerate((17, 20, 22))}   # one page bucket
    sender = Engine(params, cfg, export=True, speculative=False)
    for rid, prompt in prompts.items():
        sender.add_request(rid, prompt, 4)
    payloads = {e.request.request_id: e.payload for e in _exports(sender, 3)}
    receiver = Engine(params, cfg, kv_source=OneShot(payloads))
    before = jax.tree.map(np.asarray, receiver.state)
    assert receiver.warm_imports(payloads["r0"]) == 3   # 1, 2 and 4 rows (3 slots)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, receiver.state))
    for rid, prompt in prompts.items():
        receiver.add_request(rid, prompt, 6)
    with compiled_in(caplog, "import_step") as compiled:
        results = {r.request_id: r for r in receiver.run()}
    assert not compiled, compiled
    alone = Engine(params, cfg).generate(list(prompts.values()), 6)
    assert [results[rid].tokens for rid in prompts] == [r.tokens for r in alone]
    assert np.asarray(receiver.state.kv.num_free).tolist() == [p.num_usable_pages
                                                               for p in cfg.spec.pools]


def test_warm_imports_refuse_while_steps_are_in_flight(pair):
    params, cfg, _ = pair
    engine = Engine(params, cfg, export=True, speculative=False)
    engine.add_request("a", list(range(1, 20)), 4)
    (export,) = _exports(engine, 1)
    engine.add_request("b", list(range(1, 12)), 4)
    engine.step()
    with pytest.raises(RuntimeError, match="in flight"):
        engine.warm_imports(export.payload)
    engine.run()


def test_slots_freed_and_admitted_while_kv_is_awaited_are_emptied_by_the_import(pair):
    """A second round on the same receiver: the slots its first round freed and the
    slots the new requests take are emptied by the import call itself (no call of
    resets alone runs before it); tokens equal aggregated serving, every page returns."""
    params, cfg, _ = pair
    prompts = [[(5 * i + j) % 60 + 1 for j in range(n)] for i, n in enumerate((19, 23))]
    sender = Engine(params, cfg, export=True, speculative=False)
    for round_ in range(2):
        for i, prompt in enumerate(prompts):
            sender.add_request(f"{round_}-{i}", prompt, 4)
    payloads = {e.request.request_id: e.payload for e in _exports(sender, 4)}
    receiver = Engine(params, cfg, kv_source=OneShot(payloads))
    calls = []
    real_import, real_step = receiver.executor._import, receiver.executor._step_fn
    receiver.executor._import = lambda *a, **k: (calls.append("import"), real_import(*a, **k))[1]
    receiver.executor._step_fn = lambda *a, **k: (calls.append("step"), real_step(*a, **k))[1]
    alone = [r.tokens for r in Engine(params, cfg).generate(prompts, 6)]
    for round_ in range(2):
        calls.clear()
        for i, prompt in enumerate(prompts):
            receiver.add_request(f"{round_}-{i}", prompt, 6)
        results = sorted(receiver.run(), key=lambda r: r.request_id)
        assert [r.tokens for r in results] == alone
        assert calls[0] == "import", calls
    assert np.asarray(receiver.state.kv.num_free).tolist() == [p.num_usable_pages
                                                               for p in cfg.spec.pools]
    assert not np.asarray(receiver.state.running).any()


def test_a_payload_for_other_lengths_is_refused_in_the_step(pair):
    params, cfg, _ = pair
    sender = Engine(params, cfg, export=True, speculative=False)
    sender.add_request("a", list(range(1, 30)), 4)
    exports = []
    while not exports:
        sender.step()
        exports = sender.take_exports()
    payload = exports[0].payload

    # The receiver believes the prompt is 29 tokens but is told its pages start later.
    shifted = tuple(np.where(l >= 0, l + 1, l) for l in payload.logical_pages)
    bad = dataclasses.replace(payload, logical_pages=shifted)
    receiver = Engine(params, cfg, kv_source=OneShot({"b": bad}))
    receiver.add_request("b", list(range(1, 30)), 4)
    [result] = receiver.run()
    assert not result.ok and "page ranges" in result.error
    assert np.asarray(receiver.state.kv.num_free).tolist() == [p.num_usable_pages
                                                               for p in cfg.spec.pools]
    assert not np.asarray(receiver.state.running).any()
    jax.block_until_ready(receiver.state)
