"""Acceptance depends on the draft context KV (the thing disaggregation must carry).

Uses the shipped tiny 'copy' pair (tests/fixtures/make_copy_pair.py): the target
copies a repeating pattern; the drafter can only draft past its anchor by
reading the pattern from its context pages.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drafter.engine import Engine
from drafter.steps import StepConfig
from drafter.checkpoint import load_dflash
from models.checkpoint import load_qwen3
from unified_kv import CacheSpec

PAIR = Path(__file__).parent.parent / "fixtures" / "copy_pair"
MAX_NEW = 32


@pytest.fixture(scope="module")
def copy_pair():
    tcfg, target = load_qwen3(PAIR / "target")
    dcfg, draft = load_dflash(PAIR / "draft")
    layers = tcfg.layer_specs("f32") + dcfg.layer_specs("f32")
    spec = CacheSpec(8, tuple(layers), 4, 128, 1 << 26, 8)
    return {"target": target, "draft": draft}, StepConfig(tcfg, spec, dcfg, "reference")


def periodic_prompts(n=6, length=24, seed=123):
    rng = np.random.default_rng(seed)
    return [np.resize(rng.integers(0, 31, rng.integers(3, 9)), length).tolist()
            for _ in range(n)]


def run_with_context(params, cfg, prompts, tamper):
    """One request at a time; `tamper(kv)` rewrites every draft layer's K/V after
    prefill (draft layers may share a pool with target layers: only their slice)."""
    draft_layers = [cfg.spec.layer_location(l.name) for l in cfg.spec.layers
                    if l.role == "draft"]
    als, outs = [], []
    for i, prompt in enumerate(prompts):
        engine = Engine(params, cfg)
        engine.add_request(f"r{i}", prompt, MAX_NEW)
        engine.prefill_submitted()  # the prompt's KV is in before the context is rewritten
        if tamper is not None:
            pools = list(engine.state.kv.pools)
            for pid, offset in draft_layers:
                layer = pools[pid][:, :, offset]
                pools[pid] = pools[pid].at[:, :, offset].set(tamper(layer, i))
            engine.state = engine.state.replace(kv=engine.state.kv.replace(pools=tuple(pools)))
        done = []
        while not done:
            done = engine.step()
        als.append(done[0].acceptance_length)
        outs.append(done[0].tokens)
    return float(np.mean(als)), outs


def test_draft_context_drives_acceptance(copy_pair):
    params, cfg = copy_pair
    prompts = periodic_prompts()
    intact, tokens = run_with_context(params, cfg, prompts, None)
    dropped, tokens_dropped = run_with_context(params, cfg, prompts,
                                               lambda pool, i: jnp.zeros_like(pool))
    noise = lambda pool, i: jax.random.normal(jax.random.key(i), pool.shape, pool.dtype)
    corrupted, tokens_corrupted = run_with_context(params, cfg, prompts, noise)
    print(f"AL intact={intact:.2f} dropped={dropped:.2f} corrupted={corrupted:.2f}")
    # Output is unchanged (lossless) whatever the drafter sees ...
    assert tokens == tokens_dropped == tokens_corrupted
    # ... but acceptance is not: the measured values are ~{intact}, far above these.
    assert intact >= 3.0
    assert dropped <= intact - 0.75
    assert corrupted <= intact - 0.75


def test_shipped_pair_is_lossless_against_plain_greedy(copy_pair):
    params, cfg = copy_pair
    prompts = periodic_prompts(n=4, seed=7)
    speculative = Engine(params, cfg).generate(prompts, 24)
    plain_cfg = StepConfig(cfg.target, cfg.spec, None, cfg.impl)
    plain = Engine(params, plain_cfg, speculative=False).generate(prompts, 24)
    assert [r.tokens for r in speculative] == [r.tokens for r in plain]
