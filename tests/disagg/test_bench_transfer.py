"""Smoke test of the transfer benchmark (benchmarks/bench_transfer.py --quick): tiny
sizes on the CPU host devices, every path, the same code the GPU run measures."""

import json

import jax
import pytest

from benchmarks import bench_transfer


@pytest.mark.timeout(120)
def test_quick_run_times_every_path_and_writes_json(tmp_path, capsys):
    report = bench_transfer.main(["--quick", "--sizes", "2M", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "transfer.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"]))
    row = saved["rows"][0]
    two = len(jax.devices()) >= 2
    assert row["same_device"] == (not two)
    assert set(row["move_ms"]) == set(bench_transfer.PATHS) and not row["errors"]
    assert row["live_bytes"] <= row["moved_bytes"] <= 1.125 * row["live_bytes"] + (2 << 20)
    for key in ("gather_ms", "checksum_ms", "export_ms", "import_ms", "scatter_ms"):
        assert row[key] > 0, key
    assert row["pinned_host_vs_link"] > 0 and row["per_fragment_us"] > 0
    assert (row["coalesced_vs_link"] > 0) if two else row["coalesced_vs_link"] is None
    assert "pinned_roundtrip_ms" in row["link"] and ("d2d_ms" in row["link"]) == two
    assert "coalesced" in capsys.readouterr().out


def test_sizes_parse_and_bad_ones_are_named():
    assert [bench_transfer.parse_size(s) for s in ("64M", "1G", "4GiB", "512K", "100")] == [
        64 << 20, 1 << 30, 4 << 30, 512 << 10, 100]
    with pytest.raises(SystemExit, match="size '12Q' is not understood"):
        bench_transfer.parse_size("12Q")
