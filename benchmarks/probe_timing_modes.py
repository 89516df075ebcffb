"""fp8 decode vs verify-8 timed three ways in one process, per kernel version.

    PYTHONPATH=. python benchmarks/probe_timing_modes.py [--ctx 16384 4096]
        [--kernel FILE ...] [--out DIR]

1. back to back: `time_call` (50 queued calls, one sync, median of 5), what
   BENCHMARKS.md reports;
2. device durations of the same back-to-back stream, from jax's profiler
   (CUPTI): each kernel's own time and the idle gap before it;
3. device durations of isolated calls (a sync and a 20 ms pause before each),
   so the GPU starts each kernel cool, as under ncu;
4. with `--sustained N`: N back-to-back calls, each kernel's device time early
   and late in the run, beside nvidia-smi's clocks, power and clock-event
   reasons sampled every 20 ms.

Why: ncu put fp8 verify-8 at 1.21x decode per kernel, back-to-back timing at
1.32x (BENCHMARKS.md, eighth session), and nvidia-smi's clocks explain only
2% of it.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import statistics
import subprocess
import tempfile
import time

import jax
import numpy as np

from benchmarks.bench_paged_attention import FP8, ours, setup
from benchmarks.profile_paged_attention import load_kernel
from benchmarks.timing import time_call, write_results
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from tests.pallas_kernels.test_paged_attention import (assert_verify_equals_decode, make_case,
                                                       rel_err)


def kernel_events(trace_dir):
    """(ts, dur) in us of every paged-attention kernel on a GPU, in time order."""
    path, = glob.glob(f"{trace_dir}/plugins/profile/*/*.trace.json.gz")
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") ==
                "process_name" and "GPU" in str(e.get("args", {}).get("name", ""))}
    on_gpu = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids]
    found = sorted((e["ts"], e["dur"]) for e in on_gpu if "paged_attention" in e["name"])
    if not found:  # name the device's events, so the next run can match them
        names = sorted({(e["name"][:80], e["pid"], e.get("tid")) for e in on_gpu})[:20]
        raise RuntimeError(f"no paged_attention kernel among GPU events {names}; "
                           f"GPU pids {gpu_pids}")
    return found


def check(kernel, interpret=False):
    """fp8 verify-8 against the reference, and verify == decode bit for bit (head
    dim 128, GQA 4 and 8, 16-key pages, windowed and full)."""
    result = {}
    case = dict(num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=16,
                kv_dtype=FP8)
    q, pool, table, kv_lens, q_lens = make_case(np.random.default_rng(0), batch=6, max_q=8,
                                                kv_lens=[700, 300, 64, 9, 1000, 513], **case)
    kw = dict(layer_offset=1, k_scale=0.5, v_scale=0.25)
    out = kernel(q, pool, table, kv_lens, q_lens, **kw, interpret=interpret)
    result["err_q8"] = float(rel_err(out, paged_attention_reference(q, pool, table, kv_lens,
                                                                     q_lens, **kw)))
    for window in (None, 200):
        for heads in (16, 32):
            try:
                assert_verify_equals_decode(
                    np.random.default_rng(1), max_q=8, batch=6, max_len=1200, interpret=interpret,
                    window=window, attention=kernel, **(case | {"num_q_heads": heads}))
                result[f"bits_w{window}_h{heads}"] = "equal"
            except AssertionError as e:
                result[f"bits_w{window}_h{heads}"] = f"{e!s:.200}"
    return result


class GpuSampler:
    """nvidia-smi's SM clock, power, temperature and clock-event reasons every 20 ms."""
    FIELDS = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"

    def __enter__(self):
        self.file = tempfile.TemporaryFile("w+")
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits",
                 "-lms", "20"], stdout=self.file, stderr=subprocess.DEVNULL)
        except FileNotFoundError:
            self.proc = None
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.file.seek(0)
        self.rows = [[x.strip() for x in line.split(",")] for line in self.file if line.strip()]
        self.file.close()

    def summary(self):
        rows = [r for r in self.rows if len(r) == 4 and r[0].isdigit()]
        if not rows:
            return None
        clocks = [float(r[0]) for r in rows]
        power = [float(r[1]) for r in rows]
        reasons = [int(r[3], 16) for r in rows]
        return {"samples": len(rows), "sm_mhz_mean": statistics.fmean(clocks),
                "sm_mhz_min": min(clocks), "power_w_mean": statistics.fmean(power),
                "power_w_max": max(power), "temp_c_last": float(rows[-1][2]),
                # 0x4: software power cap; 0x20/0x40: software/hardware thermal slowdown
                "power_cap_share": sum(bool(r & 0x4) for r in reasons) / len(rows),
                "thermal_share": sum(bool(r & 0x60) for r in reasons) / len(rows)}


def trace_kernels(fn, args, calls, pause=None):
    """(ts, dur) in us of each paged-attention kernel of `calls` calls of fn(*args),
    back to back, or each after a sync and `pause` seconds."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            out = None
            for _ in range(calls):
                if pause is not None:
                    jax.block_until_ready(out)
                    time.sleep(pause)
                out = fn(*args)
            jax.block_until_ready(out)
        return kernel_events(d)


def traced(fn, args, calls, pause=None):
    events = trace_kernels(fn, args, calls, pause)
    durs = [dur for _, dur in events]
    gaps = [t1 - (t0 + d0) for (t0, d0), (t1, _) in zip(events, events[1:])]
    return {"kernels": len(events), "median_us": statistics.median(durs),
            "mean_us": statistics.fmean(durs),
            "median_gap_us": statistics.median(gaps) if gaps else None}


def sustained(fn, args, calls):
    """`calls` back-to-back calls under the profiler and the sampler: each kernel's
    device time early and late in the run."""
    with GpuSampler() as sampler:
        durs = [dur for _, dur in trace_kernels(fn, args, calls)]
    windows = {"first_50": durs[:50], "calls_200_250": durs[200:250],
               "last_50": durs[-50:]}
    return {"kernels": len(durs), "run_s": sum(durs) / 1e6,
            **{f"{k}_median_us": statistics.median(v) for k, v in windows.items() if v},
            "gpu": sampler.summary()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ctx", type=int, nargs="*", default=[16384])
    parser.add_argument("--kernel", nargs="*", default=[],
                        help="other versions of pallas_kernels/paged_attention.py")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--verify-options", type=json.loads, nargs="*", default=[],
                        help="launch options for verify only (ones that change no bit: "
                             "stages, page-id prefetch), each timed beside default decode, "
                             "e.g. '{\"prefetch_page_ids\": true, \"num_stages\": 3}'")
    parser.add_argument("--sustained", type=int, default=0,
                        help="also this many back-to-back calls, each kernel timed, with "
                             "nvidia-smi sampling clocks and power")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    kernels = {"repo": paged_attention} | {k: load_kernel(k) for k in args.kernel}
    rows = []
    for ctx in args.ctx:
        runs = [(name, kernel, {}) for name, kernel in kernels.items()]
        runs += [(f"repo, verify {json.dumps(kw)}", paged_attention, kw)
                 for kw in args.verify_options]
        for name, kernel, verify_kw in runs:
            row = {"ctx": ctx, "kernel": name}
            if ctx == args.ctx[0] and not args.skip_checks and not verify_kw:
                row["check"] = check(kernel)
            for max_q in (1, 8):
                inputs = setup(ctx, FP8, max_q=max_q)
                fn = ours(*inputs, kernel=kernel, **(verify_kw if max_q > 1 else {}))
                tag = f"q{max_q}"
                row[f"{tag}_b2b_ms"] = time_call(fn, *inputs) * 1e3
                try:
                    row[f"{tag}_trace_b2b"] = traced(fn, inputs, args.calls)
                    row[f"{tag}_trace_isolated"] = traced(fn, inputs, 20, pause=0.02)
                    if args.sustained:
                        time.sleep(3)  # let the GPU cool a little between runs
                        row[f"{tag}_sustained"] = sustained(fn, inputs, args.sustained)
                except Exception as e:  # the profiler is evidence, not the point
                    row[f"{tag}_trace_error"] = f"{e!s:.300}"
                del inputs
            row["ratio_b2b"] = row["q8_b2b_ms"] / row["q1_b2b_ms"]
            for mode in ("trace_b2b", "trace_isolated"):
                a, b = row.get(f"q8_{mode}", {}), row.get(f"q1_{mode}", {})
                if a.get("median_us") and b.get("median_us"):
                    row[f"ratio_{mode}"] = a["median_us"] / b["median_us"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("wrote", write_results("probe_timing_modes", {"rows": rows}, args.out))


if __name__ == "__main__":
    main()
