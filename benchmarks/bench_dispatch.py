"""Host cost of launching one jitted call, by how many arrays it takes.

    python benchmarks/bench_dispatch.py [--out DIR]

A step call of the embedded pair takes about 110 arrays (93 weights, 15 of state, the
packed batch). This times a call doing almost nothing on the device (each input's first
element summed) that takes 1 to 256 small arrays, each passed as is or donated and
returned, and reports host microseconds per call (dispatch alone, and dispatch to a
finished call) beside the 1-array call of the same run; and a call that reads one array
and returns 1 to 256 fresh ones (an export call returns six a request). Writes
dispatch.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

COUNTS = (1, 16, 64, 128, 256)


def _timed(call, calls: int) -> tuple[float, float]:
    """(host us per `call()` to return, us per call to a finished result), medians of 5."""
    dispatch, finished = [], []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            out = call()
        issued = time.perf_counter()
        jax.block_until_ready(out)
        dispatch.append((issued - start) / calls * 1e6)
        start = time.perf_counter()
        for _ in range(calls):
            jax.block_until_ready(call())
        finished.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(dispatch), statistics.median(finished)


def _read(n: int, calls: int) -> tuple[float, float]:
    """A call that reads its n arrays (weights)."""
    xs = [jnp.zeros((256,), jnp.float32) + i for i in range(n)]
    fn = jax.jit(lambda *a: sum(x[0] for x in a))
    fn(*xs).block_until_ready()
    return _timed(lambda: fn(*xs), calls)


def _donated(n: int, calls: int) -> tuple[float, float]:
    """A call that donates its n arrays and returns them (the engine's state threading)."""
    def step(*xs):
        return (xs[0] + 1,) + xs[1:]
    step = jax.jit(step, donate_argnums=tuple(range(n)))
    state = [step(*(jnp.zeros((256,), jnp.float32) + i for i in range(n)))]

    def call():
        state[0] = step(*state[0])
        return state[0]
    return _timed(call, calls)


def _outputs(n: int, calls: int) -> tuple[float, float]:
    """A call that reads one array and returns n new ones (each a buffer of its own)."""
    x = jnp.zeros((256,), jnp.float32)
    fn = jax.jit(lambda a: tuple(a + i for i in range(n)))
    jax.block_until_ready(fn(x))
    return _timed(lambda: fn(x), calls)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--counts", type=int, nargs="+", default=list(COUNTS),
                    help="array counts to time; the first is the baseline")
    args = ap.parse_args(argv)
    rows = []
    for n in args.counts:
        read, donated = _read(n, args.calls), _donated(n, args.calls)
        made = _outputs(n, args.calls)
        rows.append(dict(arrays=n, read_dispatch_us=read[0], read_finished_us=read[1],
                         donated_dispatch_us=donated[0], donated_finished_us=donated[1],
                         outputs_dispatch_us=made[0], outputs_finished_us=made[1]))
        print(f"{n:4d} arrays: read {read[0]:7.1f} us to return, {read[1]:7.1f} us to done; "
              f"donated {donated[0]:7.1f} / {donated[1]:7.1f} us; returned "
              f"{made[0]:7.1f} / {made[1]:7.1f} us", flush=True)
    base = rows[0]
    for row in rows:
        for key in ("read_dispatch_us", "donated_dispatch_us", "outputs_dispatch_us"):
            row[key.replace("_us", "_over_one_array")] = row[key] / base[key]
    result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, calls=args.calls,
                  rows=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dispatch.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'dispatch.json'}")


if __name__ == "__main__":
    main()
