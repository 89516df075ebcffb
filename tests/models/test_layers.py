"""Layers as scans: runs of alike layers, the stacked form, and one fingerprint for both forms."""

import jax
import jax.numpy as jnp
import numpy as np

from models.checkpoint import fingerprint
from models.layers import (FUSED_PROJECTIONS, fused_parts, layer_runs, scan_layers, stack_params,
                           step_params, unstack_layers, unstack_params)
from models.qwen3 import Qwen3Config, dense_forward, init_params
from unified_kv import CacheSpec


def _spec(layer_types, kv_dtype="bf16"):
    cfg = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32,
                      num_layers=len(layer_types), num_heads=2, num_kv_heads=1, head_dim=8,
                      layer_types=layer_types, sliding_window=16)
    return cfg, CacheSpec(8, tuple(cfg.layer_specs(kv_dtype)), 2, 64, 1 << 24)


def _shape(runs):
    return [(r.first, r.period, r.repeats) for r in runs]


def test_runs_follow_repeating_layer_kinds():
    full, slide = "full_attention", "sliding_attention"
    cfg, spec = _spec((full,) * 6)
    (run,) = layer_runs(spec, "target", 6)
    assert _shape([run]) == [(0, 1, 6)] and run.offsets == tuple((i,) for i in range(6))
    cfg, spec = _spec((slide, full) * 3)
    (run,) = layer_runs(spec, "target", 6)
    assert _shape([run]) == [(0, 2, 3)]
    assert [pool for _, pool in run.kinds] == [0, 1]
    assert run.offsets == ((0, 0), (1, 1), (2, 2))  # each kind counts in its own pool
    cfg, spec = _spec((full,) * 3 + (slide,) * 3)
    assert _shape(layer_runs(spec, "target", 6)) == [(0, 1, 3), (3, 1, 3)]
    cfg, spec = _spec((full, slide, slide, full))
    assert sum(r.period * r.repeats for r in layer_runs(spec, "target", 4)) == 4


def test_stacked_and_listed_layers_are_the_same_weights():
    cfg, _ = _spec(("full_attention",) * 3)
    params = {"target": init_params(cfg, jax.random.key(0))}
    stacked = stack_params(params)
    assert stacked["target"]["layers"]["q"].shape == (3, 16, 16)
    assert stack_params(stacked)["target"]["layers"] is stacked["target"]["layers"]
    back = unstack_layers(stacked["target"]["layers"])
    assert all(jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves(back),
                                                     jax.tree.leaves(params["target"]["layers"])))
    assert fingerprint(stacked) == fingerprint(params)
    changed = jax.tree.map(lambda x: x, stacked)
    changed["target"]["layers"]["q"] = changed["target"]["layers"]["q"].at[2, 0, 0].add(1e-3)
    assert fingerprint(changed) != fingerprint(params)




def test_step_params_fuse_projections_and_the_forward_is_unchanged():
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    params = {"target": init_params(cfg, jax.random.key(0))}
    tokens = jnp.arange(10, dtype=jnp.int32)[None] % 64
    want = dense_forward(params["target"], cfg, tokens)[0]
    for scan in (False, True):
        fused = step_params(params, scan)
        layers = fused["target"]["layers"]
        first = layers if scan else layers[0]
        assert set(FUSED_PROJECTIONS) <= set(first)
        assert not {"q", "k", "v", "gate", "up"} & set(first)
        assert first["qkv"].shape[-1] == (4 + 2 + 2) * 8
        again = step_params(fused, scan)  # already in step form: unchanged
        assert jax.tree.map(jnp.shape, again) == jax.tree.map(jnp.shape, fused)
        got = dense_forward(unstack_params(fused)["target"], cfg, tokens)[0]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_the_step_form_fingerprints_like_the_checkpoint():
    """Stacked or listed, fused or not: the same weights, the same fingerprint (a pair
    of workers compares them at connect), and a changed value still changes it."""
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    params = init_params(cfg, jax.random.key(0))
    want = fingerprint(params)
    for scan in (False, True):
        model = step_params({"target": params}, scan)["target"]
        assert fingerprint(model, fused=fused_parts(cfg)) == want
        assert fingerprint(model) != want  # the fused leaves as they are: another tree
    changed = step_params({"target": params}, False)["target"]
    changed["layers"][1]["qkv"] = changed["layers"][1]["qkv"].at[0, -1].add(1.0)  # a v weight
    assert fingerprint(changed, fused=fused_parts(cfg)) != want


def test_unsliced_weights_reach_the_layer_stacked_with_its_row():
    """A scan hands `unsliced` names over whole, with the row of the layer at hand (here
    a two-layer body run twice, then a lone layer); the others arrive sliced to that
    row."""
    full, slide = "full_attention", "sliding_attention"
    cfg, spec = _spec((full, slide, full, slide, full))
    runs = layer_runs(spec, "target", 5)
    assert _shape(runs) == [(0, 2, 2), (4, 1, 1)]
    layers = {"norm": jnp.arange(5 * 3, dtype=jnp.float32).reshape(5, 3),
              "w": jnp.arange(5 * 2, dtype=jnp.float32).reshape(5, 2)}

    def layer_fn(p, x, pools, layer, pool_id, offset):
        norm = p["norm"]
        picked = jax.lax.dynamic_index_in_dim(norm.stack, norm.row, keepdims=False)
        assert norm.stack.shape == (5, 3) and p["w"].shape == (2,)
        return x + (picked[0] * 2 - p["w"][0] * 3), pools   # 0 when row and slice agree

    x, _, taps = scan_layers(layer_fn, layers, runs, jnp.zeros(1), (), taps=(0, 2, 4),
                             unsliced=("norm",))
    assert float(x[0]) == 0.0

    def row_of(p, x, pools, layer, pool_id, offset):
        return x * 0 + p["norm"].row.astype(x.dtype), pools

    _, _, rows = scan_layers(row_of, layers, runs, jnp.zeros(()), (), taps=(0, 1, 2, 3, 4),
                             unsliced=("norm",))
    assert [int(r) for r in rows] == [0, 1, 2, 3, 4]
