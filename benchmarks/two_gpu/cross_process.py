"""Part remote of the two-GPU benchmark: the context process on device 0 and a
generation child on device 1 with a RemoteSource (equality, handoff, a stream), the
transport alone (bulk offer and pull) and the device-to-device link."""

from __future__ import annotations

import datetime
import json
import os
import re
import time
from pathlib import Path

import numpy as np

from benchmarks.two_gpu.common import (equal_outputs, equality_prompts, first_difference,
                                       held_out, meshes, outputs, pair_source, say)
from benchmarks.two_gpu.runner import Runner
from benchmarks.two_gpu.streams import (describe, make_stream, run_stream, stream_metrics,
                                        warm_stream)


def context_process(spec: dict, log_path: Path):
    """`serve-remote --role context` on this run's context device (spec["context_env"])."""
    from disagg.processes import ContextProcess
    source = pair_source(spec["quick"], spec.get("num_slots"))
    return ContextProcess(source, log_path, tp=1, timeout=spec.get("timeout", 30.0),
                          extra_args=["--warmup"], extra_env=spec.get("context_env") or {},
                          start_timeout=spec.get("start_timeout", 300.0))


_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*Compiling ")


def compiles_in_log(log_path: Path, run: dict) -> int:
    """Programs the context process compiled while `run` was timed (its log, written
    with JAX_LOG_COMPILES=1: each compile a timestamped line)."""
    count = 0
    for line in log_path.read_text(errors="replace").splitlines():
        if m := _LOG_TIME.match(line):
            t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            count += run["started_at"] <= t <= run["ended_at"]
    return count


def remote_engine(address: str, params, cfg, mesh, timeout: float, **engine_kwargs):
    from disagg.handshake import Weights
    from disagg.kv_format import KVFormat
    from disagg.remote import RemoteSource
    from drafter.engine import Engine
    source = RemoteSource(address, KVFormat.of(cfg.spec, "shared"), weights=Weights.of(params, cfg),
                          mesh=mesh, timeout=timeout)
    return Engine(params, cfg, mesh=mesh, kv_source=source, mode="shared",
                  kv_timeout_s=source.engine_timeout_s, **engine_kwargs)


def handoff_rows(agg, remote, prompts_by_len: dict, repeats: int, sink) -> list:
    """One request at a time per prompt length: TTFT, the first generation step, the pull
    (RemoteSource's bytes and seconds) and the overhead beyond it."""
    source, rows = remote.kv_source, []
    for length, prompts in sorted(prompts_by_len.items()):
        prompt = prompts[0]
        for engine in (agg, remote):
            engine.generate([prompt], 2, ignore_eos=True)   # this length's compiles
        got = {"ttft_a": [], "ttft_r": [], "first_a": [], "first_r": [], "pull": [], "bytes": []}
        for _ in range(repeats):
            a = agg.generate([prompt], 2, ignore_eos=True)[0]
            nbytes, seconds = source.bytes_pulled, source.pull_seconds
            r = remote.generate([prompt], 2, ignore_eos=True)[0]
            got["bytes"].append(source.bytes_pulled - nbytes)
            got["pull"].append(1e3 * (source.pull_seconds - seconds))
            got["ttft_a"].append(1e3 * a.time_to_first_token_s)
            got["ttft_r"].append(1e3 * r.time_to_first_token_s)
            got["first_a"].append(1e3 * a.token_times_s[1])
            got["first_r"].append(1e3 * r.token_times_s[1])
        med = {k: float(np.median(v)) for k, v in got.items()}
        row = {"prompt_tokens": length, "ttft_aggregated_ms": med["ttft_a"],
               "ttft_remote_ms": med["ttft_r"], "first_step_aggregated_ms": med["first_a"],
               "first_step_remote_ms": med["first_r"], "pull_ms": med["pull"],
               "kv_bytes": int(med["bytes"]),
               "pull_GBps": med["bytes"] / (med["pull"] / 1e3) / 1e9 if med["pull"] else None,
               "handoff_overhead_ms": med["first_r"] - med["first_a"] - med["pull"]}
        rows.append(row)
        say("remote", f"{length:>5} tokens: TTFT aggregated {row['ttft_aggregated_ms']:.2f} / "
                      f"remote {row['ttft_remote_ms']:.2f} ms; first generation step "
                      f"{row['first_step_aggregated_ms']:.2f} / {row['first_step_remote_ms']:.2f} "
                      f"ms; pull {row['kv_bytes'] / 1e6:.2f} MB in {row['pull_ms']:.3f} ms -> "
                      f"overhead beyond the pull {row['handoff_overhead_ms']:.2f} ms")
        sink["handoff"] = rows
        sink.save()
    return rows


def child_remote(spec: dict, sink) -> None:
    """Generation side on this process's device; the context a child process."""
    quick = spec["quick"]
    log = Path(spec["log_dir"]) / "two_gpu_context_remote.log"
    start = time.perf_counter()
    with context_process(spec, log) as ctx:
        say("remote", f"context process listening on {ctx.address}")
        params, cfg = pair_source(quick, spec.get("num_slots")).load()
        mesh = meshes(1)[0]
        from drafter.engine import Engine
        agg = Engine(params, cfg, mesh=mesh)
        remote = remote_engine(ctx.address, params, cfg, mesh, spec.get("timeout", 30.0))
        prompts = spec["equality_prompts"]
        max_new = spec["max_new"]
        ref = outputs(agg.generate(prompts, max_new))
        got = outputs(remote.generate(prompts, max_new))
        diff = first_difference(ref, got)
        sink["cross_process_equal"] = equal_outputs(ref, got)
        sink["difference"] = diff
        sink["acceptance_length"] = float(np.mean([a for r in got["acceptance"] for a in r]))
        sink.save()
        say("remote", f"cross_process_equal = {sink['cross_process_equal']}"
                      + (f" ({diff})" if diff else "")
                      + f" ({len(prompts)} prompts, {time.perf_counter() - start:.1f} s so far)")
        by_len = {int(k): v for k, v in spec["handoff_prompts"].items()}
        handoff_rows(agg, remote, by_len, spec["repeats"], sink)
        stream = spec["stream"]
        for name, engine in (("aggregated", agg), ("remote", remote)):
            warm_stream(engine, stream)
            run = run_stream(engine, stream)
            if name == "remote":
                run["context_programs_compiled"] = compiles_in_log(log, run)
            sink[f"stream_{name}"] = run
            sink.save()
            say("remote", "stream " + describe(name, stream_metrics([run])))
        stats = remote.kv_source.close()
        sink["context_stats_at_close"] = stats
        sink.save()


def child_bulk_offer(spec: dict, sink) -> None:
    """Offer `sizes` bytes (rounds + 1 single-use offers each) on this process's device,
    write the offers to spec["offer_file"], wait until spec["done_file"] exists."""
    import secrets
    import jax
    import jax.numpy as jnp
    from benchmarks.bench_transfer import random_array
    from disagg.wire import start_transfer_server
    server = start_transfer_server("127.0.0.1")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    arrays, offers = [], {}
    for size in spec["sizes"]:
        x = jax.block_until_ready(random_array((size,), jnp.uint8, device, 3))
        uuids = [secrets.randbits(62) for _ in range(spec["rounds"] + 1)]
        for uuid in uuids:
            server.await_pull(uuid, [x])
        arrays.append(x)
        offers[str(size)] = uuids
    Path(spec["offer_file"] + ".tmp").write_text(json.dumps(
        {"address": server.address(), "offers": offers}))
    os.replace(spec["offer_file"] + ".tmp", spec["offer_file"])
    deadline = time.monotonic() + spec["wait_s"]
    while not Path(spec["done_file"]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    sink["offered"] = list(offers)
    sink.save()


def child_bulk_pull(spec: dict, sink) -> None:
    """Pull each offered size onto this process's device: seconds per pull (the first
    pull of a size warms up), median of the rest."""
    import jax
    import jax.numpy as jnp
    from disagg.wire import start_transfer_server
    deadline = time.monotonic() + spec["wait_s"]
    while not Path(spec["offer_file"]).exists():
        if time.monotonic() > deadline:
            raise SystemExit("the offering process wrote no offers in time")
        time.sleep(0.05)
    offer = json.loads(Path(spec["offer_file"]).read_text())
    server = start_transfer_server("127.0.0.1")
    connection = server.connect(offer["address"])
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    rows = []
    for size, uuids in offer["offers"].items():
        size = int(size)
        aval = jax.ShapeDtypeStruct((size,), jnp.uint8, sharding=device)
        jax.block_until_ready(connection.pull(uuids[0], [aval]))
        seconds = []
        for uuid in uuids[1:]:
            start = time.perf_counter()
            jax.block_until_ready(connection.pull(uuid, [aval]))
            seconds.append(time.perf_counter() - start)
        row = {"bytes": size, "pull_ms": 1e3 * float(np.median(seconds)),
               "pull_ms_runs": [1e3 * s for s in seconds]}
        row["pull_GBps"] = size / (row["pull_ms"] / 1e3) / 1e9
        rows.append(row)
        say("remote", f"transport pull {size / 2**20:.1f} MiB: {row['pull_ms']:.3f} ms, "
                      f"{row['pull_GBps']:.2f} GB/s")
        sink["pulls"] = rows
        sink.save()


def child_link(spec: dict, sink) -> None:
    """The device-to-device link: one `jax.device_put` of N contiguous bytes from device
    0 to device 1 of this process (bench_transfer's timing: median of rounds)."""
    import jax
    import jax.numpy as jnp
    from benchmarks import bench_transfer
    if spec["quick"]:
        bench_transfer.TIMING.update(budget_s=0.01, repeats=2)
    devices = jax.devices()
    if len(devices) < 2:
        raise SystemExit("the link needs 2 devices in one process")
    src, dst = (jax.sharding.SingleDeviceSharding(d) for d in devices[:2])
    rows = []
    for size in spec["sizes"]:
        x = jax.block_until_ready(bench_transfer.random_array((size,), jnp.uint8, src, 7))
        ms = 1e3 * bench_transfer.median_seconds(lambda: jax.device_put(x, dst), out_bytes=size)
        rows.append({"bytes": size, "d2d_ms": ms, "d2d_GBps": size / (ms / 1e3) / 1e9})
        say("remote", f"link device 0 -> 1, {size / 2**20:.2f} MiB: {ms:.3f} ms, "
                      f"{rows[-1]['d2d_GBps']:.2f} GB/s")
        sink["link"] = rows
        sink.save()
        del x


# ============================================================ the parent's side

def remote_workload(quick: bool) -> dict:
    by_len = held_out(quick)
    if quick:
        stream = make_stream(by_len, {48: 1.0}, 3, 20.0, 6, seed=1, prefix="s")
        return {"equality_prompts": equality_prompts(True), "max_new": 8,
                "handoff_prompts": {48: by_len[48]}, "repeats": 1, "stream": stream}
    short = {n: v for n, v in by_len.items() if n <= 2048}
    stream = make_stream(short, {128: 0.4, 512: 0.4, 2048: 0.2}, 16, 8.0, 48, seed=1,
                         prefix="s")
    return {"equality_prompts": equality_prompts(False) + by_len[2048][:1], "max_new": 64,
            "handoff_prompts": {n: v[:1] for n, v in by_len.items()}, "repeats": 3,
            "stream": stream}


def part_remote(runner: Runner, args, limit: float) -> dict:
    start = time.monotonic()

    def left(share: float) -> float:
        return share * (limit - (time.monotonic() - start))

    spec = {"quick": args.quick, "log_dir": str(runner.log_dir), "timeout": 30.0,
            "context_env": {**runner.device_env([0]), "JAX_LOG_COMPILES": "1"},
            **remote_workload(args.quick)}
    say("remote", f"context process on device 0, generation process on device 1 "
                  f"({len(spec['equality_prompts'])} equality prompts, handoff at "
                  f"{sorted(spec['handoff_prompts'])} tokens, a stream of "
                  f"{len(spec['stream'])} requests)")
    out = {"serving": runner.run("remote", spec, [1], left(0.7), "remote")}
    sizes = [1 << 20, 4 << 20] if args.quick else [64 << 20, 256 << 20, 1 << 30]
    files = {"offer_file": str(runner.work / "offer.json"),
             "done_file": str(runner.work / "pulled")}
    budget = left(0.5)
    offer = runner.start("bulk-offer", {"sizes": sizes, "rounds": 3, "wait_s": budget,
                                        **files}, [0])
    pulled = runner.run("bulk-pull", {"wait_s": budget, **files}, [1], budget, "remote")
    Path(files["done_file"]).touch()
    runner.wait([offer], 30.0, "remote")
    out["transport"] = pulled
    serving_bytes = [r["kv_bytes"] for r in out["serving"].get("handoff", []) if r["kv_bytes"]]
    link_sizes = sizes + sorted(set(serving_bytes))
    if runner.shared_gpu:
        out["link"] = {"status": "skipped: needs 2 GPUs"}
    else:
        out["link"] = runner.run("link", {"quick": args.quick, "sizes": link_sizes}, [0, 1],
                                 left(1.0), "remote")
    return out
