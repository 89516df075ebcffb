import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from unified_kv import (AdmissionController, AdmissionError, CacheSpec, LayerSpec, budget_for,
                        bytes_per_pool, bytes_per_request, capacity, check_fits, grow,
                        init_state, pages_per_request, retire_window_pages)


def make_spec(num_slots=4, budget_rows=2.0):
    layers = (LayerSpec("t0", "target", 2, 16, "fp8_e4m3"),
              LayerSpec("t1", "target", 2, 16, "fp8_e4m3", 32),
              LayerSpec("d0", "draft", 2, 16, "bf16", 32))
    probe = CacheSpec(16, layers, num_slots, 256, 1 << 40, 9)
    one = sum(n * p.bytes_per_page for p, n in zip(probe.pools, pages_per_request(probe, 256)))
    one += sum(p.bytes_per_page for p in probe.pools)  # each pool's reserved null page
    return CacheSpec(16, layers, num_slots, 256, int(one * budget_rows), 9)


def test_reservations_are_worst_case_per_pool():
    spec = make_spec()
    # full: ceil((256 + 9) / 16) = 17; windowed: ceil((31 + 9) / 16) + 1 = 4
    assert pages_per_request(spec, 256) == (17, 4, 4)
    assert pages_per_request(spec, 20) == (2, 2, 2)  # short: its own full size
    per_req = bytes_per_request(spec, 256)
    assert per_req[0] == 17 * spec.pools[0].bytes_per_page
    assert sum(bytes_per_pool(spec).values()) <= spec.memory_budget_bytes


def test_admission_refuses_cleanly_and_touches_no_other_request():
    spec = make_spec(budget_rows=2.0)
    ctl = AdmissionController(spec)
    a = ctl.admit("a", 256)
    b = ctl.admit("b", 256)
    before = (ctl.reserved_pages, ctl.num_free_slots, ctl.reservation("a"), ctl.reservation("b"))
    with pytest.raises(AdmissionError, match=r"request 'c': pool 0 .* needs 17 pages"):
        ctl.admit("c", 256)
    assert (ctl.reserved_pages, ctl.num_free_slots, ctl.reservation("a"),
            ctl.reservation("b")) == before
    ctl.release("a")
    c = ctl.admit("c", 256)
    assert c.slot == a.slot and b.slot != a.slot


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_len=257), "exceeds the cache's max_seq_len=256"),
    (dict(max_len=0), "max_len must be a positive int"),
])
def test_admission_errors(kwargs, match):
    ctl = AdmissionController(make_spec())
    with pytest.raises(AdmissionError, match=match):
        ctl.admit("r", **kwargs)
    assert ctl.reserved_pages == (0, 0, 0)


def test_check_fits_is_the_rule_admit_applies_before_counting_reservations():
    spec = make_spec(num_slots=1)
    assert check_fits(spec, "r", 256) == pages_per_request(spec, 256)
    ctl = AdmissionController(spec)
    ctl.admit("a", 20)
    with pytest.raises(AdmissionError, match="exceeds the cache's max_seq_len"):
        ctl.admit("b", 257)  # too long for any cache of this spec, not just a busy one


def test_slots_run_out_and_duplicate_ids_are_refused():
    spec = make_spec(num_slots=2, budget_rows=8.0)
    ctl = AdmissionController(spec)
    ctl.admit("a", 16)
    with pytest.raises(AdmissionError, match="already admitted"):
        ctl.admit("a", 16)
    ctl.admit("b", 16)
    with pytest.raises(AdmissionError, match="all 2 slots are busy"):
        ctl.admit("c", 16)
    with pytest.raises(KeyError, match="not admitted"):
        ctl.release("zzz")


def test_admitted_requests_never_overflow_in_step():
    """Every slot runs a max-length request with K+1 overrun: allocation never fails."""
    spec = make_spec(num_slots=2, budget_rows=2.0)
    ctl = AdmissionController(spec)
    slots = [ctl.admit(r, 256).slot for r in ("a", "b")]
    state = init_state(spec)
    ids = jnp.array(slots, jnp.int32)
    lengths = np.zeros(2, np.int32)
    rng = np.random.default_rng(0)
    while (lengths < 256).any():
        lengths = np.minimum(lengths + rng.integers(1, 10, 2), 256)
        # Verify writes up to max_step_tokens past the committed length.
        ends = jnp.asarray(lengths + spec.max_step_tokens)
        state, ok = grow(spec, state, ids, ends, ends)
        assert np.asarray(ok).all(), f"overflow at lengths {lengths}"
        state = state.replace(target_lens=state.target_lens.at[ids].set(jnp.asarray(lengths)),
                              draft_ctx_lens=state.draft_ctx_lens.at[ids].set(jnp.asarray(lengths)))
        state = retire_window_pages(spec, state, ids)


@pytest.mark.parametrize("requests", [1, 2, 3, 5])
def test_capacity_is_exactly_what_admission_takes(requests):
    base = make_spec(num_slots=8)
    budget = budget_for(base, requests)
    spec = dataclasses.replace(base, memory_budget_bytes=budget)
    cap = capacity(spec)
    assert (cap.requests, cap.limited_by) == (requests, "memory")
    assert cap.kv_bytes == sum(bytes_per_pool(spec).values()) <= budget
    ctl = AdmissionController(spec)
    for i in range(requests):
        ctl.admit(f"r{i}", spec.max_seq_len)
    with pytest.raises(AdmissionError, match="unreserved"):
        ctl.admit("one more", spec.max_seq_len)
    # one byte less holds one request fewer (none: the spec itself refuses)
    if requests > 1:
        assert capacity(dataclasses.replace(base, memory_budget_bytes=budget - 1)).requests \
            == requests - 1
    assert f"holds {requests} request(s) of 256 tokens" in cap.describe()
    assert "memory limit it" in cap.describe()


def test_capacity_counts_slots_when_memory_holds_more():
    spec = dataclasses.replace(make_spec(num_slots=2), memory_budget_bytes=budget_for(
        make_spec(num_slots=2), 6))
    cap = capacity(spec)
    assert (cap.requests, cap.limited_by) == (2, "slots")
    # shorter requests: more of them fit in memory, still two slots
    assert capacity(spec, 32).requests == 2
