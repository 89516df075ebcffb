"""Kernel variants of paged attention timed in one device call, and one case
run alone for a profiler (ncu) or a compiler dump.

    PYTHONPATH=. python benchmarks/profile_paged_attention.py [--ctx 32768] [--out DIR]
    PYTHONPATH=. python benchmarks/profile_paged_attention.py --case fp8_q8 --calls 3
    git show REV:pallas_kernels/paged_attention.py > old_kernel.py
    PYTHONPATH=. python benchmarks/profile_paged_attention.py --baseline old_kernel.py

Shapes are bench_paged_attention's decode case (batch 64, 32 / 8 heads, d 128,
page 16). A case is (KV dtype, queries per row, kernel keyword arguments);
every time is beside bf16 decode (`bf16_q1`) from the same run, and with
`--baseline` beside the same case run by another version of the kernel module.
"""

from __future__ import annotations

import argparse
import importlib.util

import jax
import jax.numpy as jnp

from benchmarks.bench_paged_attention import FP8, ours, setup
from benchmarks.timing import time_call, write_results
from pallas_kernels.paged_attention import paged_attention

CASES = {
    "bf16_q1": (jnp.bfloat16, 1, {}),
    "bf16_q8": (jnp.bfloat16, 8, {}),
    "fp8_q1": (FP8, 1, {}),
    "fp8_q8": (FP8, 8, {}),
}
for _name, _dtype in (("bf16", jnp.bfloat16), ("fp8", FP8)):  # the last 2048 tokens' prefill
    CASES[f"{_name}_prefill2048"] = (_dtype, 2048, {"rows_per_block": 128, "pages_per_block": 4,
                                                    "num_warps": 4, "num_stages": 2})
for _q in (1, 8):  # fp8 blockings: pages per block, warps, pipeline stages
    for _ppb, _w, _st in ((2, 2, 3), (4, 2, 4), (8, 2, 3), (8, 4, 3), (4, 4, 3), (4, 2, 5),
                          (4, 2, 6), (8, 2, 5)):
        CASES[f"fp8_q{_q}_p{_ppb}w{_w}s{_st}"] = (
            FP8, _q, {"pages_per_block": _ppb, "num_warps": _w, "num_stages": _st})
    # From 5 stages on, or with the page ids prefetched, Triton pipelines the
    # key loop (benchmarks/inspect_triton.py).
    CASES[f"bf16_q{_q}_s5"] = (jnp.bfloat16, _q, {"num_stages": 5})
    for _name, _dtype in (("bf16", jnp.bfloat16), ("fp8", FP8)):
        for _st in (2, 3, 4):
            CASES[f"{_name}_q{_q}_prefetch_s{_st}"] = (
                _dtype, _q, {"prefetch_page_ids": True, "num_stages": _st})
            CASES[f"{_name}_q{_q}_p2_prefetch_s{_st}"] = (
                _dtype, _q, {"prefetch_page_ids": True, "num_stages": _st,
                             "pages_per_block": 2})


def load_kernel(path):
    """`paged_attention` of another version of the kernel module (a file)."""
    spec = importlib.util.spec_from_file_location("baseline_paged_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.paged_attention


def run_case(name, ctx, calls=None, kernel=paged_attention):
    dtype, max_q, kw = CASES[name]
    args = setup(ctx, dtype, max_q=max_q)
    fn = ours(*args, kernel=kernel, **kw)
    if calls is not None:  # for a profiler: compile, then `calls` launches
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
        return None
    return time_call(fn, *args)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--case", nargs="*", default=None, help=f"some of {list(CASES)}")
    parser.add_argument("--calls", type=int, default=None,
                        help="run the cases this many times each, untimed (for ncu)")
    parser.add_argument("--baseline", default=None,
                        help="another version of pallas_kernels/paged_attention.py: "
                             "every case is timed with it too, in the same run")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    baseline = load_kernel(args.baseline) if args.baseline else None
    names = args.case or list(CASES)
    if args.calls is not None:
        for name in names:
            run_case(name, args.ctx, args.calls)
        return
    rows = {}
    for name in ["bf16_q1"] + [n for n in names if n != "bf16_q1"]:
        try:
            rows[name] = run_case(name, args.ctx) * 1e3
        except Exception as e:  # a config Triton cannot compile
            print(f"{name}: failed: {e!s:.300}", flush=True)
            continue
        print(f"{name}: {rows[name]:.3f} ms  bf16_q1/this {rows['bf16_q1'] / rows[name]:.2f}x",
              flush=True)
        if baseline is not None:
            try:
                rows[f"{name}@baseline"] = run_case(name, args.ctx, kernel=baseline) * 1e3
            except Exception as e:  # e.g. a keyword the older kernel lacks
                print(f"{name}@baseline: failed: {e!s:.300}", flush=True)
                continue
            print(f"{name}@baseline: {rows[f'{name}@baseline']:.3f} ms  "
                  f"baseline/this {rows[f'{name}@baseline'] / rows[name]:.3f}x", flush=True)
    print("wrote", write_results("profile_paged_attention",
                                 {"ctx": args.ctx, "baseline": args.baseline, "ms": rows},
                                 args.out))


if __name__ == "__main__":
    main()
