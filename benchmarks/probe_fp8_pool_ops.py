"""Whether a page gather or scatter on an fp8 pool touches only its pages.

    PYTHONPATH=. python benchmarks/probe_fp8_pool_ops.py [--pages 6144] [--moved 16]

XLA has no fp8 gather or scatter of its own: on an fp8 operand it converts the operand to
f16 and back, so moving a few pages in or out of a pool costs a pass over every page.
This times, on a pool of the 8B pair's shape ([8 kv heads, pages, 36 layers, 2, 16,
128], fp8), moving `--moved` pages out (a gather, as `export_step`) and in (a scatter
into the donated pool, as `import_step`), each on the fp8 pool as it is and on its
uint8 view (`pool_layout.byte_view`), and the scatter also page by page
(`dynamic_update_slice` in a loop), beside one copy of the pool at the device's
bandwidth (what a pass over it costs), with each program's temporary memory.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.pool_layout import byte_view, from_byte_view


def page_loop(pool, pages, buf):
    """`buf`'s pages written into `pool` at `pages` one by one (dynamic_update_slice in a
    loop; out-of-range pages rewrite a page with itself): a scatter without one."""
    def body(k, pool):
        page = pages[k]
        ok = (page >= 0) & (page < pool.shape[1])
        page = jnp.clip(page, 0, pool.shape[1] - 1)
        new = jnp.where(ok, jax.lax.dynamic_slice_in_dim(buf, k, 1, axis=1),
                        jax.lax.dynamic_slice_in_dim(pool, page, 1, axis=1))
        return jax.lax.dynamic_update_slice_in_dim(pool, new, page, axis=1)
    return jax.lax.fori_loop(0, pages.shape[0], body, pool)


def _timed(fn, *args, calls: int = 20, donated: bool = False) -> float:
    """ms per call (the first call, compiling, untimed); a donated first argument is
    threaded through."""
    out = fn(*args)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(calls):
        if donated:
            args = (out, *args[1:])
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=6144)
    ap.add_argument("--moved", type=int, default=16)
    args = ap.parse_args(argv)
    shape = (8, args.pages, 36, 2, 16, 128)
    pool = jnp.zeros(shape, jnp.float8_e4m3fn)
    idx = jnp.asarray(np.random.default_rng(0).choice(args.pages, args.moved, replace=False),
                      jnp.int32)
    buf = jnp.ones((8, args.moved, *shape[2:]), jnp.float8_e4m3fn)
    gathers = {"fp8": lambda p, i: jnp.take(p, i, axis=1),
               "uint8 view": lambda p, i: from_byte_view(jnp.take(byte_view(p), i, axis=1),
                                                         p.dtype)}
    scatters = {"fp8": lambda p, i, b: p.at[:, i].set(b, mode="drop"),
                "uint8 view": lambda p, i, b: from_byte_view(
                    byte_view(p).at[:, i].set(byte_view(b), mode="drop"), p.dtype),
                "fp8, page by page": page_loop,
                "uint8 view, page by page": lambda p, i, b: from_byte_view(
                    page_loop(byte_view(p), i, byte_view(b)), p.dtype)}
    report = {"device": jax.devices()[0].device_kind, "pool_bytes": int(np.prod(shape)),
              "moved_pages": args.moved}
    copy = jax.jit(lambda p: p + jnp.ones((), p.dtype))
    report["pool_pass_ms"] = _timed(copy, pool)
    print(f"{report['device']}: pool {report['pool_bytes'] / 2**30:.2f} GiB; one pass over "
          f"it (read + write) {report['pool_pass_ms']:.3f} ms", flush=True)
    for name, f in gathers.items():
        fn = jax.jit(f)
        temp = fn.lower(pool, idx).compile().memory_analysis().temp_size_in_bytes
        ms = _timed(fn, pool, idx)
        report[f"gather {name}"] = {"ms": ms, "temp_bytes": temp}
        print(f"gather {args.moved} pages, {name}: {ms:.3f} ms, temp {temp / 2**20:.0f} MiB",
              flush=True)
    for name, f in scatters.items():
        fn = jax.jit(f, donate_argnums=0)
        temp = fn.lower(pool, idx, buf).compile().memory_analysis().temp_size_in_bytes
        pool = jnp.zeros(shape, jnp.float8_e4m3fn)
        ms = _timed(fn, pool, idx, buf, donated=True)
        report[f"scatter {name}"] = {"ms": ms, "temp_bytes": temp}
        print(f"scatter {args.moved} pages, {name}: {ms:.3f} ms, temp {temp / 2**20:.0f} MiB",
              flush=True)
    return report


if __name__ == "__main__":
    main()
