"""call_kernels: one call's kernels picked out of an ncu trace (synthetic CSV here)."""

import pytest

from benchmarks.call_kernels import kernel_times

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"\n')


def write_trace(tmp_path, kernels):
    lines = ["==PROF== Connected to process 1\n", HEADER]
    for i, (name, ns) in enumerate(kernels):
        for metric, value in (("gpu__time_duration.sum", f"{ns:,}"),
                              ("launch__grid_size", "512")):
            lines.append(f'"{i}","1","python3","h","{name}","1","7","(64, 1, 1)",'
                         f'"(1, 64, 8)","0","9.0","Command line profiler metrics",'
                         f'"{metric}","","{value}"\n')
    path = tmp_path / "ncu.csv"
    path.write_text("".join(lines))
    return path


def test_the_last_calls_of_the_trace_are_timed_per_kernel(tmp_path):
    setup = [("random_bits", 9000), ("permute", 8000)]
    call = [("prep", 2000), ("paged_attention", 200_000), ("prep", 1000)]  # prep launched twice
    warm = [(n, t * 3) for n, t in call]  # slower warm-up calls are left out
    path = write_trace(tmp_path, setup + warm * 3 + call * 5)
    times = kernel_times(path, calls=5)
    assert set(times) == {"prep", "paged_attention"}
    assert times["paged_attention"][:3] == (200_000, 1, 200_000)
    assert times["prep"][:2] == (3000, 2)  # both launches, per call
    assert times["prep"][3] == "512"


def test_a_trace_that_does_not_end_in_repeats_is_refused(tmp_path):
    path = write_trace(tmp_path, [("a", 1), ("b", 2), ("c", 3)])
    with pytest.raises(ValueError, match="not 2 repeats"):
        kernel_times(path, calls=2)
