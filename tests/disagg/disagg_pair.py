"""What the disaggregated-serving tests share (tests/disagg/test_disagg*.py): one tiny
pair and its aggregated results, the meshes, page-conservation checks and a tampering KV
source. `pair` and `aggregated` are module-scoped fixtures, so each module that takes them
builds its own; the second compiles nothing the first compiled (the suite's persistent
compilation cache)."""

import jax
import numpy as np
import pytest

from disagg.sources import disaggregated_engine
from drafter.engine import Engine
from tests.drafter.engine_pair import assert_all_free
from tests.drafter.tiny import tiny_pair


# One tiny pair for a module (4 kv heads, so the TP tests can split them 4 ways): every
# engine here, aggregated or either side of a pair, on a device or a mesh, runs the same
# configuration and so compiles each of its steps once for the whole module.
@pytest.fixture(scope="module")
def pair():
    params, cfg, _ = tiny_pair(num_slots=2, num_kv_heads=4)
    return params, cfg


_rng = np.random.default_rng(1)
PROMPTS = [_rng.integers(0, 63, n).tolist() for n in (5, 17, 33, 40, 9)]  # > draft window 16
MAX_NEW = 16


@pytest.fixture(scope="module")
def aggregated(pair):
    """The aggregated engine's results for PROMPTS: what every serving split must equal."""
    params, cfg = pair
    return Engine(params, cfg).generate(PROMPTS, MAX_NEW)


def meshes():
    devices = np.array(jax.devices())
    if len(devices) < 4:
        pytest.skip("needs 4 (host) devices")
    return (jax.sharding.Mesh(devices[:2], ("tp",)), jax.sharding.Mesh(devices[2:4], ("tp",)))


def split_engine(params, cfg, **kwargs):
    """A pair on the equality test's meshes (context TP2, generation TP2: their compiled
    steps are shared) where there are 4 devices, else on the default device."""
    if len(jax.devices()) >= 4:
        mesh_a, mesh_b = meshes()
        kwargs = dict(context_meshes=(mesh_a,), mesh=mesh_b, **kwargs)
    return disaggregated_engine(params, cfg, **kwargs)


def assert_pair_free(engine):
    assert_all_free(engine)
    for ctx in engine.kv_source.contexts:
        ctx.engine.run()
        assert_all_free(ctx.engine)


class Tampered:
    """A KV source whose arrived payloads pass through `change(request_id, payload)` (a
    bad wire); progress and failures pass as they are."""

    def __init__(self, inner, change):
        self.inner, self.change = inner, change
        self.contexts = inner.contexts

    def fetch(self, request):
        self.inner.fetch(request)

    def poll(self, timeout):
        return [(rid, item if item is None or isinstance(item, BaseException)
                 else self.change(rid, item)) for rid, item in self.inner.poll(timeout)]
