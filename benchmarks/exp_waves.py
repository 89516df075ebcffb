"""Throwaway: 8B-shaped scanned steps at batch 32 (1K), the Gluon kernel's threshold at 2
programs an SM (Pallas at 32 rows) beside 1.5 (Gluon at 32 rows), same process."""
import argparse, dataclasses, sys
import numpy as np
from benchmarks.profile_step import load_pair
from drafter.engine import Engine
from drafter.evaluate import device_rate
from pallas_kernels import attention

ap = argparse.ArgumentParser()
ap.add_argument("--layers", type=int, default=36); ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--context", type=int, default=1024); ap.add_argument("--layer-loop", default="scan")
ap.add_argument("--precision", default="auto"); ap.add_argument("--pair", default="8b")
ap.add_argument("--quick", action="store_true"); ap.add_argument("--rounds", type=int, default=2)
args = ap.parse_args()
params, tcfg, dcfg, config = load_pair(args)
for rnd in range(args.rounds):
    for waves in (2.0, 1.5):
        attention.GLUON_MIN_WAVES = waves
        for name, spec in (("plain", False), ("speculative", True)):
            engine = Engine(params if spec else {"target": params["target"]},
                            config(dcfg if spec else None), speculative=spec)
            rng = np.random.default_rng(0)
            top = min(tcfg.vocab_size, dcfg.mask_token_id)
            for i in range(args.batch):
                engine.add_request(f"r{i}", rng.integers(0, top, args.context).tolist(), 512)
            engine.prefill_submitted()
            r = device_rate(engine, 8, 3)
            print(f"round {rnd} waves {waves} {name} b{args.batch} ctx{args.context}: "
                  f"{r['device_step_ms']:.3f} ms a step", flush=True)
            del engine
