"""Probe: the Mosaic GPU decode / verify (pallas_kernels/paged_decode_mgpu.py)
against the reference and the Triton kernel, on one GPU in one call.

    PYTHONPATH=. python benchmarks/probe_decode_mgpu.py [--ctx 32768] [--out DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_paged_attention import FP8, ours, setup
from benchmarks.timing import time_call, write_results
from pallas_kernels.paged_attention import paged_attention_reference
from pallas_kernels.paged_decode_mgpu import paged_decode_mgpu

INTERPRET = jax.default_backend() == "cpu"


def rel_err(out, ref):
    out, ref = (np.asarray(x, np.float32) for x in (out, ref))
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def check(a_via_smem, stages):
    """Error vs the reference (ragged rows, a padding row) and decode == verify bits."""
    res = {}
    batch, ctx = 4, 512
    for max_q in (1, 8):
        q, pool, table, _, _ = setup(ctx, FP8, max_q=max_q, batch=batch)
        kv_lens = jnp.array([ctx, 300, 17, 0], jnp.int32)
        q_lens = jnp.array([max_q, max_q, min(max_q, 3), 0], jnp.int32)
        out = paged_decode_mgpu(q, pool, table, kv_lens, q_lens, layer_offset=0,
                                a_via_smem=a_via_smem, stages=stages, interpret=INTERPRET)
        out = jax.block_until_ready(out)
        print("ran", a_via_smem, stages, max_q, flush=True)
        ref = paged_attention_reference(q, pool, table, kv_lens, q_lens, layer_offset=0)
        live = np.asarray(jnp.arange(max_q)[None, :] < q_lens[:, None])
        res[f"err_q{max_q}"] = rel_err(np.asarray(out)[live], np.asarray(ref)[live])
        res[f"dead_rows_zero_q{max_q}"] = bool(np.all(np.asarray(out, np.float32)[~live] == 0))
        if max_q == 8:  # query i of row 0 == decode at its position
            same = []
            for i in range(max_q):
                dec = paged_decode_mgpu(q[:, i:i + 1], pool, table,
                                        kv_lens - max_q + 1 + i, jnp.ones_like(q_lens),
                                        layer_offset=0, a_via_smem=a_via_smem, stages=stages,
                                        interpret=INTERPRET)
                same.append(bool(np.array_equal(np.asarray(dec[0, 0]), np.asarray(out[0, i]))))
            res["verify_equals_decode_row0"] = same
    return res


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ctx", type=int, nargs="*", default=[32768, 4096])
    parser.add_argument("--out", default=None)
    parser.add_argument("--variants", default="reg3,reg2,reg4,smem3")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--check-only", default=None, help="one variant's check, in this process")
    args = parser.parse_args()
    if args.check_only:
        v = args.check_only
        print("CHECK", v, check(a_via_smem=v.startswith("smem"), stages=int(v[-1])), flush=True)
        return
    variants = {v: dict(a_via_smem=v.startswith("smem"), stages=int(v[-1]))
                for v in args.variants.split(",")}
    results = {"checks": {}, "ms": {}}
    for name in [] if args.skip_checks else variants:  # each in its own process: a crash there (illegal address) stays there
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
