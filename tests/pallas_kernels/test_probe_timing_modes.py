"""probe_timing_modes: kernels picked out of a profiler trace, nvidia-smi samples
summarised (synthetic inputs here; the probe itself runs on the GPU)."""

import gzip
import json

import pytest

from benchmarks.probe_timing_modes import GpuSampler, kernel_events


def write_trace(tmp_path, events):
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}}]
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    return tmp_path


def test_only_the_gpu_s_paged_attention_kernels_are_kept_in_time_order(tmp_path):
    kernel = "paged_attention_q8_g4_r32_ppb4_s1"
    trace = write_trace(tmp_path, [
        {"ph": "X", "pid": 7, "name": kernel, "ts": 30.0, "dur": 12.5},
        {"ph": "X", "pid": 1, "name": kernel, "ts": 1.0, "dur": 99.0},  # the host's launch
        {"ph": "X", "pid": 7, "name": "copy", "ts": 5.0, "dur": 3.0},
        {"ph": "X", "pid": 7, "name": kernel, "ts": 10.0, "dur": 12.0}])
    assert kernel_events(trace) == [(10.0, 12.0), (30.0, 12.5)]


def test_a_trace_without_the_kernel_names_what_it_saw(tmp_path):
    trace = write_trace(tmp_path, [{"ph": "X", "pid": 7, "name": "fusion_3", "ts": 0, "dur": 1}])
    with pytest.raises(RuntimeError, match="fusion_3"):
        kernel_events(trace)


def test_samples_summarise_clocks_power_and_the_power_cap():
    sampler = GpuSampler()
    sampler.rows = [["1980", "540.5", "40", "0x0000000000000000"],
                    ["1245", "702.6", "41", "0x0000000000000004"],
                    ["N/A", "", "", ""]]  # a torn line is skipped
    summary = sampler.summary()
    assert summary["samples"] == 2
    assert summary["sm_mhz_min"] == 1245 and summary["power_w_max"] == 702.6
    assert summary["power_cap_share"] == 0.5 and summary["thermal_share"] == 0
