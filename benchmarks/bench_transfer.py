"""Moving one request's KV: gather, each move path, scatter, against the link rate.

    PYTHONPATH=. python3 benchmarks/bench_transfer.py --out DIR [--sizes 64M,256M,1G,4G]
        [--fragments-max 1G] [--quick]

KV shape: a Qwen3-8B-like target (36 layers, 8 kv heads, head dim 128, fp8
KV, page 16, no windows) plus a 2-layer bf16 DFlash drafter (8 kv heads, head
dim 128): two pools, 80 KiB per token, 1.25 MiB per 16-token page (1.125 MiB
target + 128 KiB draft). A request of S bytes holds S / 80 KiB tokens
(64 MiB ~ 0.8K tokens, 4 GiB ~ 52K). Its pages are scattered over the source
pool (shuffled free lists) and filled with random bytes. Each size gets its
own source and destination caches, sized for exactly that request.

Everything goes through the code users run: `export_step` (gather +
checksum), `move_payload` (per path), `import_step` (allocate + verify +
scatter). The baseline path `fragments` (`move_fragments`, here only) puts one
logical page of one pool at a time (all its layers, K and V, all kv heads; 1.125
MiB for the target pool): what a transfer without coalescing makes in this pool layout.

Source -> destination: device 0 -> device 1 when there are two devices, the
link being `jax.device_put` of one contiguous array of the same bytes
between them; on one device, source and destination are the same device (the
coalesced and fragment puts then copy nothing, flagged `same_device`), and
the link is device -> pinned host -> device of one contiguous array. The
device <-> pinned host rates are measured in both cases; the pinned_host path
is compared with that round trip.

Timing: one warm-up call (compiles), then 3 rounds of back-to-back calls
(as many as fill ~0.25 s, at most 20) with one block_until_ready per round;
the median per call is reported.

End-to-end serving figures (handoff, disaggregated vs aggregated) are
benchmarks/bench_serving.py's.

--quick: tiny sizes (a smoke test; runs on CPU in seconds).
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from benchmarks.timing import write_results
from disagg.transfer import move_payload, pinned_host_sharding
from drafter.kv_io import (KVPayload, checksum, export_step, import_step, live_logical_pages,
                           padded_pages, receiver_shardings, sent_pool_ids)
from drafter.transfer_calls import pack_export_index, pack_import_index
from drafter.steps import StepState, StepConfig
from unified_kv import NULL_PAGE, CacheSpec, LayerSpec, grow, init_state, layer_name

TARGET_LAYERS, DRAFT_LAYERS, KV_HEADS, HEAD_DIM, PAGE = 36, 2, 8, 128, 16
BYTES_PER_TOKEN = KV_HEADS * HEAD_DIM * 2 * (TARGET_LAYERS * 1 + DRAFT_LAYERS * 2)
PATHS = ("coalesced", "pinned_host", "host", "fragments")
MiB = 1 << 20
TIMING = {"budget_s": 0.25, "repeats": 3}  # --quick shrinks both
OUTPUT_BYTES_PER_ROUND = 12 << 30  # outputs of one timing round held at once


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)
    except (ValueError, IndexError):
        raise SystemExit(f"size {text!r} is not understood; write e.g. 64M, 1G, 4G") from None


def median_seconds(call, *, out_bytes: int = 0, chained: bool = False) -> float:
    """Median seconds per call of `call()` (returns what to block on).

    A round blocks on every call's output, not just the last: copies between
    devices and host go on several streams, so the last one can finish before
    earlier ones. `out_bytes` (the size of one output) caps the calls per
    round so their outputs fit in memory together. `chained`: each call
    consumes the last one's (donated) output; block on the last only.
    """
    budget_s, repeats = TIMING["budget_s"], TIMING["repeats"]
    jax.block_until_ready(call())  # compiles, allocates
    start = time.perf_counter()
    jax.block_until_ready(call())
    one = time.perf_counter() - start
    max_iters = max(1, min(20, OUTPUT_BYTES_PER_ROUND // max(out_bytes, 1)))
    iters = max(1, min(max_iters, int(budget_s / max(one, 1e-6))))
    samples = []
    for _ in range(repeats if one < 1.0 else 2):
        start = time.perf_counter()
        outs = [call() for _ in range(iters)]
        jax.block_until_ready(outs[-1] if chained else outs)
        samples.append((time.perf_counter() - start) / iters)
        del outs
    return statistics.median(samples)


def cache_spec(tokens: int) -> CacheSpec:
    layers = ([LayerSpec(layer_name("target", i), "target", KV_HEADS, HEAD_DIM, "fp8_e4m3")
               for i in range(TARGET_LAYERS)]
              + [LayerSpec(layer_name("draft", i), "draft", KV_HEADS, HEAD_DIM, "bf16")
                 for i in range(DRAFT_LAYERS)])
    # One slot and an ample budget: each pool holds exactly one such request.
    return CacheSpec(PAGE, tuple(layers), num_slots=1, max_seq_len=tokens,
                     memory_budget_bytes=1 << 50, max_step_tokens=PAGE)


def random_array(shape, dtype, sharding, seed: int) -> jax.Array:
    """Pseudo-random bytes from a hash of the element index: one fused
    elementwise kernel (jax.random's threefry compiles for seconds on CPU)."""
    itemsize = np.dtype(dtype).itemsize
    full = tuple(shape) + ((itemsize,) if itemsize > 1 else ())

    def make():
        h = jnp.full(full, (seed * 0x9E3779B9) & 0xFFFFFFFF, jnp.uint32)
        for dim, prime in zip(range(len(full)), (0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F,
                                                  0x165667B1, 0x9E3779B1, 0x61C88647,
                                                  0x7FEB352D)):
            h = h + jax.lax.broadcasted_iota(jnp.uint32, full, dim) * jnp.uint32(prime)
        h = (h ^ (h >> 16)) * jnp.uint32(0x45D9F3B)
        return jax.lax.bitcast_convert_type((h ^ (h >> 16)).astype(jnp.uint8), dtype)

    return jax.jit(make, out_shardings=sharding)()


def source_cache(spec: CacheSpec, mesh: Mesh, tokens: int, seed: int = 0):
    """A cache whose slot 0 holds `tokens` tokens on scattered pages of random bytes."""
    kv = init_state(spec, mesh=mesh)
    rng = np.random.default_rng(seed)
    free = tuple(jax.device_put(np.append(rng.permutation(np.arange(1, p.num_pages)),
                                          NULL_PAGE).astype(np.int32), f.sharding)
                 for p, f in zip(spec.pools, kv.free_pages))
    shardings = [a.sharding for a in kv.pools]
    kv, ok = jax.jit(grow, static_argnums=0)(spec, kv.replace(pools=(), free_pages=free),
                                             [0], [tokens], [tokens])
    assert bool(ok[0]), "the source cache is too small for the request (a bug here)"
    return kv.replace(pools=tuple(random_array(p.shape, p.dtype, sharding, seed + i)
                                  for i, (p, sharding) in enumerate(zip(spec.pools, shardings))))


@jax.jit
def _gather(pools, pages):
    return [jnp.take(pool, p, axis=1) for pool, p in zip(pools, pages)]


@jax.jit
def _scatter(pools, pages, buffers):
    return [pool.at[:, p].set(b, mode="drop") for pool, p, b in zip(pools, pages, buffers)]


def step_state(kv):
    """The step state around a bare cache (export and import take a StepState)."""
    n = kv.target_lens.shape[0]
    return StepState(kv=kv, anchors=jnp.zeros((n,), jnp.int32),
                     drafts=jnp.zeros((n, 1), jnp.int32), running=jnp.zeros((n,), bool),
                     output_counts=jnp.zeros((n, 1), jnp.int32),
                     prompt_seen=jnp.zeros((n, 1), bool))


def link_rates(nbytes: int, src_sharding, dst_sharding, two_devices: bool) -> dict:
    """The raw link for `nbytes` contiguous bytes: device->device (two devices)
    and device->pinned host, pinned host->device."""
    x = random_array((nbytes,), jnp.uint8, src_sharding, 7)
    pinned = pinned_host_sharding(src_sharding)
    out = {"d2h_ms": 1e3 * median_seconds(lambda: jax.device_put(x, pinned), out_bytes=nbytes)}
    staged = jax.device_put(x, pinned)
    out["h2d_ms"] = 1e3 * median_seconds(lambda: jax.device_put(staged, dst_sharding),
                                         out_bytes=nbytes)
    out["pinned_roundtrip_ms"] = out["d2h_ms"] + out["h2d_ms"]
    if two_devices:
        out["d2d_ms"] = 1e3 * median_seconds(lambda: jax.device_put(x, dst_sharding),
                                             out_bytes=nbytes)
    for key in list(out):
        out[key.replace("_ms", "_GBps")] = nbytes / (out[key] / 1e3) / 1e9
    return out


def warm_host_memory(nbytes: int, sharding) -> None:
    """Touch as much pinned and pageable host memory as the run will use: on
    VMs that add memory on first touch, those touches are slow and would land
    in the first sizes' timings."""
    x = random_array((nbytes,), jnp.uint8, sharding, 1)
    staged = [jax.device_put(x, pinned_host_sharding(sharding)) for _ in range(3)]
    jax.block_until_ready(staged)
    pageable = [np.asarray(x) for _ in range(2)]
    del staged, pageable, x
    gc.collect()


def move_fragments(payload: KVPayload, mesh) -> list:
    """The baseline the coalesced path replaces: one put per logical page of each
    buffer, stacked on the receiver."""
    sharding, _ = receiver_shardings(mesh)
    return [jnp.stack([jax.device_put(b[:, j], sharding) for j in range(b.shape[1])], axis=1)
            for b in payload.buffers]


def time_moves(payload: KVPayload, mesh, paths, moved_bytes: int) -> tuple[dict, dict]:
    """({path: ms per move}, {path: error}) for each move path; one path failing on
    this platform does not lose the others."""
    move_ms, errors = {}, {}
    for path in paths:
        try:
            move_ms[path] = 1e3 * median_seconds(
                lambda: (move_fragments(payload, mesh) if path == "fragments"
                         else move_payload(payload, mesh, path=path).buffers),
                out_bytes=moved_bytes)
        except Exception as e:
            errors[path] = f"{type(e).__name__}: {e}"
            print(f"  move path {path!r} failed: {errors[path]}", flush=True)
    return move_ms, errors


def bench_size(size: int, src_mesh: Mesh, dst_mesh: Mesh, *, fragments_max: int) -> dict:
    two = src_mesh.devices.flat[0] != dst_mesh.devices.flat[0]
    tokens = max(PAGE, size // BYTES_PER_TOKEN // PAGE * PAGE)
    spec = cache_spec(tokens)
    live = tokens * BYTES_PER_TOKEN
    src = source_cache(spec, src_mesh, tokens)
    dst = init_state(spec, mesh=dst_mesh)
    row = {"size_bytes": size, "tokens": tokens, "live_bytes": live,
           "pages": -(-tokens // PAGE), "same_device": not two}

    # Gather alone: one take per pool, then export_step as a whole (+ checksums).
    pool_ids = sent_pool_ids(spec, "shared")
    logical = tuple(padded_pages(live_logical_pages(spec, spec.pools[i], tokens, tokens))
                    for i in pool_ids)
    src_pages = [np.where(l >= 0, np.asarray(src.page_tables[i][0])[np.maximum(l, 0)],
                          NULL_PAGE).astype(np.int32) for i, l in zip(pool_ids, logical)]
    src_state = step_state(src)

    def export():
        return export_step(src_state, pack_export_index([(0, logical)]), pool_ids=pool_ids,
                           buckets=tuple(len(x) for x in logical))[0]

    buffers, sums, _, drafts = export()
    row["moved_bytes"] = moved_bytes = sum(b.nbytes for b in buffers)
    row["gather_ms"] = 1e3 * median_seconds(lambda: _gather(src.pools, src_pages),
                                            out_bytes=moved_bytes)
    row["fragments"] = sum(b.shape[1] for b in buffers)
    row["checksum_ms"] = 1e3 * median_seconds(lambda: [checksum(b) for b in buffers])
    row["export_ms"] = 1e3 * median_seconds(lambda: export()[0], out_bytes=moved_bytes)
    payload = KVPayload(tokens, tokens, np.int32(0), drafts, pool_ids, logical, buffers, sums,
                        "shared")

    paths = [p for p in PATHS if p != "fragments" or live <= fragments_max]
    row["move_ms"], row["errors"] = time_moves(payload, dst_mesh, paths, moved_bytes)
    moved = move_payload(payload, dst_mesh, path="coalesced")

    # import_step donates the cache: thread it through the calls. No drafter: no redraft.
    cfg = StepConfig(target=None, spec=spec)
    state = {"s": step_state(dst)}
    import_jit = jax.jit(functools.partial(import_step, cfg=cfg),
                         static_argnames=("pool_ids", "mode"), donate_argnums=0)
    no_resets = np.full(spec.num_slots, spec.dummy_slot, np.int32)

    index = pack_import_index(no_resets, [(0, tokens, tokens, moved.logical_pages)])

    def import_once():
        arrival = (moved.first_token, moved.drafts, moved.buffers, moved.checksums)
        state["s"], ok = import_jit(state["s"], index, (arrival,), pool_ids=pool_ids,
                                    mode="shared")
        return state["s"].kv.pools

    row["import_ms"] = 1e3 * median_seconds(import_once, chained=True)
    kv = state.pop("s").kv
    assert bool(kv.target_lens[0] == tokens), "the import failed (a bug here)"
    dst_pages = [np.where(l >= 0, np.asarray(kv.page_tables[i][0])[np.maximum(l, 0)],
                          spec.pools[i].num_pages).astype(np.int32)
                 for i, l in zip(pool_ids, logical)]
    pools = {"p": list(kv.pools)}

    def scatter_once():
        pools["p"] = _scatter(pools["p"], dst_pages, moved.buffers)
        return pools["p"]

    row["scatter_ms"] = 1e3 * median_seconds(scatter_once, chained=True)
    del src, dst, payload, moved, pools, kv, src_state
    gc.collect()

    src_sharding = NamedSharding(src_mesh, P())
    row["link"] = link_rates(live, src_sharding, NamedSharding(dst_mesh, P()), two)
    move_ms = row["move_ms"]
    row["move_GBps"] = {path: live / (ms / 1e3) / 1e9 for path, ms in move_ms.items()}
    link = row["link"]
    # Fractions of the link rate (1.0 = as fast as one contiguous put of the same bytes).
    row["coalesced_vs_link"] = (link["d2d_ms"] / move_ms["coalesced"]
                                if two and "coalesced" in move_ms else None)
    row["pinned_host_vs_link"] = (link["pinned_roundtrip_ms"] / move_ms["pinned_host"]
                                  if "pinned_host" in move_ms else None)
    if "fragments" in move_ms:
        row["per_fragment_us"] = 1e3 * move_ms["fragments"] / row["fragments"]
        row["fragments_over_coalesced"] = (move_ms["fragments"] / move_ms["coalesced"]
                                           if two and "coalesced" in move_ms else None)
    gc.collect()
    return row


def print_rows(rows, two: bool) -> None:
    print(f"\n{'size':>7} {'tokens':>7} {'moved':>8} | {'gather':>7} {'export':>7} "
          f"{'import':>7} {'scatter':>7} | " + " ".join(f"{p:>11}" for p in PATHS)
          + f" | {'link d2d':>8} {'pin rt':>7} | {'coal/lnk':>8} {'pin/lnk':>7} "
          f"{'frag/coal':>9} {'us/frag':>7}")
    unit = "    (MiB)          (ms)    (ms)    (ms)    (ms)     (ms, GB/s in json)"
    print(unit)

    def f(x, fmt="8.2f"):
        return format(x, fmt) if x is not None else "-".rjust(int(fmt.split(".")[0]))

    for r in rows:
        moves = " ".join(f(r["move_ms"].get(p), "11.2f") for p in PATHS)
        print(f"{r['size_bytes'] / MiB:>6.0f}M {r['tokens']:>7} {r['moved_bytes'] / MiB:>8.1f} | "
              f"{r['gather_ms']:>7.2f} {r['export_ms']:>7.2f} {r['import_ms']:>7.2f} "
              f"{r['scatter_ms']:>7.2f} | {moves} | {f(r['link'].get('d2d_ms'))} "
              f"{r['link']['pinned_roundtrip_ms']:>7.2f} | {f(r['coalesced_vs_link'])} "
              f"{f(r['pinned_host_vs_link'], '7.2f')} "
              f"{f(r.get('fragments_over_coalesced'), '9.1f')} "
              f"{f(r.get('per_fragment_us'), '7.1f')}")
    if not two:
        print("one device: coalesced and fragment puts copy nothing (same device); "
              "compare pinned_host with the pinned round trip")


# ------------------------------------------------------------------ end to end

def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for transfer.json")
    parser.add_argument("--sizes", default=None,
                        help="request sizes, comma separated (default 64M,256M,1G,4G)")
    parser.add_argument("--fragments-max", default="1G",
                        help="largest request the slow per-page path is timed for")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        TIMING.update(budget_s=0.01, repeats=1)
    sizes = [parse_size(s) for s in (args.sizes or ("2M,6M" if args.quick
                                                    else "64M,256M,1G,4G")).split(",")]
    devices = jax.devices()
    two = len(devices) >= 2
    src_mesh = Mesh(np.array(devices[:1]), ("tp",))
    dst_mesh = Mesh(np.array(devices[1:2] if two else devices[:1]), ("tp",))
    print(f"{len(devices)} x {devices[0].device_kind}; {src_mesh.devices.flat[0]} -> "
          f"{dst_mesh.devices.flat[0]}; {BYTES_PER_TOKEN // 1024} KiB per token", flush=True)
    rows = []
    if not args.quick:
        start = time.perf_counter()
        warm_host_memory(max(sizes), NamedSharding(src_mesh, P()))
        print(f"  host memory warmed in {time.perf_counter() - start:.1f}s", flush=True)
    for size in sizes:
        start = time.perf_counter()
        rows.append(bench_size(size, src_mesh, dst_mesh,
                               fragments_max=parse_size(args.fragments_max)))
        print(f"  {size / MiB:.0f} MiB done in {time.perf_counter() - start:.1f}s",
              flush=True)
    print_rows(rows, two)
    report = {"kv_shape": {"target_layers": TARGET_LAYERS, "draft_layers": DRAFT_LAYERS,
                           "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "page_size": PAGE,
                           "target_kv": "fp8_e4m3", "draft_kv": "bf16",
                           "bytes_per_token": BYTES_PER_TOKEN},
              "devices": len(devices), "rows": rows}
    if args.out:
        print("wrote", write_results("transfer", report, args.out))
    return report


if __name__ == "__main__":
    main()
