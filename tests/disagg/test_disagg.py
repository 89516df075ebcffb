"""Disaggregated serving: identical to aggregated in shared mode, loud on every failure."""

import dataclasses
import time

import jax
import numpy as np
import pytest

from disagg.layout import Layout, LayoutMismatch, check_layouts
from disagg.transfer import MOVE_PATHS, TransferError
from disagg.workers import (Channel, ContextWorker, DisaggregatedPair, GenerationWorker,
                            TransferTimeout, connect)
from drafter.engine import Engine
from tests.drafter.test_context import PAIR, periodic_prompts
from tests.drafter.tiny import tiny_pair


def meshes():
    devices = np.array(jax.devices())
    if len(devices) < 4:
        pytest.skip("needs 4 (host) devices")
    return (jax.sharding.Mesh(devices[:2], ("tp",)), jax.sharding.Mesh(devices[2:4], ("tp",)))


def free_pages(worker):
    return np.asarray(worker.engine.state.kv.num_free).tolist()


def all_free(worker):
    return [p.num_usable_pages for p in worker.engine.spec.pools]


@pytest.mark.parametrize("path", MOVE_PATHS)
def test_shared_mode_equals_aggregated_token_for_token_and_step_for_step(path):
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if path == "pinned_host" and "pinned_host" not in kinds:
        pytest.skip(f"this platform's devices offer no pinned host memory ({sorted(kinds)})")
    params, cfg, _ = tiny_pair(num_slots=3)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 63, n).tolist() for n in (5, 17, 33, 40, 9)]  # > draft window 16
    agg = Engine(params, cfg).generate(prompts, 16)
    mesh_a, mesh_b = meshes()
    pair = DisaggregatedPair(ContextWorker(params, cfg, mesh=mesh_a),
                             GenerationWorker(params, cfg, mesh=mesh_b, move_path=path))
    dis = pair.generate(prompts, 16)
    assert [r.tokens for r in dis] == [r.tokens for r in agg]
    assert [r.acceptance for r in dis] == [r.acceptance for r in agg]
    assert pair.generation.bytes_received > 0
    assert pair.context.num_held == 0 and free_pages(pair.context) == all_free(pair.context)
    assert free_pages(pair.generation) == all_free(pair.generation)


def test_private_mode_loses_acceptance_not_output():
    from models.checkpoint import load_dflash, load_qwen3
    from drafter.steps import StepConfig
    from unified_kv import CacheSpec
    tcfg, target = load_qwen3(PAIR / "target")
    dcfg, draft = load_dflash(PAIR / "draft")
    spec = CacheSpec(8, tuple(tcfg.layer_specs("f32") + dcfg.layer_specs("f32")), 4, 128,
                     1 << 26, 8)
    cfg, params = StepConfig(tcfg, spec, dcfg, "reference"), {"target": target, "draft": draft}
    prompts = periodic_prompts(n=4)
    runs = {}
    for mode in ("shared", "private"):
        pair = DisaggregatedPair(ContextWorker(params, cfg, mode=mode),
                                 GenerationWorker(params, cfg, mode=mode))
        runs[mode] = pair.generate(prompts, 32)
    al = {m: np.mean([a for r in rs for a in r.acceptance]) for m, rs in runs.items()}
    assert [r.tokens for r in runs["shared"]] == [r.tokens for r in runs["private"]]
    assert al["private"] < al["shared"] - 0.5, al


def variant(cfg, **layer_changes):
    layers = tuple(dataclasses.replace(l, **layer_changes) if l.role == "draft" else l
                   for l in cfg.spec.layers)
    return dataclasses.replace(cfg, spec=dataclasses.replace(cfg.spec, layers=layers))


@pytest.mark.parametrize("change,match", [
    (dict(mode="private"), "mode: context worker has 'shared', generation worker has 'private'"),
    (dict(page_size=16), "page_size: context worker has 8, generation worker has 16"),
    (dict(drop_draft=True), "num_draft_layers: context worker has 2, generation worker has 1"),
    (dict(kv_dtype="bf16"), "layers: context worker has .*'f32'.*generation worker has .*'bf16'"),
    (dict(sliding_window=32), "layers: .*16.*32"),
])
def test_layout_gate_fails_fast_naming_both_sides(change, match):
    params, cfg, _ = tiny_pair(num_slots=2)
    mode = change.pop("mode", "shared")
    other = cfg
    if change.pop("drop_draft", False):
        layers = tuple(l for l in cfg.spec.layers if l.name != "draft.1")
        other = dataclasses.replace(cfg, spec=dataclasses.replace(cfg.spec, layers=layers))
    elif "page_size" in change:
        other = dataclasses.replace(cfg, spec=dataclasses.replace(cfg.spec, **change))
    elif change:
        other = variant(cfg, **change)
    start = time.monotonic()
    with pytest.raises(LayoutMismatch, match=match):
        check_layouts(Layout.of(cfg.spec, "shared"), Layout.of(other.spec, mode))
    assert time.monotonic() - start < 1.0


def test_connect_refuses_mismatched_workers():
    params, cfg, _ = tiny_pair(num_slots=2)
    with pytest.raises(LayoutMismatch, match="mode"):
        connect(ContextWorker(params, cfg, mode="shared"),
                GenerationWorker(params, cfg, mode="private"))


@pytest.mark.parametrize("which", [0, -1])
def test_corrupted_buffer_is_caught_and_pages_freed_on_both_sides(which):
    """Any pool's corruption (the last one too: every pool is verified before
    any is scattered into the receiver's cache) fails the request, nothing else."""
    params, cfg, _ = tiny_pair(num_slots=2)
    ctx, gen = ContextWorker(params, cfg), GenerationWorker(params, cfg)
    handoff = ctx.prefill("r0", list(range(1, 30)), 8)
    pool_id = list(handoff.pools)[which]
    buf = handoff.pools[pool_id].buffer
    handoff.pools[pool_id].buffer = buf.at[0, 0, 0, 0, 0, 0].add(1.0)  # one value off
    with pytest.raises(TransferError, match="checksum .* corrupted in transit"):
        gen.receive(handoff)
    ctx.complete("r0")
    assert free_pages(gen) == all_free(gen)
    assert gen.engine.admission.reserved_pages == (0,) * len(gen.engine.spec.pools)
    assert free_pages(ctx) == all_free(ctx) and ctx.num_held == 0
    assert not any(pool.is_deleted() for pool in gen.engine.state.kv.pools)


def test_silent_peer_times_out_and_context_pages_are_freed():
    params, cfg, _ = tiny_pair(num_slots=2)
    ctx, gen = ContextWorker(params, cfg), GenerationWorker(params, cfg)
    pair = DisaggregatedPair(ctx, gen, timeout=0.2)
    pair.channel.send = lambda item: None  # the wire drops everything: a dead peer
    ctx.prefill("warm", [1, 2, 3, 4, 5], 4)  # compile outside the timed wait
    ctx.complete("warm")
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match="within 0.2s"):
        pair.transfer_one("r0", [1, 2, 3, 4, 5], 4)
    assert time.monotonic() - start < 1.0
    assert ctx.num_held == 0 and free_pages(ctx) == all_free(ctx)
    assert free_pages(gen) == all_free(gen)


def test_channel_recv_times_out():
    with pytest.raises(TransferTimeout):
        Channel().recv(timeout=0.05)


@pytest.mark.parametrize("gen_tp", [2, 1])
def test_context_tp4_into_generation_tp2_and_tp1(gen_tp):
    """kv heads split 4 ways on the context side are resharded (fan-in) on receipt."""
    devices = np.array(jax.devices())
    if len(devices) < 4:
        pytest.skip("needs 4 (host) devices")
    params, cfg, _ = tiny_pair(num_slots=2, num_kv_heads=4)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 63, n).tolist() for n in (9, 26, 40)]
    agg = Engine(params, cfg).generate(prompts, 12)
    ctx_mesh = jax.sharding.Mesh(devices[:4], ("tp",))
    gen_mesh = jax.sharding.Mesh(devices[4 - gen_tp:], ("tp",))
    pair = DisaggregatedPair(ContextWorker(params, cfg, mesh=ctx_mesh),
                             GenerationWorker(params, cfg, mesh=gen_mesh))
    assert len(pair.context.engine.state.kv.pools[0].sharding.device_set) == 4
    dis = pair.generate(prompts, 12)
    assert len(pair.generation.engine.state.kv.pools[0].sharding.device_set) == gen_tp
    assert [r.tokens for r in dis] == [r.tokens for r in agg]
    assert [r.acceptance for r in dis] == [r.acceptance for r in agg]


def test_long_prompt_into_windowed_pools_takes_only_the_window_tail():
    """The receiver backs a windowed pool's in-window tail only: a prompt whose
    whole page range is larger than the windowed pools still moves."""
    params, cfg, _ = tiny_pair(num_slots=2)
    prompt = np.random.default_rng(5).integers(0, 63, 130).tolist()
    windowed = [p for p in cfg.spec.pools if p.sliding_window]
    assert windowed and all(p.num_usable_pages < -(-len(prompt) // cfg.spec.page_size)
                            for p in windowed)
    agg = Engine(params, cfg).generate([prompt], 8)
    pair = DisaggregatedPair(ContextWorker(params, cfg), GenerationWorker(params, cfg))
    dis = pair.generate([prompt], 8)
    assert [r.tokens for r in dis] == [r.tokens for r in agg]
    assert [r.acceptance for r in dis] == [r.acceptance for r in agg]
    assert free_pages(pair.generation) == all_free(pair.generation)
    assert pair.context.num_held == 0 and free_pages(pair.context) == all_free(pair.context)
