"""The Pallas kernels under tensor parallelism: each device attends its own kv heads."""

import jax
import numpy as np
import pytest

from drafter.engine import Engine
from tests.drafter.tiny import tiny_pair


@pytest.mark.timeout(900)
def test_pallas_kernels_on_a_kv_head_mesh_give_the_single_device_tokens(monkeypatch,
                                                                       interpret):
    """Interpret mode over host devices on CPU; compiled over 2 GPUs on a GPU host."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (host devices on CPU, or 2 GPUs)")
    sharded = []  # (in_specs) of every kernel traced per device
    real_shard_map = jax.shard_map

    def spy(f, **kwargs):
        sharded.append(kwargs["in_specs"])
        return real_shard_map(f, **kwargs)
    monkeypatch.setattr(jax, "shard_map", spy)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    params, cfg, _ = tiny_pair(num_slots=2, impl="interpret" if interpret else "pallas",
                                max_seq_len=64)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], list(range(1, 20))]
    # one decode shape (a row per slot): each compile here runs the kernels interpreted
    want = Engine(params, cfg, batch_invariant=True).generate(prompts, 6)
    engine = Engine(params, cfg, mesh=mesh, batch_invariant=True)
    assert not sharded  # without a mesh the kernels run as they are
    got = engine.generate(prompts, 6)
    # every kernel splits its first operand's heads over the mesh: attention's q
    # [B, T, heads, D] and rope_store's projections [N, heads * D]
    assert sharded and all(spec[0] == jax.sharding.PartitionSpec(*[None] * (len(spec[0]) - 1),
                                                                 "tp") for spec in sharded)
    assert any(len(spec[0]) == 2 for spec in sharded)  # rope_store ran per device
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.acceptance for r in got] == [r.acceptance for r in want]
    pool = engine.state.kv.pools[0]
    assert len(pool.sharding.device_set) == 2  # the pools really are split over the mesh
    assert pool.addressable_shards[0].data.shape[0] == pool.shape[0] // 2
