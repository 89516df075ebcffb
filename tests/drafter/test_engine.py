"""Engine bad input: clear errors, and nothing else disturbed."""

import logging

import jax
import numpy as np
import pytest

from drafter.engine import Engine
from tests.drafter.tiny import tiny_pair
from unified_kv import AdmissionError


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(num_slots=2, max_seq_len=64)


def snapshot(engine):
    return jax.tree.map(np.asarray, engine.state)


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("prompt,max_new,err,match", [
    ([], 4, ValueError, "empty prompt"),
    ([1, 2, 64], 4, ValueError, r"token ids \[64\] are outside the vocabulary \[0, 64\)"),
    ([1, -1], 4, ValueError, r"token ids \[-1\]"),
    ([1] * 60, 4, AdmissionError, "exceeds max_seq_len=64"),
    ([1, 2], 0, ValueError, "max_new_tokens must be >= 1"),
])
def test_bad_requests_are_refused_and_leave_others_intact(pair, prompt, max_new, err, match):
    params, spec_cfg, _ = pair
    engine = Engine(params, spec_cfg)
    engine.add_request("ok", [5, 6, 7, 8, 9, 10, 11, 12, 13], 6)
    before = snapshot(engine)
    with pytest.raises(err, match=match):
        engine.add_request("bad", prompt, max_new)
    assert_same(before, snapshot(engine))
    # The admitted request still decodes exactly as it would alone.
    done = []
    while not done:
        done = engine.step()
    alone = Engine(params, spec_cfg).generate([[5, 6, 7, 8, 9, 10, 11, 12, 13]], 6)[0]
    assert done[0].tokens == alone.tokens


def test_more_requests_than_slots(pair):
    params, spec_cfg, _ = pair
    engine = Engine(params, spec_cfg)
    engine.add_request("a", [1, 2, 3], 5)
    engine.add_request("b", [4, 5, 6], 5)
    before = snapshot(engine)
    with pytest.raises(AdmissionError, match="all 2 slots are busy"):
        engine.add_request("c", [7, 8, 9], 5)
    assert_same(before, snapshot(engine))
    # generate() queues instead: 5 requests through 2 slots, all complete.
    results = Engine(params, spec_cfg).generate([[i + 1, i + 2] for i in range(5)], 5)
    assert [len(r.tokens) for r in results] == [5] * 5


def test_pages_return_to_the_free_lists_after_generate(pair):
    params, spec_cfg, _ = pair
    engine = Engine(params, spec_cfg)
    engine.generate([[3] * 20, [4] * 9, [5] * 33], 7)
    free = np.asarray(engine.state.kv.num_free).tolist()
    assert free == [p.num_usable_pages for p in spec_cfg.spec.pools]
    assert engine.admission.reserved_pages == (0,) * len(spec_cfg.spec.pools)


def test_step_times_hold_one_dispatch_and_wait_per_decode_step(pair):
    params, spec_cfg, _ = pair
    engine = Engine(params, spec_cfg)
    engine.add_request("a", [1, 2, 3], 4)
    steps = 0
    while not engine.step():
        steps += 1
    assert len(engine.step_times) == steps + 1
    assert all(d > 0 and w >= 0 for d, w in engine.step_times)


def test_engine_runs_the_pallas_kernel_path_in_interpret_mode():
    """The GPU path (Pallas batch tables + attention) wired through the engine."""
    params, spec_cfg, plain_cfg = tiny_pair(num_slots=2, max_seq_len=64, impl="interpret")
    ref_params, ref_cfg, _ = tiny_pair(num_slots=2, max_seq_len=64, impl="reference")
    prompt = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    got = Engine(params, spec_cfg).generate(prompt, 5)[0]
    want = Engine(ref_params, ref_cfg).generate(prompt, 5)[0]
    assert got.tokens == want.tokens and got.acceptance == want.acceptance


def test_fp8_kernel_options_stay_lossless_in_interpret_mode():
    """Over fp8 target KV the kernels take their fp8 launch options (lazy
    rescale, prefetched page ids, 5-stage verify) and speculative output
    still equals plain greedy output (interpret mode; the H200 eval is
    BENCHMARKS.md's)."""
    params, spec_cfg, plain_cfg = tiny_pair(num_slots=2, max_seq_len=64,
                                            target_kv_dtype="fp8_e4m3", impl="interpret")
    prompt = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
    spec = Engine(params, spec_cfg).generate(prompt, 6)[0]
    plain = Engine(params, plain_cfg, speculative=False).generate(prompt, 6)[0]
    assert spec.tokens == plain.tokens


def test_warmup_compiles_table_widths_and_changes_nothing():
    params, cfg, _ = tiny_pair(num_slots=2)
    prompts = [[1, 2, 3, 4, 5], list(range(1, 30))]
    want = Engine(params, cfg).generate(prompts, 10)
    engine = Engine(params, cfg)
    engine.add_request("a", prompts[0], 10)
    before = jax.tree.map(np.asarray, engine.state)
    assert engine.warmup() == 2  # max_seq_len 160 at page 8 spans widths 16 and 32
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, engine.state))
    engine.release("a")
    got = engine.generate(prompts, 10)
    assert [r.tokens for r in got] == [r.tokens for r in want]


def test_a_warm_engine_compiles_nothing_more(caplog):
    params, cfg, _ = tiny_pair(num_slots=1)
    params = jax.device_put(params, jax.devices()[0])  # committed, as checkpoints load
    engine = Engine(params, cfg)
    engine.generate([[1, 2, 3, 4, 5]], 6)  # compiles every step once
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING):
            engine.generate([[6, 7, 8, 9, 10]], 6)
    finally:
        jax.config.update("jax_log_compiles", False)
    # An uncommitted first state made admit and prefill compile a second time here.
    compiled = [r.getMessage() for r in caplog.records if "Finished XLA compilation" in r.getMessage()]
    assert not compiled, compiled
