"""The two-GPU benchmark's report: the goal keys from the parts that ran, and the remote
part's summary (stream metrics and the link comparison)."""

from __future__ import annotations

import numpy as np

from benchmarks.two_gpu.streams import stream_metrics, stream_tokens


def goals(parts: dict) -> dict:
    """The goal keys from whichever parts ran (those missing are left out)."""
    g = {}
    tp = parts.get("tp", {})
    if "tp2_equal_tp1" in tp:
        g["tp2_equal_tp1"] = tp["tp2_equal_tp1"]
    scale = tp.get("qwen3_8b", {})
    if "tp2_over_tp1" in scale:
        g["tp2_over_tp1_step"] = scale["tp2_over_tp1"]
        g["tp2_over_tp1_step_shape"] = f"Qwen3-8B shape, {scale['layers']} layers, batch 1"
    elif "tp2_over_tp1" in tp.get("default_pair_b1", {}):
        g["tp2_over_tp1_step"] = tp["default_pair_b1"]["tp2_over_tp1"]
        g["tp2_over_tp1_step_shape"] = "embedded default pair, batch 1"
    if "hetero_tp_equal" in parts.get("hetero", {}):
        g["hetero_tp_equal"] = parts["hetero"]["hetero_tp_equal"]
    remote = parts.get("remote", {})
    serving = remote.get("serving", {})
    if "cross_process_equal" in serving:
        g["cross_process_equal"] = serving["cross_process_equal"]
    pulls = remote.get("transport", {}).get("pulls", [])
    link = {r["bytes"]: r for r in remote.get("link", {}).get("link", [])}
    if pulls and pulls[-1]["bytes"] in link:
        biggest = pulls[-1]
        g["transfer_over_link"] = link[biggest["bytes"]]["d2d_ms"] / biggest["pull_ms"]
        g["transfer_over_link_bytes"] = biggest["bytes"]
    rows = serving.get("handoff", [])
    if rows:
        g["handoff_overhead_ms_p50"] = float(np.median([r["handoff_overhead_ms"]
                                                        for r in rows]))
    m = serving.get("stream_remote_metrics") or (
        stream_metrics([serving["stream_remote"]]) if "stream_remote" in serving else None)
    if m:
        g["stream_ttft_ms_p50"], g["stream_tokens_per_s"] = m["ttft_ms_p50"], m["tokens_per_s"]
    e2e = parts.get("e2e", {})
    modes = [m for m in ("aggregated", "data_parallel", "disaggregated")
             if "tokens_per_s" in e2e.get(m, {})]
    if modes:
        g["e2e_tokens_per_s"] = {m: e2e[m]["tokens_per_s"] for m in modes}
        g["e2e_itl_ms_p99"] = {m: e2e[m]["itl_ms_p99"] for m in modes}
        if {"aggregated", "disaggregated"} <= set(modes) and e2e["aggregated"]["itl_ms_p99"]:
            g["e2e_itl_p99_disagg_over_aggregated"] = (e2e["disaggregated"]["itl_ms_p99"]
                                                       / e2e["aggregated"]["itl_ms_p99"])
    if "tokens_equal_across_modes" in e2e:
        g["e2e_tokens_equal"] = e2e["tokens_equal_across_modes"]
    return g


def summarise_remote(out: dict) -> dict:
    """Stream metrics and the link comparison in the report (raw streams dropped)."""
    serving = out.get("serving", {})
    for name in ("aggregated", "remote"):
        run = serving.pop(f"stream_{name}", None)
        if run is not None:
            serving[f"stream_{name}_metrics"] = stream_metrics([run])
            serving.setdefault("_streams", {})[name] = stream_tokens([run])
    streams = serving.pop("_streams", {})
    if len(streams) == 2:
        serving["stream_tokens_equal"] = streams["aggregated"] == streams["remote"]
    link = {r["bytes"]: r for r in out.get("link", {}).get("link", [])}
    for r in out.get("transport", {}).get("pulls", []):
        if r["bytes"] in link:
            r["over_link"] = link[r["bytes"]]["d2d_ms"] / r["pull_ms"]
    for r in serving.get("handoff", []):
        if r["kv_bytes"] in link and r["pull_ms"]:
            r["pull_over_link"] = link[r["kv_bytes"]]["d2d_ms"] / r["pull_ms"]
    return out
