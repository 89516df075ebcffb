"""Throwaway: does each step call write the cache in place (its output pool the input
pool's buffer), and what peak memory does a batched 8K prefill reach?"""
import argparse
import sys

import jax
import numpy as np

from benchmarks.profile_step import load_pair
from drafter.engine import Engine

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
args = argparse.Namespace(layers=layers, batch=32, context=8192, layer_loop="scan",
                          precision="auto", pair="8b", quick=False)
params, tcfg, dcfg, config = load_pair(args)
dev = jax.devices()[0]
for speculative in (False, True):
    engine = Engine(params if speculative else {"target": params["target"]},
                    config(dcfg if speculative else None), speculative=speculative)
    jax.block_until_ready(engine.state)
    pools = engine.state.kv.pools
    print(f"speculative {speculative}: pools {[f'{p.nbytes / 2**30:.2f} GiB' for p in pools]}, "
          f"in use {(dev.memory_stats() or {}).get('bytes_in_use', 0) / 2**30:.2f} GiB", flush=True)
    rng = np.random.default_rng(0)
    for i in range(args.batch):
        engine.add_request(f"r{i}", rng.integers(0, min(150_000, tcfg.vocab_size - 1), args.context).tolist(), 512)
    for call in range(12):
        before = [p.unsafe_buffer_pointer() for p in engine.state.kv.pools]
        engine.step()
        jax.block_until_ready(engine.state)
        after = [p.unsafe_buffer_pointer() for p in engine.state.kv.pools]
        s = dev.memory_stats() or {"bytes_in_use": 0, "peak_bytes_in_use": 0}
        print(f"  call {call}: {dict(engine.executor.calls)} pools in place "
              f"{[a == b for a, b in zip(before, after)]}, in use "
              f"{s['bytes_in_use'] / 2**30:.2f} GiB, peak {s['peak_bytes_in_use'] / 2**30:.2f} GiB",
              flush=True)
    del engine, pools
