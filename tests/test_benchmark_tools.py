"""The profiling tools: a Perfetto trace into a handoff's timeline, XLA's log into graph
records, the dispatch cost by array count."""

import gzip
import json

from benchmarks.graph_records import summarize
from benchmarks.profile_handoff import busy_spans, timeline


def test_kernels_less_than_the_gap_apart_form_one_busy_span():
    kernels = [(100.0, 10.0), (0.0, 5.0), (15.0, 5.0), (30.0, 2.0)]   # us, unsorted
    assert busy_spans(kernels, gap_us=20.0) == [(0.0, 32.0, 3), (100.0, 110.0, 1)]
    assert busy_spans([], gap_us=20.0) == []


def _trace(tmp_path, events):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7,
             "args": {"name": "Stream #14(Compute)"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    path = tmp_path / "plugins" / "profile" / "run" / "perfetto_trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def test_a_timeline_orders_host_calls_and_device_spans_and_sums_device_idle(tmp_path):
    x = lambda pid, ts, dur, name, tid=0: {"ph": "X", "pid": pid, "tid": tid, "ts": ts,
                                           "dur": dur, "name": name}
    _trace(tmp_path, [
        x(2, 1000, 300, "PjitFunction(import_step)"),
        x(2, 1001, 298, "PjitFunction(import_step)"),   # the profiler's nested twin
        x(1, 1200, 50, "scatter_fusion", tid=7),
        x(1, 1260, 40, "loop_fusion", tid=7),             # 10 us later: the same span
        x(2, 1400, 600, "collect"),
        x(1, 1500, 100, "gemm_fusion", tid=7),            # 200 us later: a new span
        x(1, 1600, 5, "Memcpy DtoH", tid=7),              # not a kernel
    ])
    rows, idle = timeline(str(tmp_path))
    assert [(r[0], r[2], r[3], r[4]) for r in rows] == [
        (0.0, "host", "PjitFunction(import_step)", ""),
        (0.2, "device", "kernels", 2),
        (0.4, "host", "collect", ""),
        (0.5, "device", "kernels", 1)]
    assert abs(idle - 0.2) < 1e-9   # 1300 -> 1500 us


def test_graph_records_are_counted_per_graph_size_beside_first_records():
    log = ["I1203 command_buffer_thunk.cc:362] [0] Updated command buffer in 195 μs; "
           "num_commands=209",
           "I1203 command_buffer_thunk.cc:362] [0] Updated command buffer in 105 μs; "
           "num_commands=209",
           "I1203 command_buffer_thunk.cc:362] [0] Updated command buffer in 67 μs; "
           "num_commands=28",
           "I1203 command_buffer_thunk.cc:300] Initialized command buffer on device #0 in "
           "900 μs; num_commands=28",
           "I1203 unrelated line"]
    got = summarize(log)
    assert got["records"] == 3 and got["record_us"] == 367 and got["first_records"] == 1
    assert got["by_commands"] == {28: [67], 209: [195, 105]}


def test_a_programs_top_level_thunks_are_counted_by_kind_after_the_thunk_passes(tmp_path):
    from benchmarks.graph_records import program_thunks

    before = "000: kKernel\n001: kCustomCall\n002: kKernel\n"
    after = ("000: kCommandBuffer\n  000: kKernel\n  001: kKernel\n"
             "001: kCustomCall\n002: kWhile\n  000: kCommandBuffer\n    000: kKernel\n"
             "003: kCommandBuffer\n  000: kKernel\n")
    (tmp_path / "module_0001.jit_packed_step.thunk_sequence.txt").write_text(before)
    (tmp_path / "module_0001.jit_packed_step.thunk_sequence_after_thunk_passes.txt"
     ).write_text(after)
    (tmp_path / "module_0002.jit_export_step.thunk_sequence.txt").write_text(before)
    got = program_thunks(str(tmp_path))
    assert got["module_0001.jit_packed_step"] == {"kCommandBuffer": 2, "kCustomCall": 1,
                                                  "kWhile": 1}
    assert got["module_0002.jit_export_step"] == {"kKernel": 2, "kCustomCall": 1}


def test_dispatch_costs_are_reported_per_array_count_beside_one_array(tmp_path):
    from benchmarks import bench_dispatch
    bench_dispatch.main(["--out", str(tmp_path), "--calls", "20", "--counts", "1", "256"])
    rows = json.loads((tmp_path / "dispatch.json").read_text())["rows"]
    assert [r["arrays"] for r in rows] == [1, 256]
    assert rows[0]["read_dispatch_over_one_array"] == 1.0
    # 256 arrays cost more host time to pass than one, on any backend
    assert rows[1]["donated_dispatch_us"] > rows[0]["donated_dispatch_us"]
    assert rows[1]["outputs_dispatch_us"] > rows[0]["outputs_dispatch_us"]


def test_a_machine_record_names_the_host_cpu_and_a_calls_launch_cost_is_measured():
    """Host-bound figures (serving on one GPU) follow the host: every results file names
    its CPU, and bench_serving records a trivial call's launch time in the same run."""
    from drafter import timing
    record = timing.machine()
    assert record["cpu"] and record["cpu"] != "unknown" and record["cpus"] >= 1
    assert 0 < timing.launch_us(calls=20) < 100_000
