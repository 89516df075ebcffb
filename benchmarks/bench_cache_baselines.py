"""Decode step time and KV memory: the unified cache against the baselines it replaces.

    PYTHONPATH=. python benchmarks/bench_cache_baselines.py [--out DIR] [--contexts 4096 ...]
        [--batches 1 16] [--quick]

The embedded default pair (fp8 target KV in a windowed and a full pool, bf16
windowed draft layers, page 16, block 8), a cache of 256 slots whose
max_seq_len covers the longest context and whose memory budget buys 16
max-length requests. For every context and batch, each
row's cache is filled to the context length, then one speculative decode step
(verify 8 tokens, accept, draft context, draft the next block) is timed,
as device time (16 steps in one jitted loop, no host in between; median of
5 loops), for:

  unified       target and draft layers in one cache, per-pool tables built
                for the batch's rows only (this project)
  two_caches    target and draft KV in two caches (two allocators, two table
                builds, two retirements per step)
  per_layer     one pool and page table per layer
  full_rebuild  the unified cache, but every slot's full-capacity table
                rebuilt each step (then the batch rows picked)

KV memory is what each variant holds on the device (pools, page tables, free
lists). Ratios are against `unified` in the same run.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.cache_baselines import (TwoCacheState, full_rebuild, kv_memory_bytes, per_layer,
                                        split_config, split_state, two_cache_decode_step)
from benchmarks.timing import print_row, time_step_loop, write_results
from drafter.default import default_step_config, load_default
from drafter.steps import init_step_state
from drafter.uniform_steps import decode_step
from unified_kv import bucket_width
from unified_kv import admit_slots, bytes_per_request, grow, init_state, retire_window_pages

NUM_SLOTS = 256     # slots in the cache (what a full-capacity rebuild pays for)
NUM_REQUESTS = 16   # max-length requests the memory budget buys
VARIANTS = ("unified", "two_caches", "per_layer", "full_rebuild")
LINE = ("{batch:>5} {context:>8} {variant:>12} {step_ms:9.3f} {step_over_unified:9.3f} "
        "{kv_memory_gib:8.3f} {memory_over_unified:9.4f}")  # no unified row: ratios nan


def variant_config(base, name: str):
    return {"per_layer": per_layer, "full_rebuild": full_rebuild}.get(name, lambda c: c)(base)


@functools.partial(jax.jit, static_argnums=(0, 3))
def grow_in_chunks(spec, kv, slots, context: int):
    """Grow rows to `context` a prefill chunk at a time, retiring window pages
    between chunks as prefill does (windowed pools hold only a window's pages)."""
    def chunk(i, carry):
        kv, ok = carry
        end = jnp.full(slots.shape, jnp.minimum((i + 1) * spec.max_step_tokens, context))
        kv, fits = grow(spec, kv, slots, end, end)
        return retire_window_pages(spec, kv, slots), ok & fits.all()
    return jax.lax.fori_loop(0, -(-context // spec.max_step_tokens), chunk,
                             (kv, jnp.bool_(True)))


def filled_state(cfg, batch: int, context: int):
    """A cache whose first `batch` slots hold `context` tokens (random KV)."""
    spec = cfg.spec
    kv = init_state(spec)
    slots = jnp.arange(batch, dtype=jnp.int32)
    kv = jax.jit(admit_slots, static_argnums=0)(spec, kv, slots)
    kv, ok = grow_in_chunks(spec, kv, slots, context)
    assert bool(ok), "cache too small for the benchmark's contexts"
    keys = jax.random.split(jax.random.key(context), len(kv.pools))
    pools = tuple(jax.random.normal(k, p.shape, jnp.float32).astype(p.dtype)
                  for k, p in zip(keys, kv.pools))
    state = init_step_state(cfg, kv.replace(pools=pools))
    rng = np.random.default_rng(batch)
    return state.replace(anchors=jnp.asarray(rng.integers(0, 256, state.anchors.shape),
                                             jnp.int32),
                         drafts=jnp.asarray(rng.integers(0, 256, state.drafts.shape), jnp.int32))


def bench_one(params, base, name: str, batch: int, context: int, steps: int, repeats: int):
    cfg = variant_config(base, name)
    slot_ids = jnp.arange(batch, dtype=jnp.int32)
    longest = context + (steps * (repeats + 1) + 2) * cfg.block_size  # rows grow while timed
    width = bucket_width(-(-longest // cfg.spec.page_size), cfg.spec.max_pages_per_seq)
    state = filled_state(cfg, batch, context)
    if name == "two_caches":
        cfgs = split_config(base)
        tkv, dkv = split_state(base, state.kv, cfgs)
        state = TwoCacheState(tkv, dkv, state.anchors, state.drafts)
        specs = [c.spec for c in cfgs]
        step = lambda p, s, k: two_cache_decode_step(p, s, slot_ids, k, cfgs=cfgs,
                                                      table_width=width)[0]
    else:
        specs = [cfg.spec]
        step = lambda p, s, k: decode_step(p, s, slot_ids, k, cfg=cfg, table_width=width)[0]
    seconds, _, _ = time_step_loop(step, params, state, steps=steps, repeats=repeats,
                                   donate=True)
    return {"variant": name, "batch": batch, "context": context,
            "step_ms": float(np.median(seconds)) * 1e3,
            "kv_memory_gib": sum(kv_memory_bytes(s)["total"] for s in specs) / 2**30,
            "table_width": width, "num_pools": sum(len(s.pools) for s in specs)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 65536, 262144, 1048576])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 1])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny contexts (CPU smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.batches, args.steps, args.repeats = [1000], [2], 2, 1
    params, tcfg, dcfg = load_default(jnp.bfloat16)
    max_seq_len = max(args.contexts) + 4096
    probe = default_step_config(tcfg, dcfg, num_slots=NUM_SLOTS, max_seq_len=max_seq_len)
    # A budget for NUM_REQUESTS max-length requests (and so for 16 rows at any context).
    one_request = sum(bytes_per_request(probe.spec, max_seq_len).values())
    base = default_step_config(tcfg, dcfg, num_slots=NUM_SLOTS, max_seq_len=max_seq_len,
                               memory_budget_bytes=one_request * (NUM_REQUESTS + 1))
    rows = []
    print(f"{'batch':>5} {'context':>8} {'variant':>12} {'step ms':>9} {'x unified':>9} "
          f"{'KV GiB':>8} {'x unified':>9}", flush=True)
    for batch in args.batches:
        for context in args.contexts:
            unified = None
            for name in args.variants:
                row = bench_one(params, base, name, batch, context, args.steps, args.repeats)
                unified = unified or (row if name == "unified" else None)
                if unified:
                    row["step_over_unified"] = row["step_ms"] / unified["step_ms"]
                    row["memory_over_unified"] = row["kv_memory_gib"] / unified["kv_memory_gib"]
                print_row(rows, row, LINE)
                write_results("cache_baselines",
                              {"num_slots": NUM_SLOTS, "num_requests": NUM_REQUESTS,
                               "max_seq_len": max_seq_len, "steps": args.steps, "rows": rows},
                              args.out)


if __name__ == "__main__":
    main()
