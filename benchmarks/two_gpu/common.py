"""Shared helpers of the two-GPU benchmark: output comparison, held-out prompts, the
worker pair and device meshes."""

from __future__ import annotations

import numpy as np


def say(tag: str, message: str) -> None:
    print(f"[{tag}] {message}", flush=True)


def outputs(results) -> dict:
    """Every request's tokens and per-step acceptance (drafter.request.Result list)."""
    return {"tokens": [[int(t) for t in r.tokens] for r in results],
            "acceptance": [[int(a) for a in r.acceptance] for r in results]}


def equal_outputs(a: dict, b: dict) -> bool:
    """Request by request, the same tokens and the same per-step acceptance; two empty
    runs (nothing generated) are not equal."""
    return (bool(a["tokens"]) and all(a["tokens"]) and a["tokens"] == b["tokens"]
            and a["acceptance"] == b["acceptance"])


def first_difference(a: dict, b: dict) -> str | None:
    """Where two runs first differ, in words (None: they do not)."""
    if len(a["tokens"]) != len(b["tokens"]):
        return f"{len(a['tokens'])} vs {len(b['tokens'])} requests"
    for i, (ta, tb, aa, ab) in enumerate(zip(a["tokens"], b["tokens"], a["acceptance"],
                                             b["acceptance"])):
        if ta != tb:
            k = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            return f"request {i}: tokens differ at {k} ({ta[k:k + 4]} vs {tb[k:k + 4]})"
        if aa != ab:
            return f"request {i}: acceptance {aa} vs {ab}"
    return None


def pct(values, q) -> float | None:
    return float(np.percentile(np.asarray(values, float), q)) if len(values) else None


def held_out(quick: bool) -> dict:
    """{length: [prompts]} of the shipped held-out prompts; --quick: the first two,
    cut to 48 tokens."""
    from drafter.default import load_prompts
    by_len: dict[int, list] = {}
    for q in load_prompts():
        by_len.setdefault(q["length"], []).append(q["tokens"])
    if quick:
        return {48: [p[:48] for p in by_len[min(by_len)][:2]]}
    return by_len


def equality_prompts(quick: bool) -> list:
    """Two prompts of 128 and two of 512 tokens (--quick: two of 48)."""
    by_len = held_out(quick)
    return [p for n in sorted(by_len)[:2] for p in by_len[n][:2]]


def pair_source(quick: bool, num_slots: int | None = None):
    """The worker processes' pair and cache (both sides build the same one)."""
    from disagg.processes import PairSource
    if quick:
        return PairSource(None, num_slots=num_slots or 4, max_seq_len=512, kv_memory_mib=64)
    return PairSource(None, num_slots=num_slots or 16, max_seq_len=9216, kv_memory_mib=1024)


def meshes(n: int) -> list:
    """Meshes over the first 1..n devices ("tp" axis)."""
    import jax
    devices = jax.devices()
    if len(devices) < n:
        raise SystemExit(f"this part needs {n} devices, the process sees {len(devices)} "
                         f"(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={n})")
    return [jax.sharding.Mesh(np.array(devices[:k]), ("tp",)) for k in range(1, n + 1)]
