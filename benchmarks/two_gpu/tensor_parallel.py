"""Parts tp and hetero of the two-GPU benchmark: tensor parallelism in one process (TP=2
equals TP=1, device step time on both meshes, optionally at the Qwen3-8B shape) and
heterogeneous TP (context TP=2 into generation TP=1)."""

from __future__ import annotations

import time

import numpy as np

from benchmarks.two_gpu.common import (equal_outputs, equality_prompts, first_difference,
                                       held_out, meshes, outputs, pair_source, say)
from benchmarks.two_gpu.runner import Runner


def tp_equality(params, cfg, prompts, max_new: int, tag: str = "tp") -> dict:
    """The prompts on one device and on a 2-device mesh: outputs of both, and whether
    they are identical."""
    from drafter.engine import Engine
    mesh1, mesh2 = meshes(2)
    runs, pool_devices = {}, {}
    for name, mesh in (("tp1", mesh1), ("tp2", mesh2)):
        start = time.perf_counter()
        engine = Engine(params, cfg, mesh=mesh)
        runs[name] = outputs(engine.generate(prompts, max_new))
        pool_devices[name] = len(engine.state.kv.pools[0].sharding.device_set)
        al = np.mean([a for r in runs[name]["acceptance"] for a in r])
        say(tag, f"{name}: {len(prompts)} prompts x {max_new} new tokens, AL {al:.2f}, KV "
                 f"pools over {pool_devices[name]} device(s) "
                 f"({time.perf_counter() - start:.1f} s, compiles included)")
    diff = first_difference(runs["tp1"], runs["tp2"])
    equal = equal_outputs(runs["tp1"], runs["tp2"])
    say(tag, f"tp2_equal_tp1 = {equal}" + (f" ({diff})" if diff else ""))
    return {**runs, "tp2_equal_tp1": equal, "difference": diff, "pool_devices": pool_devices}


def step_ms(params, cfg, prompts, batch: int, mesh, steps: int, repeats: int,
            room: int | None = None) -> dict:
    """Device time per speculative step (drafter.evaluate.device_rate) of an Engine on
    `mesh` whose `batch` rows hold the prompts (cycled), prefilled."""
    import jax
    from drafter.engine import Engine
    from drafter.evaluate import device_rate
    engine = Engine(params, cfg, mesh=mesh)
    room = room or (steps * (repeats + 1) + 4) * cfg.block_size + 64
    for i in range(batch):
        engine.add_request(f"r{i}", prompts[i % len(prompts)], room, ignore_eos=True)
    engine.prefill_submitted()
    with jax.set_mesh(mesh):   # the kernels run per device, as the engine's steps do
        rate = device_rate(engine, steps, repeats)
    del engine
    return rate


def tp_step_ratio(params, cfg, prompts, batch: int, steps: int, repeats: int, *,
                  tag: str, sink, key: str, room: int | None = None, meta=None) -> dict:
    """Device step time on one device and on the 2-device mesh, saved into sink[key]
    as each is measured; their ratio."""
    out = sink[key] = {"batch": batch, **(meta or {})}
    for name, mesh in zip(("tp1", "tp2"), meshes(2)):
        out[name] = step_ms(params, cfg, prompts, batch, mesh, steps, repeats, room)
        say(tag, f"{key} {name}: {out[name]['device_step_ms']:.3f} ms per step, "
                 f"{out[name]['tokens_per_step']:.2f} tokens per step")
        sink.save()
    out["tp2_over_tp1"] = out["tp2"]["device_step_ms"] / out["tp1"]["device_step_ms"]
    sink.save()
    say(tag, f"{key}: tp2 / tp1 step time = {out['tp2_over_tp1']:.3f}")
    return out


def child_tp(spec: dict, sink) -> None:
    quick = spec["quick"]
    params, cfg = pair_source(quick).load()
    prompts = equality_prompts(quick)
    max_new = 8 if quick else 64
    sink.update(tp_equality(params, cfg, prompts, max_new))
    if sink["tp2_equal_tp1"]:   # the outputs are kept where they differ
        sink["tokens_per_request"] = [len(t) for t in sink.pop("tp1")["tokens"]]
        sink.pop("tp2")
    sink.save()
    short = held_out(quick)[min(held_out(quick))]
    steps, repeats = (2, 1) if quick else (32, 3)
    for batch in ([1] if quick else [1, 16]):
        cfg_b = pair_source(quick, num_slots=batch).load()[1]
        tp_step_ratio(params, cfg_b, short, batch, steps, repeats, tag="tp", sink=sink,
                      key=f"default_pair_b{batch}")
    if spec.get("scale"):
        scale_step_ratio(spec["scale"], sink)


def scale_step_ratio(scale: dict, sink) -> None:
    """tp2 / tp1 device step time at the Qwen3-8B shape (random bf16 weights, fp8
    target KV, bf16 draft KV), batch 1, `context`-token rows."""
    from benchmarks.bench_scale import step_config
    from drafter.shapes import qwen3_8b_pair, random_params
    layers = scale["layers"]
    tcfg, dcfg = qwen3_8b_pair(num_target_layers=layers,
                               num_draft_layers=5 if layers >= 8 else 1,
                               **({"vocab_size": scale["vocab"]} if scale.get("vocab") else {}))
    params = random_params(tcfg, dcfg)
    cfg = step_config(tcfg, dcfg, 1, scale["context"], scale.get("layer_loop", "auto"))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, min(150_000, tcfg.vocab_size - 1), scale["context"]).tolist()
    loop = "scan" if cfg.scans_layers else "unrolled"
    say("tp", f"Qwen3-8B shape: {layers} target layers, context {scale['context']}, "
              f"layers {loop}")
    tp_step_ratio(params, cfg, [prompt], 1, scale["steps"], 3, tag="tp", sink=sink,
                  key="qwen3_8b", room=min(768, cfg.spec.max_seq_len - scale["context"]),
                  meta={"layers": layers, "context": scale["context"], "layer_loop": loop})


# ============================================================ part 3: heterogeneous TP

def hetero_equality(params, cfg, prompts, max_new: int, reference: dict | None = None,
                    tag: str = "hetero") -> dict:
    """Context TP=2 (both devices) into generation TP=1 (device 0), in one process,
    against aggregated TP=1 on device 0 (`reference`: its outputs, if already run)."""
    from disagg.sources import disaggregated_engine
    from drafter.engine import Engine
    mesh1, mesh2 = meshes(2)
    start = time.perf_counter()
    if reference is None:
        reference = outputs(Engine(params, cfg, mesh=mesh1).generate(prompts, max_new))
        say(tag, f"aggregated tp1: {time.perf_counter() - start:.1f} s")
        start = time.perf_counter()
    engine = disaggregated_engine(params, cfg, context_meshes=(mesh2,), mesh=mesh1)
    got = outputs(engine.generate(prompts, max_new))
    moved = engine.kv_source.bytes_moved
    context_devices = len(engine.kv_source.contexts[0].engine.state.kv.pools[0]
                          .sharding.device_set)
    diff = first_difference(reference, got)
    equal = equal_outputs(reference, got)
    say(tag, f"context tp2 -> generation tp1: {len(prompts)} prompts, {moved} KV bytes "
             f"moved ({time.perf_counter() - start:.1f} s); hetero_tp_equal = {equal}"
             + (f" ({diff})" if diff else ""))
    engine.kv_source.close()
    return {"aggregated_tp1": reference, "context_tp2_generation_tp1": got,
            "hetero_tp_equal": equal, "difference": diff, "kv_bytes_moved": moved,
            "context_pool_devices": context_devices,
            "generation_pool_devices": len(engine.state.kv.pools[0].sharding.device_set)}


def child_hetero(spec: dict, sink) -> None:
    quick = spec["quick"]
    params, cfg = pair_source(quick).load()
    sink.update(hetero_equality(params, cfg, equality_prompts(quick), 8 if quick else 64))
    if sink["hetero_tp_equal"]:   # the outputs are kept where they differ
        sink["tokens_per_request"] = [len(t) for t in sink.pop("aggregated_tp1")["tokens"]]
        sink.pop("context_tp2_generation_tp1")
    sink.save()


# ============================================================ the parent's side

def part_tp(runner: Runner, args, limit: float) -> dict:
    if runner.shared_gpu:
        return {"status": "skipped: needs 2 GPUs"}
    scale = None
    if args.scale:
        scale = ({"layers": args.scale_layers or 2, "vocab": 4096, "context": 128, "steps": 2}
                 if args.quick else
                 {"layers": args.scale_layers or 36, "vocab": None, "context": 1024,
                  "steps": 8})
        scale["layer_loop"] = args.layer_loop
    return runner.run("tp", {"quick": args.quick, "scale": scale}, [0, 1], limit, "tp")


def part_hetero(runner: Runner, args, limit: float) -> dict:
    if runner.shared_gpu:
        return {"status": "skipped: needs 2 GPUs"}
    return runner.run("hetero", {"quick": args.quick}, [0, 1], limit, "hetero")
