"""Device time of jitted steps, and the machine a figure was measured on."""

from __future__ import annotations

import os
import platform
import statistics
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
    """What a figure was measured on: the device, and the host that drives it (a serving
    figure bound by host launches follows the host's CPU as much as the device)."""
    dev = jax.devices()[0]
    return {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
            "host": platform.node(), "cpu": host_cpu(), "cpus": os.cpu_count()}


def host_cpu() -> str:
    """The host CPU's model name ("unknown" where the OS does not say)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def launch_us(calls: int = 200) -> float:
    """Host microseconds to launch a jitted call that reads one small array and does
    almost nothing (median of 5 runs of `calls`): the fixed cost of every call on this
    host and device, beside which host-bound figures are read."""
    x = jax.numpy.zeros((256,), jax.numpy.float32)
    fn = jax.jit(lambda a: a[0] + 1)
    jax.block_until_ready(fn(x))
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(x)
        runs.append((time.perf_counter() - start) / calls * 1e6)
        jax.block_until_ready(out)
    return statistics.median(runs)
