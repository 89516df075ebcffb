"""Device timing helpers: many back-to-back calls, one sync, median of repeats."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import jax

RESULTS_DIR = Path(__file__).parent / "results"


def time_call(fn, *args, iters: int = 50, repeats: int = 5, warmup: int = 3) -> float:
    """Median seconds per call of `fn(*args)`, timed over `iters` queued calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def device_copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus written."""
    import jax.numpy as jnp
    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)  # a real read + write, not an alias
    seconds = time_call(copy, x, iters=iters)
    return 2 * nbytes / seconds


def machine() -> dict:
    dev = jax.devices()[0]
    return {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
            "host": platform.node()}


def write_results(name: str, payload: dict, out_dir: str | None = None) -> Path:
    path = Path(out_dir) if out_dir else RESULTS_DIR
    path.mkdir(parents=True, exist_ok=True)
    file = path / f"{name}.json"
    file.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return file
