"""Throwaway: device memory of a served Qwen3-8B-shaped target (bf16, batch 32 x 8K
cache) with its weights put on the device in the checkpoint's form (executor converts)
against the step form converted on the host (disagg.frontend.device_step_params)."""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_scale import step_config
from disagg.frontend import device_step_params
from drafter.engine import Engine
from drafter.shapes import qwen3_8b_pair
from models.qwen3 import init_params

mode = sys.argv[1]
tcfg, _ = qwen3_8b_pair()
cfg = step_config(tcfg, None, 32, 8192, "scan")
gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
stats = lambda: jax.devices()[0].memory_stats()  # noqa: E731
template = jax.eval_shape(lambda: init_params(tcfg, jax.random.key(0)))
host = {"target": jax.tree.map(lambda s: np.zeros(s.shape, jnp.bfloat16), template)}
weights = sum(x.nbytes for x in jax.tree.leaves(host))
start = time.perf_counter()
if mode == "served":
    params = device_step_params(host, cfg.scans_layers)
else:
    params = jax.device_put(host)
jax.block_until_ready(params)
del host
print(f"{mode}: weights {gib(weights)}, pools {[gib(p.nbytes) for p in cfg.spec.pools]}, "
      f"in use after the weights {gib(stats()['bytes_in_use'])} of {gib(stats()['bytes_limit'])} "
      f"({time.perf_counter() - start:.1f} s)", flush=True)
try:
    engine = Engine(params, cfg, speculative=False)
except Exception as e:  # noqa: BLE001 - a probe: report it
    print(f"{mode}: engine FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
    sys.exit(0)
print(f"{mode}: engine made, in use {gib(stats()['bytes_in_use'])}, "
      f"peak {gib(stats()['peak_bytes_in_use'])}", flush=True)
rng = np.random.default_rng(0)
for i in range(32):
    engine.add_request(f"r{i}", rng.integers(0, 150_000, 8192).tolist(), 16)
for call in range(3):
    engine.step()
jax.block_until_ready(engine.state)
print(f"{mode}: 3 steps ran ({dict(engine.executor.calls)}), in use {gib(stats()['bytes_in_use'])}, "
      f"peak {gib(stats()['peak_bytes_in_use'])}", flush=True)
