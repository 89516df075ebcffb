"""Matrix-vector products of a decode step at the 8B shape: the small-batch linear kernel
against XLA's matmul (cuBLAS) on the same stacked weights, and the copy bandwidth.

    PYTHONPATH=. python benchmarks/bench_small_batch_linear.py [--out DIR] [--quick]

Each call reads one layer of a stack of 8 (the layer cycles, so no weight stays in the
50 MB L2), as a scanned step does. Shapes: Qwen3-8B's fused q|k|v, o, gate|up, down
and lm_head, at 1 and 4 rows. Reports ms per call, weight bytes per second over the copy
bandwidth measured in the same run, and the kernel's largest error against
`linear_reference`. Writes small_batch_linear.json.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks.timing import device_copy_bandwidth, time_alternating, write_results
from pallas_kernels import small_batch_linear as sbl

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576),
          "down": (12288, 4096), "lm_head": (4096, 151936)}
PLANS = {"default": {}, "bk64": {"block_k": 64},
         "dot": {"use_dot": True, "block_k": 64},
         "dot_bn64": {"use_dot": True, "block_k": 64, "block_n": 64},
         "dot_bk128": {"use_dot": True, "block_k": 128, "block_n": 64},
         "dot_w8": {"use_dot": True, "block_k": 64, "block_n": 128, "num_warps": 8}}
LAYERS = 8


def _cycled(matvec, layers):
    """One call: `matvec(x, w, layer)` for each layer of the stack in turn, summed."""
    def run(x, w):
        acc = jnp.zeros((x.shape[0], w.shape[-1]), jnp.float32)
        for i in range(layers):
            acc = acc + matvec(x, w, jnp.full((1,), i, jnp.int32)).astype(jnp.float32)
        return acc
    return jax.jit(run)


def xla_matvec(x, w, layer):
    return (x @ jax.lax.dynamic_index_in_dim(w, layer[0], keepdims=False)).astype(x.dtype)


def kernel_matvec(plan_kwargs, x, w, layer):
    m, k = x.shape
    p = sbl.plan(m, k, w.shape[-1], **plan_kwargs)
    return sbl.linear_parts(x, w, layer, linear_plan=p).sum(0).astype(x.dtype)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--plans", nargs="+", default=list(PLANS))
    args = ap.parse_args(argv)
    copy_bw = device_copy_bandwidth()
    report = {"device": str(jax.devices()[0].device_kind), "copy_bandwidth_Bps": copy_bw,
              "runs": []}
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    for name in args.shapes:
        k, n = SHAPES[name]
        layers = 1 if name == "lm_head" else LAYERS
        w = jax.random.normal(jax.random.key(1), (layers, k, n), jnp.bfloat16)
        weight_bytes = k * n * 2
        for m in args.rows:
            x = jax.random.normal(jax.random.key(2), (m, k), jnp.bfloat16)
            fns = {"xla": _cycled(xla_matvec, layers)}
            fns.update({p: _cycled(functools.partial(kernel_matvec, PLANS[p]), layers)
                        for p in args.plans if m <= 4 or PLANS[p].get("use_dot")})
            ms = time_alternating(fns, x, w)
            want = sbl.linear_reference(x, w, jnp.array([layers - 1])).sum(0)
            got = jax.jit(functools.partial(kernel_matvec, {"use_dot": m > 4, "block_k": 64}))(
                x, w, jnp.array([layers - 1], jnp.int32))
            err = float(jnp.abs(got.astype(jnp.float32) - want).max())
            for fn_name, t in ms.items():
                per_call = t / layers
                row = {"shape": name, "k": k, "n": n, "rows": m, "fn": fn_name,
                       "ms": per_call, "over_copy": weight_bytes / (per_call * 1e-3) / copy_bw,
                       "vs_xla": ms["xla"] / t, "max_abs_err": err}
                report["runs"].append(row)
                print(f"{name:8s} m={m} {fn_name:13s} {per_call * 1e3:8.1f} us  "
                      f"{row['over_copy']:.2f} of copy  x{row['vs_xla']:.2f} vs xla  err {err:.2g}")
            del fns
        del w
    write_results("small_batch_linear", report, args.out)
    return report


if __name__ == "__main__":
    main()
