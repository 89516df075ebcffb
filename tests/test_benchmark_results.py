"""The report's results files keep the platform they were measured on."""

import json

import pytest

from benchmarks import timing


def test_a_run_on_another_platform_never_replaces_the_reports_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(timing, "RESULTS_DIR", tmp_path)
    here = timing.machine()["platform"]
    other = "gpu" if here != "gpu" else "cpu"
    measured = tmp_path / "bench.json"
    measured.write_text(json.dumps({"machine": {"platform": other}, "figure": 1.0}))
    with pytest.raises(timing.WouldReplaceDeviceResults, match="--out DIR"):
        timing.write_results("bench", {"figure": 2.0})
    assert json.loads(measured.read_text())["figure"] == 1.0   # untouched
    # elsewhere, or over a file from this platform, a run writes as asked
    timing.write_results("bench", {"figure": 3.0}, str(tmp_path / "elsewhere"))
    assert json.loads((tmp_path / "elsewhere" / "bench.json").read_text())["figure"] == 3.0
    measured.write_text(json.dumps({"machine": {"platform": here}, "figure": 1.0}))
    timing.write_results("bench", {"figure": 4.0})
    assert json.loads(measured.read_text())["figure"] == 4.0
