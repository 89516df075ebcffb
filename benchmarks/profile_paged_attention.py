"""Kernel variants of paged attention timed in one device call, and one case
run alone for a profiler (ncu) or a compiler dump.

    PYTHONPATH=. python benchmarks/profile_paged_attention.py [--ctx 16384] [--out DIR]
    PYTHONPATH=. python benchmarks/profile_paged_attention.py --case fp8_q8 --calls 3
    git show REV:pallas_kernels/paged_attention.py > old_kernel.py
    PYTHONPATH=. python benchmarks/profile_paged_attention.py --baseline old_kernel.py

Shapes are bench_paged_attention's decode case (batch 64 unless a case says,
32 / 8 heads, d 128, page 16). A case names its KV dtype, queries per row
and kernel options (`--help`); every time is beside bf16 decode (`bf16_q1`)
from the same run, and with `--baseline` beside the same case run by another
version of the kernel module.
"""

from __future__ import annotations

import argparse
import importlib.util
import re

import jax

from benchmarks.bench_paged_attention import BATCH, HKV, HQ, KV_DTYPES, ours, setup
from benchmarks.timing import time_call, write_results
from pallas_kernels.paged_attention import paged_attention

CASE_GRAMMAR = """A case name is KV_WORK[_OPTION...]: KV is bf16 or fp8; WORK is qN (N query
tokens per row: 1 decode, 8 verify) or prefillN (the last N tokens of each
row as one chunk); OPTIONs: bN batch rows (default 64), gN query heads per
kv head (default 4), rN query rows per block, pN pages per block, kN key
splits, wN warps, sN pipeline stages (written alone or run together:
p4w2s5), prefetch (page ids one block ahead), lazyT (rescale threshold T),
plain (fast_fp8=False: the plain fp8 options). Examples: fp8_q8,
fp8_q8_p4w2s5, fp8_q1_prefetch_s3, bf16_prefill2048_lazy8, fp8_q8_g8_w2,
fp8_q8_plain, bf16_q1_b4_k16."""
# Prefill's own blocking: 128 query rows per block want 4 warps.
PREFILL_KW = {"rows_per_block": 128, "pages_per_block": 4, "num_warps": 4, "num_stages": 2}
_KEYS = {"b": "batch", "g": "q_per_kv", "r": "rows_per_block", "p": "pages_per_block",
         "k": "num_splits", "w": "num_warps", "s": "num_stages"}
_NUMBERED = f"([{''.join(_KEYS)}])(\\d+)"  # one letter of _KEYS and its number
_OPTION = re.compile(rf"_(?:(?P<blocking>(?:{_NUMBERED})+)|(?P<prefetch>prefetch)|(?P<plain>plain)"
                     r"|lazy(?P<lazy>\d+(?:\.\d+)?))")


def parse_case(name):
    """(KV dtype, query tokens per row, query heads per kv head, batch rows, kernel
    keywords)."""
    head = re.match(r"(bf16|fp8)_(?:q(\d+)|prefill(\d+))", name)
    if head is None:
        raise ValueError(f"bad case name {name!r}. {CASE_GRAMMAR}")
    dtype = KV_DTYPES[head.group(1)]
    max_q = int(head.group(2) or head.group(3))
    kw = dict(PREFILL_KW) if head.group(3) else {}
    pos = head.end()
    while pos < len(name):
        option = _OPTION.match(name, pos)
        if option is None:
            raise ValueError(f"bad option {name[pos:]!r} in case {name!r}. {CASE_GRAMMAR}")
        if option["blocking"]:
            for key, value in re.findall(_NUMBERED, option["blocking"]):
                kw[_KEYS[key]] = int(value)
        elif option["prefetch"]:
            kw["prefetch_page_ids"] = True
        elif option["plain"]:
            kw["fast_fp8"] = False
        else:
            kw["rescale_threshold"] = float(option["lazy"])
        pos = option.end()
    return dtype, max_q, kw.pop("q_per_kv", HQ // HKV), kw.pop("batch", BATCH), kw


DEFAULT_CASES = ["bf16_q1", "bf16_q8", "fp8_q1", "fp8_q8", "bf16_prefill2048",
                 "fp8_prefill2048"]


def load_kernel(path, name="paged_attention"):
    """`paged_attention` (or another function) of a version of the kernel module (a file)."""
    spec = importlib.util.spec_from_file_location("baseline_paged_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def run_case(name, ctx, calls=None, kernel=paged_attention):
    dtype, max_q, q_per_kv, batch, kw = parse_case(name)
    args = setup(ctx, dtype, max_q=max_q, num_q_heads=q_per_kv * HKV, batch=batch)
    fn = ours(*args, kernel=kernel, **kw)
    if calls is not None:  # for a profiler: compile, then `calls` launches
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
        return None
    return time_call(fn, *args)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ctx", type=int, default=16384)  # 32K: past 2^31
    parser.add_argument("--case", nargs="*", default=None, help=CASE_GRAMMAR)
    parser.add_argument("--calls", type=int, default=None,
                        help="run the cases this many times each, untimed (for ncu)")
    parser.add_argument("--baseline", default=None,
                        help="another version of pallas_kernels/paged_attention.py: "
                             "every case is timed with it too, in the same run")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    baseline = load_kernel(args.baseline) if args.baseline else None
    names = args.case or DEFAULT_CASES
    for name in names:  # a typo fails here, not after minutes of timing
        parse_case(name)
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
