"""Matmul precision follows the weights, and greedy speculative output stays equal to
plain greedy output under it (on the GPU at a real per-layer shape)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drafter.engine import Engine
from drafter.shapes import qwen3_8b_pair, random_params
from drafter.steps import StepConfig, matmul_precision_for
from unified_kv import CacheSpec


def test_precision_follows_the_weight_dtype():
    bf16 = {"w": jnp.zeros((2, 2), jnp.bfloat16), "ids": jnp.zeros(3, jnp.int32)}
    mixed = {**bf16, "norm": jnp.zeros(2, jnp.float32)}
    assert matmul_precision_for(bf16) == "default"
    assert matmul_precision_for(mixed) == "highest"   # any f32 weight: f32-exact matmuls
    assert matmul_precision_for(bf16, "highest") == "highest"  # an explicit choice wins
    assert matmul_precision_for({"w": jnp.zeros(2)}, "auto") == "highest"


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="TF32 / bf16 tensor cores: a GPU")
def test_speculative_equals_plain_greedy_at_8b_layer_shape():
    """4 Qwen3-8B-shaped target layers, a 1-layer block-16 drafter, bf16 weights, fp8
    target KV, the shipped StepConfig precision: the verify of 16 tokens and the 1-token
    plain step must pick the same argmax at every position."""
    tcfg, dcfg = qwen3_8b_pair(num_target_layers=4, num_draft_layers=1)
    params = random_params(tcfg, dcfg, seed=3)

    def cfg(draft):
        layers = tcfg.layer_specs("fp8_e4m3") + (draft.layer_specs("bf16") if draft else [])
        spec = CacheSpec(page_size=16, layers=tuple(layers), num_slots=4, max_seq_len=1024,
                         memory_budget_bytes=256 << 20, max_step_tokens=256)
        return StepConfig(tcfg, spec, draft)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 150_000, n).tolist() for n in (17, 300, 511, 64)]
    speculative = Engine(params, cfg(dcfg)).generate(prompts, 48)
    plain = Engine({"target": params["target"]}, cfg(None), speculative=False).generate(
        prompts, 48)
    for i, (s, p) in enumerate(zip(speculative, plain)):
        assert s.tokens == p.tokens, f"prompt {i} diverged at {_first_diff(s.tokens, p.tokens)}"


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
