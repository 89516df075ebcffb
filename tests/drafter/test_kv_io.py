"""Export / import steps: the host's live-page rule matches the device's tables, and
a payload that disagrees with the receiver fails inside the step: its slot does not run,
and the host's reset returns its pages."""

import dataclasses
import time

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from drafter import transfer_calls
from drafter.engine import Engine
from drafter.kv_io import (export_step, import_step, live_logical_pages, page_bucket,
                           transfer_shapes)
from drafter.transfer_calls import (CALL_PAGES, call_groups, call_rows, pack_export_index,
                                    pack_import_index)
from drafter.scheduler import padded_rows, row_shapes
from drafter.steps import empty_slots
from pallas_kernels.testing import whole_pool_conversions
from tests.compile_log import compiled_in
from tests.drafter.engine_pair import pool_addresses
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


@pytest.mark.parametrize("mode,redrafts", [("shared", 0), ("private", 1)])
def test_a_burst_of_one_bucket_moves_in_one_call_each_way_and_a_bad_row_fails_alone(
        pair, mode, redrafts):
    """Three prompts of one page bucket, prefilled in one step, leave in one export call
    and arrive in one import call; in shared mode each brings its sender's first draft
    block (no redraft: acceptance step by step equals aggregated serving), in private
    mode one redraft call drafts for all. The row whose checksum is wrong fails, the
    others generate what aggregated serving does, and every page comes back."""
    params, cfg, _ = pair
    prompts = {f"r{i}": [(7 * i + j) % 60 + 1 for j in range(n)]
               for i, n in enumerate((17, 20, 22))}
    sender = Engine(params, cfg, export=True, speculative=False, mode=mode)
    for rid, prompt in prompts.items():
        sender.add_request(rid, prompt, 4)
    exports = _exports(sender, 3)
    assert sender.executor.calls["export"] == 1 and len(exports) == 3
    payloads = {e.request.request_id: e.payload for e in exports}
    payloads["r1"] = dataclasses.replace(
        payloads["r1"], checksums=np.asarray(payloads["r1"].checksums) + np.uint32(1))
    receiver = Engine(params, cfg, kv_source=OneShot(payloads), mode=mode)
    for rid, prompt in prompts.items():
        receiver.add_request(rid, prompt, 6)
    results = {r.request_id: r for r in receiver.run()}
    calls = receiver.executor.calls
    assert (calls["import"], calls["redraft"], calls["export"]) == (1, redrafts, 0)
    assert not results["r1"].ok and "checksum" in results["r1"].error
    alone = Engine(params, cfg).generate([prompts["r0"], prompts["r2"]], 6)
    assert [results["r0"].tokens, results["r2"].tokens] == [r.tokens for r in alone]
    if mode == "shared":
        assert [results["r0"].acceptance, results["r2"].acceptance] == [r.acceptance
                                                                        for r in alone]
    assert np.asarray(receiver.state.kv.num_free).tolist() == [p.num_usable_pages
                                                               for p in cfg.spec.pools]
    assert not np.asarray(receiver.state.running).any()


def test_a_burst_of_two_buckets_moves_in_a_call_per_bucket_each_way(pair):
    """Two short prompts and a long one prefilled in one step: one export call and one
    import call per page bucket (the pair's call padded to the step's rows), and every
    request generates its own aggregated tokens (outputs go back to the right rows)."""
    params, cfg, _ = pair
    prompts = {"a": [(3 * j) % 60 + 1 for j in range(17)],
               "long": [(5 * j) % 60 + 1 for j in range(70)],
               "b": [(11 * j) % 60 + 1 for j in range(20)]}
    sender = Engine(params, cfg, export=True, speculative=False)
    for rid, prompt in prompts.items():
        sender.add_request(rid, prompt, 4)
    exports = _exports(sender, 3)
    assert sender.executor.transfer_rows == 3
    assert sender.executor.calls["export"] == 2
    receiver = Engine(params, cfg, kv_source=OneShot({e.request.request_id: e.payload
                                                      for e in exports}))
    for rid, prompt in prompts.items():
        receiver.add_request(rid, prompt, 6)
    results = {r.request_id: r for r in receiver.run()}
    assert receiver.executor.calls["import"] == 2
    alone = Engine(params, cfg).generate(list(prompts.values()), 6)
    assert [results[rid].tokens for rid in prompts] == [r.tokens for r in alone]
    assert [results[rid].acceptance for rid in prompts] == [r.acceptance for r in alone]
    assert np.asarray(receiver.state.kv.num_free).tolist() == [p.num_usable_pages
                                                               for p in cfg.spec.pools]


def test_a_draft_block_of_another_drafter_is_refused_for_its_request_alone(pair):
    """A shared-mode payload whose first draft block has another length (another
    drafter's) fails its own request with an error naming the fix; a good one beside it
    generates what aggregated serving does."""
    params, cfg, _ = pair
    prompts = {"bad": [(3 * j) % 60 + 1 for j in range(18)],
               "good": [(5 * j) % 60 + 1 for j in range(19)]}
    sender = Engine(params, cfg, export=True, speculative=False)
    for rid, prompt in prompts.items():
        sender.add_request(rid, prompt, 4)
    payloads = {e.request.request_id: e.payload for e in _exports(sender, 2)}
    payloads["bad"] = dataclasses.replace(payloads["bad"], drafts=np.zeros(2, np.int32))
    receiver = Engine(params, cfg, kv_source=OneShot(payloads))
    for rid, prompt in prompts.items():
        receiver.add_request(rid, prompt, 5)
    results = {r.request_id: r for r in receiver.run()}
    assert not results["bad"].ok and "same drafter" in results["bad"].error
    assert results["good"].tokens == Engine(params, cfg).generate([prompts["good"]], 5)[0].tokens
    assert np.asarray(receiver.state.kv.num_free).tolist() == [p.num_usable_pages
                                                               for p in cfg.spec.pools]


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


@pytest.mark.parametrize("graph_copies", [1, 2])
def test_warmup_compiles_every_transfer_of_its_lengths_and_changes_nothing(caplog, graph_copies):
    """After `warmup(max_len)`, prompts of three page buckets leave a context engine and
    arrive at a generation engine (one arriving alone, two together) without compiling
    anything that either runs (its steps, exports, imports, every copy of each:
    `StepConfig.graph_copies`); the warm-ups changed no state, so the requests generate
    what aggregated serving does and every page comes back."""
    # a config no other test compiles (compiled_in sees only this test's compiles)
    params, cfg, _ = tiny_pair(num_slots=2, max_seq_len=152, block_size=3)
    cfg = dataclasses.replace(cfg, graph_copies=graph_copies)
    lengths = (5, 20, 40)   # 1, 3 and 5 full-pool pages: buckets of 1, 4 and 8
    prompts = {f"r{i}": [(3 * i + j) % 60 + 1 for j in range(n)] for i, n in enumerate(lengths)}
    sender = Engine(params, cfg, export=True, speculative=False)
    receiver = Engine(params, cfg, kv_source=OneShot({}))
    before = [jax.tree.map(np.asarray, e.state) for e in (sender, receiver)]
    max_len = max(lengths) + 12
    sender.warmup(max_len)
    receiver.warmup(max_len)
    for engine, state in zip((sender, receiver), before):
        jax.tree.map(np.testing.assert_array_equal, state, jax.tree.map(np.asarray, engine.state))
    with compiled_in(caplog, "_step") as compiled:
        for rid, prompt in prompts.items():
            sender.add_request(rid, prompt, 4)
        receiver.kv_source.items = {e.request.request_id: e.payload for e in _exports(sender, 3)}
        receiver.add_request("r0", prompts["r0"], 6)
        results = {r.request_id: r for r in receiver.run()}
        for rid in ("r1", "r2"):
            receiver.add_request(rid, prompts[rid], 6)
        results.update((r.request_id, r) for r in receiver.run())
    assert not compiled, compiled   # no export, import or step program of either role
    alone = Engine(params, cfg).generate(list(prompts.values()), 6)
    assert [results[rid].tokens for rid in prompts] == [r.tokens for r in alone]
    assert np.asarray(receiver.state.kv.num_free).tolist() == [p.num_usable_pages
                                                               for p in cfg.spec.pools]


def test_kv_that_arrives_in_a_steps_poll_is_imported_and_decoded_by_the_next_step(pair):
    """The source is polled once a step has been dispatched (the senders' work then runs
    while the device does): KV ready at that poll is imported by the next step's calls,
    which also decode it."""
    params, cfg, _ = pair
    prompt = [(7 * j) % 60 + 1 for j in range(21)]
    sender = Engine(params, cfg, export=True, speculative=False)
    sender.add_request("r", prompt, 4)
    [export] = _exports(sender, 1)
    receiver = Engine(params, cfg, kv_source=OneShot({"r": export.payload}))
    receiver.add_request("r", prompt, 6)
    receiver.step()   # admits, fetches, dispatches nothing, polls: the payload is there
    calls = receiver.executor.calls
    assert (calls["import"], calls["decode"]) == (0, 0)
    receiver.step()
    assert (calls["import"], calls["decode"], calls["prefill"]) == (1, 1, 0)
    [result] = receiver.run()
    assert result.tokens == Engine(params, cfg).generate([prompt], 6)[0].tokens


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
    (export,) = _exports(sender, 1)
    payload = export.payload

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


def test_a_failed_import_leaves_its_slot_not_running_until_the_reset_returns_its_pages(pair):
    params, cfg, _ = pair
    sender = Engine(params, cfg, export=True, speculative=False)
    sender.add_request("a", list(range(1, 30)), 4)
    [export] = _exports(sender, 1)
    bad = dataclasses.replace(export.payload, checksums=np.asarray(
        export.payload.checksums) + np.uint32(1))
    receiver = Engine(params, cfg)
    slot = 1
    [ok] = receiver.executor.import_payloads([(slot, bad, export.request)])
    state = receiver.state
    assert not bool(ok) and not bool(state.running[slot])
    usable = [p.num_usable_pages for p in cfg.spec.pools]
    held = [u - int(n) for u, n in zip(usable, np.asarray(state.kv.num_free))]
    assert sum(held) > 0   # within the request's reservation, until the reset
    resets = np.full(cfg.spec.num_slots, cfg.spec.dummy_slot, np.int32)
    resets[0] = slot   # what the next step's reset does
    receiver.state = empty_slots(cfg, state, resets)
    assert np.asarray(receiver.state.kv.num_free).tolist() == usable


def test_a_transfer_calls_rows_hold_a_bounded_number_of_pages():
    # short buckets: every row a step may export; long ones fewer, down to one
    assert call_rows((16, 16, 16), 8) == 8 and call_rows((16,), 3) == 3
    assert call_rows((20, 32, 4), 8) == 4 and call_rows((40,), 8) == 2
    assert call_rows((CALL_PAGES,), 8) == 1 and call_rows((1024, 16), 8) == 1
    assert call_rows((0, 0), 8) == 8
    keys = [(16,), (64,), (16,), (64,), (64,), (16,)]
    assert list(call_groups(keys, 8)) == [((16,), [0, 2, 5], 4), ((64,), [1, 3], 2),
                                          ((64,), [4], 1)]


def test_requests_of_a_long_bucket_move_one_a_call_and_warm_up_compiles_that(
        pair, monkeypatch, caplog):
    """With a call's rows bounded to 8 pages, two 70-token prompts (16-page bucket) and a
    17-token one prefilled in one step move in three export and three import calls, and
    generate their aggregated tokens; the warm-up compiled every call they ran."""
    monkeypatch.setattr(transfer_calls, "CALL_PAGES", 8)
    params, cfg, _ = pair
    prompts = {"a": [(3 * j) % 60 + 1 for j in range(17)],
               "long1": [(5 * j) % 60 + 1 for j in range(70)],
               "long2": [(7 * j) % 60 + 1 for j in range(75)]}
    sender = Engine(params, cfg, export=True, speculative=False)
    sender.warmup(80)
    warm_exports = sender.executor.calls["export"]
    # one call per bucket and row count it can run: the long buckets' at one row only
    buckets = transfer_shapes(cfg.spec, "shared", range(1, 81), with_draft=True)
    assert warm_exports == sum(len(row_shapes(call_rows(b, 3))) for b in buckets)
    assert warm_exports < 3 * len(buckets)
    with compiled_in(caplog, "export") as compiles:
        for rid, prompt in prompts.items():
            sender.add_request(rid, prompt, 4)
        exports = _exports(sender, 3)
    assert sender.executor.calls["export"] - warm_exports == 3
    assert not compiles, compiles
    receiver = Engine(params, cfg, kv_source=OneShot({e.request.request_id: e.payload
                                                      for e in exports}))
    receiver.warmup(80)
    warm_imports = receiver.executor.calls["import"]
    with compiled_in(caplog, "import") as compiles:
        for rid, prompt in prompts.items():
            receiver.add_request(rid, prompt, 6)
        results = {r.request_id: r for r in receiver.run()}
    assert receiver.executor.calls["import"] - warm_imports == 3
    assert not compiles, compiles
    alone = Engine(params, cfg).generate(list(prompts.values()), 6)
    assert [results[rid].tokens for rid in prompts] == [r.tokens for r in alone]
    assert np.asarray(receiver.state.kv.num_free).tolist() == [p.num_usable_pages
                                                               for p in cfg.spec.pools]


def test_transfer_and_prefill_calls_pad_their_rows_to_a_power_of_two():
    assert [padded_rows(n, 8) for n in range(9)] == [0, 1, 2, 4, 4, 8, 8, 8, 8]
    assert [padded_rows(n, 3) for n in range(1, 4)] == [1, 2, 3]
    assert row_shapes(8) == [1, 2, 4, 8] and row_shapes(3) == [1, 2, 3]
    assert row_shapes(1) == [1]


def test_export_and_import_move_an_fp8_pools_pages_as_bytes():
    """XLA has no fp8 gather or scatter: on an fp8 pool it converts the whole pool to f16
    (on the H100 an 8B cache's export asked for 6.75 GiB that way and ran out of memory).
    export_step and import_step move the pools' uint8 views (pool_layout.byte_view)."""
    params, cfg, _ = tiny_pair(num_slots=2, max_seq_len=64, kv_dtype="bf16",
                               target_kv_dtype="fp8_e4m3")
    sender = Engine(params, cfg, export=True, speculative=False)
    sender.add_request("r", list(range(1, 21)), 4)
    (export,) = _exports(sender, 1)
    payload, state = export.payload, sender.state
    elements = min(p.size for p in state.kv.pools if p.dtype == jnp.float8_e4m3fn)
    slot = int(np.flatnonzero(np.asarray(state.kv.target_lens) == 20)[0])
    buckets = tuple(len(p) for p in payload.logical_pages)
    text = export_step.lower(state, pack_export_index([(slot, payload.logical_pages)]),
                             pool_ids=payload.pool_ids, buckets=buckets).compile().as_text()
    assert whole_pool_conversions(text, elements) == []
    index = pack_import_index(np.full(cfg.spec.num_slots, cfg.spec.dummy_slot, np.int32),
                              [(slot, payload.target_len, payload.draft_ctx_len,
                                payload.logical_pages)])
    rows = ((payload.first_token, payload.drafts, payload.buffers, payload.checksums),)
    receive = jax.jit(import_step, static_argnames=("cfg", "pool_ids", "mode"))
    text = receive.lower(state, index, rows, cfg=cfg, pool_ids=payload.pool_ids,
                         mode="shared").compile().as_text()
    assert whole_pool_conversions(text, elements) == []
    sender.run()


class NeverReady(int):
    """A first token the device has not computed at any poll (is_ready stays False)."""

    def is_ready(self):
        return False


def test_an_imported_first_token_is_booked_before_its_steps_outputs_are_read(pair):
    """A first token not ready at any poll is booked when the step that imports it is
    read, before that step's outputs (the import and its decode steps): dated by its own
    read, so the time to first token is earlier than the first decode step's token."""
    params, cfg, _ = pair
    prompt = [(3 * j) % 60 + 1 for j in range(20)]
    sender = Engine(params, cfg, export=True, speculative=False)
    sender.add_request("r", prompt, 4)
    (export,) = _exports(sender, 1)
    payload = dataclasses.replace(export.payload,
                                  first_token=NeverReady(int(export.payload.first_token)))
    receiver = Engine(params, cfg, kv_source=OneShot({"r": payload}), decode_steps_per_call=2)
    receiver.add_request("r", prompt, 5)
    (result,) = receiver.run()
    alone = Engine(params, cfg).generate([prompt], 5)[0]
    assert result.ok and result.tokens == alone.tokens
    assert result.token_times_s[0] < result.token_times_s[1], result.token_times_s


def test_export_and_import_calls_keep_each_cache_in_place(pair):
    """A sender's prefills and exports and a receiver's imports (and redrafts) and decode
    calls leave each engine's pools in the buffers they started in: no transfer call
    holds a second copy of a cache."""
    params, cfg, _ = pair
    prompts = {f"r{i}": [(5 * i + j) % 60 + 1 for j in range(n)]
               for i, n in enumerate((9, 40, 90))}
    for mode in ("shared", "private"):
        sender = Engine(params, cfg, export=True, speculative=False, mode=mode)
        sent = pool_addresses(sender)
        for rid, prompt in prompts.items():
            sender.add_request(rid, prompt, 4)
        exports = []
        while len(exports) < len(prompts):
            sender.step()
            exports += sender.take_exports()
            assert pool_addresses(sender) == sent
        payloads = {e.request.request_id: e.payload for e in exports}
        receiver = Engine(params, cfg, kv_source=OneShot(payloads), mode=mode)
        received = pool_addresses(receiver)
        for rid, prompt in prompts.items():
            receiver.add_request(rid, prompt, 6)
        while receiver.has_work:
            receiver.step()
            assert pool_addresses(receiver) == received
        assert sender.executor.calls["export"] >= 1 and receiver.executor.calls["import"] >= 1


def _primitive_counts(jaxpr, names=("gather", "scatter", "reduce_sum")) -> dict:
    """How often each primitive of `names` appears in a jaxpr, its sub-jaxprs included."""
    counts = dict.fromkeys(names, 0)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in counts:
            counts[eqn.primitive.name] += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            for k, v in _primitive_counts(sub, names).items():
                counts[k] += v
    return counts


def test_a_transfer_calls_gathers_scatters_and_checksums_do_not_grow_with_its_rows(pair):
    """An export call gathers and sums each sent pool once for all its rows, and an import
    call sums and scatters each once: the kernels a call launches (its host launch time)
    stay the same from 1 row to 4."""
    params, cfg, _ = pair
    sender = Engine(params, cfg, export=True, speculative=False)
    sender.add_request("r", list(range(1, 41)), 4)
    (export,) = _exports(sender, 1)
    payload, dummy = export.payload, cfg.spec.dummy_slot
    buckets = tuple(len(p) for p in payload.logical_pages)
    row = (payload.first_token, payload.drafts, payload.buffers, payload.checksums)
    counts = {}
    for n in (1, 4):
        sent = jax.make_jaxpr(lambda s, i: export_step(
            s, i, pool_ids=payload.pool_ids, buckets=buckets))(
                sender.state, pack_export_index([(dummy, payload.logical_pages)] * n))
        index = pack_import_index(np.full(cfg.spec.num_slots, dummy, np.int32), [
            (dummy, payload.target_len, payload.draft_ctx_len, payload.logical_pages)] * n)
        received = jax.make_jaxpr(lambda s, i, p: import_step(
            s, i, p, cfg=cfg, pool_ids=payload.pool_ids, mode="shared"))(
                sender.state, index, (row,) * n)
        counts[n] = (_primitive_counts(sent.jaxpr), _primitive_counts(received.jaxpr))
    assert counts[4] == counts[1], counts
    assert counts[1][0]["gather"] >= len(payload.pool_ids)
    assert counts[1][1]["scatter"] >= len(payload.pool_ids)
    sender.run()
