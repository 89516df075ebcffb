"""Throwaway: 8B-shaped scanned steps at batch 32 and 8K contexts, fp8 few-query
attention on the Gluon kernel from 2 (row, kv head) programs an SM (Pallas at 32 rows x
8 kv heads on 132 SMs) beside 1.5 (Gluon there), same process, donated device loops."""
import argparse
import time

import jax
import numpy as np

from benchmarks.profile_step import load_pair
from drafter import programs
from drafter.engine import Engine
from drafter.evaluate import device_rate
from pallas_kernels import attention

ap = argparse.ArgumentParser()
ap.add_argument("--layers", type=int, default=36)
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--context", type=int, default=8192)
ap.add_argument("--layer-loop", default="scan")
ap.add_argument("--precision", default="auto")
ap.add_argument("--pair", default="8b")
ap.add_argument("--quick", action="store_true")
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--waves", type=float, nargs="+", default=[2.0, 1.5])
args = ap.parse_args()
params, tcfg, dcfg, config = load_pair(args)
for rnd in range(args.rounds):
    for waves in args.waves:
        attention.GLUON_MIN_PROGRAMS_PER_SM = waves
        q = jax.ShapeDtypeStruct((args.batch, 16, 32, 128), jax.numpy.bfloat16)
        pool = jax.ShapeDtypeStruct((8, 4096, 36, 2, 16, 128), jax.numpy.float8_e4m3fn)
        print(f"waves {waves}: verify at batch {args.batch} takes "
              f"{attention.select_backend(q, pool, impl='pallas')}", flush=True)
        for name, spec in (("plain", False), ("speculative", True)):
            jax.clear_caches()
            programs.packed_step_for.cache_clear()
            start = time.perf_counter()
            engine = Engine(params if spec else {"target": params["target"]},
                            config(dcfg if spec else None), speculative=spec)
            rng = np.random.default_rng(0)
            top = min(tcfg.vocab_size, dcfg.mask_token_id)
            for i in range(args.batch):
                engine.add_request(f"r{i}", rng.integers(0, top, args.context).tolist(), 512)
            engine.prefill_submitted()
            r = device_rate(engine, 8, 3, donate=True)
            print(f"round {rnd} waves {waves} {name} b{args.batch} ctx{args.context}: "
                  f"{r['device_step_ms']:.3f} ms a step ({time.perf_counter() - start:.0f} s)",
                  flush=True)
            del engine
