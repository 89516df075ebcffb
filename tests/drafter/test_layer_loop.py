"""Scanned and unrolled layers are the same model: same tokens, same acceptance."""

import dataclasses

import jax
import numpy as np
import pytest

from drafter.engine import Engine
from tests.drafter.tiny import tiny_pair


def test_scanned_and_unrolled_layers_generate_the_same_tokens_and_acceptance():
    params, cfg, _ = tiny_pair()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 60, n).tolist() for n in (5, 23, 40)]  # past the windows
    runs = {}
    for loop in ("scan", "unrolled"):
        engine = Engine(params, dataclasses.replace(cfg, layer_loop=loop))
        stacked = isinstance(engine.params["target"]["layers"], dict)
        assert stacked == (loop == "scan")
        runs[loop] = [(r.tokens, r.acceptance) for r in engine.generate(prompts, 12)]
    assert runs["scan"] == runs["unrolled"]


def test_layer_loop_auto_scans_except_on_gpus_and_unknown_names_are_refused():
    _, cfg, _ = tiny_pair()
    assert cfg.scans_layers == (jax.default_backend() != "gpu")
    with pytest.raises(ValueError, match="layer_loop 'loop'"):
        dataclasses.replace(cfg, layer_loop="loop").scans_layers
