"""Two devices: tensor parallelism, context and generation in two processes, heterogeneous
TP, and aggregated vs data-parallel vs disaggregated serving end to end (issue 30).

    PYTHONPATH=. python benchmarks/bench_two_gpu.py --out DIR [--quick] [--scale]
        [--parts tp hetero remote e2e] [--limit PART=SECONDS ...]

Made for one host with two GPUs (the `nvidia-h200-x2` machine); on a CPU machine every
part runs as a dry run, each process with its own forced host devices
(XLA_FLAGS=--xla_force_host_platform_device_count). The embedded default pair
throughout, through public APIs only: `drafter.engine.Engine`,
`disagg.sources.disaggregated_engine`, `python -m disagg serve-remote` (through
`disagg.processes.ContextProcess`) with `disagg.remote.RemoteSource`.

Every part runs in child processes of this script, each under its own time limit
(`--limit`, defaults in LIMITS), printing its lines as it goes and saving what it has
measured after each step, so a part stopped at its limit still reports what it
finished. A child sees only its devices: CUDA_VISIBLE_DEVICES on GPUs, its own host
device count on CPU. The GPU calls are limited to 600 s, so on the GPU machine run
`--parts tp hetero remote`, then `--parts e2e`, then `--scale --parts tp`
(benchmarks/gpu_all.sh stages two_gpu, two_gpu_e2e, two_gpu_scale): each run keeps
the other parts' entries of two_gpu.json. With one GPU only, tp and hetero are
skipped and both processes of a pair share it (a dry run; `shared_gpu` says so).

  tp      one process, both devices. The held-out prompts through an Engine on one
          device and on a 2-device mesh (KV split over kv heads): `tp2_equal_tp1`
          when every request's tokens and per-step acceptance are identical. Then
          device time per speculative step (drafter.evaluate.device_rate: a jitted
          loop, no host) on both meshes, rows prefilled with the 128-token prompts:
          `tp2_over_tp1_step`. With --scale the same step-time ratio at the Qwen3-8B
          shape (drafter/shapes.py, random weights; `--scale-layers` cuts the depth)
          is measured too and becomes `tp2_over_tp1_step`. What the mesh splits by
          construction is the KV pools and attention (kv heads); the engine places
          the weights replicated on every device, so how the matmuls divide is up
          to XLA's sharding propagation.
  hetero  one process, both devices: `disaggregated_engine` with a context worker on
          the 2-device mesh (TP=2) and the generation engine on one device (TP=1):
          `hetero_tp_equal` when tokens and acceptance equal aggregated TP=1.
  remote  the context process (`serve-remote --role context`) on device 0, this
          script's generation child on device 1 with a RemoteSource (KV through
          jax.experimental.transfer, metadata through the control channel):
            - `cross_process_equal`: the held-out prompts' tokens and acceptance equal
              aggregated serving's (an Engine on device 1 in the same child);
            - handoff, one request at a time per prompt length: time to the first
              generation step's token, remote minus aggregated, minus the pull
              itself (RemoteSource's own bytes / seconds, which include its polling
              for the pull's end, 0.1 to 10 ms apart): `handoff_overhead_ms_p50`;
            - a small Poisson stream of requests through both: TTFT and tokens/s;
            - the transport alone: one process offers N bytes on device 0 and another
              pulls them onto device 1 (jax.experimental.transfer, what RemoteSource
              pulls through), against the device-to-device link (`jax.device_put` of
              the same bytes between the two devices of one process) measured right
              after: `transfer_over_link` at the largest size (goal >= 0.8).
  e2e     a prompt-heavy mixed stream (held-out prompts of 128 to 8K tokens, Poisson
          arrivals, `--e2e-new` new tokens each) served three ways: aggregated on one
          device; aggregated data-parallel on two (two processes, one device each,
          requests split by turns, started together); disaggregated, 1 context
          process + 1 generation process. Tokens/s, TTFT, and inter-token latency:
          the gaps between successive token arrivals of a request (tokens one step
          commits arrive together), p50 / p99 over every request. Disaggregation is
          expected to win on p99 inter-token latency (no prompt chunk shares a
          generation step); the figures say what it does.

Writes two_gpu.json (keys in GOAL_KEYS first). A run of some parts keeps the other
parts' entries of an existing two_gpu.json (each part says when it ran).

--quick: short prompts, few tokens and requests, small transfers; the CPU dry run
(tests/disagg/test_two_gpu_dry_run.py runs the tp and hetero equality in-process).
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path

from benchmarks.two_gpu.children import child_main
from benchmarks.two_gpu.common import say
from benchmarks.two_gpu.cross_process import part_remote
from benchmarks.two_gpu.e2e import part_e2e
from benchmarks.two_gpu.report import goals, summarise_remote
from benchmarks.two_gpu.runner import Runner, probe
from benchmarks.two_gpu.tensor_parallel import part_hetero, part_tp

PARTS = ("tp", "hetero", "remote", "e2e")
GOAL_KEYS = ("tp2_equal_tp1", "tp2_over_tp1_step", "hetero_tp_equal", "cross_process_equal",
             "transfer_over_link", "handoff_overhead_ms_p50", "stream_ttft_ms_p50",
             "stream_tokens_per_s", "e2e_tokens_per_s", "e2e_itl_ms_p99",
             "e2e_itl_p99_disagg_over_aggregated", "e2e_tokens_equal")
# Seconds per part. GPU: tp + hetero + remote fit one 600 s device call, e2e another
# (benchmarks/gpu_all.sh: stages two_gpu and two_gpu_e2e); CPU dry run: ample.
LIMITS = {"gpu": {"tp": 130, "hetero": 90, "remote": 300, "e2e": 540},
          "cpu": {"tp": 600, "hetero": 400, "remote": 700, "e2e": 900}}
SCALE_LIMIT_S = 540   # the tp part with --scale (run it as its own call on the GPU machine)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for two_gpu.json")
    ap.add_argument("--quick", action="store_true", help="the CPU dry run's small sizes")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--scale", action="store_true",
                    help="tp: also the step-time ratio at the Qwen3-8B shape")
    ap.add_argument("--scale-layers", type=int, default=None,
                    help="target layers at --scale (default 36; --quick: 2)")
    ap.add_argument("--layer-loop", default="auto", choices=("auto", "scan", "unrolled"))
    ap.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS",
                    help="a part's time limit (default: LIMITS; tp with --scale: "
                         f"{SCALE_LIMIT_S})")
    ap.add_argument("--e2e-requests", type=int, default=None)
    ap.add_argument("--e2e-rate", type=float, default=None, help="arrivals per second")
    ap.add_argument("--e2e-new", type=int, default=None, help="new tokens per request")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args.child, args.spec, args.result)

    platform, visible = probe()
    limits = dict(LIMITS[platform])
    if args.scale:
        limits["tp"] = SCALE_LIMIT_S
    for item in args.limit:
        part, _, seconds = item.partition("=")
        if part not in PARTS or not seconds.replace(".", "", 1).isdigit():
            raise SystemExit(f"--limit {item!r}: give PART=SECONDS with PART in {PARTS}")
        limits[part] = float(seconds)
    work = Path(tempfile.mkdtemp(prefix="two_gpu-"))
    log_dir = Path(args.out) if args.out else work
    log_dir.mkdir(parents=True, exist_ok=True)
    runner = Runner(platform, visible, work, log_dir)
    say("two_gpu", f"platform {platform}"
                   + (f", GPUs {visible}" if platform == "gpu" else ", forced host devices")
                   + (" (one GPU: both processes share it; tp and hetero skipped)"
                      if runner.shared_gpu else "")
                   + f"; parts {args.parts}; limits {[limits[p] for p in args.parts]} s")
    run = {"tp": part_tp, "hetero": part_hetero, "remote": part_remote, "e2e": part_e2e}
    parts = {}
    for name in args.parts:
        start = time.monotonic()
        say(name, f"--- part {name} (limit {limits[name]:.0f} s)")
        try:
            parts[name] = run[name](runner, args, limits[name])
        except Exception as e:   # noqa: BLE001 - one part's failure does not lose the others
            parts[name] = {"status": f"failed: {type(e).__name__}: {e}"}
            say(name, parts[name]["status"])
        if name == "remote":
            summarise_remote(parts[name])
        parts[name]["seconds"] = time.monotonic() - start
        parts[name]["finished_at"] = datetime.datetime.now().isoformat(timespec="seconds")
        parts[name]["quick"] = args.quick
        say(name, f"--- part {name} done in {parts[name]['seconds']:.0f} s")
    import shutil
    shutil.rmtree(work, ignore_errors=True)   # the children's specs, results, compile cache
    previous = {}
    if args.out and (Path(args.out) / "two_gpu.json").exists():
        previous = json.loads((Path(args.out) / "two_gpu.json").read_text()).get("parts", {})
    merged = {**{k: v for k, v in previous.items() if k not in parts}, **parts}
    report = {**goals(merged), "platform": platform, "gpus": visible,
              "shared_gpu": runner.shared_gpu, "parts": merged}
    from benchmarks.timing import report_goals
    return report_goals("two_gpu", report, GOAL_KEYS, args.out)


if __name__ == "__main__":
    main()
