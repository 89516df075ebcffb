"""Device timing helpers: many back-to-back calls, one sync, median of repeats.

`time_step_loop` and `machine` live in `drafter.timing` (the evaluation uses them
too) and are re-exported here."""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import time
from pathlib import Path

import jax

from drafter.timing import machine, time_step_loop  # noqa: F401

RESULTS_DIR = Path(__file__).parent / "results"


@contextlib.contextmanager
def counting_compiles():
    """Yields a list that collects the names of the XLA programs compiled inside the
    block (from jax's compile log)."""
    names = []

    class Handler(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("Finished XLA compilation of "):
                names.append(message.split()[4])

    handler, log = Handler(), logging.getLogger("jax")
    log.addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    try:
        yield names
    finally:
        jax.config.update("jax_log_compiles", False)
        log.removeHandler(handler)


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


def device_copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus written."""
    import jax.numpy as jnp
    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)  # a real read + write, not an alias
    seconds = time_call(copy, x, iters=iters)
    return 2 * nbytes / seconds


def device_matmul_peak(n: int = 8192, iters: int = 20) -> float:
    """bf16 matmul FLOP/s (f32 accumulation) of an n^3 product: the compute bound."""
    import jax.numpy as jnp
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    return 2 * n ** 3 / time_call(mm, a, a, iters=iters)


class _NanForMissing(dict):
    def __missing__(self, key):
        return float("nan")


def print_row(rows: list, row: dict, line: str) -> dict:
    """Append `row` to `rows` and print it as one line of the run's table: `line` is a
    `str.format` template over the row's keys (a key the row lacks prints as nan)."""
    rows.append(row)
    print(line.format_map(_NanForMissing(row)), flush=True)
    return row


class WouldReplaceDeviceResults(RuntimeError):
    """A run on one platform would overwrite the report's figures from another."""


def write_results(name: str, payload: dict, out_dir: str | None = None) -> Path:
    """Write `name`.json under `out_dir` (default: the report's results). In the report's
    results, a file measured on another platform (the H200's, from a CPU smoke run) is
    never replaced: WouldReplaceDeviceResults names it and the fix."""
    path = Path(out_dir) if out_dir else RESULTS_DIR
    path.mkdir(parents=True, exist_ok=True)
    file = path / f"{name}.json"
    here = machine()
    if file.exists() and path.resolve() == RESULTS_DIR.resolve():
        try:
            before = json.loads(file.read_text()).get("machine", {}).get("platform")
        except (ValueError, AttributeError):
            before = None
        if before not in (None, here["platform"]):
            raise WouldReplaceDeviceResults(
                f"{file} holds figures measured on {before!r}; this run is on "
                f"{here['platform']!r} and would replace them. Write elsewhere (--out DIR), "
                f"or delete the file first if replacing it is meant")
    file.write_text(json.dumps({"machine": here, **payload}, indent=2))
    return file


def report_goals(name: str, report: dict, goal_keys, out_dir: str | None) -> dict:
    """Print the goal keys present, put them first, write `name`.json when `out_dir`."""
    goals = {k: report[k] for k in goal_keys if k in report}
    print("goals:", json.dumps(goals), flush=True)
    report = {**goals, **report}
    if out_dir:
        print("wrote", write_results(name, report, out_dir))
    return report
