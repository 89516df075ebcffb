"""Throwaway: why exp_waves_8k.py's batch-32 x 8K plain prefill asked for a pool-sized
buffer where exp_prefill_memory.py's did not: the same engine built after load_pair, with
and without jax.clear_caches() first; each distinct call's memory analysis."""
import argparse
import gc
import json
import sys

import jax
import numpy as np

from benchmarks.exp_prefill_memory import capture
from benchmarks.profile_step import load_pair
from drafter import programs
from drafter.engine import Engine

args = argparse.Namespace(layers=36, batch=32, context=8192, layer_loop="scan",
                          precision="auto", pair="8b", quick=False)
params, tcfg, dcfg, config = load_pair(args)
records = []
capture(records)
for clear in map(int, sys.argv[1:] or ["0", "1"]):
    if clear:
        jax.clear_caches()
        programs.packed_step_for.cache_clear()
    engine = Engine({"target": params["target"]}, config(None), speculative=False)
    pool = engine.state.kv.pools[0]
    print(f"clear {clear}: pool {pool.nbytes / 2**30:.2f} GiB, in use "
          f"{jax.devices()[0].memory_stats()['bytes_in_use'] / 2**30:.2f} GiB", flush=True)
    rng = np.random.default_rng(0)
    for i in range(args.batch):
        engine.add_request(f"r{i}", rng.integers(0, 150_000, args.context).tolist(), 512)
    try:
        engine.prefill_submitted()
        print(f"clear {clear}: prefill ok; old pool deleted {pool.is_deleted()}", flush=True)
    except Exception as e:  # noqa: BLE001 - a throwaway probe reports and goes on
        print(f"clear {clear}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
    del engine, pool
    gc.collect()
print(json.dumps(records)[:3000])
