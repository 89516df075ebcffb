"""Device time of jitted steps, and the machine a figure was measured on."""

from __future__ import annotations

import platform
import time

import jax


def time_step_loop(step, params, state, *, steps: int, repeats: int, donate: bool = False,
                   probe=None, compiler_options=None):
    """Device seconds per call of `state = step(params, state, key)`: `steps`
    calls run in one jitted loop (no host in between, a fresh key each), timed
    `repeats` times after a compile run, compiled with `compiler_options` (the
    step's `StepConfig.compiler_options`, so the loop runs what the engine runs).

    Returns (seconds per step of each repeat, [probe(state) before each repeat
    and after the last] (empty without `probe`), the final state).
    """
    def run(params, state, key):
        return jax.lax.fori_loop(
            0, steps, lambda i, s: step(params, s, jax.random.fold_in(key, i)), state)

    loop = jax.jit(run, donate_argnums=1 if donate else (), compiler_options=compiler_options)
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


def machine() -> dict:
    dev = jax.devices()[0]
    return {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
            "host": platform.node()}
