"""Where a handoff's time goes: one request's host and device timeline, aggregated beside
disaggregated-shared, on one device.

    PYTHONPATH=. python benchmarks/profile_handoff.py [--lengths 128 2048] [--out DIR]

For each prompt length, both modes serve one request of 2 tokens (one decode step per
call, as bench_serving's handoff part), twice:

  * unprofiled, as served: the host's events in ms from the request, timed on the host
    (every engine's jitted step, import and export calls, its reads of step outputs,
    `collect`, and the reads of first tokens);
  * under the jax profiler: the same events beside the device's busy spans (kernels
    less than 20 us apart), read back from the Perfetto trace, and the device's idle
    time between spans: on one GPU, the part of a handoff the host decides.

While a profiler session is active XLA runs every CUDA graph's kernels one by one (CUPTI
and CUDA graphs do not mix), so the profiled run's host durations are those of op-by-op
launches: it gives the device's side and the order; the unprofiled run gives the costs.

`--demo` runs bench_serving's demo workload instead (six held-out prompts of at most 512
tokens, 48 new tokens each, the engines' own decode steps per call), unprofiled only:
each mode's host events in order and summed by label, beside the run's wall time; a
`collect` is mostly the host waiting for the device, the rest is host work the device
may wait on.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax

from benchmarks.profile_step import device_lines, kernel_events, outer_jit_calls
from benchmarks.serving_stream import DEMO_NEW_TOKENS, close, demo_prompts, make_engine
from drafter.default import default_step_config, load_default, load_prompts

MODES = ("aggregated", "disagg-shared")
# the labels `instrumented` puts on a trace besides the jitted calls' own
ANNOTATED = ("collect", "gen collect", "ctx collect", "book_first_tokens", "gen poll")


def _wrap(obj, name: str, label: str, events: list) -> None:
    """Wrap obj.name: each call is appended to `events` as (label, start s, end s) of
    perf_counter, and shows on a profiler trace's host line as `label`."""
    inner = getattr(obj, name)

    def call(*args, **kwargs):
        start = time.perf_counter()
        with jax.profiler.TraceAnnotation(label):
            out = inner(*args, **kwargs)
        events.append((label, start, time.perf_counter()))
        return out
    setattr(obj, name, call)


def instrumented(engine, events: list):
    """The engine, and its in-process context engines, with their jitted calls, output
    reads and first-token reads recorded into `events` (a profiling tool's view of the
    engine's internals: the names it wraps are the executor's and the engine's own)."""
    contexts = [ctx.engine for ctx in getattr(engine.kv_source, "contexts", ())]
    for e, who in [(engine, "gen" if contexts else "")] + [(c, "ctx") for c in contexts]:
        for name, label in (("_step_fn", "step"), ("_import", "import"),
                            ("_export", "export")):
            _wrap(e.executor, name, f"{who} {label}".strip(), events)
        _wrap(e, "_collect", f"{who} collect".strip(), events)
    if contexts:
        _wrap(engine.kv_source, "poll", "gen poll", events)
    _wrap(engine.arrivals, "_book_first_tokens", "book_first_tokens", events)
    return engine


def busy_spans(kernels, gap_us: float = 20.0) -> list[tuple[float, float, int]]:
    """Kernel (start, duration) pairs in us merged into device busy spans (start, end,
    kernels): kernels less than `gap_us` apart belong to one span."""
    spans: list[list] = []
    for ts, dur in sorted(kernels):
        if spans and ts <= spans[-1][1] + gap_us:
            spans[-1][1] = max(spans[-1][1], ts + dur)
            spans[-1][2] += 1
        else:
            spans.append([ts, ts + dur, 1])
    return [tuple(x) for x in spans]


def timeline(trace_dir: str) -> tuple[list[tuple], float]:
    """(rows (start ms, duration ms, "host" or "device", what, kernels), device idle ms
    between its first and last kernel) of the trace under `trace_dir`. Host rows: jitted
    calls (the outermost of the profiler's nested pair) and the annotated reads; device
    rows: busy spans of kernels."""
    events, device_pids, threads = device_lines(trace_dir)
    kernels = [(e["ts"], e["dur"]) for e in kernel_events(events, device_pids, threads)]
    host = sorted([(ts, dur, name) for _, _, ts, dur, name in outer_jit_calls(events, device_pids)]
                  + [(e["ts"], e["dur"], e["name"]) for e in events
                     if e.get("ph") == "X" and e.get("pid") not in device_pids
                     and e["name"] in ANNOTATED])
    spans = busy_spans(kernels)
    if not spans and not host:
        return [], 0.0
    firsts = ([spans[0][0]] if spans else []) + ([host[0][0]] if host else [])
    t0 = min(firsts)
    rows = [((ts - t0) / 1e3, dur / 1e3, "host", name, "") for ts, dur, name in host]
    rows += [((a - t0) / 1e3, (b - a) / 1e3, "device", "kernels", n) for a, b, n in spans]
    idle = sum(b[0] - a[1] for a, b in zip(spans, spans[1:])) / 1e3
    return sorted(rows), idle


def host_summary(events, wall_s: float) -> list[str]:
    """Host events summed by label: calls, ms and share of the wall time."""
    by: dict[str, list] = {}
    for label, a, b in events:
        got = by.setdefault(label, [0, 0.0])
        got[0] += 1
        got[1] += b - a
    return [f"  {label:<20} x{n:<3d} {1e3 * t:8.3f} ms ({100 * t / wall_s:4.1f}% of the wall)"
            for label, (n, t) in sorted(by.items(), key=lambda x: -x[1][1])]


def demo_timelines(params, cfg, held, out_dir) -> None:
    """The demo workload's host events per mode, unprofiled (see the module doc)."""
    prompts, new = demo_prompts(held), DEMO_NEW_TOKENS
    events: list = []
    engines = {m: instrumented(make_engine(m, params, cfg), events) for m in MODES}
    for mode, engine in engines.items():
        for _ in range(3):   # compile, then warm
            engine.generate(prompts, new)
        events.clear()
        start = time.perf_counter()
        results = engine.generate(prompts, new)
        wall = time.perf_counter() - start
        tokens = sum(len(r.tokens) for r in results)
        lines = [f"{mode}, demo workload ({len(prompts)} prompts x {new} tokens), unprofiled: "
                 f"{1e3 * wall:.2f} ms wall, {tokens / wall:.0f} tok/s; host events, ms "
                 f"from the first submit:"]
        lines += [f"  {1e3 * (a - start):8.3f} +{1e3 * (b - a):7.3f} {label}"
                  for label, a, b in sorted(events, key=lambda e: e[1])]
        lines += ["summed by label:"] + host_summary(events, wall)
        print("\n".join(lines), flush=True)
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, f"demo_{mode}.txt"), "w") as f:
                f.write("\n".join(lines) + "\n")
    for engine in engines.values():
        close(engine)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--demo", action="store_true",
                    help="the demo workload's host events instead (module doc)")
    ap.add_argument("--out", default=None, help="write each timeline to DIR/handoff_*.txt")
    args = ap.parse_args(argv)
    params, tcfg, dcfg = load_default()
    cfg = default_step_config(tcfg, dcfg)
    held = load_prompts()
    if args.demo:
        return demo_timelines(params, cfg, held, args.out)
    events: list = []
    engines = {m: instrumented(make_engine(m, params, cfg, decode_steps_per_call=1), events)
               for m in MODES}
    for length in args.lengths:
        prompt = next((q["tokens"] for q in held if q["length"] == length), None)
        if prompt is None:
            raise SystemExit(f"--lengths {length}: no held-out prompt of that length; give "
                             f"one of {sorted({q['length'] for q in held})}")
        for mode, engine in engines.items():
            for _ in range(3):   # compile, then warm
                engine.generate([prompt], 2, ignore_eos=True)
            events.clear()
            start = time.perf_counter()
            r = engine.generate([prompt], 2, ignore_eos=True)[0]
            lines = [f"{mode}, {length}-token prompt, unprofiled (CUDA graphs as served): TTFT "
                     f"{1e3 * r.time_to_first_token_s:.2f} ms, first generation step "
                     f"{1e3 * r.token_times_s[1]:.2f} ms; host events, ms from the request:"]
            lines += [f"  {1e3 * (a - start):8.3f} +{1e3 * (b - a):7.3f} {label}"
                      for label, a, b in sorted(events, key=lambda e: e[1])]
            trace_dir = tempfile.mkdtemp(prefix="profile_handoff_")
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                r = engine.generate([prompt], 2, ignore_eos=True)[0]
            rows, idle = timeline(trace_dir)
            lines += [f"profiled (kernels one by one): first generation step "
                      f"{1e3 * r.token_times_s[1]:.2f} ms; device idle between busy spans "
                      f"{idle:.2f} ms"]
            lines += [f"  {t:8.3f} +{d:7.3f} {where:6} {name[:70]} {n}"
                      for t, d, where, name, n in rows]
            print("\n".join(lines), flush=True)
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, f"handoff_{mode}_{length}.txt"), "w") as f:
                    f.write("\n".join(lines) + "\n")
    for engine in engines.values():
        close(engine)


if __name__ == "__main__":
    main()
