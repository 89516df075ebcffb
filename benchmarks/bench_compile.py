"""Compile seconds of each step at a model shape, ahead of time and with no weights.

    python -m benchmarks.bench_compile                      # Qwen3-8B + DFlash-b16 shapes
    python -m benchmarks.bench_compile --impl reference --target-layers 8

Every argument is an abstract `jax.ShapeDtypeStruct` (params via `jax.eval_shape`),
so nothing is allocated: the figures are `jit(step).lower(...)` (trace) and
`.compile()` (XLA) on the default backend. Steps: the prefill of one chunk per row,
the speculative decode step and the plain decode step (`drafter.steps`), with the
params in the form the executor holds them for `--layer-loop` (stacked for a scan).
Cold figures need the persistent compilation cache off (JAX_COMPILATION_CACHE_DIR unset).
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp

from drafter.shapes import qwen3_8b_pair, random_params
from drafter.steps import StepConfig, init_step_state
from drafter.uniform_steps import decode_step, plain_decode_step, prefill_step
from models.layers import step_params
from unified_kv import CacheSpec, bucket_width, init_state


def step_config(tcfg, dcfg, *, batch: int, context: int, chunk: int, impl: str,
                target_kv: str, draft_kv: str, layer_loop: str = "auto") -> StepConfig:
    layers = tcfg.layer_specs(target_kv) + (dcfg.layer_specs(draft_kv) if dcfg else [])
    per_token = sum(2 * l.num_kv_heads * l.head_dim * (1 if l.kv_dtype == "fp8_e4m3" else 2)
                    for l in layers)
    max_len = context + 1024
    spec = CacheSpec(page_size=16, layers=tuple(layers), num_slots=batch + 1,
                     max_seq_len=max_len, max_step_tokens=chunk,
                     memory_budget_bytes=int(1.3 * (batch + 1) * (max_len + chunk) * per_token))
    return StepConfig(tcfg, spec, dcfg, impl=impl, matmul_precision="auto",
                      layer_loop=layer_loop)


def abstract_args(cfg: StepConfig, batch: int, chunk: int):
    """(params, state, slot_ids, tokens, lens, is_last, key) as ShapeDtypeStructs."""
    params = jax.eval_shape(lambda: step_params(random_params(cfg.target, cfg.draft),
                                                cfg.scans_layers))
    state = jax.eval_shape(lambda: init_step_state(cfg, init_state(cfg.spec)))
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    return (params, state, i32((batch,)), i32((batch, chunk)), i32((batch,)),
            jax.ShapeDtypeStruct((batch,), jnp.bool_), key)


def compile_seconds(fn, *args) -> dict:
    start = time.perf_counter()
    lowered = fn.lower(*args)
    traced = time.perf_counter() - start
    lowered.compile()
    return {"lower_s": round(traced, 2),
            "compile_s": round(time.perf_counter() - start - traced, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target-layers", type=int, default=36)
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=None, help="default: Qwen3's 151,936")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256, help="prefill tokens per row and call")
    ap.add_argument("--impl", default="auto", help="attention: auto, pallas, reference")
    ap.add_argument("--target-kv", default="fp8_e4m3")
    ap.add_argument("--draft-kv", default="bf16")
    ap.add_argument("--steps", default="prefill,decode,plain")
    ap.add_argument("--layer-loop", default="auto", choices=("auto", "scan", "unrolled"))
    args = ap.parse_args()

    pair = dict(num_target_layers=args.target_layers, num_draft_layers=args.draft_layers,
                block_size=args.block_size)
    if args.vocab:
        pair["vocab_size"] = args.vocab
    tcfg, dcfg = qwen3_8b_pair(**pair)
    cfg = step_config(tcfg, dcfg, batch=args.batch, context=args.context, chunk=args.chunk,
                      impl=args.impl, target_kv=args.target_kv, draft_kv=args.draft_kv,
                      layer_loop=args.layer_loop)
    plain_cfg = step_config(tcfg, None, batch=args.batch, context=args.context,
                            chunk=args.chunk, impl=args.impl, target_kv=args.target_kv,
                            draft_kv=args.draft_kv, layer_loop=args.layer_loop)
    width = bucket_width(-(-(args.context + args.chunk) // 16), cfg.spec.max_pages_per_seq)
    report = {"backend": jax.default_backend(), "args": vars(args), "steps": {}}
    for name in args.steps.split(","):
        step_cfg = plain_cfg if name == "plain" else cfg
        params, state, slots, tokens, lens, last, key = abstract_args(step_cfg, args.batch,
                                                                      args.chunk)
        step = {"prefill": prefill_step, "decode": decode_step, "plain": plain_decode_step}[name]
        fn = jax.jit(functools.partial(step, cfg=step_cfg, table_width=width), donate_argnums=1)
        call = ((params, state, slots, tokens, lens, last, key) if name == "prefill"
                else (params, state, slots, key))
        report["steps"][name] = compile_seconds(fn, *call)
        print(f"{name:8s} {report['steps'][name]}", flush=True)
    report["total_s"] = round(sum(s["lower_s"] + s["compile_s"]
                                  for s in report["steps"].values()), 2)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
