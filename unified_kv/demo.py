"""A tour of the unified cache: `python -m unified_kv.demo`.

Builds the cache for a Qwen3-style target (windowed and full FP8 layers) plus
a windowed BF16 DFlash drafter, admits requests, runs jitted grow/retire
steps with a padding row, builds the batch-only tables, and prints pools,
memory and page tables. (The serving demo replaces this once `disagg` lands.)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.batch_tables import build_batch_tables
from unified_kv import (AdmissionController, CacheSpec, LayerSpec, bucket_width, bytes_per_pool,
                        grow, init_state, layer_name, release_slots, retire_window_pages,
                        row_extent)


def demo_spec(max_seq_len: int = 4096) -> CacheSpec:
    target = [LayerSpec(layer_name("target", i), "target", 8, 128, "fp8_e4m3",
                        512 if i % 2 == 0 else None) for i in range(8)]
    draft = [LayerSpec(layer_name("draft", i), "draft", 8, 128, "bf16", 512) for i in range(2)]
    return CacheSpec(page_size=16, layers=tuple(target + draft), num_slots=8,
                     max_seq_len=max_seq_len, memory_budget_bytes=256 << 20,
                     max_step_tokens=16)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="decode steps to simulate")
    args = parser.parse_args(argv)
    spec = demo_spec()
    print(f"backend: {jax.default_backend()}  page_size={spec.page_size}  "
          f"slots={spec.num_slots}  max_seq_len={spec.max_seq_len}")
    for pool, nbytes in zip(spec.pools, bytes_per_pool(spec).values()):
        print(f"pool {pool.pool_id}: {pool.kv_dtype:8s} window={str(pool.sliding_window):5s} "
              f"layers={','.join(pool.layer_names)}  pages={pool.num_pages}  "
              f"{nbytes / 2**20:.1f} MiB")

    admission = AdmissionController(spec)
    prompts = {"short": 300, "long": 2000}
    slots = [admission.admit(rid, n + 1024).slot for rid, n in prompts.items()]
    batch = jnp.array(slots + [spec.dummy_slot, spec.dummy_slot], jnp.int32)  # 2 padding rows
    step = jax.jit(lambda s, t, d: retire_window_pages(spec, grow(spec, s, batch, t, d)[0], batch),
                   donate_argnums=0)
    state = init_state(spec)
    lens = np.array(list(prompts.values()) + [0, 0], np.int32)  # prefill
    state = step(state, jnp.asarray(lens), jnp.asarray(lens))
    rng = np.random.default_rng(0)
    for _ in range(args.steps):  # each step commits 1..K+1 tokens per real row
        lens[:2] += rng.integers(1, 9, 2)
        state = step(state, jnp.asarray(lens), jnp.asarray(lens))
    width = bucket_width(int(row_extent(state.page_tables[0][batch]).max()),
                         spec.max_pages_per_seq)
    tables = build_batch_tables(batch, state.page_tables, table_width=width,
                                scales=tuple(p.page_index_scale for p in spec.pools),
                                interpret=jax.default_backend() == "cpu")
    print(f"after prefill + {args.steps} steps: lens={lens[:2].tolist()}  "
          f"free pages per pool={np.asarray(state.num_free).tolist()}")
    for pool, table in zip(spec.pools, tables):
        row = np.asarray(table[1])
        live = np.flatnonzero(row >= 0)
        print(f"pool {pool.pool_id} 'long' row: {live.size} live pages, logical "
              f"{live.min()}..{live.max()}, kernel indices {row[live[:3]].tolist()}...")
    state = release_slots(spec, state, batch)
    for rid in prompts:
        admission.release(rid)
    print(f"released: free pages per pool={np.asarray(state.num_free).tolist()} "
          f"(all {[p.num_pages for p in spec.pools]})")


if __name__ == "__main__":
    main()
