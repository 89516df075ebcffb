"""The engine tests' shared pair and checks (tests/drafter/test_engine*.py): `pair` is a
module-scoped fixture, so each module that takes it builds its own; the second compiles
nothing the first compiled (the suite's persistent compilation cache)."""

import jax
import numpy as np
import pytest

from tests.drafter.tiny import tiny_pair


@pytest.fixture(scope="module")
def pair():
    """The module's one reference pair, its params committed to a device as checkpoints
    load: every test serving on it shares its compiled steps (tests/models/test_checkpoint.py
    serves the same config, so its steps come from the run's compilation cache)."""
    params, speculative_cfg, plain_cfg = tiny_pair(num_slots=2)
    return jax.device_put(params, jax.devices()[0]), speculative_cfg, plain_cfg


def snapshot(engine):
    return jax.tree.map(np.asarray, engine.state)


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def pool_addresses(engine):
    """Where each of `engine`'s KV pools lives on its device (equal across calls: the
    calls update the cache in place)."""
    jax.block_until_ready(engine.state)
    return [p.unsafe_buffer_pointer() for p in engine.state.kv.pools]


def assert_all_free(engine):
    """Nothing held: every pool's pages free, no reservation, every slot free, no request
    active or running (after an engine's last step, and after each fault)."""
    spec = engine.spec
    assert np.asarray(engine.state.kv.num_free).tolist() == [p.num_usable_pages
                                                             for p in spec.pools]
    assert engine.admission.reserved_pages == (0,) * len(spec.pools)
    assert engine.admission.num_free_slots == spec.num_slots
    assert engine.num_active == 0 and not np.asarray(engine.state.running).any()
