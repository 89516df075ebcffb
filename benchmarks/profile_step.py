"""Where a decode step's device time goes, kernel by kernel, at the 8B shape.

    PYTHONPATH=. python benchmarks/profile_step.py [--layers 36] [--batch 1]
        [--context 1024] [--layer-loop auto] [--precision auto] [--top 25]
        [--engine CALLS] [--pair 8b|embedded] [--out DIR]

Prefills `batch` random prompts of `context` tokens, then runs the plain and
the speculative step in a jitted loop under the jax profiler, and reads the
Perfetto trace back: device time per step of each kernel (summed over its
launches), largest first, beside the step's weight-read bound at the copy
bandwidth measured in the same run, and the idle time between consecutive kernels by
the pair they sit between. `--engine CALLS` profiles the engine's
own calls too (several decode steps each), so the two programs' kernels can be
set side by side. XLA flags (XLA_FLAGS) apply per process, so
compare them by running this once per setting; a step's own compiler options
(`StepConfig.compiler_options`) are applied.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import cProfile
import dataclasses
import functools
import glob
import gzip
import json
import os
import pstats
import re
import tempfile
import time

import jax
import numpy as np

from benchmarks.bench_decode_speed import warm_for_calls
from benchmarks.bench_scale import step_config, weight_read_bytes
from benchmarks.timing import device_copy_bandwidth
from drafter.default import default_step_config, load_default
from drafter.engine import Engine
from drafter.evaluate import device_rate
from drafter.shapes import qwen3_8b_pair, random_step_params
from pallas_kernels import launch_plan

# launches that are the profiler's own or the host's, not the step's kernels
_NOT_KERNELS = re.compile(r"^(Memcpy|Memset|cuda|cu[A-Z]|ThunkExecutor|\$)")


def device_lines(trace_dir: str):
    """(events, device pids, {(pid, tid): line name} of device lines) of the Perfetto
    trace the profiler wrote under `trace_dir`."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no Perfetto trace under {trace_dir}")
    return _read_trace(max(paths, key=os.path.getmtime))


@functools.lru_cache(maxsize=1)
def _read_trace(path: str):
    """`device_lines` of one trace file, parsed once however many summaries read it."""
    with gzip.open(path) as f:
        events = json.load(f)
    events = events.get("traceEvents", events)
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, name in names.items() if "/device:GPU" in name}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"
               and e["pid"] in device_pids}
    return events, device_pids, threads


def kernel_events(events, device_pids, threads):
    # kernels sit on stream lines; other device lines (XLA modules, ops) summarise them
    streams = {key for key, name in threads.items() if name.startswith("Stream")}
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in device_pids:
            continue
        if streams and (e["pid"], e.get("tid")) not in streams:
            continue
        if not _NOT_KERNELS.match(e["name"]):
            yield e


def kernel_times(trace_dir: str, calls: int) -> list[tuple[str, float, int]]:
    """(kernel name, device ms per call, launches per call), largest first, from
    the Perfetto trace the profiler wrote under `trace_dir`."""
    events, device_pids, threads = device_lines(trace_dir)
    print(f"device lines: {sorted(set(threads.values()))}", flush=True)
    total, count = collections.Counter(), collections.Counter()
    for e in kernel_events(events, device_pids, threads):
        total[e["name"]] += e["dur"] / 1e3
        count[e["name"]] += 1
    return [(n, t / calls, count[n] // calls) for n, t in total.most_common()]


def kernel_gaps(trace_dir: str, calls: int) -> list[tuple[str, float, int]]:
    """Idle time between consecutive kernels of one stream, per call: (kernel -> next
    kernel, device ms idle per call, times per call), largest first. A gap over 1 ms
    (the host between profiled runs) is not counted."""
    events, device_pids, threads = device_lines(trace_dir)
    by_line = collections.defaultdict(list)
    for e in kernel_events(events, device_pids, threads):
        by_line[(e["pid"], e.get("tid"))].append(e)
    total, count = collections.Counter(), collections.Counter()
    for line in by_line.values():
        line.sort(key=lambda e: e["ts"])
        for a, b in zip(line, line[1:]):
            gap = b["ts"] - (a["ts"] + a["dur"])
            if 0 < gap < 1000:
                pair = f"{a['name'][:40]} -> {b['name'][:40]}"
                total[pair] += gap / 1e3
                count[pair] += 1
    return [(n, t / calls, count[n] // calls) for n, t in total.most_common()]


def module_kernels(trace_dir: str) -> dict[str, dict]:
    """Per XLA program (the device's "XLA Modules" line): its runs, kernels launched
    and their device ms, summed over the trace; kernels are counted in the program
    whose run covers their start."""
    events, device_pids, threads = device_lines(trace_dir)
    modules = sorted((e["ts"], e["ts"] + e["dur"], re.sub(r"\(\d+\)$", "", e["name"]))
                     for e in events if e.get("ph") == "X" and e.get("pid") in device_pids
                     and "XLA Modules" in threads.get((e["pid"], e.get("tid")), ""))
    out: dict[str, dict] = {}
    for start, _, name in modules:
        out.setdefault(name, {"runs": 0, "kernels": 0, "kernel_ms": 0.0})["runs"] += 1
    starts = [m[0] for m in modules]
    for e in kernel_events(events, device_pids, threads):
        k = bisect.bisect_right(starts, e["ts"]) - 1
        if k >= 0 and e["ts"] <= modules[k][1]:
            got = out[modules[k][2]]
            got["kernels"] += 1
            got["kernel_ms"] += e["dur"] / 1e3
    return out


def print_kernels(kernels, top: int, title: str) -> dict:
    total = sum(t for _, t, _ in kernels)
    print(f"\n{title}; kernels summed {total:.3f} ms", flush=True)
    for name, ms, launches in kernels[:top]:
        print(f"  {ms:8.3f} ms  x{launches:<4d} {name[:110]}", flush=True)
    return {"kernels_ms": total,
            "kernels": [{"name": n, "ms": t, "launches": c} for n, t, c in kernels[:top]]}


def outer_jit_calls(events, device_pids) -> list[tuple]:
    """The host's jitted calls (the profiler's `PjitFunction(name)` events) as (pid, tid,
    ts, dur, name), by thread then time; a call inside another on its thread (the
    profiler nests a second event in each call) is left out: its time is the outer
    call's."""
    calls = sorted((e["pid"], e.get("tid"), e["ts"], e["dur"], e["name"]) for e in events
                   if e.get("ph") == "X" and e.get("pid") not in device_pids
                   and e["name"].startswith("PjitFunction("))
    out, outer = [], (None, None, 0.0)  # (pid, tid, end) of the last outermost call
    for pid, tid, ts, dur, name in calls:
        if (pid, tid) == outer[:2] and ts < outer[2]:
            continue
        outer = (pid, tid, ts + dur)
        out.append((pid, tid, ts, dur, name))
    return out


def host_dispatch(trace_dir: str) -> dict[str, dict]:
    """Per jitted function: its calls and the host time they took to dispatch (the
    profiler's `PjitFunction(name)` events), summed over the trace."""
    events, device_pids, _ = device_lines(trace_dir)
    out: dict[str, dict] = {}
    for _, _, _, dur, name in outer_jit_calls(events, device_pids):
        got = out.setdefault(name[len("PjitFunction("):-1], {"calls": 0, "ms": 0.0})
        got["calls"] += 1
        got["ms"] += dur / 1e3
    return out


def traced_kernel_ms(run, trace_dir: str, label: str) -> float:
    """`run()` once under the jax profiler: its kernels' device time summed (against its
    wall time, what the host adds), the top kernels and each XLA program's kernel count
    printed."""
    start = time.perf_counter()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        run()
    wall = 1e3 * (time.perf_counter() - start)
    got = print_kernels(kernel_times(trace_dir, 1), 12, f"{label}: one run, {wall:.1f} ms wall")
    for name, m in sorted(module_kernels(trace_dir).items(), key=lambda x: -x[1]["kernels"]):
        print(f"  program {name[:60]}: {m['runs']} runs, {m['kernels']} kernels, "
              f"{m['kernel_ms']:.2f} ms", flush=True)
    for name, m in sorted(host_dispatch(trace_dir).items(), key=lambda x: -x[1]["ms"]):
        print(f"  host dispatch {name[:50]}: {m['calls']} calls, {m['ms']:.2f} ms "
              f"({m['ms'] / m['calls']:.3f} ms a call)", flush=True)
    return got["kernels_ms"]


def write_host_profile(profiler: cProfile.Profile, path: str, top: int = 45) -> None:
    """A cProfile run's top functions, by own time and by cumulative time, to `path`."""
    with open(path, "w") as f:
        for key in ("tottime", "cumulative"):
            pstats.Stats(profiler, stream=f).sort_stats(key).print_stats(top)


def profile(engine, steps: int, top: int, label: str, *, donate: bool) -> dict:
    """The step in a jitted device loop (`device_rate`: no host), kernels per step. With
    `donate` the loop takes the engine's state (the engine is spent); without, every
    loop call first copies the whole state, cache included, which the step time then
    carries (a copy, not a kernel, so the kernel list leaves it out)."""
    trace_dir = tempfile.mkdtemp(prefix="profile_step_")
    repeats = 3
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        step_ms = device_rate(engine, steps, repeats, donate=donate)["device_step_ms"]
    # the profiled region ran the loop 1 + repeats times (the compile-and-warm run first)
    calls = (1 + repeats) * steps
    out = print_kernels(kernel_times(trace_dir, calls), top,
                        f"{label}: device loop, {step_ms:.3f} ms a step"
                        + ("" if donate else " (each loop call copies the state first)"))
    gaps = kernel_gaps(trace_dir, calls)
    print(f"idle between kernels: {sum(t for _, t, _ in gaps):.3f} ms a step", flush=True)
    for name, ms, times in gaps[:15]:
        print(f"  {ms:8.3f} ms  x{times:<4d} {name}", flush=True)
    return {"device_step_ms": step_ms, "state_donated": donate,
            "idle_ms": sum(t for _, t, _ in gaps),
            "idle": [{"between": n, "ms": t, "times": c} for n, t, c in gaps[:15]], **out}


def profile_engine(engine, calls: int, top: int, label: str) -> dict:
    """`calls` Engine.step() calls (host loop, one call in flight ahead), kernels per
    call: beside the device loop's, what the engine's own program adds."""
    steps_per_call = engine.decode_steps
    warm_for_calls(engine, calls)
    trace_dir = tempfile.mkdtemp(prefix="profile_engine_")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        start = time.perf_counter()
        for _ in range(calls):
            engine.step()
        engine.flush()
        wall_ms = (time.perf_counter() - start) / calls * 1e3
    out = print_kernels(kernel_times(trace_dir, calls), top,
                        f"{label}: engine, {wall_ms:.3f} ms a call of {steps_per_call} steps "
                        f"({wall_ms / steps_per_call:.3f} ms a step)")
    return {"engine_call_ms": wall_ms, "steps_per_call": steps_per_call, **out}


def load_pair(args):
    """(params, tcfg, dcfg, StepConfig for a drafter or None): the 8B shapes, or with
    --pair embedded the embedded default pair."""
    if args.pair == "embedded":
        params, tcfg, dcfg = load_default()
        return params, tcfg, dcfg, lambda draft: dataclasses.replace(
            default_step_config(tcfg, draft, num_slots=args.batch,
                                max_seq_len=args.context + 2048),
            matmul_precision=args.precision)
    tcfg, dcfg = qwen3_8b_pair(num_target_layers=args.layers,
                               num_draft_layers=5 if args.layers >= 8 else 1,
                               **({"vocab_size": 4096} if args.quick else {}))
    probe = step_config(tcfg, dcfg, args.batch, args.context, args.layer_loop)
    params = random_step_params(tcfg, dcfg, probe.scans_layers)
    return params, tcfg, dcfg, lambda draft: dataclasses.replace(
        step_config(tcfg, draft, args.batch, args.context, args.layer_loop),
        matmul_precision=args.precision)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layer-loop", default="auto", choices=("auto", "scan", "unrolled"))
    ap.add_argument("--precision", default="auto",
                    help="StepConfig.matmul_precision: highest, default or auto")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--plain-only", action="store_true")
    ap.add_argument("--engine", type=int, default=0, metavar="CALLS",
                    help="also profile this many Engine.step() calls (the host loop's program)")
    ap.add_argument("--pair", default="8b", choices=("8b", "embedded"),
                    help="8b: Qwen3-8B shapes, random weights; embedded: the default pair")
    ap.add_argument("--quick", action="store_true", help="4K vocabulary: a CPU smoke test")
    ap.add_argument("--out", default=None)
    ap.add_argument("--split-keys", type=int, default=None,
                    help="keys per attention key split at small batch for this run "
                         "(launch_plan.SMALL_BATCH_SPLIT_KEYS; 0: none)")
    args = ap.parse_args(argv)
    if args.split_keys is not None:
        launch_plan.SMALL_BATCH_SPLIT_KEYS = args.split_keys
    params, tcfg, dcfg, config = load_pair(args)
    bw = device_copy_bandwidth(64 << 20, 3) if args.quick else device_copy_bandwidth()
    weights_t, weights_d = weight_read_bytes(params)
    scans = config(None).scans_layers
    label = (f"{'embedded pair' if args.pair == 'embedded' else f'L{args.layers}'} "
             f"b{args.batch} ctx{args.context} {'scan' if scans else 'unrolled'} "
             f"{args.precision} split{launch_plan.SMALL_BATCH_SPLIT_KEYS} "
             f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"{label}: copy bandwidth {bw / 1e12:.2f} TB/s; weight-read bound plain "
          f"{weights_t / bw * 1e3:.3f} ms, speculative {(weights_t + weights_d) / bw * 1e3:.3f} ms",
          flush=True)
    rng = np.random.default_rng(0)
    report = {"label": label, "copy_bandwidth_bytes_per_s": bw,
              "small_batch_split_keys": launch_plan.SMALL_BATCH_SPLIT_KEYS}
    for name, speculative in (("plain", False), ("speculative", True)):
        if speculative and args.plain_only:
            break
        engine = Engine(params if speculative else {"target": params["target"]},
                        config(dcfg if speculative else None), speculative=speculative)
        top_id = min(tcfg.vocab_size, dcfg.mask_token_id)  # below the drafter's mask token
        for i in range(args.batch):
            engine.add_request(f"r{i}", rng.integers(0, top_id, args.context).tolist(), 768)
        engine.prefill_submitted()
        # the engine's own calls (--engine) need its state after the device loop
        report[name] = profile(engine, args.steps, args.top, f"{name} ({label})",
                               donate=not args.engine)
        if args.engine:
            report[name]["engine"] = profile_engine(engine, args.engine, args.top,
                                                    f"{name} ({label})")
        del engine
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)[:120]
        with open(os.path.join(args.out, f"profile_{tag}.json"), "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
