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


def time_alternating(fns: dict, *args, rounds: int = 2) -> dict:
    """ms per call of each of `fns` (name -> fn) on `args`, the kernels timed in turn
    `rounds` times, each one's best kept: a slow stretch of the GPU does not fall on one
    kernel alone."""
    best = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            ms = time_call(fn, *args) * 1e3
            best[name] = min(best.get(name, ms), ms)
    return best


def time_step_loop(step, params, state, *, steps: int, repeats: int, donate: bool = False,
                   probe=None):
    """Device seconds per call of `state = step(params, state, key)`: `steps`
    calls run in one jitted loop (no host in between, a fresh key each), timed
    `repeats` times after a compile run.

    Returns (seconds per step of each repeat, [probe(state) before each repeat
    and after the last] (empty without `probe`), the final state).
    """
    def run(params, state, key):
        return jax.lax.fori_loop(
            0, steps, lambda i, s: step(params, s, jax.random.fold_in(key, i)), state)

    loop = jax.jit(run, donate_argnums=1 if donate else ())
    key = jax.random.key(0)
    state = jax.block_until_ready(loop(params, state, key))  # compile + warm
    seconds, probes = [], []
    for _ in range(repeats):
        if probe is not None:
            probes.append(probe(state))
        start = time.perf_counter()
        state = jax.block_until_ready(loop(params, state, key))
        seconds.append((time.perf_counter() - start) / steps)
    if probe is not None:
        probes.append(probe(state))
    return seconds, probes, state


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
