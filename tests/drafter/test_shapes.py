"""Random weights at real shapes: the tree `init_params` makes, each layer drawn apart."""

import dataclasses

import jax
import numpy as np

from drafter.dflash import init_params as init_draft
from drafter.shapes import qwen3_8b_pair, random_params, random_step_params
from models.layers import step_params
from models.qwen3 import init_params as init_target


def test_random_params_have_the_init_trees_shapes_and_distinct_layers():
    tcfg, dcfg = qwen3_8b_pair(num_target_layers=3, num_draft_layers=2, vocab_size=256)
    small = {"hidden_size": 64, "intermediate_size": 96, "head_dim": 16}
    tcfg, dcfg = (dataclasses.replace(c, **small) for c in (tcfg, dcfg))
    got = random_params(tcfg, dcfg)
    for name, init, cfg in (("target", init_target, tcfg), ("draft", init_draft, dcfg)):
        want = jax.eval_shape(lambda k: init(cfg, k, jax.numpy.bfloat16), jax.random.key(0))
        assert jax.tree.structure(got[name]) == jax.tree.structure(want)
        assert [(x.shape, x.dtype) for x in jax.tree.leaves(got[name])] == [
            (x.shape, x.dtype) for x in jax.tree.leaves(want)]
        first, second = ([np.asarray(x, np.float32) for x in jax.tree.leaves(layer)]
                         for layer in got[name]["layers"][:2])
        assert not all(np.array_equal(a, b) for a, b in zip(first, second))  # keys differ


def test_random_step_params_are_the_step_form_of_random_params():
    """Drawn fused and stacked in place for a scan, the weights equal the step form
    converted from the checkpoint form, leaf for leaf (the unrolled form draws each layer
    with the same fused program, one layer a list entry)."""
    tcfg, dcfg = qwen3_8b_pair(num_target_layers=3, num_draft_layers=2, vocab_size=256)
    small = {"hidden_size": 64, "intermediate_size": 96, "head_dim": 16}
    tcfg, dcfg = (dataclasses.replace(c, **small) for c in (tcfg, dcfg))
    want = step_params(random_params(tcfg, dcfg, seed=5), True)
    got = random_step_params(tcfg, dcfg, True, seed=5)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # unrolled: the same tree of per-layer dicts (traced, not compiled)
    unrolled = jax.eval_shape(lambda: random_step_params(tcfg, dcfg, False, seed=5))
    assert unrolled == jax.eval_shape(lambda: step_params(random_params(tcfg, dcfg), False))
    assert len(unrolled["target"]["layers"]) == 3
