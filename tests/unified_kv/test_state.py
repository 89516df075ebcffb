"""Allocator invariants under random admit / grow / retire / release sequences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from unified_kv import (BAD_PAGE_INDEX, NULL_PAGE, CacheSpec, LayerSpec, admit_slots, grow,
                        init_state, max_live_pages, release_slots, retire_window_pages, row_extent,
                        validate_slot_ids)
from unified_kv.state import owned_pages


def random_spec(rng: np.random.Generator, budget_factor: float) -> CacheSpec:
    """A random cache spec: 1-3 target layers (windowed/full, fp8) plus a draft layer
    that either shares a target pool or has its own bf16 pool."""
    page_size = int(rng.choice([8, 16]))
    window_choices = [None, page_size, 3 * page_size, 40]
    windows = [window_choices[i] for i in rng.integers(0, 4, rng.integers(1, 4))]
    layers = [LayerSpec(f"t{i}", "target", 2, 8, "fp8_e4m3", w) for i, w in enumerate(windows)]
    if rng.random() < 0.4:  # a draft layer with a target layer's pool key
        layers.append(LayerSpec("d0", "draft", 2, 8, "fp8_e4m3", windows[0]))
    else:
        layers.append(LayerSpec("d0", "draft", 2, 8, "bf16",
                                [None, 2 * page_size, 40][rng.integers(0, 3)]))
    num_slots = int(rng.integers(2, 5))
    max_seq_len = int(rng.integers(page_size, 161))
    step = int(rng.choice([1, 4, 9]))
    probe = CacheSpec(page_size, tuple(layers), num_slots, max_seq_len, 1 << 40, step)
    full = sum(p.nbytes for p in probe.pools)
    one_request = sum((max_live_pages(page_size, p.sliding_window, max_seq_len, step) + 1)
                      * p.bytes_per_page for p in probe.pools)  # + the null page
    budget = max(int(full * budget_factor), one_request)
    return CacheSpec(page_size, tuple(layers), num_slots, max_seq_len, budget, step)


# A fixed, varied set of random specs, so jit compiles once per spec and the
# examples spend their time on random operation sequences.
_rng = np.random.default_rng(20261129)
ROOMY_SPECS = [random_spec(_rng, 1.0) for _ in range(6)]
TIGHT_SPECS = [random_spec(_rng, 0.5) for _ in range(4)]


def check_invariants(spec, state, lens_model=None):
    """Pages conserved, never owned twice; dummy slot empty; windows exact."""
    for pool, table, free, n_free in zip(spec.pools, state.page_tables,
                                        state.free_pages, np.asarray(state.num_free)):
        table, free = np.asarray(table), np.asarray(free)
        owned = table[table != BAD_PAGE_INDEX]
        free_list = free[:n_free]
        assert len(set(owned.tolist())) == owned.size, "a page is owned twice"
        assert len(set(free_list.tolist())) == free_list.size, "a page is free twice"
        assert not set(owned.tolist()) & set(free_list.tolist()), "owned page is free"
        assert owned.size + n_free == pool.num_usable_pages, "pages not conserved"
        assert NULL_PAGE not in owned and NULL_PAGE not in free_list, "null page handed out"
        assert (table[spec.dummy_slot] == BAD_PAGE_INDEX).all(), "dummy slot owns pages"
        extent = np.asarray(row_extent(jnp.asarray(table)))
        if lens_model is None:
            continue
        for slot, (t_len, d_len) in lens_model.items():
            lens = [l for r, l in (("target", t_len), ("draft", d_len)) if r in pool.roles]
            lo, hi = min(lens), max(lens)
            start = 0 if pool.sliding_window is None else max(lo - pool.sliding_window + 1, 0)
            first, end = start // spec.page_size, -(-hi // spec.page_size)
            valid = np.flatnonzero(table[slot] != BAD_PAGE_INDEX)
            assert valid.tolist() == list(range(first, end)), (
                f"pool {pool.pool_id} slot {slot} lens {lens}: pages at {valid.tolist()}, "
                f"expected the live tail {first}..{end - 1}")
            assert extent[slot] == (end if end > first else 0)
    assert int(state.target_lens[spec.dummy_slot]) == 0
    assert int(state.draft_ctx_lens[spec.dummy_slot]) == 0


def ops_strategy(spec):
    slot = st.integers(0, spec.num_slots - 1)
    return st.lists(st.one_of(
        st.tuples(st.just("admit"), slot),
        st.tuples(st.just("release"), slot),
        st.tuples(st.just("grow"), st.lists(st.tuples(slot, st.integers(0, spec.max_step_tokens),
                                                      st.integers(0, 3)),
                                            min_size=1, max_size=spec.num_slots)),
    ), min_size=1, max_size=12)


def apply_ops(spec, state, ops, fns, lens_model=None, check=True):
    """Runs ops; a grow is always followed by retirement, as a step does."""
    live = set()
    for op in ops:
        kind = op[0]
        if kind == "admit":
            state = fns["admit"](spec, state, jnp.array([op[1]], jnp.int32))
            live.add(op[1])
            if lens_model is not None:
                lens_model[op[1]] = (0, 0)  # admitting a live slot starts it afresh
        elif kind == "release":
            state = fns["release"](spec, state, jnp.array([op[1]], jnp.int32))
            live.discard(op[1])
        else:
            rows = {s: (d, lag) for s, d, lag in op[1] if s in live}
            if not rows:
                continue
            # Fixed batch shape (num_slots + 1 rows), padded with the dummy slot.
            pad = spec.num_slots + 1 - len(rows)
            ids = list(rows) + [spec.dummy_slot] * pad
            t = np.asarray(state.target_lens)
            new_t = [min(int(t[s]) + rows[s][0], spec.max_seq_len) for s in rows] + [0] * pad
            new_d = [max(nt - rows[s][1], int(state.draft_ctx_lens[s]))
                     for s, nt in zip(rows, new_t)] + [0] * pad
            new_d = [min(a, b) for a, b in zip(new_d, new_t)]
            state, ok = fns["grow"](spec, state, jnp.array(ids, jnp.int32),
                                    jnp.array(new_t, jnp.int32), jnp.array(new_d, jnp.int32))
            state = fns["retire"](spec, state, jnp.array(ids, jnp.int32))
            ok = np.asarray(ok)
            assert ok[len(rows):].all(), "padding rows always fit (they need nothing)"
            if lens_model is not None:
                for i, s in enumerate(rows):
                    if ok[i]:
                        lens_model[s] = (new_t[i], new_d[i])
        if lens_model is not None:
            for s in list(lens_model):
                if s not in live:
                    del lens_model[s]
            for s in live:
                lens_model.setdefault(s, (0, 0))
        if check:
            check_invariants(spec, state, lens_model)
    return state


EAGER = dict(admit=admit_slots, release=release_slots, grow=grow, retire=retire_window_pages)
JITTED = dict(admit=jax.jit(admit_slots, static_argnums=0, donate_argnums=1),
              release=jax.jit(release_slots, static_argnums=0, donate_argnums=1),
              grow=jax.jit(grow, static_argnums=0, donate_argnums=1),
              retire=jax.jit(retire_window_pages, static_argnums=0, donate_argnums=1))


@given(st.data())
def test_random_sequences_keep_invariants_and_exact_window_tails(data):
    spec = data.draw(st.sampled_from(ROOMY_SPECS))
    ops = data.draw(ops_strategy(spec))
    apply_ops(spec, init_state(spec), ops, JITTED, lens_model={})


@given(st.data())
def test_tight_budgets_overflow_as_data_and_conserve_pages(data):
    spec = data.draw(st.sampled_from(TIGHT_SPECS))
    ops = data.draw(ops_strategy(spec))
    apply_ops(spec, init_state(spec), ops, JITTED, lens_model=None)


@given(st.data())
def test_jitted_and_eager_runs_give_identical_states(data):
    spec = data.draw(st.sampled_from(ROOMY_SPECS + TIGHT_SPECS))
    ops = data.draw(ops_strategy(spec))
    eager = apply_ops(spec, init_state(spec), ops, EAGER, check=False)
    jitted = apply_ops(spec, init_state(spec), ops, JITTED, check=False)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def one_pool_spec(window, num_pages_budget_rows=1, page_size=8, max_seq_len=400, step=4):
    layers = (LayerSpec("t0", "target", 1, 8, "bf16", window),)
    probe = CacheSpec(page_size, layers, 2, max_seq_len, 1 << 40, step)
    per_row = probe.pools[0].bytes_per_page
    pages = max_live_pages(page_size, window, max_seq_len, step) * num_pages_budget_rows + 1
    return CacheSpec(page_size, layers, 2, max_seq_len, pages * per_row, step)


def test_retired_pages_are_reused_so_a_window_runs_forever_in_its_bound():
    spec = one_pool_spec(window=16)
    pool = spec.pools[0]
    assert pool.num_pages < spec.max_pages_per_seq  # can't hold the full sequence
    state = admit_slots(spec, init_state(spec), jnp.array([0]))

    @jax.jit
    def step(state, length):  # grow by one step, then retire behind the window
        state, ok = grow(spec, state, jnp.array([0]), length, length)
        return retire_window_pages(spec, state, jnp.array([0])), ok

    homes = {}  # page -> logical pages it has backed
    for length in range(4, 400, 4):
        state, ok = step(state, jnp.array([length]))
        assert bool(ok[0]), f"ran out of pages at length {length}"
        row = np.asarray(state.page_tables[0][0])
        for logical in np.flatnonzero(row >= 0):
            homes.setdefault(int(row[logical]), set()).add(int(logical))
        check_invariants(spec, state, {0: (length, length), 1: (0, 0)})
    assert set(homes) <= set(range(1, pool.num_pages))  # never the null page
    assert sum(len(h) for h in homes.values()) == -(-396 // spec.page_size)
    assert all(len(h) > 5 for h in homes.values()), "retired pages were not reused"


def test_overflowing_row_is_left_untouched_and_others_proceed():
    spec = one_pool_spec(window=None, max_seq_len=64)
    total = spec.pools[0].num_usable_pages  # one max-length request's worth
    state = admit_slots(spec, init_state(spec), jnp.array([0, 1]))
    state, ok = grow(spec, state, jnp.array([0]), jnp.array([40]), jnp.array([40]))
    assert bool(ok[0])
    before = jax.tree.map(np.asarray, state)
    # Row 1 wants more pages than are left; row 0 grows within what remains.
    state, ok = grow(spec, state, jnp.array([0, 1]), jnp.array([48, 64]), jnp.array([48, 64]))
    assert np.asarray(ok).tolist() == [True, False]
    assert int(state.target_lens[1]) == 0 and int(state.draft_ctx_lens[1]) == 0
    np.testing.assert_array_equal(np.asarray(state.page_tables[0][1]), before.page_tables[0][1])
    assert int(state.target_lens[0]) == 48
    assert int(state.num_free[0]) == total - 6


def test_row_extent_counts_leading_bad_entries():
    rows = jnp.array([[-1, -1, 7, 3, -1], [-1] * 5, [1, 2, 3, 4, 5], [-1, -1, -1, -1, 9]])
    assert row_extent(rows).tolist() == [4, 0, 5, 5]


def test_validate_slot_ids_errors():
    spec = one_pool_spec(window=None, max_seq_len=64)
    assert validate_slot_ids(spec, [0, 2, 2]).tolist() == [0, 2, 2]  # padding may repeat
    with pytest.raises(ValueError, match="repeat real slots"):
        validate_slot_ids(spec, [1, 1])
    with pytest.raises(ValueError, match="outside"):
        validate_slot_ids(spec, [0, 3])


def test_sharded_state_along_kv_heads():
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs several (host) devices")
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("tp",))
    layers = (LayerSpec("t0", "target", 4, 8, "bf16"), LayerSpec("d0", "draft", 2, 8, "bf16", 16))
    spec = CacheSpec(8, layers, 2, 64, 1 << 20, 4)
    state = init_state(spec, mesh=mesh)
    assert state.pools[0].sharding.spec == jax.sharding.PartitionSpec("tp")
    shard_shapes = {s.data.shape for s in state.pools[0].addressable_shards}
    assert shard_shapes == {(2,) + spec.pools[0].shape[1:]}
    state, ok = jax.jit(grow, static_argnums=0)(spec, state, jnp.array([0]), jnp.array([20]),
                                                 jnp.array([20]))
    assert bool(ok[0]) and owned_pages(spec, state)[0][0] == 3
    mesh3 = jax.sharding.Mesh(np.array(devices[:3]), ("tp",)) if len(devices) >= 3 else None
    if mesh3 is not None:
        with pytest.raises(ValueError, match="not divisible by mesh axis"):
            init_state(spec, mesh=mesh3)
