"""Matmul precision follows the weights, and greedy speculative output stays equal to
plain greedy output under it (on the GPU at a real per-layer shape, up to near-ties of
the exact logits)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drafter.engine import Engine
from drafter.evaluate import divergences, near_tie
from drafter.shapes import qwen3_8b_pair, random_params
from drafter.steps import StepConfig, init_step_state, matmul_precision_for
from drafter.uniform_steps import plain_decode_step
from models.qwen3 import Qwen3Config, init_params
from pallas_kernels.pool_layout import MAX_POOL_ELEMENTS
from unified_kv import CacheSpec, init_state


def test_precision_follows_the_weight_dtype():
    bf16 = {"w": jnp.zeros((2, 2), jnp.bfloat16), "ids": jnp.zeros(3, jnp.int32)}
    mixed = {**bf16, "norm": jnp.zeros(2, jnp.float32)}
    assert matmul_precision_for(bf16) == "default"
    assert matmul_precision_for(mixed) == "highest"   # any f32 weight: f32-exact matmuls
    assert matmul_precision_for(bf16, "highest") == "highest"  # an explicit choice wins
    assert matmul_precision_for({"w": jnp.zeros(2)}, "auto") == "highest"


@pytest.mark.parametrize("dtype,highest", [(jnp.bfloat16, False), (jnp.float32, True)])
def test_the_shipped_steps_run_bf16_weights_at_the_default_precision(dtype, highest):
    """A StepConfig left at its default traces bf16 weights without f32-exact matmuls
    (on GPUs those turn the 1-row decode step's matmuls into slow f32 reductions) and
    f32 weights with them."""
    tcfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=8)
    params = {"target": init_params(tcfg, jax.random.key(0), dtype)}
    spec = CacheSpec(page_size=8, layers=tuple(tcfg.layer_specs("bf16")), num_slots=2,
                     max_seq_len=64, memory_budget_bytes=1 << 20, max_step_tokens=16)
    cfg = StepConfig(tcfg, spec, impl="reference")  # precision, not kernels, is tested
    state = init_step_state(cfg, init_state(spec))
    step = jax.jit(functools.partial(plain_decode_step, cfg=cfg, table_width=8))
    hlo = step.lower(params, state, jnp.zeros(1, jnp.int32), jax.random.key(0)).as_text()
    assert " dot(" in hlo or "dot_general" in hlo
    assert ("HIGHEST" in hlo) == highest


def test_near_tie_accepts_close_pairs_only():
    logits = np.random.default_rng(0).normal(size=4096)
    order = np.argsort(logits)[::-1]
    best = int(order[0])
    close = best + 1 if best + 1 < 4096 else best - 1
    logits[close] = logits[best] - 0.01 * logits.std()
    assert near_tie(logits, best, close) and near_tie(logits, close, best)
    assert not near_tie(logits, best, int(order[50]))    # a runner-up far down
    assert not near_tie(logits, int(order[-1]), best)    # the worst token


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="TF32 / bf16 tensor cores: a GPU")
@pytest.mark.parametrize("max_seq_len,budget_bytes", [(1024, 256 << 20), (163840, 8 << 30)],
                         ids=["small_pool", "pool_past_2_32_elements"])
def test_speculative_equals_plain_greedy_at_8b_layer_shape_up_to_near_ties(max_seq_len,
                                                                           budget_bytes):
    """4 Qwen3-8B-shaped target layers, a 1-layer block-16 drafter, bf16 weights, fp8
    target KV, the shipped StepConfig precision: the verify of 16 tokens and the 1-token
    plain step pick the same argmax at every position, or where they part, both
    tokens are a near-tie of the exact (f32, uncached) logits there. At 4 slots the
    attention takes the Gluon kernel with key splits; a cache for 4 x 160K tokens puts
    the target's fp8 pool past 2^32 elements, so its reads and K/V stores take 64-bit
    offsets too, as a long-context 8B server's do."""
    tcfg, dcfg = qwen3_8b_pair(num_target_layers=4, num_draft_layers=1)
    params = random_params(tcfg, dcfg, seed=3)

    def cfg(draft):
        layers = tcfg.layer_specs("fp8_e4m3") + (draft.layer_specs("bf16") if draft else [])
        spec = CacheSpec(page_size=16, layers=tuple(layers), num_slots=4,
                         max_seq_len=max_seq_len, memory_budget_bytes=budget_bytes,
                         max_step_tokens=256)
        return StepConfig(tcfg, spec, draft)

    fp8_pool = next(p for p in cfg(dcfg).spec.pools if p.kv_dtype == "fp8_e4m3")
    assert (np.prod(fp8_pool.shape) > 2 * MAX_POOL_ELEMENTS) == (max_seq_len > 1024)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 150_000, n).tolist() for n in (17, 300, 511, 64)]
    speculative = Engine(params, cfg(dcfg)).generate(prompts, 48)
    plain = Engine({"target": params["target"]}, cfg(None), speculative=False).generate(
        prompts, 48)
    parted = divergences(params, tcfg, prompts, speculative, plain)
    for d in parted:
        assert d["near_tie"], (f"prompt {d['prompt']} diverged at token {d['at']}: "
                               f"{d['tokens']}, not a near-tie of the exact logits "
                               f"({d['gap_std']} sd)")
    equal = len(prompts) - len(parted)
    print(f"{equal} of {len(prompts)} prompts equal token for token; the rest part at "
          f"near-ties")
