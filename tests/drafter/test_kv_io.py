"""Export / import steps: the host's live-page rule matches the device's tables, and
a payload that disagrees with the receiver fails inside the step, changing nothing."""

import dataclasses

import jax
import numpy as np
import pytest

from drafter.engine import Engine
from drafter.kv_io import live_logical_pages, page_bucket
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


def test_a_payload_for_other_lengths_is_refused_in_the_step(pair):
    params, cfg, _ = pair
    sender = Engine(params, cfg, export=True, speculative=False)
    sender.add_request("a", list(range(1, 30)), 4)
    exports = []
    while not exports:
        sender.step()
        exports = sender.take_exports()
    payload = exports[0].payload

    class OneShot:
        """Delivers one payload for the request it was asked for (after admission)."""

        def __init__(self, item):
            self.item, self.asked = item, []

        def fetch(self, request):
            self.asked.append(request.request_id)

        def poll(self, timeout):
            if not self.asked or self.item is None:
                return []
            item, self.item = self.item, None
            return [(self.asked[0], item)]

    # The receiver believes the prompt is 29 tokens but is told its pages start later.
    shifted = tuple(np.where(l >= 0, l + 1, l) for l in payload.logical_pages)
    bad = dataclasses.replace(payload, logical_pages=shifted)
    receiver = Engine(params, cfg, kv_source=OneShot(bad))
    receiver.add_request("b", list(range(1, 30)), 4)
    [result] = receiver.run()
    assert not result.ok and "page ranges" in result.error
    assert np.asarray(receiver.state.kv.num_free).tolist() == [p.num_usable_pages
                                                               for p in cfg.spec.pools]
    assert not np.asarray(receiver.state.running).any()
    jax.block_until_ready(receiver.state)
