"""Probe: the Mosaic GPU decode / verify (pallas_kernels/paged_decode_mgpu.py)
against the reference and the Triton kernel, on one GPU in one call.

    PYTHONPATH=. python benchmarks/probe_decode_mgpu.py [--ctx 32768] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_paged_attention import FP8, ours, setup
from benchmarks.timing import time_call, write_results
from pallas_kernels.paged_attention import paged_attention_reference
import pallas_kernels.paged_decode_mgpu as paged_decode_mgpu_module
from pallas_kernels.paged_decode_mgpu import paged_decode_mgpu
from tests.pallas_kernels.test_paged_attention import rel_err

INTERPRET = jax.default_backend() == "cpu"


def variant_kw(name):
    """A variant's keywords: reg (wgmma's A from registers) or smem (from shared memory),
    then the stage count: reg2, smem3."""
    return dict(a_via_smem=name.startswith("smem"), stages=int(name[-1]))


def check(a_via_smem, stages):
    """Error vs the reference (ragged rows, a padding row) and decode == verify bits."""
    res = {}
    batch, ctx = 4, 512
    for max_q in (1, 8):
        q, pool, table, _, _ = setup(ctx, FP8, max_q=max_q, batch=batch)
        kv_lens = jnp.array([ctx, 300, 17, 0], jnp.int32)
        q_lens = jnp.array([max_q, max_q, min(max_q, 3), 0], jnp.int32)
        kw = dict(a_via_smem=a_via_smem, stages=stages, interpret=INTERPRET)
        out = paged_decode_mgpu(q, pool, table, kv_lens, q_lens, layer_offset=0, **kw)
        out = jax.block_until_ready(out)
        print("ran", a_via_smem, stages, max_q, flush=True)
        ref = paged_attention_reference(q, pool, table, kv_lens, q_lens, layer_offset=0)
        live = np.asarray(jnp.arange(max_q)[None, :] < q_lens[:, None])
        res[f"err_q{max_q}"] = float(rel_err(np.asarray(out)[live], np.asarray(ref)[live]))
        res[f"dead_rows_zero_q{max_q}"] = bool(np.all(np.asarray(out, np.float32)[~live] == 0))
        if max_q == 8:  # query i of row 0 == decode at its position
            same = []
            for i in range(max_q):
                dec = paged_decode_mgpu(q[:, i:i + 1], pool, table,
                                        kv_lens - max_q + 1 + i, jnp.ones_like(q_lens),
                                        layer_offset=0, **kw)
                same.append(bool(np.array_equal(np.asarray(dec[0, 0]), np.asarray(out[0, i]))))
            res["verify_equals_decode_row0"] = same
    return res


def profile_phases(args):
    """Mean time per step of each named phase, from Mosaic GPU's trace (one run each
    of decode and verify-8; the profiler's own cost is in every phase)."""
    name = args.variants.split(",")[0]
    for max_q in (1, 8):
        out_dir = Path(args.profile_dir) / f"q{max_q}"
        out_dir.mkdir(parents=True, exist_ok=True)
        a = setup(args.ctx[0], FP8, max_q=max_q, batch=args.batch)
        fn = ours(*a, kernel=paged_decode_mgpu, profile_dir=str(out_dir), **variant_kw(name))
        jax.block_until_ready(fn(*a))
        jax.effects_barrier()  # the trace is written by a host callback
        [trace] = sorted(out_dir.glob("*.json"))[-1:]
        events = json.loads(trace.read_text())["traceEvents"]
        open_at, total, count = {}, collections.Counter(), collections.Counter()
        for e in events:
            key = (e["tid"], e["name"])
            if e["ph"] == "B":
                open_at[key] = e["ts"]
            else:
                total[e["name"]] += e["ts"] - open_at.pop(key)
                count[e["name"]] += 1
        threads = len({e["tid"] for e in events})
        print(f"q{max_q}: {threads} warpgroups, us per step (mean over steps):", flush=True)
        for phase in total:
            print(f"  {phase:12s} {total[phase] / count[phase]:8.3f}  ({count[phase]} steps)",
                  flush=True)
        trace.unlink()  # large; the summary is what comes back


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ctx", type=int, nargs="*", default=[32768, 4096])
    parser.add_argument("--out", default=None)
    parser.add_argument("--variants", default="reg2,reg3,smem2")
    parser.add_argument("--pool-limit", type=float, default=None,
                        help="override paged_decode_mgpu.MAX_POOL_BYTES (to probe the limit)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--check-only", default=None, help="one variant's check, in this process")
    parser.add_argument("--profile-dir", default=None,
                        help="run the first variant once per query count with Mosaic GPU's "
                             "profiler writing there, and print each phase's share")
    args = parser.parse_args()
    if args.profile_dir:
        profile_phases(args)
        return
    if args.pool_limit:
        paged_decode_mgpu_module.MAX_POOL_BYTES = int(args.pool_limit)
    if args.check_only:
        v = args.check_only
        print("CHECK", v, check(**variant_kw(v)), flush=True)
        return
    variants = {v: variant_kw(v) for v in args.variants.split(",")}
    results = {"checks": {}, "ms": {}}
    # each check in its own process: a crash there (an illegal address) stays there
    for name in [] if args.skip_checks else variants:
        proc = subprocess.run([sys.executable, __file__, "--check-only", name],
                              capture_output=True, text=True, timeout=300)
        lines = [x for x in (proc.stdout + proc.stderr).splitlines() if "Deprecat" not in x]
        done = [x for x in lines if x.startswith("CHECK")]
        results["checks"][name] = done[0] if done else "\n".join(lines[:40])
        print(name, results["checks"][name], flush=True)
    for ctx in args.ctx:
        for max_q in (1, 8):
            a = setup(ctx, FP8, max_q=max_q, batch=args.batch)
            t = time_call(ours(*a), *a) * 1e3
            results["ms"][f"triton_q{max_q}_{ctx}_b{args.batch}"] = t
            print(f"triton fp8 q{max_q} ctx {ctx}: {t:.3f} ms", flush=True)
            for name, kw in variants.items():
                if not (args.skip_checks or results["checks"][name].startswith("CHECK")):
                    continue
                try:
                    fn = ours(*a, kernel=paged_decode_mgpu, **kw)
                    t = time_call(fn, *a) * 1e3
                except Exception:
                    print(name, traceback.format_exc()[-1500:], flush=True)
                    continue
                results["ms"][f"{name}_q{max_q}_{ctx}_b{args.batch}"] = t
                print(f"mgpu {name} fp8 q{max_q} ctx {ctx}: {t:.3f} ms", flush=True)
    print("wrote", write_results("probe_decode_mgpu", results, args.out))


if __name__ == "__main__":
    main()
